/* The nccl backend's failure path: aborting every communicator at once, failing the attached
 * works, and the watchdog thread that decides when (a collective past the timeout, an event
 * error, an asynchronous NCCL error). */
#include "nccl_internal.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
    nccl_backend *be;
    ncclComm_t comm;
    ncclResult_t result;
} abort_job;

static void *abort_one(void *arg)
{
    abort_job *j = arg;
    (void)j->be->cu->SetDevice(j->be->device); /* a new thread starts on device 0 */
    j->result = j->be->nc->CommAbort(j->comm);
    return NULL;
}

/* Aborts every communicator (issue_mu and mu held); returns how many aborts NCCL refused.
 * ncclCommAbort also stops kernels still running on the device, so streams that wait on our
 * `done` events move on. The aborts run at once, one thread each: an abort waits for its
 * communicator's kernels, and a kernel may wait (through our fork/join events) for another
 * communicator's kernel stuck on the dead peer, whose abort, one after the other, would then
 * never start. Nothing is logged here: the log hook must never run under our locks. */
static int abort_all_locked(nccl_backend *be)
{
    int n = be->world != NULL;
    for (nccl_group *g = be->groups; g; g = g->next)
        n += g->comm && g->owns_comm;
    abort_job *jobs = calloc((size_t)(n ? n : 1), sizeof *jobs);
    pthread_t *threads = calloc((size_t)(n ? n : 1), sizeof *threads);
    int *started = calloc((size_t)(n ? n : 1), sizeof *started);
    int k = 0;
    for (nccl_group *g = be->groups; g; g = g->next) {
        if (g->comm && g->owns_comm && jobs)
            jobs[k++] = (abort_job){be, g->comm, ncclSuccess};
        else if (g->comm && g->owns_comm) /* no memory for the list: one after the other */
            (void)be->nc->CommAbort(g->comm);
        g->comm = NULL;
    }
    if (be->world && jobs)
        jobs[k++] = (abort_job){be, be->world, ncclSuccess};
    else if (be->world)
        (void)be->nc->CommAbort(be->world);
    be->world = NULL;
    for (int i = 0; i < k; i++) {
        int ok = threads && started &&
                 pthread_create(&threads[i], NULL, abort_one, &jobs[i]) == 0;
        if (started)
            started[i] = ok;
        if (!ok)
            abort_one(&jobs[i]); /* no thread: in place */
    }
    int refused = 0;
    for (int i = 0; i < k; i++) {
        if (started && started[i])
            pthread_join(threads[i], NULL);
        refused += jobs[i].result != ncclSuccess && jobs[i].result != ncclInProgress;
    }
    free(jobs);
    free(threads);
    free(started);
    return refused;
}

/* Puts the backend into the failed state once: fails every attached work whose collective had
 * not finished, aborts all communicators, and makes later calls fail with `status`/`msg`.
 * Works that had finished before the failure keep their result (wait() tells them apart by
 * `fail_done` && !`reported`). `have_issue`: the caller holds issue_mu. */
void axc_nccl_fail_all(nccl_backend *be, axc_status status, const char *msg, int have_issue)
{
    pthread_mutex_lock(&be->mu);
    int first = atomic_load(&be->failed) == 0;
    if (first) {
        snprintf(be->fail_msg, sizeof be->fail_msg, "%s", msg);
        atomic_store(&be->failed, (int)status);
    }
    pthread_mutex_unlock(&be->mu);
    if (!first)
        return;
    if (!have_issue)
        pthread_mutex_lock(&be->issue_mu);
    pthread_mutex_lock(&be->mu);
    /* which collectives finished before the abort (after it, aborted kernels also "finish") */
    for (nccl_slot *s = be->head; s; s = s->next) {
        if (!s->completed && be->cu->EventQuery(s->done) == AXC_CUDA_SUCCESS)
            s->completed = 1;
    }
    int refused = abort_all_locked(be);
    for (nccl_slot *s = be->head; s; s = s->next) {
        if (s->work && !s->reported && !s->completed) {
            s->reported = 1;
            axc_work_complete(s->work, status, msg);
        }
    }
    be->fail_done = 1;
    pthread_mutex_unlock(&be->mu);
    if (!have_issue)
        pthread_mutex_unlock(&be->issue_mu);
    axc_log(2, "nccl: %s", msg);
    if (refused)
        axc_log(2, "nccl: %d ncclCommAbort call(s) failed while aborting job %s", refused,
                be->job);
}

/* ---------------------------------------------------------------- watchdog */

void *axc_nccl_watchdog_main(void *arg)
{
    nccl_backend *be = arg;
    /* bind this thread to our device so CUDA calls here never create a context elsewhere */
    if (be->cu->SetDevice(be->device) != AXC_CUDA_SUCCESS)
        axc_log(2, "nccl watchdog: cudaSetDevice(%d) failed", be->device);
    /* queries from this thread must not invalidate (or be refused by) a CUDA-graph capture
     * another thread runs in the global mode, e.g. torch.compile's "reduce-overhead" */
    int mode = AXC_CUDA_CAPTURE_MODE_RELAXED;
    if (be->cu->ThreadExchangeStreamCaptureMode &&
        be->cu->ThreadExchangeStreamCaptureMode(&mode) != AXC_CUDA_SUCCESS)
        axc_log(2, "nccl watchdog: cudaThreadExchangeStreamCaptureMode failed");
    double interval = be->timeout_s / 8;
    if (interval > 0.1)
        interval = 0.1;
    if (interval < 0.002)
        interval = 0.002;
    char msg[512];
    pthread_mutex_lock(&be->mu);
    while (!be->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t ns = (int64_t)ts.tv_nsec + (int64_t)(interval * 1e9);
        ts.tv_sec += (time_t)(ns / 1000000000LL);
        ts.tv_nsec = (long)(ns % 1000000000LL);
        pthread_cond_timedwait(&be->cv, &be->mu, &ts);
        if (be->stop)
            break;
        if (atomic_load(&be->failed))
            continue;

        axc_status reason = AXC_OK;
        int64_t now = axc_now_ns();
        for (nccl_slot *s = be->head, *next; s && reason == AXC_OK; s = next) {
            next = s->next;
            if (!s->completed) {
                int q = be->cu->EventQuery(s->done);
                if (q == AXC_CUDA_ERROR_CAPTURE_UNSUPPORTED || q == AXC_CUDA_ERROR_CAPTURE_IMPLICIT)
                    q = AXC_CUDA_ERROR_NOT_READY; /* another thread captures: ask again later */
                if (q == AXC_CUDA_SUCCESS) {
                    s->completed = 1;
                } else if (q == AXC_CUDA_ERROR_NOT_READY) {
                    double waited = (double)(now - s->start_ns) / 1e9;
                    if (waited > be->timeout_s) {
                        reason = AXC_ERR_TIMEOUT;
                        char what[200];
                        axc_nccl_describe_coll(what, sizeof what, s->coll_kind, s->op,
                                               s->count, s->dtype, s->group_kind,
                                               s->group_seq);
                        snprintf(msg, sizeof msg,
                                 "%s did not complete within %.1f s (job %s, rank %d): a peer "
                                 "died, hung, or issued a different collective (compare the "
                                 "other ranks' errors); all NCCL communicators were aborted",
                                 what, be->timeout_s, be->job, be->rank);
                    }
                } else {
                    reason = AXC_ERR_BACKEND;
                    snprintf(msg, sizeof msg,
                             "cudaEventQuery failed for %s on the %s group (job %s, rank %d): %s "
                             "(cudaError %d); all NCCL communicators were aborted",
                             axc_coll_name(s->coll_kind), axc_group_name(s->group_kind), be->job,
                             be->rank, be->cu->GetErrorString(q), q);
                }
            }
            if (s->completed && !s->work)
                axc_nccl_slot_recycle(be, s);
        }

        /* asynchronous NCCL errors (a peer's socket closed, a remote abort...) */
        if (reason == AXC_OK && pthread_mutex_trylock(&be->issue_mu) == 0) {
            for (nccl_group *g = be->groups; g && reason == AXC_OK; g = g->next) {
                if (!g->comm || !g->owns_comm)
                    continue;
                ncclResult_t st = ncclSuccess;
                ncclResult_t r = be->nc->CommGetAsyncError(g->comm, &st);
                if (r != ncclSuccess)
                    st = r;
                if (st != ncclSuccess && st != ncclInProgress) {
                    reason = AXC_ERR_PEER;
                    snprintf(msg, sizeof msg,
                             "NCCL reported an asynchronous error on the %s group (job %s, rank "
                             "%d): %s: %s; all NCCL communicators were aborted",
                             axc_group_name(g->kind), be->job, be->rank, axc_nccl_str(be->nc, st),
                             axc_nccl_last(be->nc, g->comm));
                }
            }
            if (reason == AXC_OK && be->world) {
                ncclResult_t st = ncclSuccess;
                ncclResult_t r = be->nc->CommGetAsyncError(be->world, &st);
                if (r != ncclSuccess)
                    st = r;
                if (st != ncclSuccess && st != ncclInProgress) {
                    reason = AXC_ERR_PEER;
                    snprintf(msg, sizeof msg,
                             "NCCL reported an asynchronous error on the world communicator (job "
                             "%s, rank %d): %s: %s; all NCCL communicators were aborted",
                             be->job, be->rank, axc_nccl_str(be->nc, st),
                             axc_nccl_last(be->nc, be->world));
                }
            }
            pthread_mutex_unlock(&be->issue_mu);
        }

        if (reason != AXC_OK) {
            pthread_mutex_unlock(&be->mu);
            axc_nccl_fail_all(be, reason, msg, 0);
            pthread_mutex_lock(&be->mu);
        }
    }
    pthread_mutex_unlock(&be->mu);
    return NULL;
}

#endif
