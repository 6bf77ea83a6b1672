/* The runtime: what one process's axonn_c session holds in C.
 *
 * - The communicator of the current init() and the scheduler over it (none between finalize()
 *   and the next init: axc_runtime_open / axc_runtime_close, which tear down in order: the
 *   scheduler drains before the communicator goes).
 * - The trace (axc/timeline.h): one timeline made with the runtime and kept across inits (spans
 *   recorded before init or in an earlier init stay until cleared). Each communicator is opened
 *   with it (axc_comm_config.timeline), so its collectives, and the layers over it
 *   (axc_comm_timeline), record into it; the communicator and its works hold a borrowed
 *   pointer, so the runtime frees it only once no communicator is left (destroy).
 * - The gradient bucket engine, the keep-alive queues, the records of pending gradients with
 *   the summed-over marks (axc/records.h) and the linear layers' depth dW error-feedback
 *   residuals (axc/layer_residuals.h: cleared at open and close), made with the runtime and
 *   kept across inits (their buffers and owners come from the embedding program: torch
 *   tensors, Python references, through the ops it passes in).
 * - The last weight shard each scheduled layer passed (the scheduler's prefetch reads it).
 * - The step that starts the bucket sums that came due, in the engine's order, through the
 *   scheduler, on every rank alike.
 *
 * The Python module holds exactly one (csrc/python/module.c); the bindings reach the
 * communicator, scheduler, timeline, buckets and keep-alives through it. Not thread-safe by itself: the
 * embedding program serialises calls (CPython: the interpreter lock), and the runtime lets go of
 * that lock around the calls that can block (hooks.blocking_begin / blocking_end). */
#ifndef AXC_RUNTIME_H
#define AXC_RUNTIME_H

#include "axc/buckets.h"
#include "axc/comm.h"
#include "axc/keeps.h"
#include "axc/microbatch.h"
#include "axc/layer_residuals.h"
#include "axc/records.h"
#include "axc/sched.h"
#include "axc/status.h"
#include "axc/timeline.h"

typedef struct axc_runtime_hooks {
    /* around a call that may wait (a collective's start waits for the scheduler's lock, whose
     * holder may need the caller's lock): blocking_begin's return value goes to blocking_end.
     * NULL: nothing to release. */
    void *(*blocking_begin)(void *ctx);
    void (*blocking_end)(void *ctx, void *state);
    void *ctx;
} axc_runtime_hooks;

typedef struct axc_runtime_ops {
    axc_bucket_ops buckets;                         /* the gradient buffers and residuals */
    void (*release_kept)(void *ctx, void *owner);   /* drops what a keep-alive queue or the
                                                     * gradient records held */
    void *kept_ctx;
    axc_runtime_hooks hooks;
    /* run_concurrent's gathered buffers and weight references (its blocking hooks: `hooks`);
     * all NULL: no shared gathers */
    axc_mb_ops microbatch;
    size_t bucket_bytes;                            /* the initial gradient bucket size */
} axc_runtime_ops;

typedef struct axc_runtime axc_runtime;

axc_status axc_runtime_create(axc_runtime **out, const axc_runtime_ops *ops);
/* Closes what is open and releases everything. NULL is a no-op. */
void axc_runtime_destroy(axc_runtime *rt);

/* init(): the communicator (collective: every rank calls it; opened with cfg, its timeline
 * replaced by the runtime's) and its scheduler. Fails with
 * AXC_ERR_STATE when one is open already, or while another open waits for the ranks (it lets go
 * of the caller's lock: a second thread, or a re-entry through the hooks, gets in; the Python
 * init() makes a second caller wait for the first's outcome before it gets here). */
axc_status axc_runtime_open(axc_runtime *rt, const axc_comm_config *cfg);
/* finalize(): the scheduler (after its work drained), then the communicator. Idempotent.
 * AXC_ERR_STATE while an open waits for the ranks. */
axc_status axc_runtime_close(axc_runtime *rt);
int axc_runtime_is_open(const axc_runtime *rt);

axc_comm *axc_runtime_comm(const axc_runtime *rt);   /* NULL when not open */
axc_sched *axc_runtime_sched(const axc_runtime *rt); /* NULL when not open */
axc_buckets *axc_runtime_buckets(const axc_runtime *rt);
axc_keeps *axc_runtime_keeps(const axc_runtime *rt);
axc_timeline *axc_runtime_timeline(const axc_runtime *rt); /* the runtime's, for its life */
axc_grad_records *axc_runtime_records(const axc_runtime *rt);
axc_layer_residuals *axc_runtime_layer_residuals(const axc_runtime *rt);

/* The last shard a scheduled layer call passed (`owner`: a reference the runtime takes over,
 * let go with ops.release_kept), which the scheduler's prefetch reads until the layer's next
 * call or axc_sched_forget (axc/sched.h): it replaces (and releases) the layer's previous one,
 * so a caller passing another shard first lets the scheduler drop a gather reading the
 * previous one (axc_sched_shard_passing).
 * Forget releases it (the layer is gone); close releases them all (no scheduler reads them). */
axc_status axc_runtime_keep_shard(axc_runtime *rt, int layer, void *owner);
void axc_runtime_forget_shard(axc_runtime *rt, int layer);

/* Starts every gradient sum the bucket engine has due, in its order, each after everything the
 * scheduler deferred so far, on torch's current stream of the sum's CUDA device. A call made
 * while another is starting sums (a re-entry through the callbacks or hooks, or another
 * thread that got in while the first let go of the lock) returns at once, without waiting:
 * the first one starts them all, so every rank starts them in the same order. A caller that
 * must see every sum started (the end of a pass) therefore runs on the thread that started
 * them, or after it returned: the bindings call it from one backward pass at a time.
 * AXC_ERR_STATE when sums are due and nothing is open. */
axc_status axc_runtime_start_due_sums(axc_runtime *rt);

/* The state a parameter's gradient hook decides from (set by the embedding program where it
 * changes): whether backward starts gradient sums (off inside no_grad_sync), the data overlap
 * knob in force (init(overlap=), optimize_communication(overlap_data=)), and, per thread,
 * whether the thread runs a run_concurrent micro-batch; and the bucket size of backward's sums.
 * Defaults: sums on, overlap off, no micro-batch thread, 4 MiB buckets. */
void axc_runtime_set_grad_sync(axc_runtime *rt, int on);
int axc_runtime_grad_sync(const axc_runtime *rt);
void axc_runtime_set_overlap_data(axc_runtime *rt, int on);
int axc_runtime_overlap_data(const axc_runtime *rt);
void axc_runtime_set_grad_bucket_bytes(axc_runtime *rt, size_t bytes); /* (0 is ignored) */
/* The gradients arrived so far (at a deferred Linear weight, or at a gradient hook: while a
 * sync's mark exists only its first of a pass that accumulates into .grad, not
 * torch.autograd.grad's; any thread; a backward pass has some on every rank): a synced mark
 * keeps the count it was made at, and a
 * sync_gradients leaves that .grad alone only while no gradient arrived since; after a
 * backward, a synced .grad no gradient reached in it (an unused parameter, a .grad zeroed in
 * place) takes part in the sums again, on every rank alike. */
/* `pass`: the backward pass's graph task number (>= 0), whose later gradients the hooks need not
 * count (axc_runtime_grad_pass_counted: whether `pass` was counted last), or -1 (unknown) */
void axc_runtime_grad_arrived(axc_runtime *rt, long long pass);
int axc_runtime_grad_pass_counted(const axc_runtime *rt, long long pass);
unsigned long long axc_runtime_grad_arrivals(const axc_runtime *rt);
/* A new name for a parameter's gradient in backward's overlapped buckets, whose fingerprints
 * the transport compares across ranks: 1, 2, ... (never 0), never the same twice in the
 * process, also across inits. Names are given in the order sync_gradients (a collective) first
 * meets the parameters, the same on every rank. Any thread. A parameter holds its name with
 * axc_runtime_process_token (csrc/python/py_sync.c). */
unsigned long long axc_runtime_new_grad_ident(axc_runtime *rt);
/* A number that tells this process's gradient names from those a pickled parameter carries
 * from another process (never 0; made when the runtime is). */
unsigned long long axc_runtime_process_token(const axc_runtime *rt);
size_t axc_runtime_grad_bucket_bytes(const axc_runtime *rt);
void axc_set_microbatch_thread(int on); /* the calling thread's flag */
int axc_microbatch_thread(void);

/* The running run_concurrent call (axc/microbatch.h), one at a time: begin makes it over the
 * open communicator (AXC_ERR_STATE while one runs), end destroys it (no-op when none). NULL
 * when none runs. The memory the calls learn into is kept until the communicator closes.
 * `owner` identifies the caller (compared, never dereferenced): end_owned ends the call only
 * if that caller opened it (1: ended), so a caller that cannot tell whether its begin
 * succeeded (an exception raised as it returned) ends its own call and never another's. */
axc_status axc_runtime_mb_begin(axc_runtime *rt, const void *owner, int n, size_t bucket_bytes,
                                axc_mb **out);
axc_mb *axc_runtime_mb(const axc_runtime *rt);
void axc_runtime_mb_end(axc_runtime *rt);
int axc_runtime_mb_end_owned(axc_runtime *rt, const void *owner);
axc_mb_memory *axc_runtime_mb_memory(const axc_runtime *rt); /* NULL without the ops */

/* Nothing pending: no gradient record, taken .grad, held backward result or open bucket. */
int axc_runtime_grads_idle(const axc_runtime *rt);

/* Whether a parameter's gradient arriving now needs the gradient code; 0: autograd takes it
 * untouched. It does when something is pending (not idle), the parameter (`key`, as the records
 * know it) has a mark (its .grad summed or synced), the thread runs a micro-batch, or its sum
 * would start now: initialised, sums on, the data overlap on (`own_overlap`: the parameter's
 * own knob, 0/1, or -1 for none: the runtime's), and one of `groups` (its groups; NULL: none)
 * has several ranks. */
int axc_runtime_grad_needs_work(const axc_runtime *rt, uintptr_t key, int own_overlap,
                                const axc_groups *groups);

#endif
