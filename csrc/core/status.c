/* Thread-local error messages and the log hook. */
#include "axc/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char axc_msg_[1024];
static axc_log_fn axc_log_hook_ = NULL;

axc_status axc_fail(axc_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(axc_msg_, sizeof axc_msg_, fmt, ap);
    va_end(ap);
    return status;
}

const char *axc_last_error(void) { return axc_msg_; }

void axc_set_last_error(const char *msg)
{
    snprintf(axc_msg_, sizeof axc_msg_, "%s", msg ? msg : "");
}

const char *axc_status_name(axc_status status)
{
    switch (status) {
    case AXC_OK: return "ok";
    case AXC_ERR_INVALID: return "invalid argument";
    case AXC_ERR_STATE: return "invalid state";
    case AXC_ERR_NOMEM: return "out of memory";
    case AXC_ERR_SYSTEM: return "system error";
    case AXC_ERR_TIMEOUT: return "timeout";
    case AXC_ERR_PEER: return "peer failure";
    case AXC_ERR_UNAVAILABLE: return "unavailable";
    case AXC_ERR_BACKEND: return "backend error";
    }
    return "unknown status";
}

void axc_set_log_hook(axc_log_fn fn) { axc_log_hook_ = fn; }

void axc_log(int level, const char *fmt, ...)
{
    axc_log_fn hook = axc_log_hook_;
    if (!hook)
        return;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    hook(level, buf);
}
