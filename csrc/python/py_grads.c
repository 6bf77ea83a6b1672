/* Bindings of the gradient buckets (csrc/grads/buckets.c) and keep-alive lists
 * (csrc/grads/keeps.c), both held by the runtime (csrc/runtime/runtime.c). This file gives the
 * runtime its ops: the buffers come from torch (like.new_empty, so CUDA ones from torch's
 * caching allocator on the current stream), the owners are Python references; the runtime
 * starts the due sums itself (axc_runtime_start_due_sums). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "axc/buckets.h"
#include "axc/keeps.h"
#include "axc/sched.h"
#include "axc/torch_shim.h"
#include "py_common.h"

static PyObject *s_new_empty, *s_data_ptr, *s_get_device, *s_dtype;

/* `like`: the tensor the take that needs the bucket passed (axc_py_bucket_take) */
static axc_status alloc_like(void *ctx, const axc_bucket_key *key, size_t elems, void *like,
                             void **data, void **owner)
{
    (void)ctx;
    (void)key;
    PyObject *shape = Py_BuildValue("(n)", (Py_ssize_t)elems);
    PyObject *flat = shape ? PyObject_CallMethodOneArg((PyObject *)like, s_new_empty, shape)
                           : NULL;
    Py_XDECREF(shape);
    PyObject *ptr = flat ? PyObject_CallMethodNoArgs(flat, s_data_ptr) : NULL;
    void *p = ptr ? PyLong_AsVoidPtr(ptr) : NULL;
    Py_XDECREF(ptr);
    if (PyErr_Occurred()) {
        Py_XDECREF(flat);
        return axc_fail(AXC_ERR_NOMEM, "a gradient bucket of %zu elements could not be made "
                                       "(the Python error is set)", elems);
    }
    *data = p;
    *owner = flat;
    return AXC_OK;
}

/* float32 zeros on `device` (torch.zeros: CUDA ones from torch's caching allocator on the
 * current stream), the linear layers' depth dW residuals */
static PyObject *zeros_on(int device, size_t elems)
{
    char dev[32];
    if (device < 0)
        snprintf(dev, sizeof dev, "cpu");
    else
        snprintf(dev, sizeof dev, "cuda:%d", device);
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *zeros = torch ? PyObject_GetAttrString(torch, "zeros") : NULL;
    PyObject *f32 = zeros ? PyObject_GetAttrString(torch, "float32") : NULL;
    PyObject *args = f32 ? Py_BuildValue("((n))", (Py_ssize_t)elems) : NULL;
    PyObject *kw = args ? Py_BuildValue("{s:O,s:s}", "dtype", f32, "device", dev) : NULL;
    PyObject *r = kw ? PyObject_Call(zeros, args, kw) : NULL;
    Py_XDECREF(kw);
    Py_XDECREF(args);
    Py_XDECREF(f32);
    Py_XDECREF(zeros);
    Py_XDECREF(torch);
    return r;
}

/* float32 zeros like the bucket (only float32 buckets are compressed), or on `device` without
 * one */
static axc_status alloc_residual(void *ctx, void *bucket_owner, int device, size_t elems,
                                 void **data, void **owner)
{
    (void)ctx;
    PyObject *r = !bucket_owner ? zeros_on(device, elems)
                                : PyObject_CallMethod((PyObject *)bucket_owner, "new_zeros",
                                                      "((n))", (Py_ssize_t)elems);
    PyObject *ptr = r ? PyObject_CallMethodNoArgs(r, s_data_ptr) : NULL;
    void *p = ptr ? PyLong_AsVoidPtr(ptr) : NULL;
    Py_XDECREF(ptr);
    if (PyErr_Occurred()) {
        Py_XDECREF(r);
        return axc_fail(AXC_ERR_NOMEM, "an error-feedback residual of %zu elements could not be "
                                       "made (the Python error is set)", elems);
    }
    *data = p;
    *owner = r;
    return AXC_OK;
}

static void release_owner(void *ctx, void *owner)
{
    (void)ctx;
    Py_XDECREF((PyObject *)owner);
}

static axc_buckets *buckets(void) { return axc_runtime_buckets(axc_py_runtime()); }

static void *gil_release(void *ctx)
{
    (void)ctx;
    return PyEval_SaveThread();
}

static void gil_acquire(void *ctx, void *state)
{
    (void)ctx;
    PyEval_RestoreThread((PyThreadState *)state);
}

void axc_py_grads_runtime_ops(axc_runtime_ops *ops)
{
    memset(ops, 0, sizeof *ops);
    ops->buckets = (axc_bucket_ops){alloc_like, release_owner, alloc_residual, NULL};
    ops->release_kept = release_owner;
    ops->hooks = (axc_runtime_hooks){gil_release, gil_acquire, NULL};
    ops->bucket_bytes = 4u << 20;
    axc_py_microbatch_ops(&ops->microbatch);
}

/* Starts every sum that came due, in the engine's order; -1 with the exception set. */
static int start_due(void)
{
    axc_buckets *b = buckets();
    axc_bucket_stats before = {0}, after = {0};
    if (b)
        axc_buckets_stats(b, &before);
    axc_status st = axc_runtime_start_due_sums(axc_py_runtime());
    if (st != AXC_OK) {
        if (!PyErr_Occurred()) /* (an allocation's Python error is already set) */
            axc_py_raise(st);
        return -1;
    }
    if (b)
        axc_buckets_stats(b, &after);
    if (after.ef_cutoffs > before.ef_cutoffs && !PyErr_Occurred())
        return PyErr_WarnFormat(
            PyExc_RuntimeWarning, 1,
            "axonn_c: %d backward passes summed compressed gradients without a call to "
            "sync_gradients, which ends a training step: each pass kept its own error-feedback "
            "residuals (one more set of the gradients' size per pass), and later passes get "
            "none. Call axonn_c.sync_gradients(model) once per step (with init(overlap=True) it "
            "only scales), or accumulate inside axonn_c.no_sync()", AXC_BUCKET_MAX_EF_PASSES);
    return 0;
}

int axc_py_bucket_kind(PyObject *like, axc_bucket_key *key)
{
    PyObject *dt = PyObject_GetAttr(like, s_dtype);
    PyObject *dts = dt ? PyObject_Str(dt) : NULL;
    Py_XDECREF(dt);
    const char *name = dts ? PyUnicode_AsUTF8(dts) : NULL;
    if (!name) {
        Py_XDECREF(dts);
        return -1;
    }
    axc_status st = axc_dtype_from_name(strncmp(name, "torch.", 6) ? name : name + 6, &key->dtype);
    Py_DECREF(dts);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    PyObject *dev = PyObject_CallMethodNoArgs(like, s_get_device);
    key->device = dev ? (int)PyLong_AsLong(dev) : -1;
    Py_XDECREF(dev);
    return PyErr_Occurred() ? -1 : 0;
}

int axc_py_bucket_key(PyObject *like, PyObject *groups, axc_bucket_key *key)
{
    if (axc_py_bucket_kind(like, key) < 0)
        return -1;
    if (!PyTuple_Check(groups) || PyTuple_GET_SIZE(groups) < 1 ||
        PyTuple_GET_SIZE(groups) > AXC_BUCKET_MAX_GROUPS) {
        PyErr_Format(PyExc_ValueError, "groups must be a tuple of 1 to %d group names, got %R",
                     AXC_BUCKET_MAX_GROUPS, groups);
        return -1;
    }
    key->ngroups = (int)PyTuple_GET_SIZE(groups);
    for (int i = 0; i < key->ngroups; i++) {
        const char *g = PyUnicode_AsUTF8(PyTuple_GET_ITEM(groups, i));
        if (!g)
            return -1;
        axc_status st = axc_group_from_name(g, &key->groups[i]);
        if (st != AXC_OK) {
            axc_py_raise(st);
            return -1;
        }
    }
    return 0;
}

PyObject *axc_py_bucket_take(PyObject *like, const axc_bucket_key *key, size_t n, size_t want,
                             size_t bytes, uint64_t tag, uint64_t ident, int *bucket,
                             size_t *offset)
{
    axc_buckets *b = buckets();
    if (!b)
        return NULL;
    (void)axc_buckets_set_bytes(b, bytes);
    void *owner;
    axc_status st = axc_buckets_take_shared(b, key, n, want, like, tag, ident, bucket, offset,
                                            &owner);
    if (st != AXC_OK)
        return PyErr_Occurred() ? NULL : axc_py_raise(st);
    /* (the engine's reference may go while start_due releases the GIL: hold one here) */
    PyObject *flat = (PyObject *)owner;
    Py_INCREF(flat);
    if (start_due() < 0) /* (a bucket without room retired) */
        Py_CLEAR(flat);
    return flat;
}

PyObject *axc_py_bucket_piece(PyObject *like, const axc_bucket_key *key, size_t n, size_t bytes,
                              uint64_t ident, int *bucket)
{
    size_t off;
    /* (the parameter object: the same in every step of this process) */
    PyObject *flat = axc_py_bucket_take(like, key, n, 0, bytes, (uint64_t)(uintptr_t)like,
                                        ident, bucket, &off);
    PyObject *piece = flat ? PyObject_CallMethod(flat, "narrow", "inn", 0, (Py_ssize_t)off,
                                                 (Py_ssize_t)n)
                           : NULL;
    Py_XDECREF(flat);
    return piece;
}

/* grad_bucket_take(like, n, groups, bucket_bytes) -> (piece, bucket): n elements of the open
 * bucket of like's dtype and device summed over `groups` (a tuple of names, in order) */
static PyObject *py_take(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *like, *groups;
    Py_ssize_t n, bytes;
    if (!PyArg_ParseTuple(args, "OnOn", &like, &n, &groups, &bytes))
        return NULL;
    axc_bucket_key key;
    if (n < 0 || bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "grad_bucket_take: n=%zd and bucket_bytes=%zd, expected "
                                       "n >= 0 and bucket_bytes > 0", n, bytes);
        return NULL;
    }
    if (!buckets() || axc_py_bucket_key(like, groups, &key) < 0)
        return NULL;
    int id;
    PyObject *piece = axc_py_bucket_piece(like, &key, (size_t)n, (size_t)bytes, 0, &id);
    return piece ? Py_BuildValue("(Ni)", piece, id) : NULL;
}

int axc_py_bucket_apply(int id, bucket_fn fn)
{
    axc_buckets *b = buckets();
    if (!b)
        return -1;
    axc_status st = fn(b, id);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return start_due();
}

static PyObject *bucket_op(PyObject *arg, bucket_fn fn)
{
    int id = (int)PyLong_AsLong(arg);
    if (PyErr_Occurred() || axc_py_bucket_apply(id, fn) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* grad_bucket_written(bucket): its pieces are written (a full bucket starts its sums) */
static PyObject *py_written(PyObject *self, PyObject *arg)
{
    (void)self;
    return bucket_op(arg, axc_buckets_written);
}

/* grad_bucket_hold(bucket) / grad_bucket_unhold(bucket): a chunk record accumulating into it */
static PyObject *py_hold(PyObject *self, PyObject *arg)
{
    (void)self;
    return bucket_op(arg, axc_buckets_hold);
}

static PyObject *py_unhold(PyObject *self, PyObject *arg)
{
    (void)self;
    return bucket_op(arg, axc_buckets_unhold);
}

static PyObject *py_finish(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return axc_py_grad_buckets_finish();
}

/* grad_buckets_finish(): every bucket starts its sums, everything deferred completes
 * (sched_finish), and the buffers are let go (the pieces handed out keep theirs alive). On an
 * error the work already started still completes before the buffers go. */
PyObject *axc_py_grad_buckets_finish(void)
{
    axc_sched *s = axc_py_sched();
    if (!s) {
        axc_buckets_reset(buckets());
        PyErr_SetString(PyExc_RuntimeError,
                        "axonn_c is not initialised: call axonn_c.init(...) first");
        return NULL;
    }
    int failed = 0;
    if (buckets()) {
        axc_buckets_close_all(buckets());
        failed = start_due() < 0;
    }
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_sched_finish(s);
    Py_END_ALLOW_THREADS
    axc_buckets_reset(buckets());
    if (failed)
        return NULL; /* (the first error: the start's) */
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* grad_buckets_drop(): forgets the pass's buckets without starting their sums (an abandoned
 * pass, after sched_finish; or init/finalize) */
static PyObject *py_drop(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_buckets_reset(buckets());
    Py_RETURN_NONE;
}

/* grad_buckets_open() -> buckets still taking gradients or waiting for holds */
static PyObject *py_open(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(axc_buckets_open(buckets()));
}

/* grad_buckets_stats(reset) -> {"buckets", "buckets_early", "buckets_after_holds",
 * "buckets_at_end"} */
static PyObject *py_stats(PyObject *self, PyObject *args)
{
    (void)self;
    int reset = 0;
    if (!PyArg_ParseTuple(args, "|p", &reset))
        return NULL;
    axc_bucket_stats st = {0};
    if (buckets()) {
        axc_buckets_stats(buckets(), &st);
        if (reset)
            axc_buckets_zero_stats(buckets());
    }
    return Py_BuildValue("{sLsLsLsLsL}", "buckets", st.made, "buckets_early", st.early,
                         "buckets_after_holds", st.after_holds, "buckets_at_end", st.at_end,
                         "ef_cutoffs", st.ef_cutoffs);
}

/* grad_buckets_set_codec(group, codec, block, error_feedback): how later sums over `group`
 * are compressed ("none": exact) */
static PyObject *py_set_codec(PyObject *self, PyObject *args)
{
    (void)self;
    const char *group, *codec;
    int block, ef;
    if (!PyArg_ParseTuple(args, "ssip", &group, &codec, &block, &ef))
        return NULL;
    axc_group_kind kind;
    axc_bucket_codec c = {.block = block, .error_feedback = ef};
    axc_buckets *b = buckets();
    if (!b)
        return NULL;
    axc_status st = axc_group_from_name(group, &kind);
    if (st == AXC_OK)
        st = axc_codec_from_name(codec, &c.codec);
    if (st == AXC_OK)
        st = axc_buckets_set_codec(b, kind, &c);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* grad_buckets_residuals() -> {slot: tensor}: the error-feedback residuals (live buffers) */
static PyObject *py_residuals(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    PyObject *d = PyDict_New();
    int n = axc_buckets_residual_count(buckets());
    for (int i = 0; d && i < n; i++) {
        void *owner;
        size_t elems;
        long long key;
        axc_buckets_residual(buckets(), i, &key, &owner, &elems);
        if (!owner)
            continue;
        PyObject *k = PyLong_FromLongLong(key);
        if (!k || PyDict_SetItem(d, k, (PyObject *)owner) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
    }
    return d;
}

/* grad_buckets_set_residual(slot, tensor): adopts a contiguous float32 tensor as slot's
 * residual (the engine keeps a reference and updates it in place) */
static PyObject *py_set_residual(PyObject *self, PyObject *args)
{
    (void)self;
    long long slot;
    PyObject *t;
    if (!PyArg_ParseTuple(args, "LO", &slot, &t))
        return NULL;
    void *ptr;
    size_t numel;
    axc_dtype dt;
    int device;
    axc_buckets *b = buckets();
    if (!b || axc_py_read_tensor(t, "residual", &ptr, &numel, &dt, &device) < 0)
        return NULL;
    if (dt != AXC_DT_F32) {
        PyErr_Format(PyExc_TypeError, "residual %lld has dtype %s, expected float32", slot,
                     axc_dtype_name(dt));
        return NULL;
    }
    Py_INCREF(t);
    axc_status st = axc_buckets_set_residual(b, slot, ptr, t, device, numel);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* grad_buckets_new_step(): the next pass is the first of a training step (residual keys) */
static PyObject *py_new_step(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_buckets_new_step(buckets());
    Py_RETURN_NONE;
}

/* grad_buckets_clear_residuals() */
static PyObject *py_clear_residuals(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_buckets_clear_residuals(buckets());
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- keep-alives */

static axc_keeps *keeps(void) { return axc_runtime_keeps(axc_py_runtime()); }

/* Releases what finished work kept (the scheduler's counters, read with the GIL released:
 * its lock may be held by a thread waiting for the GIL). */
void axc_py_keeps_release_done(void)
{
    axc_sched *s = axc_py_sched();
    if (!s)
        return;
    if (!axc_keeps_count(keeps(), AXC_KEEP_TASK) && !axc_keeps_count(keeps(), AXC_KEEP_RESULT) &&
        !axc_keeps_count(keeps(), AXC_KEEP_OUTPUT))
        return;
    axc_sched_stats t;
    Py_BEGIN_ALLOW_THREADS axc_sched_stats_get(s, &t);
    Py_END_ALLOW_THREADS
    axc_keeps_release_done(keeps(), t.tasks_run, t.results_done);
}

int axc_py_keep_alive(axc_keep_kind kind, uint64_t number, PyObject *obj)
{
    axc_keeps *k = keeps();
    if (!k)
        return -1;
    axc_py_keeps_release_done();
    axc_status st = axc_keeps_add(k, kind, number, Py_NewRef(obj)); /* (released on failure) */
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

static int parse_kind(PyObject *name, axc_keep_kind *kind)
{
    const char *n = PyUnicode_AsUTF8(name);
    if (!n)
        return -1;
    axc_status st = axc_keep_kind_from_name(n, kind);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* keep_alive(kind, number, obj): keeps obj until `number` of `kind` ("task": a deferred dW GEMM
 * task has run; "result" / "output": a held result was awaited) is done; first releases what
 * is done already */
static PyObject *py_keep_alive(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *name, *obj;
    unsigned long long number;
    axc_keep_kind kind;
    if (!PyArg_ParseTuple(args, "UKO", &name, &number, &obj) || parse_kind(name, &kind) < 0)
        return NULL;
    if (axc_py_keep_alive(kind, number, obj) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* keeps_release_done(): releases what the tasks that ran and the results awaited kept */
static PyObject *py_keeps_release_done(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_py_keeps_release_done();
    Py_RETURN_NONE;
}

/* keeps_count(kind) -> how many objects of that kind are kept */
static PyObject *py_keeps_count(PyObject *self, PyObject *name)
{
    (void)self;
    axc_keep_kind kind;
    if (parse_kind(name, &kind) < 0)
        return NULL;
    return PyLong_FromSize_t(axc_keeps_count(keeps(), kind));
}

/* keeps_clear(): releases everything kept (init, finalize: nothing is in flight) */
static PyObject *py_keeps_clear(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_keeps_clear(keeps());
    Py_RETURN_NONE;
}

static int intern_names(void)
{
    if (s_new_empty)
        return 0;
    return (s_new_empty = PyUnicode_InternFromString("new_empty")) &&
                   (s_data_ptr = PyUnicode_InternFromString("data_ptr")) &&
                   (s_get_device = PyUnicode_InternFromString("get_device")) &&
                   (s_dtype = PyUnicode_InternFromString("dtype"))
               ? 0
               : -1;
}

int axc_py_grads_add_types(PyObject *module)
{
    (void)module;
    return intern_names();
}

PyMethodDef axc_py_grads_methods[] = {
    {"grad_bucket_take", py_take, METH_VARARGS,
     "grad_bucket_take(like, n, groups, bucket_bytes) -> (piece, bucket)"},
    {"grad_bucket_written", py_written, METH_O, "grad_bucket_written(bucket)"},
    {"grad_bucket_hold", py_hold, METH_O, "grad_bucket_hold(bucket)"},
    {"grad_bucket_unhold", py_unhold, METH_O, "grad_bucket_unhold(bucket)"},
    {"grad_buckets_finish", py_finish, METH_NOARGS,
     "grad_buckets_finish(): start every bucket's sums, wait for all deferred work"},
    {"grad_buckets_drop", py_drop, METH_NOARGS, "grad_buckets_drop(): forget the pass's buckets"},
    {"grad_buckets_open", py_open, METH_NOARGS, "grad_buckets_open() -> int"},
    {"grad_buckets_stats", py_stats, METH_VARARGS, "grad_buckets_stats(reset=False) -> dict"},
    {"grad_buckets_set_codec", py_set_codec, METH_VARARGS,
     "grad_buckets_set_codec(group, codec, block, error_feedback)"},
    {"grad_buckets_residuals", py_residuals, METH_NOARGS, "grad_buckets_residuals() -> dict"},
    {"grad_buckets_set_residual", py_set_residual, METH_VARARGS,
     "grad_buckets_set_residual(slot, tensor)"},
    {"grad_buckets_new_step", py_new_step, METH_NOARGS, "grad_buckets_new_step()"},
    {"grad_buckets_clear_residuals", py_clear_residuals, METH_NOARGS,
     "grad_buckets_clear_residuals()"},
    {"keep_alive", py_keep_alive, METH_VARARGS, "keep_alive(kind, number, obj)"},
    {"keeps_release_done", py_keeps_release_done, METH_NOARGS, "keeps_release_done()"},
    {"keeps_count", py_keeps_count, METH_O, "keeps_count(kind) -> int"},
    {"keeps_clear", py_keeps_clear, METH_NOARGS, "keeps_clear()"},
    {NULL, NULL, 0, NULL}};
