/* The nccl backend: binding libnccl.so.2 at run time (the copy torch already loaded first) and
 * checking its version. */
#include "nccl_internal.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "axc/dynlib.h"

static pthread_once_t nccl_once_ = PTHREAD_ONCE_INIT;
static nccl_api nccl_;
static axc_status nccl_status_ = AXC_ERR_UNAVAILABLE;
static char nccl_msg_[768];

static void nccl_unavailable(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void nccl_unavailable(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(nccl_msg_, sizeof nccl_msg_, fmt, ap);
    va_end(ap);
    nccl_status_ = AXC_ERR_UNAVAILABLE;
}

void axc_nccl_version_parts(int v, int *major, int *minor, int *patch)
{
    if (v >= 10000) { /* NCCL_VERSION for >= 2.9: X*10000 + Y*100 + Z */
        *major = v / 10000;
        *minor = (v % 10000) / 100;
    } else {
        *major = v / 1000;
        *minor = (v % 1000) / 100;
    }
    *patch = v % 100;
}

static void nccl_load_once(void)
{
    static const char *const names[] = {"libnccl.so.2"};
    static const axc_dynlib_spec spec = {"NCCL", names, 1, NULL, 1,
                                         "a CUDA build of torch loads it on import"};
    char how[64];
    void *h = axc_dynlib_open(&spec, how, sizeof how, nccl_msg_, sizeof nccl_msg_);
    if (!h)
        return;
    nccl_api api;
    memset(&api, 0, sizeof api);
    const axc_dynlib_sym syms[] = {
        {"ncclGetVersion", &api.GetVersion, 1},
        {"ncclGetUniqueId", &api.GetUniqueId, 1},
        {"ncclCommInitRankConfig", &api.CommInitRankConfig, 1},
        {"ncclCommSplit", &api.CommSplit, 1},
        {"ncclCommGetAsyncError", &api.CommGetAsyncError, 1},
        {"ncclCommAbort", &api.CommAbort, 1},
        {"ncclCommFinalize", &api.CommFinalize, 1},
        {"ncclCommDestroy", &api.CommDestroy, 1},
        {"ncclGetErrorString", &api.GetErrorString, 1},
        {"ncclGetLastError", &api.GetLastError, 1},
        {"ncclAllReduce", &api.AllReduce, 1},
        {"ncclAllGather", &api.AllGather, 1},
        {"ncclReduceScatter", &api.ReduceScatter, 1},
        {"ncclBroadcast", &api.Broadcast, 1},
        {"ncclSend", &api.Send, 1},
        {"ncclRecv", &api.Recv, 1},
        {"ncclGroupStart", &api.GroupStart, 1},
        {"ncclGroupEnd", &api.GroupEnd, 1},
    };
    if (!axc_dynlib_resolve(h, "NCCL", how, syms, sizeof syms / sizeof syms[0],
                            "NCCL >= 2.18 is required", nccl_msg_, sizeof nccl_msg_))
        return;
    int v = 0;
    ncclResult_t r = api.GetVersion(&v);
    if (r != ncclSuccess) {
        nccl_unavailable("ncclGetVersion failed: %s", api.GetErrorString(r));
        return;
    }
    int ma, mi, pa;
    axc_nccl_version_parts(v, &ma, &mi, &pa);
    if (v < AXC_NCCL_MIN_VERSION || ma != NCCL_MAJOR) {
        nccl_unavailable("NCCL %d.%d.%d (%s) is not supported: axonn_c needs NCCL 2.x >= 2.18 "
                         "(ncclCommSplit) and was compiled against %d.%d.%d",
                         ma, mi, pa, how, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
        return;
    }
    if (v < NCCL_VERSION_CODE)
        axc_log(2, "nccl: the loaded NCCL %d.%d.%d is older than the headers axonn_c was built "
                   "with (%d.%d.%d)",
                ma, mi, pa, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
    api.version = v;
    nccl_ = api;
    nccl_status_ = AXC_OK;
}

axc_status axc_nccl_load(const nccl_api **api)
{
    *api = NULL;
    if (pthread_once(&nccl_once_, nccl_load_once) != 0)
        return axc_fail(AXC_ERR_SYSTEM, "pthread_once failed while loading NCCL");
    if (nccl_status_ != AXC_OK)
        return axc_fail(nccl_status_, "%s", nccl_msg_);
    *api = &nccl_;
    return AXC_OK;
}

int axc_nccl_header_version(void) { return NCCL_VERSION_CODE; }

int axc_nccl_runtime_version(void)
{
    const nccl_api *nc;
    if (axc_nccl_load(&nc) != AXC_OK)
        return 0; /* the reason is in axc_last_error() */
    return nc->version;
}

#endif
