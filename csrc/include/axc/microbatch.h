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
 * Thread-safe: arrivals, thread ends and the reducer's waits may come from any thread at once.
 * Parameters are added before the threads start (not concurrently with the rest). */
#ifndef AXC_MICROBATCH_H
#define AXC_MICROBATCH_H

#include <stddef.h>
#include <stdint.h>

#include "axc/buckets.h"
#include "axc/status.h"

typedef struct axc_mb axc_mb;

/* A call of `n` micro-batches (n >= 1) whose reducer buckets hold up to `bucket_bytes`. */
axc_status axc_mb_create(axc_mb **out, int n, size_t bucket_bytes);
void axc_mb_destroy(axc_mb *mb); /* NULL is a no-op */
int axc_mb_n(const axc_mb *mb);

/* The next parameter of the reducer's order: `id` names it (unique), `key` is its bucket key,
 * `bytes` its size. It joins the last bucket when the key matches and the bytes fit. */
axc_status axc_mb_add_param(axc_mb *mb, uintptr_t id, const axc_bucket_key *key, size_t bytes);
int axc_mb_params(const axc_mb *mb);
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
 * micro-batch failed (nothing more is summed). Blocks until then. */
int axc_mb_next_bucket(axc_mb *mb, int *first, int *count, axc_bucket_key *key);

#endif
