/* The nccl backend's small helpers: deadlines and backoff for host polling, NCCL error text,
 * polling a non-blocking communicator, the device guard, the failure state and the
 * description of a collective that errors name. */
#include "nccl_internal.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

int64_t axc_nccl_deadline_after(double seconds)
{
    if (!(seconds > 0))
        seconds = 0;
    if (seconds > 1e9)
        seconds = 1e9;
    return axc_now_ns() + (int64_t)(seconds * 1e9);
}

static void sleep_ns(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Backoff for host polling: yield first (enqueue usually finishes in microseconds), then sleep
 * 50 us growing to 1 ms, so a long wait costs no CPU. */
void axc_nccl_backoff(unsigned *spins)
{
    unsigned s = (*spins)++;
    if (s < 64) {
        sched_yield();
        return;
    }
    int64_t ns = 50000LL << ((s - 64) / 16 < 4 ? (s - 64) / 16 : 4);
    sleep_ns(ns > 1000000 ? 1000000 : ns);
}

const char *axc_nccl_str(const nccl_api *nc, ncclResult_t r)
{
    const char *s = nc->GetErrorString(r);
    return s ? s : "unknown NCCL error";
}

const char *axc_nccl_last(const nccl_api *nc, ncclComm_t comm)
{
    const char *s = nc->GetLastError(comm);
    return (s && *s) ? s : "no further detail from NCCL";
}

/* Fails with AXC_ERR_BACKEND naming the NCCL call. */
axc_status axc_nccl_fail(const nccl_backend *be, ncclResult_t r, ncclComm_t comm,
                         const char *call, const char *what)
{
    return axc_fail(AXC_ERR_BACKEND, "%s failed for %s (job %s, rank %d): %s: %s", call, what,
                    be->job, be->rank, axc_nccl_str(be->nc, r), axc_nccl_last(be->nc, comm));
}

/* Waits until `comm` leaves ncclInProgress. Returns its state (ncclSuccess or an error), or
 * ncclInProgress when `deadline_ns` passed or the backend failed meanwhile (*aborted set). */
ncclResult_t axc_nccl_poll_comm(nccl_backend *be, ncclComm_t comm, int64_t deadline_ns,
                                int *aborted)
{
    unsigned spins = 0;
    if (aborted)
        *aborted = 0;
    for (;;) {
        ncclResult_t state = ncclInProgress;
        ncclResult_t r = be->nc->CommGetAsyncError(comm, &state);
        if (r != ncclSuccess)
            return r;
        if (state != ncclInProgress)
            return state;
        if (aborted && atomic_load(&be->failed)) {
            *aborted = 1;
            return ncclInProgress;
        }
        if (axc_now_ns() >= deadline_ns)
            return ncclInProgress;
        axc_nccl_backoff(&spins);
    }
}

axc_status axc_nccl_dev_enter(nccl_backend *be, dev_guard *g)
{
    g->switched = 0;
    g->prev = -1;
    AXC_TRY(axc_cuda_check(be->cu->GetDevice(&g->prev), "cudaGetDevice"));
    if (g->prev != be->device) {
        AXC_TRY(axc_cuda_check(be->cu->SetDevice(be->device), "cudaSetDevice"));
        g->switched = 1;
    }
    return AXC_OK;
}

void axc_nccl_dev_leave(nccl_backend *be, dev_guard *g)
{
    if (g->switched) {
        int e = be->cu->SetDevice(g->prev);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: restoring CUDA device %d failed (cudaError %d)", g->prev, e);
    }
}

axc_status axc_nccl_failure_status(nccl_backend *be)
{
    pthread_mutex_lock(&be->mu);
    int st = atomic_load(&be->failed);
    char msg[sizeof be->fail_msg];
    snprintf(msg, sizeof msg, "%s", be->fail_msg);
    pthread_mutex_unlock(&be->mu);
    if (!st)
        return AXC_OK;
    return axc_fail((axc_status)st, "%s", msg);
}

/* "all_reduce (sum) of 1024 x float32 on the row group (its collective #5)": what a
 * timeout names, so that the ranks' errors can be set side by side (ranks in step have issued
 * the same collectives in the same order on every group; the first differing number or
 * description shows which rank left the common order). */
void axc_nccl_describe_coll(char *out, size_t cap, axc_coll_kind kind, axc_redop op,
                            size_t count, axc_dtype dtype, axc_group_kind group,
                            uint64_t group_seq)
{
    char what[64] = "barrier"; /* a barrier carries no data */
    if (kind != AXC_COLL_BARRIER) {
        int reduces = kind == AXC_COLL_ALL_REDUCE || kind == AXC_COLL_REDUCE_SCATTER;
        snprintf(what, sizeof what, "%s%s%s%s of %zu x %s", axc_coll_name(kind),
                 reduces ? " (" : "", reduces ? axc_redop_name(op) : "", reduces ? ")" : "",
                 count, axc_dtype_name(dtype));
    }
    snprintf(out, cap, "%s on the %s group (its collective #%llu)", what, axc_group_name(group),
             (unsigned long long)group_seq);
}

#endif
