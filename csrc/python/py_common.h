/* Shared by the csrc/python/ files: turning core statuses into Python exceptions, and the
 * method tables each file contributes to axonn_c._C. */
#ifndef AXC_PY_COMMON_H
#define AXC_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "axc/comm.h"
#include "axc/keeps.h"
#include "axc/records.h"
#include "axc/runtime.h"
#include "axc/status.h"

/* module.c: the process's runtime (axc/runtime.h), made when the module loads, and what it
 * holds: the communicator and scheduler of the current init (NULL when not initialised). */
axc_runtime *axc_py_runtime(void);
axc_comm *axc_py_comm(void);
axc_sched *axc_py_sched(void);
/* py_grads.c: the runtime's buffer and keep-alive ops (torch tensors, Python references) */
void axc_py_grads_runtime_ops(axc_runtime_ops *ops);
/* py_microbatch.c: run_concurrent's gathered buffers and weight references */
void axc_py_microbatch_ops(axc_mb_ops *ops);
/* On a micro-batch thread of the open run_concurrent call: whether an unscheduled call of layer
 * `layer` (its scheduler id, -1: none) over `depth_size` depth ranks shares its depth traffic
 * with the other micro-batches (one all-gather of W per (layer, phase, use), one dW
 * reduce-scatter of their summed blocks). */
int axc_py_mb_shares_depth(int layer, int scheduled, int depth_size);
/* w's depth shard all-gathered ([numel]) once for all micro-batches (axc_mb_gather; the calling
 * micro-batch's use of (layer, phase) counted, axc_mb_next_use): a new reference, or NULL with an
 * exception */
PyObject *axc_py_mb_gather(int layer, int bwd, PyObject *w, Py_ssize_t numel);
/* A new buffer ([numel], like w) for w's unreduced dW block when the micro-batches share its
 * reduce-scatter; None when the call reduce-scatters itself (w is not a leaf requiring grad, or
 * the running call's reducer sums it); NULL with an exception. */
PyObject *axc_py_mb_scatter_block(PyObject *w, Py_ssize_t numel);
/* Hands in this micro-batch's dW block of w: the last of the n to arrive sums them and starts
 * one depth reduce-scatter (axc_mb_scatter); microbatch_apply_scatters adds the shard to .grad
 * when the call ends. -1 with an exception. */
int axc_py_mb_scatter(int layer, PyObject *w, PyObject *block);
/* p's name in backward's overlapped buckets (py_sync.c gives it), or 0 when this process gave
 * it none (a pickle's from another process, a value a user set); -1 with an exception. */
int axc_py_grad_ident(PyObject *p, uint64_t *ident);

/* py_comm.c: with peers, aborts the job's collectives (every wait of every rank fails at once)
 * naming an interrupted run_concurrent and `why` (the exception); called with the GIL held */
void axc_py_abort_interrupted(const char *why);

/* Exception types created in module.c. */
extern PyObject *axc_py_CommError;        /* RuntimeError: a peer died, the backend failed */
extern PyObject *axc_py_CommTimeoutError; /* CommError and TimeoutError: a peer never came */

/* Raises the exception matching `status` with the core's thread-local message; returns NULL. */
PyObject *axc_py_raise(axc_status status);

/* A loop that goes on past a failed step (each summed gradient marked, even after one mark
 * failed) keeps its first error: axc_py_first_error_take after each failure (the exception
 * fetched, so that the next steps run without one set; a later one dropped, unless it is a
 * KeyboardInterrupt or SystemExit the first one is not: the user's interrupt is never lost), then
 * axc_py_first_error_restore (-1 with it set again, 0 when none failed). */
typedef struct axc_py_first_error {
    PyObject *type, *value, *tb;
    int failed;
} axc_py_first_error;

/* an exception type that is not an error of the work but the user (or the process) stopping */
static inline int axc_py_is_interrupt(PyObject *type)
{
    return type && (PyErr_GivenExceptionMatches(type, PyExc_KeyboardInterrupt) ||
                    PyErr_GivenExceptionMatches(type, PyExc_SystemExit));
}

static inline void axc_py_first_error_take(axc_py_first_error *e)
{
    if (e->failed) {
        if (!axc_py_is_interrupt(PyErr_Occurred()) || axc_py_is_interrupt(e->type)) {
            PyErr_Clear();
            return;
        }
        Py_XDECREF(e->type); /* (the interrupt replaces the error kept) */
        Py_XDECREF(e->value);
        Py_XDECREF(e->tb);
    }
    PyErr_Fetch(&e->type, &e->value, &e->tb);
    e->failed = 1;
}

static inline int axc_py_first_error_restore(axc_py_first_error *e)
{
    if (!e->failed)
        return 0;
    PyErr_Restore(e->type, e->value, e->tb);
    e->failed = 0;
    return -1;
}

/* py_comm.c: reads a dense contiguous torch.Tensor (exact type) or raises naming `argname`. */
int axc_py_read_tensor(PyObject *t, const char *argname, void **ptr, size_t *numel,
                       axc_dtype *dtype, int *device);

/* Method tables, each NULL-terminated, one per binding file. */
extern PyMethodDef axc_py_comm_methods[];
extern PyMethodDef axc_py_model_methods[];
extern PyMethodDef axc_py_gemm_methods[];
extern PyMethodDef axc_py_timeline_methods[];
extern PyMethodDef axc_py_sched_methods[];
extern PyMethodDef axc_py_compress_methods[];
extern PyMethodDef axc_py_grads_methods[];
extern PyMethodDef axc_py_records_methods[];
extern PyMethodDef axc_py_grad_hook_methods[];
extern PyMethodDef axc_py_microbatch_methods[];
extern PyMethodDef axc_py_layer_residuals_methods[];
extern PyMethodDef axc_py_sync_methods[]; /* py_sync.c: sync_gradients' sums */

/* shared by the gradient bindings (py_grads.c, py_records.c) */
typedef axc_status (*bucket_fn)(axc_buckets *, int);
int axc_py_bucket_apply(int bucket, bucket_fn fn); /* fn on a bucket, then due sums; -1: raised */
PyObject *axc_py_grad_buckets_finish(void);                 /* _C.grad_buckets_finish() */
/* py_grads.c: the bucket key of gradients like `like` summed over `groups` (names) */
int axc_py_bucket_key(PyObject *like, PyObject *groups, axc_bucket_key *key);
/* py_grads.c: the dtype and device of `like` into key (its groups left as they are) */
int axc_py_bucket_kind(PyObject *like, axc_bucket_key *key);
/* py_grads.c: n elements of the open bucket of `key` (a new one made like `like`), at most
 * `bytes` a bucket unless one piece is larger, and at most `want` (0: unknown) elements, what
 * the caller still puts into this key's buckets (axc_buckets_take): the bucket's flat buffer (a
 * new reference; NULL with an exception), its number and the piece's offset in it; the sums
 * that came due are started. `tag` names the piece's gradient for the error-feedback
 * residuals' fingerprints (the same in every step: axc_buckets_take), `ident` (0: none) the
 * same on every rank (axc_buckets_take_shared: the transport compares the bucket's pieces). */
PyObject *axc_py_bucket_take(PyObject *like, const axc_bucket_key *key, size_t n, size_t want,
                             size_t bytes, uint64_t tag, uint64_t ident, int *bucket,
                             size_t *offset);
/* py_grads.c: as axc_py_bucket_take, the piece itself (flat.narrow(0, offset, n)), tagged by
 * `like` (the parameter whose gradient it takes), named `ident` on every rank (0: none) */
PyObject *axc_py_bucket_piece(PyObject *like, const axc_bucket_key *key, size_t n, size_t bytes,
                              uint64_t ident, int *bucket);
void axc_py_keeps_release_done(void);                       /* _C.keeps_release_done() */
/* py_grads.c: keeps obj (a new reference taken) until `number` of `kind` is done, after
 * releasing what is done already (_C.keep_alive) */
int axc_py_keep_alive(axc_keep_kind kind, uint64_t number, PyObject *obj);

/* py_records.c: the records of pending gradients and the summed-over marks */
int axc_py_grad_summed(PyObject *p, axc_groups *out); /* p.grad's mark (none when stale) */
/* a gradient reaches p while p.grad is None: the mark of a .grad dropped since (zero_grad
 * without a sync between) is forgotten, so no copy made later is taken for summed by it */
int axc_py_grad_forget_dropped(PyObject *p);
int axc_py_grad_mark(PyObject *p, const axc_groups *g); /* p.grad summed over g (none forgets) */
/* p.grad's mark with its synced scale (0: not synced) and the scale it carries (1: none; synced
 * or not; either pointer may be NULL); with dropped_ok also when p.grad was set to None since
 * (the mark of a copy under another attribute, main_grad, made before) */
int axc_py_grad_mark_of(PyObject *p, int dropped_ok, axc_groups *out, double *synced,
                        double *scale);
/* whether the mark axc_py_grad_mark_of read (summed, synced, scale) was made by a sync
 * (synced, or sync_gradients_depth_parallel's, scaled or not), and its generation in *gen
 * (when not NULL; 0 when not) */
int axc_py_grad_made_by_sync(PyObject *p, const axc_groups *summed, double synced, double scale,
                             unsigned long long *gen);
/* p.grad synced (sync_gradients completed its sums over g and multiplied it by scale > 0) */
int axc_py_grad_mark_synced(PyObject *p, const axc_groups *g, double scale);
/* p.grad summed over g and multiplied by scale > 0 (1: not) by sync_gradients_depth_parallel:
 * a mark with a generation, as a synced one */
int axc_py_grad_mark_scaled(PyObject *p, const axc_groups *g, double scale);
/* a pending gradient of p (keep may be NULL), then its bucket (-1: none) written */
int axc_py_grad_record(PyObject *p, PyObject *dw, PyObject *keep, int replace,
                       const axc_groups *groups, int bucket);
int axc_py_grad_take(PyObject *p, PyObject *prev, PyObject *scratch); /* _C.grad_take */
/* one chunk call of p is done; after the last, its bucket may start its sums */
int axc_py_grad_chunk_done(PyObject *p);
PyObject *axc_py_grad_records_finish(void); /* _C.grad_records_finish() */
/* _C.grad_records_drop(), releasing the depth residuals' uses up to generation `gen` (taken
 * before the deferred work was waited for, axc/layer_residuals.h) */
PyObject *axc_py_grad_records_drop(uint64_t gen);
/* py_grad_hook.c: raises (RuntimeError, -1) when p.grad was already summed over ranks
 * (run_concurrent takes unsummed gradients only; one a sync marked is fine: axc_py_grad_unsync) */
int axc_py_grad_check_unsynced(PyObject *p);
/* A gradient is about to be accumulated into p.grad while a sync's mark is on it (sync_gradients
 * or sync_gradients_depth_parallel ran, no backward since; also what a sync does to a .grad
 * whose such mark is older than the last gradient arrived): p.grad becomes this rank's unscaled
 * share of the sum (divided by the scale and by the rank count of its groups), unmarked, so
 * that the next sync sums and scales old and new alike. Nothing for any other mark. */
int axc_py_grad_unsync(PyObject *p);

/* py_sync.c: sums tensors[0 .. n) in place over `g` (in this order), waiting for the result:
 * packed into gradient buckets of `bytes` (the same ones as backward's, emptied first by the
 * caller) and copied back, as _C.grad_reduce_now; an interrupt while it waits aborts the job's
 * collectives (run_concurrent's reducer); params[i], the parameter whose gradient tensors[i]
 * is, tags its piece (the residuals' fingerprints), idents[i] (> 0, the same on every rank:
 * its position in the caller's order) names it for the transport's check that every rank
 * packed the same gradients; -1 with an exception */
int axc_py_grad_reduce(PyObject *const *tensors, PyObject *const *params, const size_t *idents,
                       size_t n, const axc_groups *g, size_t bytes);
/* py_grad_hook.c: numel elements of the open bucket over `groups` for gradients like p's (the
 * runtime's bucket size; named by p's `_axonn_grad_ident`, set by sync_gradients) and the
 * bucket's number */
PyObject *axc_py_grad_bucket_view(PyObject *p, Py_ssize_t numel, const axc_groups *groups,
                                  int *id);
/* py_grad_deferred.c: a Linear backward's deferred weight gradient (py_linear_call.c).
 * prepare: where dW goes (a chunk call's: the pass's chunk record of param, opened by its
 * first chunk call); record: after the backward, a pending record of it (depth > 1: the
 * reduce-scatter's workspace `ws` kept with the fold until the pass ends) and the end of the
 * pass queued, or for a chunk call its part done; clear: drops what prepare handed out (a
 * backward that raised: nothing recorded, as before the move into C). */
typedef struct {
    PyObject *dw, *fold; /* new references (fold: NULL or the gradient so far to add in) */
    int replace, bucket, chunk;
} axc_py_deferred_dw;
int axc_py_deferred_prepare(PyObject *param, Py_ssize_t n, int overlap_data, int chunk,
                            axc_py_deferred_dw *out);
int axc_py_deferred_record(const axc_py_deferred_dw *dd, PyObject *param, PyObject *ws,
                           int depth);
void axc_py_deferred_clear(axc_py_deferred_dw *dd);
/* py_grad_pass.c: the end of a backward pass (grads.finish, drop_if_abandoned, queue_finish) */
PyObject *axc_py_grad_finish(void);
int axc_py_grad_drop_if_abandoned(void);
int axc_py_grad_queue_finish(void);
int axc_py_grad_pass_add_types(PyObject *module);
int axc_py_grad_enabled(void);        /* torch's grad mode (-1 with an exception) */
int axc_py_set_grad_enabled(int on); /* (after axc_py_grad_enabled) */
extern PyMethodDef axc_py_grad_pass_methods[];

/* Types registered on the module (each file adds its own). */
int axc_py_add_type(PyObject *module, PyTypeObject *type, const char *name); /* module.c */
/* module.c: getattr(obj, name, None) without raising and catching AttributeError (which costs
 * more than a hook's whole decision): a new reference, NULL with nothing set when absent, NULL
 * with an exception set on an error */
PyObject *axc_py_optional_attr(PyObject *obj, PyObject *name);
int axc_py_comm_add_types(PyObject *module);
int axc_py_linear_add_types(PyObject *module); /* py_linear_call.c */
int axc_py_grads_add_types(PyObject *module);  /* py_grads.c: its interned names */
int axc_py_grad_hook_add_types(PyObject *module); /* py_grad_hook.c: GradHook */
int axc_py_sched_add_types(PyObject *module);     /* py_sched.c: ChunkPlan */

#endif
