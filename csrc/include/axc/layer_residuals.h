/* The error-feedback residuals of the linear layers' depth dW reduce-scatters
 * (docs/compression.md#error-feedback-on-the-depth-dw-reduce-scatters): one float32 buffer per
 * layer (its scheduler id), kept across steps as the layer's training state, held by the
 * runtime next to the gradient buckets and their residuals.
 *
 * The buffers come from the caller's allocator (axc_bucket_ops.alloc_residual with no bucket:
 * torch zeros on the device, in the binding) and go back through its release. A layer's
 * residual starts from zeros, and again when a call needs another size or device. A residual
 * that a deferred reduce-scatter still reads and writes is not released when it is replaced,
 * forgotten or cleared meanwhile: it is kept until the end of the pass
 * (axc_layer_residuals_pass_done, after everything deferred completed), so no caller keeps it
 * alive. A call that must not train the residual (a micro-batch thread, a dW no .grad
 * receives) takes a scratch one of zeros for that call alone. Not thread-safe: the caller
 * serialises every call (the binding: the interpreter lock). */
#ifndef AXC_LAYER_RESIDUALS_H
#define AXC_LAYER_RESIDUALS_H

#include <stddef.h>
#include <stdint.h>

#include "axc/buckets.h"
#include "axc/status.h"

typedef struct axc_layer_residuals axc_layer_residuals;

/* `ops` needs release, and alloc_residual to make any (called with no bucket; without it
 * every call that needs a residual fails with AXC_ERR_STATE). Copied. */
axc_status axc_layer_residuals_create(axc_layer_residuals **out, const axc_bucket_ops *ops);
/* Releases every buffer, in flight or not (nothing may be in flight). NULL is a no-op. */
void axc_layer_residuals_destroy(axc_layer_residuals *t);

/* The residual of `layer` (>= 0) for a call on `device` (-1: CPU) that needs `elems` float32
 * (axc_linear_dw_residual_elems): the kept one when its size and device match, else new zeros.
 * `in_flight`: the call leaves a reduce-scatter that uses it after it returns (a deferred one):
 * kept until the pass's end even if dropped meanwhile. */
axc_status axc_layer_residuals_for(axc_layer_residuals *t, int layer, int device, size_t elems,
                                   int in_flight, float **data);
/* Zeros for one call that does not train its layer's residual. `in_flight` (as above): the
 * table keeps it until the pass's end and `*owner` is NULL; else `*owner` is the caller's to
 * give back with axc_layer_residuals_release once the call returned. */
axc_status axc_layer_residuals_scratch(axc_layer_residuals *t, int device, size_t elems,
                                       int in_flight, float **data, void **owner);
void axc_layer_residuals_release(axc_layer_residuals *t, void *owner);

/* The residual one backward call of `layer` passes (axc_linear_io.dw_residual): NULL where it
 * needs none (`elems` 0: axc_linear_dw_residual_elems says so; or no layer id, a torch.compile
 * graph: the layer then refuses error feedback by name); the layer's own when the call
 * `trains` it; else scratch zeros (concurrent micro-batches would update one residual several
 * at a time; a dW that no .grad receives must not spend the training one). `in_flight`: the
 * call defers its reduce-scatter. `*scratch`: NULL, or what to give back with
 * axc_layer_residuals_release once the call returned. */
axc_status axc_layer_residuals_for_call(axc_layer_residuals *t, int layer, int device,
                                        size_t elems, int trains, int in_flight, float **data,
                                        void **scratch);

/* The layer is gone (its id may be reused: a new layer starts from zeros). */
void axc_layer_residuals_forget(axc_layer_residuals *t, int layer);
/* Every residual dropped (init, finalize, a checkpoint's residuals loaded); those kept for
 * in-flight work go at the pass's end. */
void axc_layer_residuals_clear(axc_layer_residuals *t);
/* The generations of passes: a use by deferred work (in_flight) is open until the call that
 * made it queued that work (call_done, with the interpreter lock held again: `data` is what the
 * call was handed); it then belongs to the current generation. A pass's end takes the current
 * generation (pass_begin, which starts the next) before it waits for everything deferred, and
 * after the wait (pass_done) releases the uses of generations up to it, and only those: a pass
 * ending on one thread never releases a use that a call on another thread is still queueing,
 * nor one queued after its wait began. AXC_LAYER_RESIDUALS_ALL: every use (nothing in flight:
 * init, finalize). */
#define AXC_LAYER_RESIDUALS_ALL UINT64_MAX
uint64_t axc_layer_residuals_pass_begin(axc_layer_residuals *t);
void axc_layer_residuals_call_done(axc_layer_residuals *t, const float *data);
void axc_layer_residuals_pass_done(axc_layer_residuals *t, uint64_t gen);

/* The residuals held: how many, the i-th one's layer, buffer owner and length (checkpoints). */
int axc_layer_residuals_count(const axc_layer_residuals *t);
void axc_layer_residuals_at(const axc_layer_residuals *t, int i, int *layer, void **owner,
                            size_t *elems);
/* The owner and length of `layer`'s residual: 0 when it holds none. */
int axc_layer_residuals_get(const axc_layer_residuals *t, int layer, void **owner,
                            size_t *elems);
/* Adopts `owner` (a buffer of `elems` float32 at `data` on `device`) as `layer`'s residual; on
 * failure it is released. */
axc_status axc_layer_residuals_set(axc_layer_residuals *t, int layer, void *data, void *owner,
                                   int device, size_t elems);
/* Buffers kept for in-flight work (tests). */
int axc_layer_residuals_kept(const axc_layer_residuals *t);

#endif
