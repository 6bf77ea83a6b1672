/* One run_concurrent call (axonn_c/microbatches.py): what its micro-batch threads and its
 * reducer share, decided in C.
 *
 * The reducer: the model's parameters are handed in once, in the fixed order the reducer sums
 * them (reverse registration: about the order backward finishes them); consecutive parameters
 * of one bucket key (groups, dtype, device) share a bucket up to `bucket_bytes`. Each
 * micro-batch's gradient arrival is counted per parameter (axc_mb_arrive, from the micro-batch
 * threads); the reducer thread takes the buckets in that fixed order, each once all n
 * micro-batches have added to every parameter of it (axc_mb_next_bucket waits, on a condition
 * of this object: the caller lets go of its own lock first). The fixed order keeps the ranks'
 * collectives matched whatever order the threads finish in; the sums themselves go through the
 * gradient buckets (axc/buckets.h) like any synchronous sum.
 *
 * Shared depth gathers: one all-gather per (layer, phase, use) for all n micro-batches, on the
 * gather channel (n + 1). The first micro-batch to ask for a key starts it (unless it was
 * prefetched), waits for it and wakes the others; the buffer is let go once all n have it. The
 * order of first arrivals is the order in which the uses first occur in the (identical) program
 * of the threads, whichever thread gets there first, so every rank starts the gathers in the
 * same order. That order is learned (axc_mb_memory, kept by the runtime across calls): on the
 * next call, a first arrival that follows the learned order so far (the same key for the same
 * weight) starts the gather of its successor at once.
 *
 * Thread-safe: arrivals, thread ends, gathers and the reducer's waits may come from any thread
 * at once. Parameters are added before the threads start (not concurrently with the rest).
 * Lock order: the gathers' lock, then the reduce-scatters' own (only close holds both); each is
 * taken with the caller's lock let go (ops.blocking_begin), and the caller's lock is taken back
 * while holding it (the ops below run with both held); the reducer's lock is a leaf. */
#ifndef AXC_MICROBATCH_H
#define AXC_MICROBATCH_H

#include <stddef.h>
#include <stdint.h>

#include "axc/buckets.h"
#include "axc/comm.h"
#include "axc/status.h"

typedef struct axc_mb axc_mb;

/* What the embedding program provides (CPython: torch tensors, references, the interpreter
 * lock). Weights are the caller's handles (`w`): their identity names them. */
typedef struct axc_mb_ops {
    /* `elems` elements like weight `w`: the address and an owner that keeps it allocated */
    axc_status (*alloc)(void *ctx, void *w, size_t elems, void **data, void **owner);
    /* the weight's shard as it is now */
    axc_status (*describe)(void *ctx, void *w, const void **data, size_t *elems,
                           axc_dtype *dtype, int *device);
    void (*retain)(void *ctx, void *obj);  /* one more reference to a weight or an owner */
    void (*release)(void *ctx, void *obj); /* one less */
    /* an owner (a new reference, let go with release) that keeps the weight's shard storage,
     * as it is now, allocated while a gather sends from it, even if the weight is given other
     * storage meanwhile; described in its place. NULL: the weight itself is retained. */
    axc_status (*pin)(void *ctx, void *w, void **owner);
    /* around waits (NULL: nothing to let go) */
    void *(*blocking_begin)(void *ctx);
    void (*blocking_end)(void *ctx, void *state);
    void *ctx;
} axc_mb_ops;

/* What one call leaves the next: the learned first-arrival order (with a reference to each
 * weight, so whether a prefetch is issued never depends on when a discarded model is freed),
 * and the last call's counts. */
typedef struct axc_mb_memory axc_mb_memory;

typedef struct axc_mb_stats {
    long long gathers;         /* shared gathers started */
    long long prefetched;      /* ... first asked for when already started */
    long long reduce_scatters; /* shared dW reduce-scatters started */
    long long peak_blocks;     /* summed dW blocks held at once, at most */
} axc_mb_stats;

axc_status axc_mb_memory_create(axc_mb_memory **out, const axc_mb_ops *ops);
void axc_mb_memory_destroy(axc_mb_memory *m); /* NULL is a no-op */
void axc_mb_memory_clear(axc_mb_memory *m);   /* forgets the learned order (finalize) */
void axc_mb_memory_stats(const axc_mb_memory *m, axc_mb_stats *out);
/* The learned order's length, and its i-th weight (NULL: a per-call tensor, not kept). */
int axc_mb_memory_learned(const axc_mb_memory *m);
void *axc_mb_memory_learned_weight(const axc_mb_memory *m, int i);

/* A call of `n` micro-batches (n >= 1) whose reducer buckets hold up to `bucket_bytes`, whose
 * gathers run on `comm` and are learned in `mem` (both NULL: no gathers). */
axc_status axc_mb_create(axc_mb **out, int n, size_t bucket_bytes, axc_comm *comm,
                         axc_mb_memory *mem);
/* Without axc_mb_close: closes as failed. NULL is a no-op. */
void axc_mb_destroy(axc_mb *mb);
int axc_mb_n(const axc_mb *mb);

/* The next parameter of the reducer's order: `id` names it (unique), `key` is its bucket key,
 * `bytes` its size. It joins the last bucket when the key matches and the bytes fit. */
axc_status axc_mb_add_param(axc_mb *mb, uintptr_t id, const axc_bucket_key *key, size_t bytes);
int axc_mb_params(const axc_mb *mb);
uintptr_t axc_mb_param(const axc_mb *mb, int i); /* the id of the order's i-th (0: none) */
int axc_mb_has_param(const axc_mb *mb, uintptr_t id); /* whether the reducer sums it */
int axc_mb_buckets(const axc_mb *mb);

/* A micro-batch added its gradient to parameter `id` (ignored for one the reducer does not
 * sum). */
void axc_mb_arrive(axc_mb *mb, uintptr_t id);
/* A micro-batch thread ended (failed: with an error: the reducer stops). */
void axc_mb_thread_done(axc_mb *mb, int failed);

/* The reducer's next bucket, in order, once it is ready: every micro-batch added to each of its
 * parameters, or every thread ended without error (what arrived is summed). 1: its parameters
 * are positions [*first, *first + *count) of the order, all of key *key; 0: none left, or a
 * micro-batch failed (nothing more is summed). Waits until then, or at most wait_ms milliseconds
 * (-1: not yet; so a caller can look for an interrupt between waits); wait_ms < 0: no limit. */
int axc_mb_next_bucket(axc_mb *mb, int wait_ms, int *first, int *count, axc_bucket_key *key);

/* Which use of (layer, phase) by the calling micro-batch this is, from 1 (its thread's channel,
 * axc_comm_thread_channel, names it: micro-batch i runs on channel i + 1): counted per
 * (micro-batch, layer, phase) from the call's start, for axc_mb_gather's and axc_mb_scatter's
 * `use`. Phases: AXC_PHASE_FWD, AXC_PHASE_BWD (gathers), AXC_MB_PHASE_SCATTER (dW
 * reduce-scatters). Each micro-batch's counts are its own thread's: no lock. Fails on a thread
 * that is not on a micro-batch channel. */
enum { AXC_MB_PHASE_SCATTER = 2 };
axc_status axc_mb_next_use(axc_mb *mb, int layer, int phase, int *use);

/* Weight `w`'s depth shard gathered for all micro-batches: `numel` elements (the shard times the
 * depth group size) in *data, kept allocated by *owner (a new reference for the caller). `use`
 * counts the calling micro-batch's uses of (layer, phase) so far, from 1; `keep`: w may be kept
 * in the learned order (a per-call tensor, e.g. an autocast copy, would never match again). */
axc_status axc_mb_gather(axc_mb *mb, int layer, int phase, int use, void *w, int keep,
                         size_t numel, void **data, void **owner);

/* Shared dW reduce-scatters: one depth reduce-scatter of dW per (layer, use) for all n
 * micro-batches. Each hands in its unreduced block (`block`, `elems` elements, kept allocated by
 * `block_owner`, which the call takes a reference to); the last to arrive sums them into the
 * first block and starts the reduce-scatter on the reduce-scatter channel (n + 2) into a buffer
 * like `w` (last arrivals come in program order too, and the start happens under the lock that
 * decided it). At most `bound` summed blocks stay referenced (axc_mb_set_scatter_bound, default
 * 2): finished reduce-scatters let go of theirs, and past the bound the oldest is waited for. */
void axc_mb_set_scatter_bound(axc_mb *mb, int bound);
axc_status axc_mb_scatter(axc_mb *mb, int layer, int use, void *w, void *block_owner,
                          void *block, size_t elems);
/* After axc_mb_close: the reduce-scatters started, and the i-th one's weight and reduced shard
 * (a buffer owner the call holds); 0 when it failed. */
int axc_mb_scatters(const axc_mb *mb);
int axc_mb_scatter_result(const axc_mb *mb, int i, void **w, void **out);

/* After the threads joined: waits for the reduce-scatters and for prefetches nobody used (every rank started them), lets
 * go of the buffers, records the counts and, when `ok`, makes this call's first-arrival order
 * the learned one. Returns the first failure of a wait when `ok`. */
axc_status axc_mb_close(axc_mb *mb, int ok);

#endif
