/* Bindings of the sharded linear layer: parse ints (pointers, shapes, flags), hand off to
 * csrc/layers/linear.c with the GIL released. Tensor-level checks happen in axonn_c/linear.py,
 * which allocates outputs and workspace with torch's allocator. */
#include <stdint.h>

#include "axc/layer_residuals.h"
#include "axc/linear.h"
#include "py_common.h"


/* The layer's own codecs: None (the communicator's policy) or (depth codec, depth block, row
 * codec, row block, col codec, col block[, depth error feedback]) as ints
 * (axonn_c/compression.py layer_codec_ints). */
static int parse_layer_codecs(PyObject *o, axc_linear_desc *d)
{
    d->own_codecs = 0;
    d->depth_error_feedback = 0;
    if (!o || o == Py_None)
        return 0;
    static const axc_group_kind groups[3] = {AXC_GROUP_DEPTH, AXC_GROUP_ROW, AXC_GROUP_COL};
    int v[6], ef = 0;
    if (!PyArg_ParseTuple(o, "iiiiii|p;a layer's codecs are 6 ints and a bool", &v[0], &v[1],
                          &v[2], &v[3], &v[4], &v[5], &ef))
        return -1;
    d->depth_error_feedback = ef;
    for (int i = 0; i < 3; i++) {
        axc_status st = axc_codec_check((axc_codec)v[2 * i], v[2 * i + 1], NULL);
        if (st != AXC_OK) {
            axc_py_raise(st);
            return -1;
        }
        d->codec[groups[i]] = (axc_codec)v[2 * i];
        d->block[groups[i]] = v[2 * i + 1];
    }
    d->own_codecs = 1;
    return 0;
}

/* desc tuple: (in_features, out_features, transpose, has_bias, layout, dtype name
 *              [, overlap_all_reduce, overlap_reduce_scatter, fwd_chunks, scheduled,
 *               defer_dw_gemm, codecs]) */
int axc_py_parse_linear_desc(PyObject *t, axc_linear_desc *d)
{
    long long in, out;
    int transpose, has_bias, layout, ov_ar = 0, ov_rs = 0, chunks = 1, scheduled = 0, dw = 0;
    const char *dtype;
    PyObject *codecs = NULL;
    if (!PyArg_ParseTuple(t, "LLppis|ppippO", &in, &out, &transpose, &has_bias, &layout, &dtype,
                          &ov_ar, &ov_rs, &chunks, &scheduled, &dw, &codecs) ||
        parse_layer_codecs(codecs, d) < 0)
        return -1;
    if (chunks < 0 || chunks > 64) {
        PyErr_Format(PyExc_ValueError, "fwd_chunks must be in [1, 64] (0: by size), got %d",
                     chunks);
        return -1;
    }
    d->scheduled = scheduled;
    d->defer_dw_gemm = dw;
    d->overlap_all_reduce = ov_ar;
    d->overlap_reduce_scatter = ov_rs;
    d->fwd_chunks = chunks;
    d->in_features = in;
    d->out_features = out;
    d->transpose = transpose;
    d->has_bias = has_bias;
    d->layout = layout ? AXC_LAYOUT_EXPERT : AXC_LAYOUT_EASY;
    axc_status st = axc_dtype_from_name(dtype, &d->dtype);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

axc_comm *axc_py_linear_comm(void)
{
    axc_comm *c = axc_py_comm();
    if (!c)
        PyErr_SetString(PyExc_RuntimeError,
                        "axonn_c is not initialised: call axonn_c.init(...) before using "
                        "axonn_c.Linear");
    return c;
}

/* linear_shapes(desc, rows) -> dict */
static PyObject *py_linear_shapes(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dt;
    long long rows;
    axc_linear_desc d;
    if (!PyArg_ParseTuple(args, "O!L", &PyTuple_Type, &dt, &rows) ||
        axc_py_parse_linear_desc(dt, &d) < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    axc_linear_shapes s;
    axc_status st = axc_linear_shapes_for(comm, &d, rows, &s);
    if (st != AXC_OK)
        return axc_py_raise(st);
    return Py_BuildValue("{s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "gin",
                         axc_group_name(s.gin), "gout", axc_group_name(s.gout), "gin_size",
                         s.gin_size, "gout_size", s.gout_size, "gin_rank", s.gin_rank,
                         "gout_rank", s.gout_rank, "depth_size", s.depth_size, "k_local",
                         (long long)s.k_local, "n_local", (long long)s.n_local, "block",
                         (long long)s.block, "shard", (long long)s.shard, "saved_rows",
                         (long long)s.saved_rows, "saved_cols", (long long)s.saved_cols,
                         "workspace_elems", (long long)s.workspace_elems);
}

static void *ptr(unsigned long long v) { return (void *)(uintptr_t)v; }

/* linear_plane_tokens(desc, t, device, stream) -> t_max over the gin x gout plane */
static PyObject *py_linear_plane_tokens(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dt;
    long long t;
    int device;
    unsigned long long stream;
    axc_linear_desc d;
    if (!PyArg_ParseTuple(args, "O!LiK", &PyTuple_Type, &dt, &t, &device, &stream) ||
        axc_py_parse_linear_desc(dt, &d) < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    int64_t t_max = 0;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st =
        axc_linear_plane_tokens(comm, &d, t, device, ptr(stream), &t_max);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    return PyLong_FromLongLong(t_max);
}

/* linear_dw_residual_elems(desc, device) -> the error-feedback residual dW's depth
 * reduce-scatter needs (0: none), axc_linear_dw_residual_elems */
static PyObject *py_linear_dw_residual_elems(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dt;
    int device;
    axc_linear_desc d;
    if (!PyArg_ParseTuple(args, "O!i", &PyTuple_Type, &dt, &device) ||
        axc_py_parse_linear_desc(dt, &d) < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    int64_t elems = 0;
    axc_status st = axc_linear_dw_residual_elems(comm, &d, device, &elems);
    if (st != AXC_OK)
        return axc_py_raise(st);
    return PyLong_FromLongLong(elems);
}

typedef axc_status (*linear_fn)(axc_comm *, const axc_linear_desc *, const axc_linear_io *);


/* The arguments both calls share: (desc, device, stream, rows, t_max, <pointers>, layer,
 * version, prefetch_ok[, defer, dw_prev]) */
typedef struct layer_args {
    PyObject *desc;
    int device, layer, prefetch_ok, defer, hold_result;
    int backward, trains_residual; /* backward: whether the call trains the depth residual */
    unsigned long long stream, dw_prev, w_full, dw_full, p[7];
    long long rows, t_max, version;
} layer_args;

/* Fills io from `a`, runs `fn` with the GIL released, raises on failure; returns the number of
 * the scheduler task that computes dW (0: none; axc_linear_io.task_number). */
static PyObject *run_layer(layer_args *a, axc_linear_io *io, linear_fn fn)
{
    axc_linear_desc d;
    if (axc_py_parse_linear_desc(a->desc, &d) < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    if ((d.scheduled || a->defer) && a->layer < 0) {
        PyErr_SetString(PyExc_ValueError, "a scheduled Linear call needs its layer id");
        return NULL;
    }
    if (a->dw_full && (a->defer || a->dw_prev)) {
        PyErr_SetString(PyExc_ValueError, "dw_full excludes defer and dw_prev");
        return NULL;
    }
    io->device = a->device;
    io->stream = ptr(a->stream);
    io->rows = a->rows;
    io->t_max = a->t_max;
    io->sched = axc_py_sched();
    io->layer = a->layer;
    io->w_version = a->version;
    io->prefetch_ok = a->prefetch_ok;
    io->defer = a->defer;
    io->dw_prev = ptr(a->dw_prev);
    io->w_full = ptr(a->w_full);
    io->dw_full = ptr(a->dw_full);
    io->hold_result = a->hold_result;
    uint64_t task = 0;
    io->task_number = &task;
    /* dW's depth reduce-scatter: the error-feedback residual the runtime keeps by layer id
     * (axc/layer_residuals.h), where C says the call needs one */
    axc_layer_residuals *res = axc_runtime_layer_residuals(axc_py_runtime());
    void *scratch = NULL;
    int64_t elems = 0;
    axc_status st = AXC_OK;
    if (a->backward && a->layer >= 0 && !a->dw_full)
        st = axc_linear_dw_residual_elems(comm, &d, a->device, &elems);
    if (st == AXC_OK && elems > 0)
        st = axc_layer_residuals_for_call(res, a->layer, a->device, (size_t)elems,
                                          a->trains_residual, a->defer, &io->dw_residual,
                                          &scratch);
    if (st != AXC_OK)
        return PyErr_Occurred() ? NULL : axc_py_raise(st); /* (an allocation's error is set) */
    Py_BEGIN_ALLOW_THREADS st = fn(comm, &d, io);
    Py_END_ALLOW_THREADS
    axc_layer_residuals_release(res, scratch); /* (NULL: none, or kept until the pass's end) */
    if (st != AXC_OK)
        return axc_py_raise(st);
    return PyLong_FromUnsignedLongLong(task);
}

/* linear_forward(desc, device, stream, rows, t_max, x, w, bias, y, saved, workspace
 *                [, layer, version, prefetch_ok, w_full, hold_result]) */
static PyObject *py_linear_forward(PyObject *self, PyObject *args)
{
    (void)self;
    layer_args a = {.layer = -1};
    unsigned long long *p = a.p;
    if (!PyArg_ParseTuple(args, "O!iKLLKKKKKK|iLpKp", &PyTuple_Type, &a.desc, &a.device,
                          &a.stream, &a.rows, &a.t_max, &p[0], &p[1], &p[2], &p[3], &p[4], &p[5],
                          &a.layer, &a.version, &a.prefetch_ok, &a.w_full, &a.hold_result))
        return NULL;
    axc_linear_io io = {0};
    io.x = ptr(p[0]);
    io.w = ptr(p[1]);
    io.bias = ptr(p[2]);
    io.y = ptr(p[3]);
    io.saved = ptr(p[4]);
    io.workspace = ptr(p[5]);
    return run_layer(&a, &io, axc_linear_forward);
}

/* linear_backward(desc, device, stream, rows, t_max, x_or_saved, w, dy, dx, dw, db, workspace
 *                 [, layer, version, prefetch_ok, defer, dw_prev, w_full, dw_full,
 *                  hold_result, trains_residual]): trains_residual (default true) false: the
 * call's dW reaches no .grad or runs on a micro-batch thread, its depth reduce-scatter takes
 * scratch zeros as its error-feedback residual, not the layer's */
static PyObject *py_linear_backward(PyObject *self, PyObject *args)
{
    (void)self;
    layer_args a = {.layer = -1, .backward = 1, .trains_residual = 1};
    unsigned long long *p = a.p;
    if (!PyArg_ParseTuple(args, "O!iKLLKKKKKKK|iLppKKKpp", &PyTuple_Type, &a.desc, &a.device,
                          &a.stream, &a.rows, &a.t_max, &p[0], &p[1], &p[2], &p[3], &p[4], &p[5],
                          &p[6], &a.layer, &a.version, &a.prefetch_ok, &a.defer, &a.dw_prev,
                          &a.w_full, &a.dw_full, &a.hold_result, &a.trains_residual))
        return NULL;
    axc_linear_io io = {0};
    io.x = ptr(p[0]); /* expert: the input; easy: the saved gathered input */
    io.saved = ptr(p[0]);
    io.w = ptr(p[1]);
    io.dy = ptr(p[2]);
    io.dx = ptr(p[3]);
    io.dw = ptr(p[4]);
    io.db = ptr(p[5]);
    io.workspace = ptr(p[6]);
    return run_layer(&a, &io, axc_linear_backward);
}

PyMethodDef axc_py_linear_methods[] = {
    {"linear_shapes", py_linear_shapes, METH_VARARGS, "Shapes of a sharded linear layer."},
    {"linear_plane_tokens", py_linear_plane_tokens, METH_VARARGS,
     "Largest token count over the gin x gout plane (easy layout)."},
    {"linear_dw_residual_elems", py_linear_dw_residual_elems, METH_VARARGS,
     "linear_dw_residual_elems(desc, device): the depth dW reduce-scatter's error-feedback "
     "residual length (0: none)."},
    {"linear_forward", py_linear_forward, METH_VARARGS, "Forward of the sharded layer."},
    {"linear_backward", py_linear_backward, METH_VARARGS, "Backward of the sharded layer."},
    {NULL, NULL, 0, NULL}};
