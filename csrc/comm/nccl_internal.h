/* The nccl backend: CUDA buffers, one NCCL communicator per group, asynchronous on comm streams.
 * This private header is what its files (csrc/comm/nccl_*.c) share: the NCCL entry points, the
 * backend's state, and the functions one file provides to the others.
 *
 * Files, one job each: nccl_load.c (binding libnccl.so.2), nccl_util.c (deadlines, backoff, the
 * device guard, NCCL error text, polling a communicator), nccl_slots.c (the fork/join event
 * slots), nccl_watchdog.c (failure and the watchdog thread), nccl_setup.c (bootstrap, the world
 * communicator, group splits, create/destroy), nccl_coll.c (issuing, following, waiting),
 * nccl_stub.c (builds without the NCCL or CUDA headers).
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
#ifndef AXC_COMM_NCCL_INTERNAL_H
#define AXC_COMM_NCCL_INTERNAL_H

#include "axc/comm.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

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

typedef struct dev_guard {
    int prev, switched;
} dev_guard;


/* ---------------------------------------------------------------- nccl_load.c */

/* The bound library (loaded once; the reason it is unavailable otherwise). */
axc_status axc_nccl_load(const nccl_api **api);
void axc_nccl_version_parts(int v, int *major, int *minor, int *patch);

/* ---------------------------------------------------------------- nccl_util.c */

int64_t axc_nccl_deadline_after(double seconds);
/* Backoff for host polling: yield first, then sleep 50 us growing to 1 ms. */
void axc_nccl_backoff(unsigned *spins);
const char *axc_nccl_str(const nccl_api *nc, ncclResult_t r);
const char *axc_nccl_last(const nccl_api *nc, ncclComm_t comm);
/* Fails with AXC_ERR_BACKEND naming the NCCL call. */
axc_status axc_nccl_fail(const nccl_backend *be, ncclResult_t r, ncclComm_t comm,
                         const char *call, const char *what);
/* Waits until `comm` leaves ncclInProgress (see nccl_util.c). */
ncclResult_t axc_nccl_poll_comm(nccl_backend *be, ncclComm_t comm, int64_t deadline_ns,
                                int *aborted);
axc_status axc_nccl_dev_enter(nccl_backend *be, dev_guard *g);
void axc_nccl_dev_leave(nccl_backend *be, dev_guard *g);
/* AXC_OK while healthy, else the failure's status with its message set. */
axc_status axc_nccl_failure_status(nccl_backend *be);
void axc_nccl_describe_coll(char *out, size_t cap, axc_coll_kind kind, axc_redop op,
                            size_t count, axc_dtype dtype, axc_group_kind group,
                            uint64_t group_seq);

/* ------------------------------------------------- nccl_slots.c (mu held unless said) */

void axc_nccl_inflight_remove(nccl_backend *be, nccl_slot *s);
void axc_nccl_inflight_append(nccl_backend *be, nccl_slot *s);
void axc_nccl_slot_recycle(nccl_backend *be, nccl_slot *s);
/* (takes mu itself; call inside axc_nccl_dev_enter) */
axc_status axc_nccl_slot_get(nccl_backend *be, nccl_slot **out);
/* (takes mu itself) */
void axc_nccl_slot_put_unused(nccl_backend *be, nccl_slot *s);
void axc_nccl_slot_free(nccl_backend *be, nccl_slot *s);

/* ---------------------------------------------------------------- nccl_watchdog.c */

/* Puts the backend into the failed state once (see nccl_watchdog.c). */
void axc_nccl_fail_all(nccl_backend *be, axc_status status, const char *msg, int have_issue);
void *axc_nccl_watchdog_main(void *arg);

/* ---------------------------------------------------------------- nccl_coll.c */

axc_status axc_nccl_start(axc_backend *base, void *group, axc_work *w);
axc_status axc_nccl_wait(axc_backend *base, axc_work *w);
int axc_nccl_query(axc_backend *base, axc_work *w);

#endif

#endif
