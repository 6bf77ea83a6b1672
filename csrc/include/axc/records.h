/* The records of pending gradients and the summed-over marks (docs/ARCHITECTURE.md#who-owns-what).
 *
 * Between a backward pass's gradients and their completion, this holds per parameter (a key the
 * caller makes unique while the parameter lives, e.g. its address):
 *
 * - the records of the pass, in the order they were made: a gradient `dw` (written into a
 *   bucket piece or a scratch buffer), what the work that writes it reads (`keep`), whether it
 *   replaces .grad or is added to it, and the groups it is summed over;
 * - a "taken" .grad: the gradient accumulated before the pass and the scratch tensor put in its
 *   place while a pending record replaces .grad (another gradient of the pass is then recorded
 *   after it instead of being added where a deferred dW GEMM still reads);
 * - a chunk record (axonn_c.Sequential): the record several chunk calls of one pass accumulate
 *   into, complete after the number of calls the forwards announced (chunk call counts);
 * - the summed-over mark: the groups the parameter's current .grad was summed over, kept with a
 *   stamp of that .grad (the caller checks the stamp still names the .grad it has); a synced
 *   mark also says that sync_gradients completed that .grad's sums for the step and multiplied
 *   it by a scale (a second sync leaves it alone; the next backward first turns it back into
 *   this rank's unscaled share, docs/ARCHITECTURE.md#gradient-marks).
 *
 * The end of a pass (axc_records_detach) hands the caller the records in the order it applies
 * them and the taken .grads it puts back. Objects are opaque owners (Python references, in the
 * binding) released through the caller's function, always after they left the tables, so a
 * release may call back in. Not thread-safe: the caller serialises every call. */
#ifndef AXC_RECORDS_H
#define AXC_RECORDS_H

#include <stddef.h>
#include <stdint.h>

#include "axc/grid.h"
#include "axc/status.h"

/* an ordered list of distinct groups */
typedef struct axc_groups {
    int n;
    axc_group_kind g[AXC_GROUP_COUNT];
} axc_groups;

/* Appends the groups of `add` that `into` lacks, in their order. */
void axc_groups_union(axc_groups *into, const axc_groups *add);

typedef struct axc_grad_record {
    uintptr_t key;
    void *param, *dw, *keep; /* owners (keep may be NULL) */
    int replace;             /* dw replaces .grad (else it is added to it) */
    axc_groups groups;       /* what dw is summed over */
} axc_grad_record;

typedef struct axc_taken_grad {
    uintptr_t key;
    void *param, *prev, *scratch; /* prev may be NULL (no .grad before the pass) */
} axc_taken_grad;

/* What a pass left, handed over by axc_records_detach (release with axc_records_pass_release). */
typedef struct axc_records_pass {
    axc_grad_record *recs; /* in the order they are applied */
    size_t nrecs;
    axc_taken_grad *restore; /* the taken .grads to put back (where .grad is still the scratch) */
    size_t nrestore;
    void **drop; /* owners to release only */
    size_t ndrop;
} axc_records_pass;

typedef struct axc_grad_records axc_grad_records;
typedef struct axc_chunk_counts axc_chunk_counts;

axc_status axc_records_create(axc_grad_records **out, void (*release)(void *ctx, void *owner),
                              void *ctx);
/* Releases every owner (records, taken, counts, marks). NULL is a no-op. */
void axc_records_destroy(axc_grad_records *r);

/* ---- summed-over marks */
/* Marks key's .grad (as `stamp` names it) summed over `groups`; no groups forgets. The stamp is
 * owned (released when the mark is replaced or forgotten, also on failure). */
axc_status axc_records_mark(axc_grad_records *r, uintptr_t key, void *stamp, const axc_groups *groups);
/* As axc_records_mark, a synced mark: key's .grad is summed over `groups` (may be none) and
 * multiplied by `scale` (> 0) by sync_gradients, in generation `gen` (the caller's; axonn_c:
 * the gradients arrived so far). (Either call may be handed the mark's own stamp: each hands
 * over one ownership of it, so one is released.) */
axc_status axc_records_mark_synced(axc_grad_records *r, uintptr_t key, void *stamp,
                                   const axc_groups *groups, double scale, unsigned long long gen);
/* As axc_records_mark, a mark sync_gradients_depth_parallel made in generation `gen` (as
 * axc_records_mark_synced's), and key's .grad is multiplied by `scale` (> 0; 1: not; mean=True:
 * 1/depth). */
axc_status axc_records_mark_scaled(axc_grad_records *r, uintptr_t key, void *stamp,
                                   const axc_groups *groups, double scale, unsigned long long gen);
/* 1 and the stamp (borrowed) and groups when key has a mark, else 0. */
int axc_records_marked(const axc_grad_records *r, uintptr_t key, void **stamp, axc_groups *groups);
/* The scale of key's synced mark (and its generation in *gen, when not NULL); 0 when its mark
 * is not synced or it has none. */
double axc_records_synced(const axc_grad_records *r, uintptr_t key, unsigned long long *gen);
/* The scale key's marked .grad carries: its synced mark's scale, or its mark's scale; 1 when it
 * has no mark. */
double axc_records_scale(const axc_grad_records *r, uintptr_t key);
/* 1 and its generation (when gen is not NULL) when key's mark was made by a sync
 * (axc_records_mark_synced, axc_records_mark_scaled), else 0. */
int axc_records_dated(const axc_grad_records *r, uintptr_t key, unsigned long long *gen);
/* The keys whose mark a sync made: how many there are, the first `cap` of them written to out. */
size_t axc_records_dated_keys(const axc_grad_records *r, uintptr_t *out, size_t cap);
size_t axc_records_marks(const axc_grad_records *r);
size_t axc_records_dated_count(const axc_grad_records *r); /* the marks a sync made */

/* ---- records of the pass */
/* Appends a record; takes its owners (released on failure too). */
axc_status axc_records_add(axc_grad_records *r, const axc_grad_record *rec);
/* Whether key has a record in this pass. */
int axc_records_pending(const axc_grad_records *r, uintptr_t key);
/* key's last record in this pass (borrowed, valid until the next add/detach), or NULL. */
const axc_grad_record *axc_records_last(const axc_grad_records *r, uintptr_t key);
size_t axc_records_count(const axc_grad_records *r);

/* Takes key's .grad for the pass (owners taken; AXC_ERR_STATE when taken already). */
axc_status axc_records_take(axc_grad_records *r, const axc_taken_grad *t);
int axc_records_is_taken(const axc_grad_records *r, uintptr_t key);
size_t axc_records_taken(const axc_grad_records *r);

/* ---- chunk records */
/* key's pending record becomes a chunk record of `left` calls (<= 0: unknown, complete at the
 * end of the pass), whose bucket (-1: none) is held until then. AXC_ERR_STATE without a record. */
axc_status axc_records_chunk_open(axc_grad_records *r, uintptr_t key, int64_t bucket, long left);
/* The dw owner (borrowed) of key's open chunk record, or NULL. */
void *axc_records_chunk_dw(const axc_grad_records *r, uintptr_t key);
/* One chunk call of key's open record is done: 1 when that completed it (*bucket: the bucket
 * to release, -1 none), else 0 (no open record, or more calls to come). */
int axc_records_chunk_done(axc_grad_records *r, uintptr_t key, int64_t *bucket);
size_t axc_records_chunks_open(const axc_grad_records *r);

/* Chunk call counts: the pass's own table, or a caller's (a forward run ahead, whose calls
 * belong to the next pass). */
axc_status axc_chunk_counts_create(axc_chunk_counts **out);
/* Releases the owners through r's function. */
void axc_chunk_counts_destroy(axc_chunk_counts *c, axc_grad_records *r);
/* One more chunk call of key (param: an owner, taken; released on failure) into the table that
 * counts now. */
axc_status axc_records_expect_chunk(axc_grad_records *r, uintptr_t key, void *param);
/* Counts go into `c` (NULL: the pass's table) until the next call; returns the previous one. */
axc_chunk_counts *axc_records_count_into(axc_grad_records *r, axc_chunk_counts *c);
/* Moves c's counts into the pass's table (c is left empty). */
axc_status axc_records_add_counts(axc_grad_records *r, axc_chunk_counts *c);
/* Forgets the pass's counts (the end of a pass). */
void axc_records_clear_counts(axc_grad_records *r);
/* key's count in the pass's table, removed (0 when none). */
long axc_records_take_count(axc_grad_records *r, uintptr_t key);

/* ---- the end of a pass */
/* Hands over everything pending (records, taken .grads, chunk records; the chunk call counts
 * are forgotten). finishing=1 (the pass completes): the taken .grads of keys that have a record
 * are dropped (the record replaces .grad), the rest are to be put back; finishing=0 (the pass
 * is abandoned): every taken .grad is to be put back. */
axc_status axc_records_detach(axc_grad_records *r, int finishing, axc_records_pass *out);
void axc_records_pass_release(axc_grad_records *r, axc_records_pass *p);

/* The backward pass the pending work belongs to: its graph-task id (AXC_NO_PASS: none) and an
 * owner the caller uses to tell whether it is still running (released when replaced or
 * cleared). set_task changes the id only (the pass ended: its owner tells when it is gone). */
#define AXC_NO_PASS INT64_MIN
void axc_records_set_pass(axc_grad_records *r, int64_t task, void *owner);
void axc_records_set_task(axc_grad_records *r, int64_t task);
int64_t axc_records_pass_task(const axc_grad_records *r);
void *axc_records_pass_owner(const axc_grad_records *r); /* borrowed, or NULL */

/* Forgets everything pending, every count and the pass (not the marks). */
void axc_records_clear(axc_grad_records *r);

#endif
