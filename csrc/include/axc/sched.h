/* The cross-layer scheduler (docs/ARCHITECTURE.md#one-training-step): depth all-gathers of
 * layer weights prefetched in the learned execution order, and collectives deferred past the
 * layer that started them.
 *
 * Order learning. Every layer call ("visit": layer id, forward or backward) is appended to the
 * current step's trace. A step ends at axc_sched_step_end() (the end of a backward pass), or
 * implicitly when a forward-only loop (no backward visit yet) revisits its first visit. At the end of a step the trace becomes the learned order if it differs.
 * While the running step's trace is a prefix of the learned order, each visit at position p
 * issues the gathers of the visits at p+1 .. p+k (k = prefetch), within the memory budget. A
 * visit off the order is served by a synchronous gather (correct, only slower) and prefetching
 * stops until the next step.
 *
 * Gathered weights. A gathered buffer records the shard pointer and version it was gathered
 * from; a visit whose shard pointer or version differs (the optimizer stepped, the parameter
 * was replaced) discards it and gathers again, so a prefetch never serves stale weights. The
 * caller must keep every shard it passed alive until the layer's next visit or
 * axc_sched_forget(), since a prefetch reads the last shard seen; a caller that lets it go
 * before the next visit (which passes another shard) first calls axc_sched_shard_passing().
 * After its visit a buffer is freed unless the layer is among the next k visits or caching
 * is on; nothing gathered outlives the step. A prefetch reads the values at issue time: a weight modified in place mid-step,
 * between its prefetch and its use, is not detected.
 *
 * Deferred work: collectives whose results are needed only at the end of backward (dW's depth
 * reduce-scatter, the data-parallel gradient buckets) are handed to the scheduler and completed
 * together by axc_sched_finish().
 *
 * Deferred tasks: host-side work a layer hands over to run later, in the order added, on the
 * thread that runs them (a layer's dW GEMM, run while a later layer waits for its dX
 * reduction). They run at axc_sched_run_tasks(), before axc_sched_start_after_deferred() starts
 * its collective (which may read what they write), and first thing in axc_sched_finish(). The
 * points are in program order, so a task that starts collectives starts them in the same order
 * on every rank. Task numbers and stats.tasks_run assume one thread drives the queue.
 *
 * Held results: a collective whose output a *later call* reads (cross-layer chunk pipelining,
 * axonn_c.Sequential: a layer's forward all-reduce of one chunk runs while other chunks and
 * layers compute). The layer hands the started work over with the memory it writes
 * (axc_sched_hold_result) and returns; the reader calls axc_sched_await_result on that memory
 * first. Results are awaited in the order held (FIFO): awaiting one also completes every older
 * one. axc_sched_finish awaits them all. The caller keeps the memory alive until its number is
 * done (stats.results_done).
 *
 * Thread-safe (one mutex); meant to be driven from one thread at a time. */
#ifndef AXC_SCHED_H
#define AXC_SCHED_H

#include <stdint.h>

#include "axc/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct axc_sched axc_sched;

enum { AXC_PHASE_FWD = 0, AXC_PHASE_BWD = 1 };

typedef struct axc_sched_config {
    int prefetch;         /* k: visits ahead whose gathers are issued (0 = no prefetch) */
    int64_t budget_bytes; /* bound on gathered-weight bytes alive at once for prefetches
                             (0 = none; a visit's own gather is never refused) */
    int cache;            /* 1: keep gathered weights until the step ends (forward to backward) */
} axc_sched_config;

typedef struct axc_sched_stats {
    uint64_t visits;       /* acquires with a depth gather (G_d > 1) */
    uint64_t hits;         /* the visit's gather was complete when it started */
    uint64_t waits;        /* ... was in flight (prefetched, the visit waited) */
    uint64_t misses;       /* ... had not been issued: gathered synchronously */
    uint64_t prefetches;   /* gathers issued ahead */
    uint64_t budget_skips; /* prefetches not issued because of the memory budget */
    uint64_t stale;        /* gathered buffers dropped because the shard changed */
    uint64_t relearned;    /* times the learned order was replaced */
    uint64_t off_order;    /* visits that did not follow the learned order */
    uint64_t deferred;     /* collectives handed over for later completion */
    uint64_t alive_bytes, peak_bytes; /* gathered-weight bytes alive now / at most */
    int alive_buffers, peak_buffers;
    uint64_t torch_buffers; /* CUDA gathered weights allocated by torch's caching allocator (the
                             * rest came from cudaMallocAsync; CPU ones from the C heap) */
    int64_t order_len;     /* visits in the learned order */
    int64_t pending;       /* deferred collectives not yet finished */
    uint64_t tasks;        /* tasks added (axc_sched_add_task; never reset) */
    uint64_t tasks_run;    /* ... run or dropped: task number k is done once k <= this */
    uint64_t results_held; /* results held (axc_sched_hold_result; never reset) */
    uint64_t results_done; /* ... awaited: result number k is done once k <= this */
} axc_sched_stats;

/* A deferred task: run(arg) once, then drop(arg) (also when it is discarded without running). */
typedef struct axc_sched_task {
    axc_status (*run)(void *arg);
    void (*drop)(void *arg);
    void *arg;
} axc_sched_task;

/* One visit's weight: the layer's depth shard as the layer sees it now. */
typedef struct axc_sched_weight {
    int layer;           /* from axc_sched_layer_new */
    int phase;           /* AXC_PHASE_FWD / AXC_PHASE_BWD */
    const void *shard;
    int64_t shard_elems;
    int64_t version;     /* changes whenever the shard's values change (torch's _version) */
    axc_dtype dtype;
    int device;          /* -1 host, >= 0 CUDA */
    void *stream;        /* CUDA: the stream the layer computes on */
    int prefetch_ok;     /* 0: this layer is never gathered ahead (e.g. a per-call cast copy) */
    int own_codec;       /* 1: the layer's depth codec (Linear(compression=...)) replaces the
                            communicator's policy for its gathers */
    axc_codec codec;
    int block;
} axc_sched_weight;

axc_status axc_sched_create(axc_sched **out, axc_comm *comm);
/* Finishes deferred work and frees every buffer (errors are dropped: call finish first). */
void axc_sched_destroy(axc_sched *s);
axc_status axc_sched_configure(axc_sched *s, const axc_sched_config *cfg);
void axc_sched_get_config(const axc_sched *s, axc_sched_config *cfg);

/* Layer ids: small integers, reused after forget. */
axc_status axc_sched_layer_new(axc_sched *s, int *id);
/* Drops the layer's buffers and any reference to its shard (waits for its gather). */
void axc_sched_forget(axc_sched *s, int id);
/* The layer's next visit passes `shard`: when it is not the shard last seen, the layer's
 * gather of the old one (a prefetch, possibly in flight) is waited for and its buffer dropped,
 * and nothing is prefetched from the old one any more; the caller may then release the old
 * shard. Call it before releasing a shard the next visit replaces (the visit itself would
 * drop that gather only after the release: a prefetch still reading freed memory). An unknown
 * id is a no-op; the gather's error, if it failed. */
axc_status axc_sched_shard_passing(axc_sched *s, int id, const void *shard);

/* The gathered [shard_elems * G_d] weight for this visit in *full (waiting for its prefetch or
 * gathering now), after issuing the gathers of the next visits. */
axc_status axc_sched_acquire(axc_sched *s, const axc_sched_weight *w, const void **full);
/* The visit is done with the gathered weight (`stream`: where its readers were queued). */
axc_status axc_sched_release(axc_sched *s, int layer, void *stream);
/* Ends the step: learns the order, frees buffers no longer wanted. */
axc_status axc_sched_step_end(axc_sched *s);
/* Ends a step that did not complete (a backward pass that raised): like step_end, but the
 * trace is discarded instead of learned. */
axc_status axc_sched_step_abort(axc_sched *s);

/* Takes ownership of a started collective; axc_sched_finish waits for it. */
axc_status axc_sched_defer(axc_sched *s, axc_work *w);
/* Runs the queued tasks, then starts `c` on `group` after every collective deferred so far (in
 * their order) and defers it. A task's failure is returned, but `c` is started all the same.
 * *started (when not NULL): whether `c` was started (an error then is a task's, or deferring's:
 * out of memory, `c` waited for at once), so its peers are not left waiting in it. */
axc_status axc_sched_start_after_deferred(axc_sched *s, axc_group_kind group, const axc_coll *c,
                                         int *started);
/* Runs the deferred tasks, then waits for every deferred collective (in order); returns the
 * first failure. */
axc_status axc_sched_finish(axc_sched *s);
/* axc_sched_finish on a thread of its own, so that its caller can wait for it in slices and
 * stay interruptible (run_concurrent's reducer, csrc/python/py_sync.c) while the waits are the
 * same (a peer's crossed-collective check, the timeouts, CUDA stream ordering). */
typedef struct axc_sched_finishing axc_sched_finishing;
axc_status axc_sched_finish_start(axc_sched *s, axc_sched_finishing **out);
/* 1 once that finish returned (*status: its result, its message this thread's; f is freed), 0
 * when it has not within `timeout_ms`. Every started finish must be waited for until it is. */
int axc_sched_finish_wait(axc_sched_finishing *f, int timeout_ms, axc_status *status);

/* Queues a task; *number (optional) receives its number (1, 2, ...: compare with
 * stats.tasks_run). On failure the task was run now (and dropped). */
axc_status axc_sched_add_task(axc_sched *s, axc_sched_task t, uint64_t *number);
/* Runs every queued task, oldest first; all run even after a failure (their collectives stay
 * matched across ranks), and the first failure is returned. */
axc_status axc_sched_run_tasks(axc_sched *s);

/* Takes ownership of a started collective that writes [ptr, ptr + bytes), which a later call
 * reads after axc_sched_await_result; *number (may be NULL) is its result number. w NULL: no-op
 * (*number unchanged). */
axc_status axc_sched_hold_result(axc_sched *s, const void *ptr, size_t bytes, axc_work *w,
                                 uint64_t *number);
/* Completes the held results up to the newest one whose memory overlaps [ptr, ptr + bytes)
 * (none overlapping: nothing to wait for); keeps the first error. */
axc_status axc_sched_await_result(axc_sched *s, const void *ptr, size_t bytes);
/* Completes the held results numbered up to `number`. */
axc_status axc_sched_await_number(axc_sched *s, uint64_t number);
/* Completes every held result. */
axc_status axc_sched_await_results(axc_sched *s);

void axc_sched_stats_get(axc_sched *s, axc_sched_stats *out);
/* Zeroes the event counters and the peaks (peaks restart from what is alive now). */
void axc_sched_stats_reset(axc_sched *s);

/* The event log (for tests and debugging): the last AXC_SCHED_LOG_CAP events. */
enum { AXC_EV_HIT = 0, AXC_EV_WAIT = 1, AXC_EV_MISS = 2, AXC_EV_PREFETCH = 3 };
#define AXC_SCHED_LOG_CAP 4096
typedef struct axc_sched_event {
    int kind, layer, phase;
} axc_sched_event;
/* Copies up to `cap` of the logged events (oldest first) and clears the log; returns the count. */
size_t axc_sched_log_take(axc_sched *s, axc_sched_event *out, size_t cap);
/* The learned order: up to `cap` visits; returns the order's length. */
int64_t axc_sched_order(axc_sched *s, axc_sched_event *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
