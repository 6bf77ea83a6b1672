/* Bindings of the running run_concurrent call (axc/microbatch.h), held by the runtime:
 * microbatch_begin / _end, the reducer's arrivals, thread ends and bucket order. */
#include "py_common.h"

#include "axc/microbatch.h"
#include "axc/status.h"

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

/* microbatch_begin(n, params, bucket_bytes, scatter_bound): a run_concurrent call of n
 * micro-batches whose reducer sums `params` (a sequence of (parameter, groups) in the reducer's
 * order; empty: no reducer) in buckets of up to bucket_bytes, holding at most scatter_bound
 * summed dW blocks */
static PyObject *py_begin(PyObject *self, PyObject *args)
{
    (void)self;
    int n, bound;
    PyObject *params;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "iOni", &n, &params, &bytes, &bound))
        return NULL;
    if (bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "microbatch_begin: bucket_bytes=%zd, expected > 0", bytes);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(params, "microbatch_begin: params must be a sequence");
    if (!seq)
        return NULL;
    axc_mb *mb;
    axc_status st = axc_runtime_mb_begin(axc_py_runtime(), n, (size_t)bytes, &mb);
    if (st != AXC_OK) {
        Py_DECREF(seq);
        return axc_py_raise(st);
    }
    axc_mb_set_scatter_bound(mb, bound);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *pg = PySequence_Fast_GET_ITEM(seq, i), *p, *groups;
        if (!PyArg_ParseTuple(pg, "OO", &p, &groups))
            goto fail;
        axc_bucket_key key;
        if (axc_py_bucket_key(p, groups, &key) < 0)
            goto fail;
        PyObject *nb = PyObject_GetAttrString(p, "nbytes");
        Py_ssize_t nbytes = nb ? PyLong_AsSsize_t(nb) : -1;
        Py_XDECREF(nb);
        if (nbytes < 0)
            goto fail;
        st = axc_mb_add_param(mb, id_of(p), &key, (size_t)nbytes);
        if (st != AXC_OK) {
            axc_py_raise(st);
            goto fail;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    axc_runtime_mb_end(axc_py_runtime());
    return NULL;
}

/* microbatch_end(): the call is over (its threads joined); no-op when none runs */
static PyObject *py_end(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_runtime_mb_end(axc_py_runtime());
    Py_RETURN_NONE;
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

/* microbatch_reduces(p) -> whether the running call's reducer sums p */
static PyObject *py_reduces(PyObject *self, PyObject *p)
{
    (void)self;
    return PyBool_FromLong(axc_mb_has_param(call(), id_of(p)));
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

/* microbatch_next_bucket() -> (first, count) of the reducer's order, once that bucket is ready;
 * None: nothing more to sum (waits without the GIL, in slices: an interrupt (Ctrl-C) between
 * them raises here, and run_concurrent aborts the job's collectives) */
/* how long the reducer waits for a bucket between looks for an interrupt */
#define NEXT_BUCKET_SLICE_MS 50

static PyObject *py_next_bucket(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_mb *mb = call(); /* (ended only by the reducer's own thread, after this returns) */
    if (!mb) {
        PyErr_SetString(PyExc_RuntimeError, "microbatch_next_bucket: no run_concurrent call");
        return NULL;
    }
    int first = 0, count = 0, got;
    axc_bucket_key key;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS got = axc_mb_next_bucket(mb, NEXT_BUCKET_SLICE_MS, &first, &count,
                                                        &key);
        Py_END_ALLOW_THREADS
        if (got >= 0)
            break;
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
    if (!got)
        Py_RETURN_NONE;
    return Py_BuildValue("(ii)", first, count);
}

/* microbatch_gather(layer, phase, use, w, keep, numel) -> w's depth shard gathered ([numel]),
 * shared by the micro-batches (axc_mb_gather) */
static PyObject *py_gather(PyObject *self, PyObject *args)
{
    (void)self;
    int layer, phase, use, keep;
    PyObject *w;
    Py_ssize_t numel;
    if (!PyArg_ParseTuple(args, "iiiOpn", &layer, &phase, &use, &w, &keep, &numel))
        return NULL;
    axc_mb *mb = call();
    if (!mb || numel < 0) {
        PyErr_Format(PyExc_RuntimeError, "microbatch_gather: %s", mb ? "numel < 0" :
                     "no run_concurrent call");
        return NULL;
    }
    void *data, *owner;
    axc_status st = axc_mb_gather(mb, layer, phase, use, w, keep, (size_t)numel, &data, &owner);
    if (st != AXC_OK)
        return PyErr_Occurred() ? NULL : axc_py_raise(st);
    return (PyObject *)owner; /* (a new reference) */
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

/* microbatch_scatter(layer, use, w, block): a micro-batch's unreduced dW block of w, reduce-
 * scattered once all n handed theirs in (axc_mb_scatter) */
static PyObject *py_scatter(PyObject *self, PyObject *args)
{
    (void)self;
    int layer, use;
    PyObject *w, *block;
    if (!PyArg_ParseTuple(args, "iiOO", &layer, &use, &w, &block))
        return NULL;
    axc_mb *mb = call();
    void *data;
    size_t elems;
    axc_dtype dt;
    int dev;
    if (!mb) {
        PyErr_SetString(PyExc_RuntimeError, "microbatch_scatter: no run_concurrent call");
        return NULL;
    }
    if (axc_py_read_tensor(block, "block", &data, &elems, &dt, &dev) < 0)
        return NULL;
    void *wdata;
    size_t welems;
    axc_dtype wdt;
    int wdev;
    if (axc_py_read_tensor(w, "weight", &wdata, &welems, &wdt, &wdev) < 0)
        return NULL;
    if (dt != wdt || dev != wdev) { /* (summed and reduce-scattered as the weight's dtype) */
        PyErr_Format(PyExc_ValueError, "microbatch_scatter: the dW block of layer %d is %s on "
                     "device %d, expected the weight's %s on device %d (-1: CPU)", layer,
                     axc_dtype_name(dt), dev, axc_dtype_name(wdt), wdev);
        return NULL;
    }
    axc_status st = axc_mb_scatter(mb, layer, use, w, block, data, elems);
    if (st != AXC_OK)
        return PyErr_Occurred() ? NULL : axc_py_raise(st);
    Py_RETURN_NONE;
}

/* microbatch_scatters() -> [(w, reduced shard)] of the call's reduce-scatters that completed
 * (after microbatch_close) */
static PyObject *py_scatters(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_mb *mb = call();
    PyObject *l = PyList_New(0);
    for (int i = 0; l && mb && i < axc_mb_scatters(mb); i++) {
        void *w, *out;
        if (!axc_mb_scatter_result(mb, i, &w, &out))
            continue;
        PyObject *t = Py_BuildValue("(OO)", (PyObject *)w, (PyObject *)out);
        if (!t || PyList_Append(l, t) < 0)
            Py_CLEAR(l);
        Py_XDECREF(t);
    }
    return l;
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
    {"microbatch_gather", py_gather, METH_VARARGS,
     "microbatch_gather(layer, phase, use, w, keep, numel) -> Tensor"},
    {"microbatch_close", py_close, METH_O, "microbatch_close(ok)"},
    {"microbatch_scatter", py_scatter, METH_VARARGS, "microbatch_scatter(layer, use, w, block)"},
    {"microbatch_scatters", py_scatters, METH_NOARGS, "microbatch_scatters() -> list"},
    {"microbatch_stats", py_stats, METH_NOARGS, "microbatch_stats() -> dict"},
    {"microbatch_learned", py_learned, METH_NOARGS, "microbatch_learned() -> list"},
    {"microbatch_begin", py_begin, METH_VARARGS,
     "microbatch_begin(n, params, bucket_bytes): a run_concurrent call starts"},
    {"microbatch_end", py_end, METH_NOARGS, "microbatch_end(): the run_concurrent call ended"},
    {"microbatch_running", py_running, METH_NOARGS,
     "microbatch_running() -> bool: a run_concurrent call is open"},
    {"microbatch_arrive", py_arrive, METH_O, "microbatch_arrive(p): p's gradient arrived"},
    {"microbatch_reduces", py_reduces, METH_O, "microbatch_reduces(p) -> bool"},
    {"microbatch_thread_done", py_thread_done, METH_O, "microbatch_thread_done(failed)"},
    {"microbatch_next_bucket", py_next_bucket, METH_NOARGS,
     "microbatch_next_bucket() -> (first, count) or None"},
    {NULL, NULL, 0, NULL}};
