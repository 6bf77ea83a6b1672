/* Gradient buckets: the one place that decides which flat buffer a gradient is written into and
 * when that buffer's sums over ranks may start (docs/ARCHITECTURE.md#gradient-buckets).
 *
 * A bucket is a flat buffer of one dtype and device whose contents are summed over an ordered
 * list of groups. Gradients take consecutive pieces of the open bucket of their key; a bucket
 * that cannot take the next piece retires: its sums start at once, or, while chunk records
 * still accumulate into it (holds), when the last hold is released. The engine only decides:
 * the caller allocates the buffers (ops.alloc, ops.release) and starts the sums it is handed
 * (axc_buckets_next_sum), so no lock is taken and no collective is started inside it. Not
 * thread-safe: one thread at a time may use it. (The binding holds the GIL, but its allocator
 * calls torch, which may release it; in axonn_c only one thread takes buckets at a time: the
 * backward pass's, or run_concurrent's reducer while the micro-batch threads take none.) */
#ifndef AXC_BUCKETS_H
#define AXC_BUCKETS_H

#include <stddef.h>
#include <stdint.h>

#include "axc/comm.h"
#include "axc/grid.h"
#include "axc/status.h"

#define AXC_BUCKET_MAX_GROUPS 4
/* Passes (a backward's, or a synchronous sum's) per step whose sums keep error feedback. */
#define AXC_BUCKET_MAX_EF_PASSES 64

/* What one bucket holds: gradients of this dtype and device, summed over groups[0..ngroups) in
 * this order. */
typedef struct axc_bucket_key {
    axc_dtype dtype;
    int device; /* -1: CPU */
    int ngroups;
    axc_group_kind groups[AXC_BUCKET_MAX_GROUPS];
} axc_bucket_key;

/* Whether two keys hold the same gradients (dtype, device, groups in order). */
int axc_bucket_key_same(const axc_bucket_key *a, const axc_bucket_key *b);

typedef struct axc_bucket_ops {
    /* A flat buffer of `elems` elements for `key`: its address and a handle that keeps it
     * allocated until release(owner). `arg` is the argument of the axc_buckets_take that needs
     * the buffer (axonn_c: the tensor the bucket is made like). */
    axc_status (*alloc)(void *ctx, const axc_bucket_key *key, size_t elems, void *arg,
                        void **data, void **owner);
    void (*release)(void *ctx, void *owner);
    /* An error-feedback residual: `elems` float32 zeros on `device`, made like the bucket whose
     * buffer `bucket_owner` holds. Released with release(). */
    axc_status (*alloc_residual)(void *ctx, void *bucket_owner, int device, size_t elems,
                                 void **data, void **owner);
    void *ctx;
} axc_bucket_ops;

/* How a bucket's sums over one group are compressed (codec AXC_CODEC_NONE: exact). Only
 * float32 buckets are compressed; others are summed exactly. With error_feedback, each
 * (pass of the step, bucket's position in the pass, group position) keeps a float32 residual across steps
 * (what encoding lost, added to the same gradients' next contribution): the caller marks each
 * step's start (axc_buckets_new_step; a pass is the buckets between two resets). A residual
 * whose size or device differs from the bucket's starts from zeros, and so does one that last
 * served other contents: the slot keeps a fingerprint of its bucket's pieces (their tags and
 * sizes, in order), so a gradient that moves to another position (a parameter first bucketed
 * in a later step shifts the rest) never gets another's residual. A residual set from outside
 * (axc_buckets_set_residual: a checkpoint) has no fingerprint: its next bucket adopts it. */
typedef struct axc_bucket_codec {
    axc_codec codec;
    int block; /* 0: the codec's default */
    int error_feedback;
} axc_bucket_codec;

/* A sum to start: `count` elements at `data`, all-reduced over `group` in place, compressed
 * with `codec` (and `residual`, NULL: no error feedback) unless it is AXC_CODEC_NONE. A
 * bucket's sums come out in its group order, each to start after the previous one. */
typedef struct axc_bucket_sum {
    axc_group_kind group;
    void *data;
    size_t count;
    axc_dtype dtype;
    int device;
    axc_codec codec;
    int block;
    float *residual;
    uint64_t check; /* for axc_coll.check: the pieces' fingerprint when each had an ident */
} axc_bucket_sum;

typedef struct axc_buckets axc_buckets;

/* Counters since creation or the last axc_buckets_zero_stats. */
typedef struct axc_bucket_stats {
    long long made;         /* buckets made */
    long long early;        /* retired during the pass: full, or no room for the next piece */
    long long after_holds;  /* of those, retired at the last release of their holds */
    long long at_end;       /* retired by axc_buckets_close_all */
    /* steps whose passes went past AXC_BUCKET_MAX_EF_PASSES with error feedback on: later
     * passes' sums had none (the caller marks no step's start: axc_buckets_new_step) */
    long long ef_cutoffs;
} axc_bucket_stats;

axc_status axc_buckets_create(axc_buckets **out, const axc_bucket_ops *ops, size_t bucket_bytes);
/* Releases every buffer (no sum started). NULL is a no-op. */
void axc_buckets_destroy(axc_buckets *b);
axc_status axc_buckets_set_bytes(axc_buckets *b, size_t bucket_bytes);
/* The compression of every later sum over `group`. */
axc_status axc_buckets_set_codec(axc_buckets *b, axc_group_kind group, const axc_bucket_codec *c);
/* Error-feedback residuals: how many, and the i-th one's slot key, buffer and length. Setting
 * one adopts `owner` (released by the engine) for that key. The key is opaque to callers
 * (pass << 32 | bucket's position in the pass * AXC_BUCKET_MAX_GROUPS + group position). */
int axc_buckets_residual_count(const axc_buckets *b);
void axc_buckets_residual(const axc_buckets *b, int i, long long *key, void **owner,
                          size_t *elems);
axc_status axc_buckets_set_residual(axc_buckets *b, long long key, void *data, void *owner,
                                    int device, size_t elems);
/* A new training step: the next pass is pass 0 of the residual keys. */
void axc_buckets_new_step(axc_buckets *b);
/* Releases every residual (init/finalize, or a policy change). */
void axc_buckets_clear_residuals(axc_buckets *b);

/* `n` elements in the open bucket of `key` (a new one when it has no room: the full one retires;
 * `arg` goes to ops.alloc for it). A new bucket has bucket_bytes / element size elements, or
 * `want` if fewer (0: unknown): what the caller will still put into this key's buckets, this
 * piece included (a synchronous sum knows it: a small model's sum then takes no more memory
 * than its gradients), and never fewer than n. Out: the bucket's number (numbers go on across
 * passes: one taken before its pass ended is refused afterwards, see axc_buckets_check), the
 * piece's offset in elements, and the buffer's owner handle. `tag` names the piece's gradient
 * (the same gradient, the same tag, in every step: axonn_c uses its parameter's address) for
 * the residuals' fingerprints. */
axc_status axc_buckets_take(axc_buckets *b, const axc_bucket_key *key, size_t n, size_t want,
                            void *arg, uint64_t tag, int *bucket, size_t *offset, void **owner);
/* As axc_buckets_take, with `ident` (0: none) naming the gradient the same way on every rank
 * (a synchronous sum: its position in the sum). A bucket whose every piece has one carries
 * their fingerprint (idents and sizes, in order) in its sums (axc_bucket_sum.check), which the
 * transport compares across ranks. */
axc_status axc_buckets_take_shared(axc_buckets *b, const axc_bucket_key *key, size_t n,
                                   size_t want, void *arg, uint64_t tag, uint64_t ident,
                                   int *bucket, size_t *offset, void **owner);
/* Whether a piece taken from `bucket` may still be written and recorded: AXC_ERR_STATE once its
 * pass ended (axc_buckets_reset) or its end-of-pass sums started (axc_buckets_close_all), e.g.
 * another thread's end of pass between a piece's take and its record: the piece is then not in
 * any sum. written and hold check the same. */
axc_status axc_buckets_check(axc_buckets *b, int bucket);
/* The bucket's pieces are all written: if it is full it retires. */
axc_status axc_buckets_written(axc_buckets *b, int bucket);
/* One more record accumulates into the bucket over several calls (a chunk record): it does not
 * start its sums before axc_buckets_unhold. */
axc_status axc_buckets_hold(axc_buckets *b, int bucket);
axc_status axc_buckets_unhold(axc_buckets *b, int bucket);
/* The end of a pass: every bucket not yet retired starts its sums (parked ones first, then open
 * ones, in the order they were made: the same on every rank). */
void axc_buckets_close_all(axc_buckets *b);
/* The next sum to start, in order: 1, or 0 when there is none, or -1 when its residual could
 * not be made (the message set; the sum is still due). */
int axc_buckets_next_sum(axc_buckets *b, axc_bucket_sum *sum);
/* Forgets the pass's buckets and releases their buffers (after their sums completed, or for an
 * abandoned pass, without starting the sums still due). */
void axc_buckets_reset(axc_buckets *b);
/* Buckets still taking gradients or waiting for holds (0: nothing open). */
int axc_buckets_open(const axc_buckets *b);
/* Buckets made in this pass (including retired ones whose buffers are still held). */
int axc_buckets_count(const axc_buckets *b);
void axc_buckets_stats(const axc_buckets *b, axc_bucket_stats *out);
void axc_buckets_zero_stats(axc_buckets *b);

#endif
