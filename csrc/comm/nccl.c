/* The nccl backend: CUDA buffers, one NCCL communicator per group, asynchronous on comm streams.
 *
 * Binding. libnccl.so.2 is bound at run time to the copy torch already loaded (RTLD_NOLOAD first,
 * a normal dlopen otherwise); every function pointer has the exact type nccl.h declares.
 *
 * Communicators. Rank 0 creates the unique id and publishes it through the bootstrap store; all
 * ranks create the world communicator non-blocking (ncclConfig_t.blocking = 0) and poll it with a
 * deadline, so a missing peer gives AXC_ERR_TIMEOUT instead of a hang. Each group is split from
 * the world (ncclCommSplit, also polled); the world group reuses the world communicator.
 *
 * Streams. Every group owns a high-priority non-blocking comm stream. start() forks from the
 * caller's stream (`ready` recorded there, the comm stream waits on it), enqueues the NCCL call on
 * the comm stream and records `done` behind it; a collective that must follow other groups' works
 * (axc_comm_start_after) also waits on their `done` events there. wait() joins: the caller's
 * stream waits on `done` (no host synchronisation; a barrier alone waits on the host). The events
 * live in `slots`, pooled and recycled once `done` has fired and the work is detached.
 *
 * Failure. A watchdog thread watches every in-flight slot (EventQuery against cfg->timeout_s) and
 * every communicator (ncclCommGetAsyncError). On expiry or error it aborts all communicators
 * (at once, a thread each: an abort waits for its kernels, which may wait on another
 * communicator's), fails the attached works, and every later start() fails with the same error.
 * A barrier carries no tensor: it runs on this rank's device whatever the caller's device.
 *
 * Locks. issue_mu serialises every NCCL call made on our communicators (enqueue, split, abort,
 * finalize, async-error polling); mu protects slots, the group list and the failure state.
 * Order: issue_mu before mu. The watchdog only try-locks issue_mu while it holds mu.
 */
#include "axc/comm.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nccl.h>

#include "axc/cuda_rt.h"
#include "axc/futex.h"

#define AXC_NCCL_MIN_VERSION 21800 /* ncclCommSplit */

/* ---------------------------------------------------------------- the NCCL library */

typedef struct nccl_api {
    __typeof__(&ncclGetVersion) GetVersion;
    __typeof__(&ncclGetUniqueId) GetUniqueId;
    __typeof__(&ncclCommInitRankConfig) CommInitRankConfig;
    __typeof__(&ncclCommSplit) CommSplit;
    __typeof__(&ncclCommGetAsyncError) CommGetAsyncError;
    __typeof__(&ncclCommAbort) CommAbort;
    __typeof__(&ncclCommFinalize) CommFinalize;
    __typeof__(&ncclCommDestroy) CommDestroy;
    __typeof__(&ncclGetErrorString) GetErrorString;
    __typeof__(&ncclGetLastError) GetLastError;
    __typeof__(&ncclAllReduce) AllReduce;
    __typeof__(&ncclAllGather) AllGather;
    __typeof__(&ncclReduceScatter) ReduceScatter;
    __typeof__(&ncclBroadcast) Broadcast;
    __typeof__(&ncclSend) Send;
    __typeof__(&ncclRecv) Recv;
    __typeof__(&ncclGroupStart) GroupStart;
    __typeof__(&ncclGroupEnd) GroupEnd;
    int version;
} nccl_api;

_Static_assert(sizeof(__typeof__(&ncclAllReduce)) == sizeof(void *),
               "function pointers are not pointer-sized");

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

static void version_parts(int v, int *major, int *minor, int *patch)
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
    const char *how = "already loaded";
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (!h) {
        h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
        how = "found on the library path";
    }
    if (!h) {
        const char *e = dlerror();
        nccl_unavailable("NCCL not found: libnccl.so.2 is not loaded in this process and not on the "
                         "library path (%s); a CUDA build of torch loads it on import",
                         e ? e : "dlopen failed");
        return;
    }
    nccl_api api;
    memset(&api, 0, sizeof api);
    void *sym;
#define AXC_NCCL_RESOLVE(field, name)                                                            \
    sym = dlsym(h, name);                                                                        \
    if (!sym) {                                                                                  \
        nccl_unavailable("libnccl.so.2 (%s) has no symbol %s; NCCL >= 2.18 is required", how,    \
                         name);                                                                  \
        return;                                                                                  \
    }                                                                                            \
    memcpy(&api.field, &sym, sizeof sym);
    AXC_NCCL_RESOLVE(GetVersion, "ncclGetVersion")
    AXC_NCCL_RESOLVE(GetUniqueId, "ncclGetUniqueId")
    AXC_NCCL_RESOLVE(CommInitRankConfig, "ncclCommInitRankConfig")
    AXC_NCCL_RESOLVE(CommSplit, "ncclCommSplit")
    AXC_NCCL_RESOLVE(CommGetAsyncError, "ncclCommGetAsyncError")
    AXC_NCCL_RESOLVE(CommAbort, "ncclCommAbort")
    AXC_NCCL_RESOLVE(CommFinalize, "ncclCommFinalize")
    AXC_NCCL_RESOLVE(CommDestroy, "ncclCommDestroy")
    AXC_NCCL_RESOLVE(GetErrorString, "ncclGetErrorString")
    AXC_NCCL_RESOLVE(GetLastError, "ncclGetLastError")
    AXC_NCCL_RESOLVE(AllReduce, "ncclAllReduce")
    AXC_NCCL_RESOLVE(AllGather, "ncclAllGather")
    AXC_NCCL_RESOLVE(ReduceScatter, "ncclReduceScatter")
    AXC_NCCL_RESOLVE(Broadcast, "ncclBroadcast")
    AXC_NCCL_RESOLVE(Send, "ncclSend")
    AXC_NCCL_RESOLVE(Recv, "ncclRecv")
    AXC_NCCL_RESOLVE(GroupStart, "ncclGroupStart")
    AXC_NCCL_RESOLVE(GroupEnd, "ncclGroupEnd")
#undef AXC_NCCL_RESOLVE
    int v = 0;
    ncclResult_t r = api.GetVersion(&v);
    if (r != ncclSuccess) {
        nccl_unavailable("ncclGetVersion failed: %s", api.GetErrorString(r));
        return;
    }
    int ma, mi, pa;
    version_parts(v, &ma, &mi, &pa);
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

static axc_status nccl_load(const nccl_api **api)
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
    if (nccl_load(&nc) != AXC_OK)
        return 0; /* the reason is in axc_last_error() */
    return nc->version;
}

/* ---------------------------------------------------------------- backend state */

typedef struct nccl_backend nccl_backend;
typedef struct nccl_group nccl_group;

/* One in-flight (or pooled) collective: its fork/join events and what the watchdog needs. */
typedef struct nccl_slot {
    void *ready;            /* recorded on the caller's stream; the comm stream waits on it */
    void *done;             /* recorded on the comm stream after the NCCL call */
    void *follow;           /* made on first use: marks where another stream joined a work this
                             * one follows (follow_after) */
    uint64_t seq;           /* start order on this rank (under mu) */
    axc_work *work;         /* attached until wait() detaches it (the work is freed after that) */
    nccl_group *group;      /* NULL once its group was closed */
    axc_coll_kind coll_kind;
    axc_group_kind group_kind;
    size_t count;
    axc_dtype dtype;
    axc_redop op;
    uint64_t group_seq;     /* this collective's number on its group (1 = the first), the same on
                             * every rank in step: a timeout names it so ranks can be compared */
    int64_t start_ns;
    int completed;          /* `done` observed fired */
    int reported;           /* axc_work_complete() already called for `work` */
    struct nccl_slot *prev, *next; /* in-flight list (doubly linked) or free list (next only) */
} nccl_slot;

struct nccl_group {
    nccl_backend *be;
    axc_group_kind kind;
    int size, rank, color;
    ncclComm_t comm;  /* NULL once aborted or destroyed */
    int owns_comm;    /* 0: borrows the world communicator */
    void *stream;     /* comm stream */
    void *barrier_buf; /* one int32 on the device */
    void *cbuf;        /* compressed collectives' scratch (encoded pieces, the owner's sum) */
    size_t cbuf_bytes;
    int inflight;     /* slots with group == this */
    uint64_t issued;  /* collectives enqueued on this group so far (under issue_mu) */
    char name[160];   /* NCCL commName */
    nccl_group *next;
};

struct nccl_backend {
    axc_backend base;
    const axc_cuda_api *cu;
    const nccl_api *nc;
    int device, rank, world_size, stream_priority;
    double timeout_s;
    char job[128];
    char world_name[160];
    ncclComm_t world;

    pthread_mutex_t issue_mu;
    pthread_mutex_t mu;
    uint64_t slot_seq; /* slots started so far (under mu): their `seq` */
    pthread_cond_t cv;
    pthread_t watchdog;
    int watchdog_started;
    int stop;

    nccl_slot *head, *tail; /* in-flight, in start order */
    nccl_slot *free_slots;
    nccl_group *groups;

    _Atomic int failed; /* axc_status of the failure, 0 while healthy; written under mu */
    int fail_done;      /* fail_all finished aborting and reporting (under mu) */
    char fail_msg[512];
};

/* ---------------------------------------------------------------- helpers */

static int64_t deadline_after(double seconds)
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
static void backoff(unsigned *spins)
{
    unsigned s = (*spins)++;
    if (s < 64) {
        sched_yield();
        return;
    }
    int64_t ns = 50000LL << ((s - 64) / 16 < 4 ? (s - 64) / 16 : 4);
    sleep_ns(ns > 1000000 ? 1000000 : ns);
}

static const char *nccl_str(const nccl_api *nc, ncclResult_t r)
{
    const char *s = nc->GetErrorString(r);
    return s ? s : "unknown NCCL error";
}

static const char *nccl_last(const nccl_api *nc, ncclComm_t comm)
{
    const char *s = nc->GetLastError(comm);
    return (s && *s) ? s : "no further detail from NCCL";
}

/* Fails with AXC_ERR_BACKEND naming the NCCL call. */
static axc_status nccl_fail(const nccl_backend *be, ncclResult_t r, ncclComm_t comm,
                            const char *call, const char *what)
{
    return axc_fail(AXC_ERR_BACKEND, "%s failed for %s (job %s, rank %d): %s: %s", call, what,
                    be->job, be->rank, nccl_str(be->nc, r), nccl_last(be->nc, comm));
}

/* Waits until `comm` leaves ncclInProgress. Returns its state (ncclSuccess or an error), or
 * ncclInProgress when `deadline_ns` passed or the backend failed meanwhile (*aborted set). */
static ncclResult_t poll_comm(nccl_backend *be, ncclComm_t comm, int64_t deadline_ns, int *aborted)
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
        backoff(&spins);
    }
}

typedef struct dev_guard {
    int prev, switched;
} dev_guard;

static axc_status dev_enter(nccl_backend *be, dev_guard *g)
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

static void dev_leave(nccl_backend *be, dev_guard *g)
{
    if (g->switched) {
        int e = be->cu->SetDevice(g->prev);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: restoring CUDA device %d failed (cudaError %d)", g->prev, e);
    }
}

static axc_status failure_status(nccl_backend *be)
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
static void describe_coll(char *out, size_t cap, axc_coll_kind kind, axc_redop op, size_t count,
                          axc_dtype dtype, axc_group_kind group, uint64_t group_seq)
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

/* ---------------------------------------------------------------- slots (mu held) */

static void inflight_remove(nccl_backend *be, nccl_slot *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        be->head = s->next;
    if (s->next)
        s->next->prev = s->prev;
    else
        be->tail = s->prev;
    s->prev = s->next = NULL;
}

static void inflight_append(nccl_backend *be, nccl_slot *s)
{
    s->prev = be->tail;
    s->next = NULL;
    if (be->tail)
        be->tail->next = s;
    else
        be->head = s;
    be->tail = s;
}

/* Returns a finished, detached slot to the pool. */
static void slot_recycle(nccl_backend *be, nccl_slot *s)
{
    inflight_remove(be, s);
    if (s->group)
        s->group->inflight--;
    s->group = NULL;
    s->work = NULL;
    s->completed = s->reported = 0;
    s->next = be->free_slots;
    be->free_slots = s;
}

/* Polls the done events of detached slots and recycles the finished ones (at most `budget`
 * queries, so start() stays cheap with many ops in flight). */
static void reap(nccl_backend *be, int budget)
{
    nccl_slot *s = be->head;
    while (s && budget > 0) {
        nccl_slot *next = s->next;
        if (!s->work) {
            if (!s->completed) {
                budget--;
                if (be->cu->EventQuery(s->done) == AXC_CUDA_SUCCESS)
                    s->completed = 1;
            }
            if (s->completed)
                slot_recycle(be, s);
        }
        s = next;
    }
}

/* Takes a pooled slot or makes one (its events belong to be->device: call inside dev_enter). */
static axc_status slot_get(nccl_backend *be, nccl_slot **out)
{
    *out = NULL;
    pthread_mutex_lock(&be->mu);
    reap(be, 4);
    nccl_slot *s = be->free_slots;
    if (s)
        be->free_slots = s->next;
    pthread_mutex_unlock(&be->mu);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s)
            return axc_fail(AXC_ERR_NOMEM, "out of memory for an NCCL event pair");
        axc_status st = axc_cuda_check(
            be->cu->EventCreateWithFlags(&s->ready, AXC_CUDA_EVENT_DISABLE_TIMING),
            "cudaEventCreateWithFlags (nccl fork event)");
        if (st == AXC_OK)
            st = axc_cuda_check(be->cu->EventCreateWithFlags(&s->done, AXC_CUDA_EVENT_DISABLE_TIMING),
                                "cudaEventCreateWithFlags (nccl join event)");
        if (st != AXC_OK) {
            if (s->ready)
                be->cu->EventDestroy(s->ready);
            free(s);
            return st;
        }
    }
    s->next = s->prev = NULL;
    s->work = NULL;
    s->group = NULL;
    s->completed = s->reported = 0;
    *out = s;
    return AXC_OK;
}

/* A slot that never went in flight goes straight back to the pool. */
static void slot_put_unused(nccl_backend *be, nccl_slot *s)
{
    pthread_mutex_lock(&be->mu);
    s->next = be->free_slots;
    be->free_slots = s;
    pthread_mutex_unlock(&be->mu);
}

static void slot_free(nccl_backend *be, nccl_slot *s)
{
    if (s->ready)
        be->cu->EventDestroy(s->ready);
    if (s->done)
        be->cu->EventDestroy(s->done);
    if (s->follow)
        be->cu->EventDestroy(s->follow);
    free(s);
}

/* ---------------------------------------------------------------- failure */

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
static void fail_all(nccl_backend *be, axc_status status, const char *msg, int have_issue)
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

static void *watchdog_main(void *arg)
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
                        describe_coll(what, sizeof what, s->coll_kind, s->op, s->count, s->dtype,
                                      s->group_kind, s->group_seq);
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
                slot_recycle(be, s);
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
                             axc_group_name(g->kind), be->job, be->rank, nccl_str(be->nc, st),
                             nccl_last(be->nc, g->comm));
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
                             be->job, be->rank, nccl_str(be->nc, st), nccl_last(be->nc, be->world));
                }
            }
            pthread_mutex_unlock(&be->issue_mu);
        }

        if (reason != AXC_OK) {
            pthread_mutex_unlock(&be->mu);
            fail_all(be, reason, msg, 0);
            pthread_mutex_lock(&be->mu);
        }
    }
    pthread_mutex_unlock(&be->mu);
    return NULL;
}

/* ---------------------------------------------------------------- communicators */

static void comm_config(ncclConfig_t *config, const char *name)
{
    ncclConfig_t init = NCCL_CONFIG_INITIALIZER;
    *config = init;
    config->blocking = 0; /* every call may return ncclInProgress: we poll with a deadline */
    config->commName = name;
}

/* Finalizes and destroys `comm` (issue_mu held). On failure or timeout it aborts it instead and
 * returns the error; `comm` is gone either way. */
static axc_status comm_release_locked(nccl_backend *be, ncclComm_t comm, const char *what)
{
    if (atomic_load(&be->failed)) {
        be->nc->CommAbort(comm);
        return AXC_OK;
    }
    ncclResult_t r = be->nc->CommFinalize(comm);
    if (r == ncclInProgress || r == ncclSuccess) {
        int aborted = 0;
        r = poll_comm(be, comm, deadline_after(be->timeout_s), &aborted);
        if (aborted) {
            be->nc->CommAbort(comm);
            return AXC_OK;
        }
    }
    if (r == ncclSuccess) {
        r = be->nc->CommDestroy(comm);
        if (r == ncclSuccess || r == ncclInProgress)
            return AXC_OK;
        return nccl_fail(be, r, NULL, "ncclCommDestroy", what);
    }
    axc_status st;
    if (r == ncclInProgress)
        st = axc_fail(AXC_ERR_TIMEOUT,
                      "ncclCommFinalize of %s did not finish within %.1f s (job %s, rank %d): a "
                      "peer is missing; the communicator was aborted",
                      what, be->timeout_s, be->job, be->rank);
    else
        st = nccl_fail(be, r, comm, "ncclCommFinalize", what);
    be->nc->CommAbort(comm);
    return st;
}

static axc_status init_world(nccl_backend *be, const axc_comm_config *cfg)
{
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    char key[256];
    snprintf(key, sizeof key, "%s/nccl/uid", be->job);
    ncclResult_t r;
    if (be->rank == 0 || be->world_size == 1) {
        r = be->nc->GetUniqueId(&id);
        if (r != ncclSuccess)
            return nccl_fail(be, r, NULL, "ncclGetUniqueId", "the world communicator");
    }
    if (be->world_size > 1) {
        if (!cfg->bootstrap.set || !cfg->bootstrap.get)
            return axc_fail(AXC_ERR_INVALID,
                            "the nccl backend needs a bootstrap store to share its id among %d "
                            "ranks (job %s)",
                            be->world_size, be->job);
        if (be->rank == 0) {
            axc_status st = cfg->bootstrap.set(cfg->bootstrap.ctx, key, &id, sizeof id);
            if (st != AXC_OK)
                return axc_fail(st, "publishing the NCCL id under '%s' failed: %s", key,
                                axc_last_error());
        } else {
            size_t len = 0;
            axc_status st = cfg->bootstrap.get(cfg->bootstrap.ctx, key, &id, sizeof id, &len,
                                               be->timeout_s);
            if (st != AXC_OK)
                return axc_fail(st, "rank %d waited for rank 0's NCCL id under '%s' (job %s): %s",
                                be->rank, key, be->job, axc_last_error());
            if (len != sizeof id)
                return axc_fail(AXC_ERR_INVALID,
                                "the NCCL id under '%s' has %zu bytes, expected %zu (job %s): "
                                "another job or version wrote that key",
                                key, len, sizeof id, be->job);
        }
    }

    ncclConfig_t config;
    snprintf(be->world_name, sizeof be->world_name, "axonn_c:%s:world", be->job);
    comm_config(&config, be->world_name);
    ncclComm_t comm = NULL;
    int64_t deadline = deadline_after(be->timeout_s);
    pthread_mutex_lock(&be->issue_mu);
    r = be->nc->CommInitRankConfig(&comm, be->world_size, id, be->rank, &config);
    if (r == ncclInProgress || (r == ncclSuccess && comm))
        r = poll_comm(be, comm, deadline, NULL);
    if (r != ncclSuccess) {
        axc_status st;
        if (r == ncclInProgress)
            st = axc_fail(AXC_ERR_TIMEOUT,
                          "the NCCL world communicator of job %s was not ready within %.1f s "
                          "(rank %d of %d, cuda:%d): a peer did not arrive",
                          be->job, be->timeout_s, be->rank, be->world_size, be->device);
        else
            st = axc_fail(AXC_ERR_BACKEND,
                          "ncclCommInitRankConfig failed for job %s (rank %d of %d, cuda:%d): "
                          "%s: %s",
                          be->job, be->rank, be->world_size, be->device, nccl_str(be->nc, r),
                          nccl_last(be->nc, comm));
        if (comm)
            be->nc->CommAbort(comm);
        pthread_mutex_unlock(&be->issue_mu);
        return st;
    }
    be->world = comm;
    pthread_mutex_unlock(&be->issue_mu);
    return AXC_OK;
}

static void group_destroy_resources(nccl_backend *be, nccl_group *g)
{
    if (g->stream) {
        int e = be->cu->StreamDestroy(g->stream);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: cudaStreamDestroy of the %s group failed (cudaError %d)",
                    axc_group_name(g->kind), e);
    }
    if (g->barrier_buf) {
        int e = be->cu->Free(g->barrier_buf);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: cudaFree of the %s group's barrier buffer failed (cudaError %d)",
                    axc_group_name(g->kind), e);
    }
    if (g->cbuf) {
        int e = be->cu->Free(g->cbuf);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: cudaFree of the %s group's compression buffer failed (cudaError %d)",
                    axc_group_name(g->kind), e);
    }
    g->stream = g->barrier_buf = g->cbuf = NULL;
    g->cbuf_bytes = 0;
}

static axc_status nccl_group_open(axc_backend *base, const axc_group_info *info, void **out)
{
    nccl_backend *be = (nccl_backend *)base;
    *out = NULL;
    AXC_TRY(failure_status(be));
    if (info->kind != AXC_GROUP_WORLD && info->color < 0)
        return axc_fail(AXC_ERR_INVALID, "nccl: negative colour %d for the %s group",
                        info->color, axc_group_name(info->kind));
    nccl_group *g = calloc(1, sizeof *g);
    if (!g)
        return axc_fail(AXC_ERR_NOMEM, "out of memory opening the %s group",
                        axc_group_name(info->kind));
    g->be = be;
    g->kind = info->kind;
    g->size = info->size;
    g->rank = info->rank;
    g->color = info->color;
    snprintf(g->name, sizeof g->name, "axonn_c:%s:%s:%d:ch%d", be->job,
             axc_group_name(info->kind), info->color, info->channel);
    dev_guard dg;
    axc_status st = dev_enter(be, &dg);
    if (st != AXC_OK) {
        free(g);
        return st;
    }

    /* channel 0's world group is the world communicator; every other group (and every channel's
     * world copy, colour 0 for all) is a split of it, with its own stream */
    if (info->kind == AXC_GROUP_WORLD && info->channel == 0) {
        g->comm = be->world;
        g->owns_comm = 0;
    } else {
        ncclConfig_t config;
        comm_config(&config, g->name);
        ncclComm_t child = NULL;
        int64_t deadline = deadline_after(be->timeout_s);
        pthread_mutex_lock(&be->issue_mu);
        if (!be->world) {
            st = axc_fail(AXC_ERR_STATE, "nccl: the world communicator is gone (job %s)", be->job);
        } else {
            ncclResult_t r =
                be->nc->CommSplit(be->world, info->color, info->rank, &child, &config);
            if (r == ncclInProgress || (r == ncclSuccess && child))
                r = poll_comm(be, child, deadline, NULL);
            if (r == ncclSuccess) /* the parent takes part in the split too */
                r = poll_comm(be, be->world, deadline, NULL);
            if (r == ncclSuccess && !child)
                st = axc_fail(AXC_ERR_BACKEND,
                              "ncclCommSplit returned no communicator for the %s group (colour "
                              "%d, job %s)",
                              axc_group_name(info->kind), info->color, be->job);
            else if (r == ncclInProgress)
                st = axc_fail(AXC_ERR_TIMEOUT,
                              "ncclCommSplit for the %s group (colour %d, rank %d of %d) did not "
                              "finish within %.1f s (job %s, global rank %d): a peer did not "
                              "arrive",
                              axc_group_name(info->kind), info->color, info->rank, info->size,
                              be->timeout_s, be->job, be->rank);
            else if (r != ncclSuccess)
                st = axc_fail(AXC_ERR_BACKEND,
                              "ncclCommSplit failed for the %s group (colour %d, rank %d of %d, "
                              "job %s): %s: %s",
                              axc_group_name(info->kind), info->color, info->rank, info->size,
                              be->job, nccl_str(be->nc, r), nccl_last(be->nc, child));
            if (st != AXC_OK && child)
                be->nc->CommAbort(child);
            else
                g->comm = child;
        }
        pthread_mutex_unlock(&be->issue_mu);
        if (st != AXC_OK) {
            if (st == AXC_ERR_TIMEOUT) { /* the world is stuck mid-split: nothing can recover */
                char msg[512];
                snprintf(msg, sizeof msg, "%s", axc_last_error());
                fail_all(be, st, msg, 0);
                axc_fail(st, "%s", msg);
            }
            dev_leave(be, &dg);
            free(g);
            return st;
        }
        g->owns_comm = 1;
    }

    st = axc_cuda_check(be->cu->StreamCreateWithPriority(&g->stream, AXC_CUDA_STREAM_NON_BLOCKING,
                                                         be->stream_priority),
                        "cudaStreamCreateWithPriority (nccl comm stream)");
    if (st == AXC_OK)
        st = axc_cuda_check(be->cu->Malloc(&g->barrier_buf, sizeof(int32_t)),
                            "cudaMalloc (nccl barrier word)");
    if (st == AXC_OK) { /* zero it on the comm stream, ordered before any barrier */
        static const int32_t zero = 0;
        st = axc_cuda_check(be->cu->MemcpyAsync(g->barrier_buf, &zero, sizeof zero,
                                                AXC_CUDA_MEMCPY_H2D, g->stream),
                            "cudaMemcpyAsync (nccl barrier word)");
        if (st == AXC_OK)
            st = axc_cuda_check(be->cu->StreamSynchronize(g->stream),
                                "cudaStreamSynchronize (nccl comm stream)");
    }
    if (st != AXC_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", axc_last_error());
        group_destroy_resources(be, g);
        if (g->owns_comm && g->comm) {
            pthread_mutex_lock(&be->issue_mu);
            if (g->comm)
                be->nc->CommAbort(g->comm);
            pthread_mutex_unlock(&be->issue_mu);
        }
        dev_leave(be, &dg);
        free(g);
        return axc_fail(st, "%s", msg);
    }
    dev_leave(be, &dg);

    pthread_mutex_lock(&be->mu);
    g->next = be->groups;
    be->groups = g;
    pthread_mutex_unlock(&be->mu);
    *out = g;
    return AXC_OK;
}

static void nccl_group_close(axc_backend *base, void *group)
{
    nccl_backend *be = (nccl_backend *)base;
    nccl_group *g = group;
    if (!g)
        return;
    dev_guard dg;
    int have_dev = dev_enter(be, &dg) == AXC_OK;

    /* 1. let this group's in-flight collectives finish (bounded by the timeout) */
    int64_t deadline = deadline_after(be->timeout_s);
    unsigned spins = 0;
    for (;;) {
        pthread_mutex_lock(&be->mu);
        int pending = 0;
        for (nccl_slot *s = be->head; s; s = s->next) {
            if (s->group != g || s->completed)
                continue;
            int q = be->cu->EventQuery(s->done);
            if (q == AXC_CUDA_SUCCESS || q != AXC_CUDA_ERROR_NOT_READY)
                s->completed = 1; /* an error here is the watchdog's to report */
            else
                pending++;
        }
        int failed = atomic_load(&be->failed);
        pthread_mutex_unlock(&be->mu);
        if (!pending || failed)
            break;
        if (axc_now_ns() >= deadline) {
            char msg[512];
            snprintf(msg, sizeof msg,
                     "closing the %s group: %d collective(s) still running after %.1f s (job %s, "
                     "rank %d); all NCCL communicators were aborted",
                     axc_group_name(g->kind), pending, be->timeout_s, be->job, be->rank);
            fail_all(be, AXC_ERR_TIMEOUT, msg, 0);
            break;
        }
        backoff(&spins);
    }

    /* 2. release the communicator */
    pthread_mutex_lock(&be->issue_mu);
    if (g->owns_comm && g->comm) {
        char what[96];
        snprintf(what, sizeof what, "the %s group", axc_group_name(g->kind));
        ncclComm_t c = g->comm;
        g->comm = NULL;
        axc_status st = comm_release_locked(be, c, what);
        if (st != AXC_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", axc_last_error());
            fail_all(be, st, msg, 1);
        }
    }
    g->comm = NULL;
    pthread_mutex_unlock(&be->issue_mu);

    /* 3. forget it: slots keep running (watched) but no longer point at the group */
    pthread_mutex_lock(&be->mu);
    for (nccl_slot *s = be->head; s; s = s->next) {
        if (s->group == g)
            s->group = NULL;
    }
    g->inflight = 0;
    for (nccl_group **p = &be->groups; *p; p = &(*p)->next) {
        if (*p == g) {
            *p = g->next;
            break;
        }
    }
    pthread_mutex_unlock(&be->mu);

    group_destroy_resources(be, g);
    if (have_dev)
        dev_leave(be, &dg);
    free(g);
}

/* ---------------------------------------------------------------- collectives */

static int map_dtype(axc_dtype dt, ncclDataType_t *out)
{
    switch (dt) {
    case AXC_DT_F32: *out = ncclFloat32; return 1;
    case AXC_DT_BF16: *out = ncclBfloat16; return 1;
    case AXC_DT_F16: *out = ncclFloat16; return 1;
    case AXC_DT_I8: *out = ncclInt8; return 1;
    case AXC_DT_U8: *out = ncclUint8; return 1;
    case AXC_DT_I32: *out = ncclInt32; return 1;
    case AXC_DT_I64: *out = ncclInt64; return 1;
    case AXC_DT_F64: *out = ncclFloat64; return 1;
    case AXC_DT_COUNT: break;
    }
    return 0;
}

static int map_op(axc_redop op, ncclRedOp_t *out)
{
    switch (op) {
    case AXC_RED_SUM: *out = ncclSum; return 1;
    case AXC_RED_AVG: *out = ncclAvg; return 1;
    case AXC_RED_MAX: *out = ncclMax; return 1;
    }
    return 0;
}

/* One NCCL call of a sequence on a non-blocking communicator: the next may be issued only once
 * this one is enqueued (ncclInProgress polled to completion). */
static ncclResult_t settle(nccl_backend *be, nccl_group *g, ncclResult_t r, int *aborted)
{
    if (r == ncclInProgress)
        r = poll_comm(be, g->comm, deadline_after(be->timeout_s), aborted);
    return r;
}

/* A compressed collective (axc_coll.codec; the shm backend's run_compressed has the algorithm)
 * on the comm stream: codec kernels around a grouped send/recv all-to-all and an all-gather of
 * bytes, so every rank decodes the same bytes. A kernel that cannot be launched fails the call
 * with ncclUnhandledCudaError and its message logged. */
static ncclResult_t issue_compressed_locked(nccl_backend *be, nccl_group *g, const axc_coll *c,
                                            int *aborted)
{
    const nccl_api *nc = be->nc;
    void *s = g->stream;
    int G = g->size, me = g->rank;
    int ar = c->kind == AXC_COLL_ALL_REDUCE, ag = c->kind == AXC_COLL_ALL_GATHER;
    size_t piece = ar ? (c->count + (size_t)G - 1) / (size_t)G : c->count;
    size_t n_in = c->kind == AXC_COLL_REDUCE_SCATTER ? c->count * (size_t)G : c->count, E = 0;
    const float *send = c->send ? (const float *)c->send : (const float *)c->recv;
    float *recv = c->recv;
    if (G == 1) /* nothing to exchange: an exact copy, as on shm */
        return send == recv || !c->count
                   ? ncclSuccess
                   : (be->cu->MemcpyAsync(recv, send, c->count * 4, AXC_CUDA_MEMCPY_D2D, s) ==
                              AXC_CUDA_SUCCESS
                          ? ncclSuccess
                          : ncclUnhandledCudaError);
    if (axc_codec_encoded_bytes(c->codec, piece, c->block, &E) != AXC_OK)
        return ncclInvalidArgument;
    size_t n_send = ag ? 1 : (size_t)G, sum_off = (n_send * E + (size_t)G * E + 255) / 256 * 256;
    size_t need = sum_off + (ar ? piece * 4 : 0) + 256;
    if (g->cbuf_bytes < need) { /* (cudaFree waits for the device: earlier users are done) */
        if (g->cbuf)
            be->cu->Free(g->cbuf);
        g->cbuf = NULL;
        g->cbuf_bytes = 0;
        if (be->cu->Malloc(&g->cbuf, need) != AXC_CUDA_SUCCESS)
            return ncclSystemError;
        g->cbuf_bytes = need;
    }
    unsigned char *enc = g->cbuf, *got = enc + n_send * E;
    float *sum = (float *)(void *)(enc + sum_off);
    axc_status st = AXC_OK;
    ncclResult_t r = ncclSuccess;
#define AXC_PIECE(k, lo, len)                                                                 \
    size_t lo = (size_t)(k) * piece < n_in ? (size_t)(k) * piece : n_in;                    \
    size_t len = n_in - lo < piece ? n_in - lo : piece
    for (size_t k = 0; k < n_send && st == AXC_OK; k++) {
        AXC_PIECE(k, lo, len);
        st = axc_codec_cuda_encode(c->codec, c->block, send + lo,
                                   c->residual ? c->residual + lo : NULL, len, enc + k * E, s);
    }
    if (st == AXC_OK) {
        if (ag) {
            r = settle(be, g, nc->AllGather(enc, got, E, ncclUint8, g->comm, s), aborted);
        } else {
            r = nc->GroupStart();
            for (int p = 0; p < G && (r == ncclSuccess || r == ncclInProgress); p++) {
                r = nc->Send(enc + (size_t)p * E, E, ncclUint8, p, g->comm, s);
                if (r == ncclSuccess || r == ncclInProgress)
                    r = nc->Recv(got + (size_t)p * E, E, ncclUint8, p, g->comm, s);
            }
            ncclResult_t end = nc->GroupEnd();
            r = settle(be, g, r == ncclSuccess || r == ncclInProgress ? end : r, aborted);
        }
    }
    if (st == AXC_OK && r == ncclSuccess && !ag) {
        AXC_PIECE(me, lo, len);
        float *out = ar ? sum : recv;
        if (!ar)
            len = c->count;
        (void)lo;
        for (int k = 0; k < G && st == AXC_OK; k++)
            st = axc_codec_cuda_decode(c->codec, c->block, got + (size_t)k * E, len, out, k > 0,
                                       s);
        if (st == AXC_OK && c->op == AXC_RED_AVG)
            st = axc_codec_cuda_div(out, len, (float)G, s);
        if (st == AXC_OK && ar)
            st = axc_codec_cuda_encode(c->codec, c->block, sum, NULL, len, enc, s);
        if (st == AXC_OK && ar)
            r = settle(be, g, nc->AllGather(enc, got, E, ncclUint8, g->comm, s), aborted);
    }
    if (st == AXC_OK && r == ncclSuccess && (ar || ag)) {
        for (int k = 0; k < G && st == AXC_OK; k++) {
            AXC_PIECE(k, lo, len);
            if (ag) {
                lo = (size_t)k * c->count;
                len = c->count;
            }
            st = axc_codec_cuda_decode(c->codec, c->block, got + (size_t)k * E, len, recv + lo, 0,
                                       s);
            if (st == AXC_OK && ar && k == me && c->residual)
                st = axc_codec_cuda_feedback(c->codec, c->block, sum, recv + lo, len,
                                             c->op == AXC_RED_AVG ? (float)G : 1.0f,
                                             c->residual + lo, s);
        }
    }
#undef AXC_PIECE
    if (st != AXC_OK) {
        axc_log(2, "nccl: compressed %s on the %s group: %s", axc_coll_name(c->kind),
                axc_group_name(g->kind), axc_last_error());
        return ncclUnhandledCudaError;
    }
    return r;
}

/* Enqueues the NCCL call(s) of `c` on the group's comm stream (issue_mu held). May return
 * ncclInProgress (non-blocking communicator): the caller polls. */
static ncclResult_t issue_locked(nccl_backend *be, nccl_group *g, const axc_coll *c,
                                 ncclDataType_t dt, ncclRedOp_t op, int *aborted)
{
    const nccl_api *nc = be->nc;
    cudaStream_t s = (cudaStream_t)g->stream;
    ncclComm_t comm = g->comm;
    const void *send = c->send ? c->send : c->recv; /* NULL send: in place */
    size_t n = c->count;
    if (c->codec != AXC_CODEC_NONE)
        return issue_compressed_locked(be, g, c, aborted);
    switch (c->kind) {
    case AXC_COLL_ALL_REDUCE: return nc->AllReduce(send, c->recv, n, dt, op, comm, s);
    case AXC_COLL_ALL_GATHER: return nc->AllGather(send, c->recv, n, dt, comm, s);
    case AXC_COLL_REDUCE_SCATTER: return nc->ReduceScatter(send, c->recv, n, dt, op, comm, s);
    case AXC_COLL_BROADCAST: return nc->Broadcast(send, c->recv, n, dt, c->root, comm, s);
    case AXC_COLL_BARRIER:
        return nc->AllReduce(g->barrier_buf, g->barrier_buf, 1, ncclInt32, ncclSum, comm, s);
    case AXC_COLL_ALL_TO_ALL: {
        size_t piece = n * axc_dtype_size(c->dtype);
        ncclResult_t r = nc->GroupStart();
        if (r != ncclSuccess)
            return r;
        ncclResult_t first = ncclSuccess;
        for (int p = 0; p < g->size && (first == ncclSuccess || first == ncclInProgress); p++) {
            first = nc->Send((const char *)send + (size_t)p * piece, n, dt, p, comm, s);
            if (first == ncclSuccess || first == ncclInProgress)
                first = nc->Recv((char *)c->recv + (size_t)p * piece, n, dt, p, comm, s);
        }
        ncclResult_t end = nc->GroupEnd(); /* always closes the group, also after an error */
        if (first != ncclSuccess && first != ncclInProgress)
            return first;
        return end;
    }
    case AXC_COLL_COUNT: break;
    }
    return ncclInvalidArgument;
}

/* Orders group g's comm stream after the works `w` must follow (axc_comm_start_after: e.g. the
 * depth reduce-scatters that wrote the bucket a data-parallel sum reads), without the caller's
 * stream or the host waiting. A group's works finish in order on its stream, so one stream wait
 * on the `done` event of its latest pending work in the list covers them all (none for works of
 * g itself: its stream is in order already). A work already waited was joined into the stream
 * it was started on; when that is not this collective's stream, the point is marked there
 * (`slot->follow`) and waited for. Other backends' works were waited for by the caller. */
static axc_status follow_after(nccl_backend *be, nccl_group *g, nccl_slot *slot,
                               const axc_work *w)
{
    enum { MAX_LATEST = 16 };
    const nccl_slot *latest[MAX_LATEST]; /* per other group, its newest pending work here */
    int nlatest = 0;
    axc_status st = AXC_OK;
    pthread_mutex_lock(&be->mu); /* a concurrent wait() detaches the slot under mu */
    for (size_t i = 0; i < w->n_after && st == AXC_OK; i++) {
        const axc_work *a = w->after[i];
        if (a->backend != &be->base || a->coll.kind == AXC_COLL_BARRIER)
            continue; /* (a barrier is waited on the host) */
        const nccl_slot *s = a->backend_data;
        if (s) {
            if (s->group == g)
                continue;
            int k = 0;
            while (k < nlatest && latest[k]->group != s->group)
                k++;
            if (k < nlatest) {
                if (s->seq > latest[k]->seq)
                    latest[k] = s;
            } else if (nlatest < MAX_LATEST) {
                latest[nlatest++] = s;
            } else { /* (more groups than fit: waited for on its own) */
                st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, s->done, 0),
                                    "cudaStreamWaitEvent (nccl comm stream waits for another "
                                    "group's collective)");
            }
            continue;
        }
        if (!a->waited || a->coll.device < 0 || a->coll.stream == w->coll.stream)
            continue; /* (the same stream: the fork orders this collective after the join) */
        int capture = AXC_CUDA_CAPTURE_NONE;
        if (be->cu->StreamIsCapturing &&
            be->cu->StreamIsCapturing(a->coll.stream, &capture) == AXC_CUDA_SUCCESS &&
            capture != AXC_CUDA_CAPTURE_NONE) {
            st = axc_fail(AXC_ERR_INVALID,
                          "nccl: %s on the %s group follows a collective joined on a stream "
                          "that is being captured into a CUDA graph; axonn_c's NCCL collectives "
                          "cannot be captured",
                          axc_coll_name(w->coll.kind), axc_group_name(g->kind));
            break;
        }
        if (!slot->follow)
            st = axc_cuda_check(
                be->cu->EventCreateWithFlags(&slot->follow, AXC_CUDA_EVENT_DISABLE_TIMING),
                "cudaEventCreateWithFlags (nccl follow event)");
        if (st == AXC_OK)
            st = axc_cuda_check(be->cu->EventRecord(slot->follow, a->coll.stream),
                                "cudaEventRecord (where another stream joined a followed work)");
        if (st == AXC_OK)
            st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, slot->follow, 0),
                                "cudaStreamWaitEvent (nccl comm stream waits for a followed "
                                "work joined on another stream)");
    }
    for (int k = 0; k < nlatest && st == AXC_OK; k++)
        st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, latest[k]->done, 0),
                            "cudaStreamWaitEvent (nccl comm stream waits for another group's "
                            "collective)");
    pthread_mutex_unlock(&be->mu);
    return st;
}

static axc_status nccl_start(axc_backend *base, void *group, axc_work *w)
{
    nccl_backend *be = (nccl_backend *)base;
    nccl_group *g = group;
    const axc_coll *c = &w->coll;
    w->backend_data = NULL;
    if (!g)
        return axc_fail(AXC_ERR_STATE, "nccl: %s on a group that is not open",
                        axc_coll_name(c->kind));
    /* a barrier carries no tensor (device -1, the legacy default stream): it runs on this
     * rank's device with the backend's own buffer */
    if (c->device != be->device && c->kind != AXC_COLL_BARRIER) {
        if (c->device < 0)
            return axc_fail(AXC_ERR_INVALID,
                            "nccl: %s on the %s group got host (CPU) buffers; NCCL needs CUDA "
                            "tensors on cuda:%d",
                            axc_coll_name(c->kind), axc_group_name(g->kind), be->device);
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: %s on the %s group got buffers on cuda:%d, but this rank's NCCL "
                        "communicators use cuda:%d",
                        axc_coll_name(c->kind), axc_group_name(g->kind), c->device, be->device);
    }
    ncclDataType_t dt = ncclFloat32;
    ncclRedOp_t op = ncclSum;
    if (c->kind != AXC_COLL_BARRIER && !map_dtype(c->dtype, &dt))
        return axc_fail(AXC_ERR_INVALID, "nccl: unsupported dtype code %d", (int)c->dtype);
    if (!map_op(c->op, &op))
        return axc_fail(AXC_ERR_INVALID, "nccl: unsupported reduction code %d", (int)c->op);
    if (c->kind == AXC_COLL_ALL_TO_ALL && g->size > 1 && c->count > 0 &&
        (const void *)c->send == (const void *)c->recv)
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: all_to_all on the %s group cannot run in place (input and output "
                        "are the same buffer)",
                        axc_group_name(g->kind));
    if (atomic_load(&be->failed))
        return failure_status(be);
    /* Refused under CUDA-graph capture: the slot's events are polled by the watchdog and by
     * reap(), and an event recorded inside a capture can never be queried (the graph would
     * fail the whole job at its first replay check), nor be waited on by an uncaptured wait. */
    int capture = AXC_CUDA_CAPTURE_NONE;
    if (be->cu->StreamIsCapturing && c->kind != AXC_COLL_BARRIER &&
        be->cu->StreamIsCapturing(c->stream, &capture) == AXC_CUDA_SUCCESS &&
        capture != AXC_CUDA_CAPTURE_NONE)
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: %s of %zu x %s on the %s group was issued on a stream that is "
                        "being captured into a CUDA graph; axonn_c's NCCL collectives cannot be "
                        "captured: capture only work without them (a grid of one rank has none)",
                        axc_coll_name(c->kind), c->count, axc_dtype_name(c->dtype),
                        axc_group_name(g->kind));

    dev_guard dg;
    AXC_TRY(dev_enter(be, &dg));
    nccl_slot *slot = NULL;
    axc_status st = slot_get(be, &slot);
    if (st != AXC_OK) {
        dev_leave(be, &dg);
        return st;
    }
    /* fork: the comm stream starts after everything already queued on the caller's stream */
    st = axc_cuda_check(be->cu->EventRecord(slot->ready, c->stream),
                        "cudaEventRecord (nccl fork, caller's stream)");
    if (st == AXC_OK)
        st = axc_cuda_check(be->cu->StreamWaitEvent(g->stream, slot->ready, 0),
                            "cudaStreamWaitEvent (nccl comm stream waits for the caller)");
    if (st == AXC_OK)
        st = follow_after(be, g, slot, w);
    if (st != AXC_OK) {
        slot_put_unused(be, slot);
        dev_leave(be, &dg);
        return st;
    }

    pthread_mutex_lock(&be->issue_mu);
    if (atomic_load(&be->failed) || !g->comm) {
        pthread_mutex_unlock(&be->issue_mu);
        slot_put_unused(be, slot);
        dev_leave(be, &dg);
        st = failure_status(be);
        return st != AXC_OK ? st
                            : axc_fail(AXC_ERR_STATE, "nccl: the %s group's communicator is gone",
                                       axc_group_name(g->kind));
    }
    int skip = c->count == 0 && c->kind != AXC_COLL_BARRIER; /* nothing to move; keep ordering */
    uint64_t group_seq = ++g->issued;
    int aborted = 0;
    ncclResult_t r = skip ? ncclSuccess : issue_locked(be, g, c, dt, op, &aborted);
    if (r == ncclInProgress && !aborted)
        r = poll_comm(be, g->comm, deadline_after(be->timeout_s), &aborted);
    if (r != ncclSuccess) {
        char msg[512], what[200];
        axc_status fs;
        describe_coll(what, sizeof what, c->kind, c->op, c->count, c->dtype, g->kind,
                      group_seq);
        if (aborted) {
            pthread_mutex_unlock(&be->issue_mu);
            slot_put_unused(be, slot);
            dev_leave(be, &dg);
            return failure_status(be);
        }
        ncclResult_t async = ncclSuccess, ar = ncclSuccess;
        if (r != ncclInProgress)
            ar = be->nc->CommGetAsyncError(g->comm, &async);
        if (r == ncclInProgress) {
            fs = AXC_ERR_TIMEOUT;
            snprintf(msg, sizeof msg,
                     "%s could not be enqueued within %.1f s (job %s, rank %d): a peer is "
                     "missing; all NCCL communicators were aborted",
                     what, be->timeout_s, be->job, be->rank);
        } else if (ar != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
            fs = AXC_ERR_PEER; /* the communicator itself is broken */
            snprintf(msg, sizeof msg,
                     "%s failed (job %s, rank %d): %s: %s; all NCCL communicators were aborted",
                     what, be->job, be->rank, nccl_str(be->nc, r), nccl_last(be->nc, g->comm));
        } else { /* a usage error: the communicator is still fine */
            st = nccl_fail(be, r, g->comm, "enqueueing the NCCL call", what);
            pthread_mutex_unlock(&be->issue_mu);
            slot_put_unused(be, slot);
            dev_leave(be, &dg);
            return st;
        }
        fail_all(be, fs, msg, 1);
        pthread_mutex_unlock(&be->issue_mu);
        slot_put_unused(be, slot);
        dev_leave(be, &dg);
        return axc_fail(fs, "%s", msg);
    }
    pthread_mutex_unlock(&be->issue_mu);

    /* join point: `done` fires when the NCCL kernel (and the fork) finished */
    st = axc_cuda_check(be->cu->EventRecord(slot->done, g->stream),
                        "cudaEventRecord (nccl join, comm stream)");
    if (st != AXC_OK) {
        /* the op is queued but cannot be joined: the CUDA context is broken, stop everything */
        char msg[768];
        snprintf(msg, sizeof msg, "%s; all NCCL communicators were aborted", axc_last_error());
        fail_all(be, AXC_ERR_BACKEND, msg, 0);
        slot_put_unused(be, slot);
        dev_leave(be, &dg);
        return axc_fail(AXC_ERR_BACKEND, "%s", msg);
    }

    pthread_mutex_lock(&be->mu);
    slot->work = w;
    slot->group = g;
    slot->coll_kind = c->kind;
    slot->group_kind = g->kind;
    slot->count = c->count;
    slot->dtype = c->dtype;
    slot->op = c->op;
    slot->group_seq = group_seq;
    slot->start_ns = axc_now_ns();
    slot->seq = ++be->slot_seq;
    slot->completed = slot->reported = 0;
    g->inflight++;
    inflight_append(be, slot);
    w->backend_data = slot;
    int failed = atomic_load(&be->failed);
    if (failed) { /* fail_all ran since issue_mu was released and did not see this slot: its
                   * kernel was aborted; wait() must not take it for one finished before */
        slot->reported = 1;
        axc_work_complete(w, (axc_status)failed, be->fail_msg);
    }
    pthread_mutex_unlock(&be->mu);
    dev_leave(be, &dg);
    return AXC_OK;
}

/* Joins `w` into the caller's stream (a barrier waits on the host). Afterwards the work is detached
 * from its slot; the slot stays watched until `done` fires, then returns to the pool. */
static axc_status nccl_wait(axc_backend *base, axc_work *w)
{
    nccl_backend *be = (nccl_backend *)base;
    nccl_slot *slot = w->backend_data;
    if (!slot)
        return axc_fail(AXC_ERR_STATE, "nccl: wait on a work that was never started");
    int host_wait = w->coll.kind == AXC_COLL_BARRIER;
    dev_guard dg;
    axc_status dst = dev_enter(be, &dg);
    if (dst != AXC_OK) { /* detach anyway: the generic layer frees `w` after an error */
        char m[512];
        snprintf(m, sizeof m, "%s", axc_last_error());
        pthread_mutex_lock(&be->mu);
        slot->work = NULL;
        w->backend_data = NULL;
        int reported = slot->reported;
        pthread_mutex_unlock(&be->mu);
        if (!reported)
            axc_work_complete(w, dst, m);
        return axc_fail(dst, "%s", m);
    }
    int64_t deadline = slot->start_ns + (int64_t)((be->timeout_s + 1.0) * 1e9);
    axc_status st = AXC_OK;
    char msg[512] = "";
    int report = 0; /* call axc_work_complete after detaching */
    unsigned spins = 0;
    for (;;) {
        pthread_mutex_lock(&be->mu);
        if (slot->reported) { /* failed by fail_all: the status and message are in the work */
            st = w->status != AXC_OK ? w->status : AXC_ERR_PEER;
            snprintf(msg, sizeof msg, "%s", w->message);
            break;
        }
        if (atomic_load(&be->failed) && !be->fail_done) {
            /* fail_all is deciding which works finished before the abort: ask again shortly */
            pthread_mutex_unlock(&be->mu);
            backoff(&spins);
            continue;
        }
        /* healthy, or failed after this collective had finished (its result stands) */
        if (!host_wait) {
            int e = be->cu->StreamWaitEvent(w->coll.stream, slot->done, 0);
            if (e != AXC_CUDA_SUCCESS) {
                st = axc_cuda_check(e, "cudaStreamWaitEvent (joining an NCCL collective)");
                snprintf(msg, sizeof msg, "%s", axc_last_error());
            }
            report = 1;
            break;
        }
        int q = slot->completed ? AXC_CUDA_SUCCESS : be->cu->EventQuery(slot->done);
        if (q != AXC_CUDA_ERROR_NOT_READY) {
            if (q == AXC_CUDA_SUCCESS) {
                slot->completed = 1;
            } else {
                st = axc_cuda_check(q, "cudaEventQuery (NCCL barrier)");
                snprintf(msg, sizeof msg, "%s", axc_last_error());
            }
            report = 1;
            break;
        }
        pthread_mutex_unlock(&be->mu);
        if (axc_now_ns() >= deadline) {
            char m[512], what[200];
            describe_coll(what, sizeof what, AXC_COLL_BARRIER, AXC_RED_SUM, 0, AXC_DT_F32,
                          w->group.kind, slot->group_seq);
            snprintf(m, sizeof m,
                     "%s did not complete within %.1f s (job %s, rank %d): a peer died or is "
                     "stuck; all NCCL communicators were aborted",
                     what, be->timeout_s, be->job, be->rank);
            fail_all(be, AXC_ERR_TIMEOUT, m, 0); /* the next round sees slot->reported */
            continue;
        }
        backoff(&spins);
    }
    /* every break above holds mu: detach (the generic layer frees `w` after we return) */
    slot->work = NULL;
    w->backend_data = NULL;
    if (slot->completed && !atomic_load(&be->failed))
        slot_recycle(be, slot);
    pthread_mutex_unlock(&be->mu);
    if (report)
        axc_work_complete(w, st, msg);
    dev_leave(be, &dg);
    if (st != AXC_OK)
        return axc_fail(st, "%s", msg);
    return AXC_OK;
}

static int nccl_query(axc_backend *base, axc_work *w)
{
    nccl_backend *be = (nccl_backend *)base;
    if (atomic_load_explicit(&w->state, memory_order_acquire) != AXC_WORK_PENDING)
        return 1;
    nccl_slot *slot = w->backend_data;
    if (!slot)
        return 1;
    int q = be->cu->EventQuery(slot->done);
    return q != AXC_CUDA_ERROR_NOT_READY; /* finished, or an error that wait() reports */
}

static void nccl_destroy(axc_backend *base)
{
    nccl_backend *be = (nccl_backend *)base;
    if (!be)
        return;
    if (be->watchdog_started) {
        pthread_mutex_lock(&be->mu);
        be->stop = 1;
        pthread_cond_broadcast(&be->cv);
        pthread_mutex_unlock(&be->mu);
        pthread_join(be->watchdog, NULL);
        be->watchdog_started = 0;
    }
    while (be->groups) /* normally closed by the generic layer already */
        nccl_group_close(base, be->groups);
    dev_guard dg;
    int have_dev = dev_enter(be, &dg) == AXC_OK;
    axc_status wst = AXC_OK;
    pthread_mutex_lock(&be->issue_mu);
    if (be->world) {
        ncclComm_t w = be->world;
        be->world = NULL;
        wst = comm_release_locked(be, w, "the world communicator");
    }
    pthread_mutex_unlock(&be->issue_mu);
    if (wst != AXC_OK)
        axc_log(2, "nccl: %s", axc_last_error());
    /* slots: finished ones are idle; unfinished ones were aborted. EventDestroy of an event whose
     * work is pending is allowed (the runtime releases it when it completes). */
    while (be->head) {
        nccl_slot *s = be->head;
        inflight_remove(be, s);
        slot_free(be, s);
    }
    while (be->free_slots) {
        nccl_slot *s = be->free_slots;
        be->free_slots = s->next;
        slot_free(be, s);
    }
    if (have_dev)
        dev_leave(be, &dg);
    pthread_cond_destroy(&be->cv);
    pthread_mutex_destroy(&be->mu);
    pthread_mutex_destroy(&be->issue_mu);
    free(be);
}

axc_status axc_nccl_backend_create(axc_backend **out, const axc_comm_config *cfg)
{
    *out = NULL;
    const axc_cuda_api *cu;
    const nccl_api *nc;
    AXC_TRY(axc_cuda_load(&cu));
    AXC_TRY(nccl_load(&nc));
    if (cfg->cuda_device < 0 || cfg->cuda_device >= cu->device_count)
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: CUDA device %d does not exist (this process sees %d device(s))",
                        cfg->cuda_device, cu->device_count);
    if (cfg->grid.world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->grid.world_size)
        return axc_fail(AXC_ERR_INVALID, "nccl: rank %d is outside the world of %d ranks",
                        cfg->rank, cfg->grid.world_size);

    nccl_backend *be = calloc(1, sizeof *be);
    if (!be)
        return axc_fail(AXC_ERR_NOMEM, "out of memory creating the nccl backend");
    be->base.name = "nccl";
    be->base.group_open = nccl_group_open;
    be->base.group_close = nccl_group_close;
    be->base.start = nccl_start;
    be->base.follows_after = 1; /* follow_after(): stream waits on the works' events */
    be->base.wait = nccl_wait;
    be->base.query = nccl_query;
    be->base.destroy = nccl_destroy;
    be->cu = cu;
    be->nc = nc;
    be->device = cfg->cuda_device;
    be->rank = cfg->rank;
    be->world_size = cfg->grid.world_size;
    be->timeout_s = cfg->timeout_s > 0 ? cfg->timeout_s : 300.0;
    snprintf(be->job, sizeof be->job, "%s", (cfg->job_id && *cfg->job_id) ? cfg->job_id : "axonn_c");
    atomic_store(&be->failed, 0);

    pthread_condattr_t ca;
    int e = pthread_mutex_init(&be->issue_mu, NULL);
    if (e == 0 && (e = pthread_mutex_init(&be->mu, NULL)) != 0)
        pthread_mutex_destroy(&be->issue_mu);
    if (e != 0) {
        free(be);
        return axc_fail(AXC_ERR_SYSTEM, "nccl: pthread_mutex_init failed: %s", strerror(e));
    }
    if ((e = pthread_condattr_init(&ca)) == 0) {
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        e = pthread_cond_init(&be->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (e != 0) {
        pthread_mutex_destroy(&be->mu);
        pthread_mutex_destroy(&be->issue_mu);
        free(be);
        return axc_fail(AXC_ERR_SYSTEM, "nccl: pthread_cond_init failed: %s", strerror(e));
    }

    dev_guard dg;
    axc_status st = dev_enter(be, &dg);
    if (st != AXC_OK) {
        nccl_destroy(&be->base);
        return st;
    }
    int least = 0, greatest = 0;
    if (cu->DeviceGetStreamPriorityRange(&least, &greatest) == AXC_CUDA_SUCCESS)
        be->stream_priority = greatest; /* numerically lowest = highest priority */
    (void)least;

    st = init_world(be, cfg);
    if (st == AXC_OK) {
        e = pthread_create(&be->watchdog, NULL, watchdog_main, be);
        if (e != 0)
            st = axc_fail(AXC_ERR_SYSTEM, "nccl: starting the watchdog thread failed: %s",
                          strerror(e));
        else
            be->watchdog_started = 1;
    }
    dev_leave(be, &dg);
    if (st != AXC_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", axc_last_error());
        nccl_destroy(&be->base);
        axc_set_last_error(msg);
        return st;
    }
    int ma, mi, pa;
    version_parts(nc->version, &ma, &mi, &pa);
    axc_log(1, "nccl: world communicator ready (job %s, rank %d of %d, cuda:%d, NCCL %d.%d.%d)",
            be->job, be->rank, be->world_size, be->device, ma, mi, pa);
    *out = &be->base;
    return AXC_OK;
}

#else /* built without the NCCL or CUDA headers */

axc_status axc_nccl_backend_create(axc_backend **out, const axc_comm_config *cfg)
{
    (void)cfg;
    *out = NULL;
    return axc_fail(AXC_ERR_UNAVAILABLE,
                    "the nccl backend is unavailable: axonn_c was built without NCCL headers "
                    "(install nvidia-nccl-cu13 and the CUDA headers, then reinstall axonn_c)");
}

int axc_nccl_header_version(void) { return 0; }

int axc_nccl_runtime_version(void)
{
    axc_fail(AXC_ERR_UNAVAILABLE,
             "the nccl backend is unavailable: axonn_c was built without NCCL headers");
    return 0;
}

#endif
