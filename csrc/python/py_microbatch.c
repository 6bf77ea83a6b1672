/* Bindings of the running run_concurrent call (axc/microbatch.h), held by the runtime:
 * microbatch_begin / _end, the reducer's order, arrivals, thread ends and its loop over the
 * buckets (microbatch_reduce_all), the shared depth gathers and dW reduce-scatters. */
#include <string.h>

#include "py_common.h"

#include "axc/microbatch.h"
#include "axc/sched.h"
#include "axc/status.h"
#include "axc/sync.h"

static axc_mb *call(void) { return axc_runtime_mb(axc_py_runtime()); }

static uintptr_t id_of(PyObject *p) { return (uintptr_t)p; }

/* the ops of axc/microbatch.h, called with the GIL held */
static axc_status alloc_like(void *ctx, void *w, size_t elems, void **data, void **owner)
{
    (void)ctx;
    PyObject *t = PyObject_CallMethod((PyObject *)w, "new_empty", "((n))", (Py_ssize_t)elems);
    PyObject *ptr = t ? PyObject_CallMethod(t, "data_ptr", NULL) : NULL;
    *data = ptr ? PyLong_AsVoidPtr(ptr) : NULL;
    Py_XDECREF(ptr);
    if (PyErr_Occurred()) {
        Py_XDECREF(t);
        return axc_fail(AXC_ERR_NOMEM, "shared depth all-gather: no buffer of %zu elements",
                        elems);
    }
    *owner = t;
    return AXC_OK;
}

static axc_status describe(void *ctx, void *w, const void **data, size_t *elems,
                           axc_dtype *dtype, int *device)
{
    (void)ctx;
    void *p;
    if (axc_py_read_tensor((PyObject *)w, "weight", &p, elems, dtype, device) < 0)
        return axc_fail(AXC_ERR_INVALID, "shared depth all-gather: the weight is not a dense "
                                         "contiguous tensor");
    *data = p;
    return AXC_OK;
}

static void retain(void *ctx, void *obj)
{
    (void)ctx;
    Py_INCREF((PyObject *)obj);
}

static void release(void *ctx, void *obj)
{
    (void)ctx;
    Py_DECREF((PyObject *)obj);
}

/* w.detach(): a tensor of w's storage as it is now, which keeps that storage allocated while a
 * gather sends from it, even if fn gives w other storage (w.data = ...) meanwhile */
static axc_status pin(void *ctx, void *w, void **owner)
{
    (void)ctx;
    PyObject *alias = PyObject_CallMethod((PyObject *)w, "detach", NULL);
    if (!alias)
        return axc_fail(AXC_ERR_INVALID, "shared depth all-gather: the weight cannot be "
                                         "detached (not a tensor?)");
    *owner = alias;
    return AXC_OK;
}

void axc_py_microbatch_ops(axc_mb_ops *ops)
{
    *ops = (axc_mb_ops){.alloc = alloc_like, .describe = describe, .retain = retain,
                        .release = release, .pin = pin};
}

/* Parameter p's part in the reducer (run_concurrent's `model=`): the groups it is summed over
 * (its `_axonn_grad_groups`, else `replicated`; a tuple or list of names, in order), less those
 * of one rank, into key->groups (ngroups 0: not summed; its dtype and device are set only when
 * summed). -1 with an exception. */
static int reducer_key(PyObject *p, PyObject *replicated, unsigned several, axc_bucket_key *key)
{
    static PyObject *s_groups_attr;
    if (!s_groups_attr && !(s_groups_attr = PyUnicode_InternFromString("_axonn_grad_groups")))
        return -1;
    PyObject *own = axc_py_optional_attr(p, s_groups_attr);
    if (!own && PyErr_Occurred())
        return -1;
    PyObject *names = own ? own : Py_NewRef(replicated);
    PyObject *seq = PySequence_Fast(names, "a parameter's groups must be a tuple of group names");
    Py_DECREF(names);
    if (!seq)
        return -1;
    int rc = 0;
    key->ngroups = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        const char *name = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : NULL;
        axc_group_kind k;
        if (!name || axc_group_from_name(name, &k) != AXC_OK) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "run_concurrent: %R is not a group name (expected one "
                                           "of col, row, depth, data, intra, world)", item);
            rc = -1;
        } else if (several >> k & 1u) { /* (a group of one rank has nothing to sum) */
            if (key->ngroups == AXC_BUCKET_MAX_GROUPS) {
                PyErr_Format(PyExc_ValueError, "run_concurrent: a parameter is summed over %R, "
                             "expected at most %d groups", seq, AXC_BUCKET_MAX_GROUPS);
                rc = -1;
            } else {
                key->groups[key->ngroups++] = k;
            }
        }
    }
    Py_DECREF(seq);
    if (rc == 0 && key->ngroups)
        rc = axc_py_bucket_kind(p, key);
    return rc;
}

/* The reducer's order of `params`: the ones that require grad, in reverse (about the order
 * backward finishes them), each summed over its groups of several ranks (reducer_key); none may
 * hold a .grad summed already. Added to the call; the list of them in *out (a new reference).
 * -1 with an exception. */
static int reducer_order(axc_mb *mb, PyObject *params, PyObject *replicated, PyObject **out)
{
    static PyObject *s_requires_grad, *s_nbytes;
    if ((!s_requires_grad && !(s_requires_grad = PyUnicode_InternFromString("requires_grad"))) ||
        (!s_nbytes && !(s_nbytes = PyUnicode_InternFromString("nbytes"))))
        return -1;
    *out = PyList_New(0);
    PyObject *seq = *out ? PySequence_Fast(params, "microbatch_begin: params must be a "
                                                   "sequence") : NULL;
    if (!seq) {
        Py_CLEAR(*out);
        return -1;
    }
    axc_comm *comm = axc_py_comm();
    unsigned several = comm ? axc_sync_several(axc_comm_grid(comm)) : 0;
    int rc = 0;
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(seq) - 1; rc == 0 && i >= 0; i--) {
        PyObject *p = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *rg = PyObject_GetAttr(p, s_requires_grad);
        int trains = rg ? PyObject_IsTrue(rg) : -1;
        Py_XDECREF(rg);
        axc_bucket_key key;
        if (trains < 0 || (trains && reducer_key(p, replicated, several, &key) < 0)) {
            rc = -1;
            break;
        }
        /* (the reducer sums its .grad whether a micro-batch reaches it or not: its share now) */
        if (trains && axc_py_grad_unsync(p) < 0) {
            rc = -1;
            break;
        }
        if (!trains || !key.ngroups)
            continue;
        if (axc_py_grad_check_unsynced(p) < 0) {
            rc = -1;
            break;
        }
        PyObject *nb = PyObject_GetAttr(p, s_nbytes);
        Py_ssize_t nbytes = nb ? PyLong_AsSsize_t(nb) : -1;
        Py_XDECREF(nb);
        axc_status st = nbytes < 0 ? AXC_OK : axc_mb_add_param(mb, id_of(p), &key, (size_t)nbytes);
        if (nbytes < 0 || st != AXC_OK || PyList_Append(*out, p) < 0) {
            if (st != AXC_OK)
                axc_py_raise(st);
            rc = -1;
        }
    }
    Py_DECREF(seq);
    if (rc < 0)
        Py_CLEAR(*out);
    return rc;
}

/* microbatch_begin(owner, n, params, replicated, bucket_bytes, scatter_bound) -> the
 * parameters the reducer sums, in its order (a tuple for microbatch_reduce_all; empty: nothing
 * to sum): a run_concurrent call of n micro-batches whose reducer sums those of `params` (a
 * model's parameters, in registration order; empty: no reducer) that reducer_order picks, in
 * buckets of up to bucket_bytes, holding at most scatter_bound summed dW blocks. `owner`: the
 * caller's token (kept alive by it until microbatch_end(owner)), which alone ends the call */
static PyObject *py_begin(PyObject *self, PyObject *args)
{
    (void)self;
    int n, bound;
    PyObject *owner, *params, *replicated, *order = NULL;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "OiOOni", &owner, &n, &params, &replicated, &bytes, &bound))
        return NULL;
    if (bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "microbatch_begin: bucket_bytes=%zd, expected > 0", bytes);
        return NULL;
    }
    axc_mb *mb;
    axc_status st = axc_runtime_mb_begin(axc_py_runtime(), owner, n, (size_t)bytes, &mb);
    if (st != AXC_OK)
        return axc_py_raise(st);
    axc_mb_set_scatter_bound(mb, bound);
    if (reducer_order(mb, params, replicated, &order) < 0) {
        axc_runtime_mb_end(axc_py_runtime());
        return NULL;
    }
    PyObject *t = PyList_AsTuple(order);
    Py_DECREF(order);
    if (!t)
        axc_runtime_mb_end(axc_py_runtime());
    return t;
}

/* microbatch_end(owner) -> whether it ended the call: the one `owner` opened is over (its
 * threads joined); no-op (False) when none runs or another caller's does. Safe to call
 * whatever microbatch_begin(owner, ...) did, also when it raised or was interrupted as it
 * returned */
static PyObject *py_end(PyObject *self, PyObject *owner)
{
    (void)self;
    return PyBool_FromLong(axc_runtime_mb_end_owned(axc_py_runtime(), owner));
}

/* microbatch_running() -> whether a run_concurrent call is open (finalize asks before it
 * changes anything) */
static PyObject *py_running(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(axc_runtime_mb(axc_py_runtime()) != NULL);
}

/* microbatch_arrive(p): a post-accumulate-grad hook: on a micro-batch thread, one more
 * micro-batch's gradient of p arrived (elsewhere, or for a parameter not summed: nothing) */
static PyObject *py_arrive(PyObject *self, PyObject *p)
{
    (void)self;
    axc_mb *mb = call();
    if (mb && axc_microbatch_thread())
        axc_mb_arrive(mb, id_of(p));
    Py_RETURN_NONE;
}

/* microbatch_thread_done(failed): a micro-batch thread ended */
static PyObject *py_thread_done(PyObject *self, PyObject *arg)
{
    (void)self;
    int failed = PyObject_IsTrue(arg);
    if (failed < 0)
        return NULL;
    axc_mb *mb = call();
    if (mb)
        axc_mb_thread_done(mb, failed);
    Py_RETURN_NONE;
}

/* how long the reducer waits for a bucket between looks for an interrupt */
#define NEXT_BUCKET_SLICE_MS 50

/* The reducer's next bucket (axc_mb_next_bucket): 1 with it, 0 when nothing more is to be
 * summed, -1 with an exception. Waits without the GIL, in slices: an interrupt (Ctrl-C) between
 * them raises here, and run_concurrent aborts the job's collectives. */
static int next_bucket(axc_mb *mb, int *first, int *count, axc_bucket_key *key)
{
    for (;;) {
        int got;
        Py_BEGIN_ALLOW_THREADS got = axc_mb_next_bucket(mb, NEXT_BUCKET_SLICE_MS, first, count,
                                                        key);
        Py_END_ALLOW_THREADS
        if (got >= 0)
            return got;
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

/* Sums one bucket: the parameters order[first .. first + count) that have a .grad, in place
 * over the key's groups (py_sync.c's sum), then marks each .grad summed over them. -1 with an
 * exception: a failed sum marks nothing of the bucket; a failed mark, after the sum, leaves the
 * others marked. */
static int reduce_bucket(axc_mb *mb, PyObject *order, int first, int count,
                         const axc_bucket_key *key, size_t bytes, PyObject **have,
                         PyObject **grads, size_t *idents)
{
    static PyObject *s_grad;
    if (!s_grad && !(s_grad = PyUnicode_InternFromString("grad")))
        return -1;
    size_t k = 0;
    int rc = 0;
    for (int i = first; rc == 0 && i < first + count; i++) {
        PyObject *p = PyTuple_GET_ITEM(order, i);
        if (id_of(p) != axc_mb_param(mb, i)) {
            PyErr_Format(PyExc_ValueError, "microbatch_reduce_all: parameter %d is not the one "
                                           "microbatch_begin put there", i);
            rc = -1;
            break;
        }
        PyObject *g = PyObject_GetAttr(p, s_grad);
        if (!g) {
            rc = -1;
        } else if (g == Py_None) { /* (no micro-batch gave it a gradient) */
            Py_DECREF(g);
        } else {
            have[k] = p;
            idents[k] = (size_t)i + 1; /* (its place in the order: the same on every rank) */
            grads[k++] = g;
        }
    }
    axc_groups groups = {.n = key->ngroups};
    memcpy(groups.g, key->groups, (size_t)key->ngroups * sizeof key->groups[0]);
    if (rc == 0 && k)
        rc = axc_py_grad_reduce(grads, have, idents, k, &groups, bytes); /* (tagged by parameter) */
    /* (only after the sum succeeded) each one, also past a mark that failed: the first error
     * kept */
    axc_py_first_error err = {0};
    for (size_t j = 0; rc == 0 && j < k; j++)
        if (axc_py_grad_mark(have[j], &groups) < 0)
            axc_py_first_error_take(&err);
    if (axc_py_first_error_restore(&err) < 0)
        rc = -1;
    for (size_t j = 0; j < k; j++)
        Py_DECREF(grads[j]);
    return rc;
}

/* microbatch_reduce_all(order, bucket_bytes): the reducer (on the calling thread, channel 0):
 * takes each bucket of `order` (what microbatch_begin returned) once all n micro-batches have
 * added to it, in the fixed order, and sums it (reduce_bucket, packed into buckets of up to
 * bucket_bytes); returns when nothing more is to be summed (every bucket summed, or a
 * micro-batch failed) */
static PyObject *py_reduce_all(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *order;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "O!n", &PyTuple_Type, &order, &bytes))
        return NULL;
    axc_mb *mb = call(); /* (ended only by this thread, after this returns) */
    if (!mb || bytes <= 0 || PyTuple_GET_SIZE(order) != axc_mb_params(mb)) {
        PyErr_Format(PyExc_ValueError, "microbatch_reduce_all: %s", !mb ?
                     "no run_concurrent call" : bytes <= 0 ? "bucket_bytes must be > 0" :
                     "the order is not the one microbatch_begin returned");
        return NULL;
    }
    Py_ssize_t np = PyTuple_GET_SIZE(order);
    PyObject **have = PyMem_Calloc(np ? (size_t)np : 1, sizeof *have);
    PyObject **grads = PyMem_Calloc(np ? (size_t)np : 1, sizeof *grads);
    size_t *idents = PyMem_Calloc(np ? (size_t)np : 1, sizeof *idents);
    int rc = have && grads && idents ? 1 : -1;
    if (rc < 0)
        PyErr_NoMemory();
    while (rc > 0) {
        int first, count;
        axc_bucket_key key;
        rc = next_bucket(mb, &first, &count, &key);
        if (rc > 0 && reduce_bucket(mb, order, first, count, &key, (size_t)bytes, have,
                                    grads, idents) < 0)
            rc = -1;
        /* (buckets ready back to back never reach a timed-out slice: look between them too) */
        if (rc > 0 && PyErr_CheckSignals() < 0)
            rc = -1;
    }
    PyMem_Free(have);
    PyMem_Free(grads);
    PyMem_Free(idents);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

int axc_py_mb_shares_depth(int layer, int scheduled, int depth_size)
{
    return depth_size > 1 && layer >= 0 && !scheduled && axc_microbatch_thread() && call();
}

PyObject *axc_py_mb_gather(int layer, int bwd, PyObject *w, Py_ssize_t numel)
{
    axc_mb *mb = call();
    if (!mb) {
        PyErr_SetString(PyExc_RuntimeError, "a shared depth all-gather without a run_concurrent "
                                            "call");
        return NULL;
    }
    /* (a per-call cast, autocast's, can never match on the next call: not kept alive) */
    PyObject *leaf = PyObject_GetAttrString(w, "is_leaf");
    int keep = leaf ? PyObject_IsTrue(leaf) : -1;
    Py_XDECREF(leaf);
    if (keep < 0)
        return NULL;
    int use;
    void *data, *owner;
    axc_status st = axc_mb_next_use(mb, layer, bwd ? AXC_PHASE_BWD : AXC_PHASE_FWD, &use);
    if (st == AXC_OK)
        st = axc_mb_gather(mb, layer, bwd, use, w, keep, (size_t)numel, &data, &owner);
    if (st != AXC_OK)
        return PyErr_Occurred() ? NULL : axc_py_raise(st);
    return (PyObject *)owner; /* (a new reference) */
}

PyObject *axc_py_mb_scatter_block(PyObject *w, Py_ssize_t numel)
{
    PyObject *leaf = PyObject_GetAttrString(w, "is_leaf");
    PyObject *req = leaf ? PyObject_GetAttrString(w, "requires_grad") : NULL;
    int own = req ? leaf == Py_True && req == Py_True : -1;
    Py_XDECREF(leaf);
    Py_XDECREF(req);
    if (own < 0)
        return NULL;
    /* (the reducer's parameters: it counts autograd's accumulations, which a shared
     * reduce-scatter bypasses) */
    if (!own || axc_mb_has_param(call(), id_of(w)))
        Py_RETURN_NONE;
    return PyObject_CallMethod(w, "new_empty", "((n))", numel);
}

/* microbatch_close(ok): after the threads joined: unused prefetches waited for, the order
 * learned when ok (raises the first failure then) */
static PyObject *py_close(PyObject *self, PyObject *arg)
{
    (void)self;
    int ok = PyObject_IsTrue(arg);
    if (ok < 0)
        return NULL;
    axc_mb *mb = call();
    axc_status st = mb ? axc_mb_close(mb, ok) : AXC_OK;
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

int axc_py_mb_scatter(int layer, PyObject *w, PyObject *block)
{
    axc_mb *mb = call();
    void *data, *wdata;
    size_t elems, welems;
    axc_dtype dt, wdt;
    int dev, wdev, use;
    if (!mb) {
        PyErr_SetString(PyExc_RuntimeError, "microbatch_scatter: no run_concurrent call");
        return -1;
    }
    if (axc_py_read_tensor(block, "block", &data, &elems, &dt, &dev) < 0 ||
        axc_py_read_tensor(w, "weight", &wdata, &welems, &wdt, &wdev) < 0)
        return -1;
    if (dt != wdt || dev != wdev) { /* (summed and reduce-scattered as the weight's dtype) */
        PyErr_Format(PyExc_ValueError, "microbatch_scatter: the dW block of layer %d is %s on "
                     "device %d, expected the weight's %s on device %d (-1: CPU)", layer,
                     axc_dtype_name(dt), dev, axc_dtype_name(wdt), wdev);
        return -1;
    }
    axc_status st = axc_mb_next_use(mb, layer, AXC_MB_PHASE_SCATTER, &use);
    if (st == AXC_OK)
        st = axc_mb_scatter(mb, layer, use, w, block, data, elems);
    if (st != AXC_OK) {
        if (!PyErr_Occurred())
            axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* microbatch_scatter(layer, w, block): axc_py_mb_scatter */
static PyObject *py_scatter(PyObject *self, PyObject *args)
{
    (void)self;
    int layer;
    PyObject *w, *block;
    if (!PyArg_ParseTuple(args, "iOO", &layer, &w, &block) ||
        axc_py_mb_scatter(layer, w, block) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* microbatch_apply_scatters(): after microbatch_close(True): each completed shared dW
 * reduce-scatter's shard into its weight's .grad (w.grad = shard.view_as(w), or added to the
 * .grad there), in issue order (the caller turns grad mode off) */
static PyObject *py_apply_scatters(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    static PyObject *s_grad;
    if (!s_grad && !(s_grad = PyUnicode_InternFromString("grad")))
        return NULL;
    axc_mb *mb = call();
    for (int i = 0; mb && i < axc_mb_scatters(mb); i++) {
        void *w, *out;
        if (!axc_mb_scatter_result(mb, i, &w, &out))
            continue;
        axc_runtime_grad_arrived(axc_py_runtime(), -1);
        /* (a synced .grad first becomes this rank's share: this is a gradient arriving) */
        PyObject *v = axc_py_grad_unsync((PyObject *)w) < 0
                          ? NULL
                          : PyObject_CallMethod((PyObject *)out, "view_as", "O", (PyObject *)w);
        PyObject *g = v ? PyObject_GetAttr((PyObject *)w, s_grad) : NULL;
        int rc = -1;
        if (g == Py_None) {
            rc = PyObject_SetAttr((PyObject *)w, s_grad, v);
        } else if (g) {
            PyObject *r = PyObject_CallMethod(g, "add_", "O", v);
            rc = r ? 0 : -1;
            Py_XDECREF(r);
        }
        Py_XDECREF(g);
        Py_XDECREF(v);
        if (rc < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* microbatch_stats() -> the last call's {"gathers", "prefetched", "reduce_scatters",
 * "peak_blocks"} */
static PyObject *py_stats(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_mb_stats st;
    axc_mb_memory_stats(axc_runtime_mb_memory(axc_py_runtime()), &st);
    return Py_BuildValue("{sLsLsLsL}", "gathers", st.gathers, "prefetched", st.prefetched,
                         "reduce_scatters", st.reduce_scatters, "peak_blocks", st.peak_blocks);
}

/* microbatch_learned() -> the learned order's weights (None: a per-call tensor, not kept) */
static PyObject *py_learned(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    const axc_mb_memory *m = axc_runtime_mb_memory(axc_py_runtime());
    int n = axc_mb_memory_learned(m);
    PyObject *l = PyList_New(n);
    for (int i = 0; l && i < n; i++) {
        PyObject *w = axc_mb_memory_learned_weight(m, i);
        w = w ? w : Py_None;
        Py_INCREF(w);
        PyList_SET_ITEM(l, i, w);
    }
    return l;
}

PyMethodDef axc_py_microbatch_methods[] = {
    {"microbatch_close", py_close, METH_O, "microbatch_close(ok)"},
    {"microbatch_scatter", py_scatter, METH_VARARGS, "microbatch_scatter(layer, w, block)"},
    {"microbatch_apply_scatters", py_apply_scatters, METH_NOARGS,
     "microbatch_apply_scatters(): the shared dW reduce-scatters' shards into .grad"},
    {"microbatch_stats", py_stats, METH_NOARGS, "microbatch_stats() -> dict"},
    {"microbatch_learned", py_learned, METH_NOARGS, "microbatch_learned() -> list"},
    {"microbatch_begin", py_begin, METH_VARARGS,
     "microbatch_begin(owner, n, params, replicated, bucket_bytes, scatter_bound) -> the "
     "reducer's order: owner's run_concurrent call starts"},
    {"microbatch_end", py_end, METH_O,
     "microbatch_end(owner) -> bool: owner's run_concurrent call ended (False: not open)"},
    {"microbatch_running", py_running, METH_NOARGS,
     "microbatch_running() -> bool: a run_concurrent call is open"},
    {"microbatch_arrive", py_arrive, METH_O, "microbatch_arrive(p): p's gradient arrived"},
    {"microbatch_thread_done", py_thread_done, METH_O, "microbatch_thread_done(failed)"},
    {"microbatch_reduce_all", py_reduce_all, METH_VARARGS,
     "microbatch_reduce_all(order, bucket_bytes): the reducer: sums each bucket as it comes due"},
    {NULL, NULL, 0, NULL}};
