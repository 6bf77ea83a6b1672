/* Status codes and the thread-local error message every fallible core call sets. */
#ifndef AXC_STATUS_H
#define AXC_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum axc_status {
    AXC_OK = 0,
    AXC_ERR_INVALID = 1,     /* bad argument: shapes, sizes, dtypes, grid */
    AXC_ERR_STATE = 2,       /* wrong call order: not initialised, already initialised */
    AXC_ERR_NOMEM = 3,       /* allocation failed */
    AXC_ERR_SYSTEM = 4,      /* an OS call failed (errno in the message) */
    AXC_ERR_TIMEOUT = 5,     /* a peer did not arrive within the timeout */
    AXC_ERR_PEER = 6,        /* a peer died or aborted the communicator */
    AXC_ERR_UNAVAILABLE = 7, /* a library or device is not available (no CUDA, no NCCL) */
    AXC_ERR_BACKEND = 8      /* the CUDA/NCCL/cuBLAS runtime returned an error */
} axc_status;

/* Sets the calling thread's message and returns `status` so callers can `return axc_fail(...)`. */
axc_status axc_fail(axc_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Message of the last failure on this thread ("" when none). */
const char *axc_last_error(void);

/* Copies another thread's message (e.g. the progress thread's) into this thread's. */
void axc_set_last_error(const char *msg);

const char *axc_status_name(axc_status status);

/* Optional log sink; default drops messages. level: 0 debug, 1 info, 2 warning. */
typedef void (*axc_log_fn)(int level, const char *msg);
void axc_set_log_hook(axc_log_fn fn);
void axc_log(int level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#define AXC_TRY(expr)                      \
    do {                                   \
        axc_status axc_try_s_ = (expr);    \
        if (axc_try_s_ != AXC_OK)          \
            return axc_try_s_;             \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif
