/* axonn_c._C.LinearCall: one axonn_c.Linear's C handle for the eager calls that need nothing of
 * the cross-layer machinery (no scheduler gather, no deferred gradient, no held result): the
 * layer description is parsed once when the handle is made, and each forward / backward is one
 * call that takes the tensors, allocates the outputs with torch (new_empty on the input) and
 * runs csrc/layers/linear.c with the GIL released. axonn_c/linear.py decides when a call may
 * take this path (Linear._plain_call) and keeps the handle per init() and knob setting. */
#include <stdint.h>

#include "axc/cuda_rt.h"
#include "axc/linear.h"
#include "axc/torch_shim.h"
#include "py_common.h"

/* py_linear.c: the description tuple's parser (this handle's is its 9-item prefix) and the
 * communicator or the "not initialised" error */
int axc_py_parse_linear_desc(PyObject *t, axc_linear_desc *d);
axc_comm *axc_py_linear_comm(void);

typedef struct {
    PyObject_HEAD axc_linear_desc d;
    /* the error a call on a CUDA stream being captured into a graph raises (the layer's knobs
     * ask for the cross-layer scheduler, whose decisions are made at run time); NULL: allowed */
    PyObject *refuse_capture;
} LinearCall;

static PyObject *s_shape, *s_data_ptr, *s_new_empty, *s_contiguous, *s_numel, *s_get_device;
static PyObject *g_empty_like; /* torch.empty_like: parses one argument, half new_empty's cost */

/* LinearCall((in, out, transpose, has_bias, layout, dtype, overlap_all_reduce,
 *             overlap_reduce_scatter, fwd_chunks)[, refuse_capture: str or None]) */
static int call_init(LinearCall *self, PyObject *args, PyObject *kwargs)
{
    PyObject *t, *refuse = Py_None;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "LinearCall takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!|O", &PyTuple_Type, &t, &refuse) ||
        axc_py_parse_linear_desc(t, &self->d) < 0)
        return -1;
    if (refuse != Py_None && !PyUnicode_Check(refuse)) {
        PyErr_SetString(PyExc_TypeError, "LinearCall: refuse_capture must be a str or None");
        return -1;
    }
    Py_XSETREF(self->refuse_capture, refuse == Py_None ? NULL : Py_NewRef(refuse));
    return 0;
}

static void call_dealloc(LinearCall *self)
{
    Py_XDECREF(self->refuse_capture);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* -1 with the handle's refusal raised when `stream` of `device` is being captured into a CUDA
 * graph and the handle refuses that */
static int check_capture(const LinearCall *self, int device, void *stream)
{
    if (device < 0 || !self->refuse_capture)
        return 0;
    const axc_cuda_api *api = NULL;
    int status = AXC_CUDA_CAPTURE_NONE;
    if (axc_cuda_load(&api) != AXC_OK || !api->StreamIsCapturing ||
        api->StreamIsCapturing(stream, &status) != AXC_CUDA_SUCCESS ||
        status == AXC_CUDA_CAPTURE_NONE)
        return 0; /* (a runtime that cannot tell: the GEMM's own capture check reports it) */
    PyErr_SetObject(PyExc_RuntimeError, self->refuse_capture);
    return -1;
}

/* The CUDA stream a call runs on: the one given, or for None torch's current stream of
 * `device`, read through torch's C shim (no Python call). */
static int stream_of(PyObject *arg, int device, void **stream)
{
    if (arg != Py_None || device < 0) {
        *stream = arg == Py_None ? NULL : PyLong_AsVoidPtr(arg);
        return PyErr_Occurred() ? -1 : 0;
    }
    axc_status st = axc_torch_cuda_current_stream(device, stream);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* The call's device and stream: explicit (device, stream) arguments, or when they are left out
 * the tensor's device and, on CUDA, torch's current stream (the common call: no Python helper
 * computes them per call). */
static int device_stream_of(PyObject *t, PyObject *const *given, int *device, void **stream)
{
    if (given) {
        *device = (int)PyLong_AsLong(given[0]);
        return PyErr_Occurred() ? -1 : stream_of(given[1], *device, stream);
    }
    PyObject *d = PyObject_CallMethodNoArgs(t, s_get_device);
    if (!d)
        return -1;
    *device = (int)PyLong_AsLong(d);
    Py_DECREF(d);
    return PyErr_Occurred() ? -1 : stream_of(Py_None, *device, stream);
}

/* torch.empty_like(t): a contiguous t's layout */
static PyObject *empty_like(PyObject *t)
{
    if (!g_empty_like) {
        PyObject *torch = PyImport_ImportModule("torch");
        if (!torch)
            return NULL;
        g_empty_like = PyObject_GetAttrString(torch, "empty_like");
        Py_DECREF(torch);
        if (!g_empty_like)
            return NULL;
    }
    return PyObject_CallOneArg(g_empty_like, t);
}

static void *ptr_of(PyObject *t, int *err)
{
    PyObject *v = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!v) {
        *err = 1;
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    if (PyErr_Occurred())
        *err = 1;
    return p;
}

static int64_t dim0(PyObject *t)
{
    PyObject *shape = PyObject_GetAttr(t, s_shape);
    if (!shape)
        return -1;
    PyObject *v = PySequence_GetItem(shape, 0);
    Py_DECREF(shape);
    if (!v)
        return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return n;
}

/* like.new_empty((a,)) or ((a, b)) */
static PyObject *new_empty(PyObject *like, int64_t a, int64_t b, int two)
{
    PyObject *shape = two ? Py_BuildValue("(LL)", (long long)a, (long long)b)
                          : Py_BuildValue("(L)", (long long)a);
    if (!shape)
        return NULL;
    PyObject *out = PyObject_CallMethodOneArg(like, s_new_empty, shape);
    Py_DECREF(shape);
    return out;
}

static int check_shard(const LinearCall *self, PyObject *w, const axc_linear_shapes *s)
{
    PyObject *v = PyObject_CallMethodNoArgs(w, s_numel);
    if (!v)
        return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (n != s->shard) {
        PyErr_Format(PyExc_RuntimeError,
                     "axonn_c.Linear(%lld, %lld): the weight shard has %lld elements, the "
                     "current grid needs %lld; build the layer after init(), or move its "
                     "weights with full_state_dict()",
                     (long long)self->d.in_features, (long long)self->d.out_features, n,
                     (long long)s->shard);
        return -1;
    }
    return 0;
}

/* forward(x, w, b[, device, stream]) -> (y, saved or None); x: [rows, features], contiguous;
 * device -1: CPU; stream None: torch's current stream of the device; both left out: x's device
 * and torch's current stream */
static PyObject *call_forward(LinearCall *self, PyObject *const *a, Py_ssize_t n)
{
    if (n != 3 && n != 5) {
        PyErr_SetString(PyExc_TypeError, "LinearCall.forward(x, w, b[, device, stream])");
        return NULL;
    }
    PyObject *x = a[0], *w = a[1], *b = a[2];
    int device = -1;
    void *stream = NULL;
    if (device_stream_of(x, n == 5 ? a + 3 : NULL, &device, &stream) < 0 ||
        check_capture(self, device, stream) < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    const axc_linear_desc *d = &self->d;
    int64_t rows = dim0(x), t_max = rows;
    if (rows < 0)
        return NULL;
    axc_status st = AXC_OK;
    if (d->layout == AXC_LAYOUT_EASY) {
        Py_BEGIN_ALLOW_THREADS st = axc_linear_plane_tokens(comm, d, rows, device, stream, &t_max);
        Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    }
    axc_linear_shapes s;
    if ((st = axc_linear_shapes_for(comm, d, t_max, &s)) != AXC_OK)
        return axc_py_raise(st);
    if (check_shard(self, w, &s) < 0)
        return NULL;
    int easy = d->layout == AXC_LAYOUT_EASY;
    PyObject *y = NULL, *saved = NULL, *ws = NULL, *out = NULL;
    /* (each allocation only after the previous one succeeded: no C API call with an exception
     * set) */
    if (!(y = new_empty(x, rows, easy ? d->out_features : s.n_local, 1)) ||
        !(saved = easy ? new_empty(x, s.saved_rows, s.saved_cols, 1)
                       : (Py_INCREF(Py_None), Py_None)) ||
        !(ws = s.workspace_elems ? new_empty(x, s.workspace_elems, 0, 0)
                                 : (Py_INCREF(Py_None), Py_None)))
        goto done;
    int err = 0;
    axc_linear_io io = {.device = device, .stream = stream, .rows = rows, .t_max = t_max,
                        .sched = axc_py_sched(), .layer = -1};
    io.x = ptr_of(x, &err);
    io.w = ptr_of(w, &err);
    io.bias = b == Py_None ? NULL : ptr_of(b, &err);
    io.y = ptr_of(y, &err);
    io.saved = saved == Py_None ? NULL : ptr_of(saved, &err);
    io.workspace = ws == Py_None ? NULL : ptr_of(ws, &err);
    if (err)
        goto done;
    Py_BEGIN_ALLOW_THREADS st = axc_linear_forward(comm, d, &io);
    Py_END_ALLOW_THREADS if (st != AXC_OK)
    {
        axc_py_raise(st);
        goto done;
    }
    out = PyTuple_Pack(2, y, saved);
done:
    Py_XDECREF(y);
    Py_XDECREF(saved);
    Py_XDECREF(ws);
    return out;
}

/* backward(dy, x, saved, w, need_dx[, device, stream]) -> (dx or None, dw, db or None) */
static PyObject *call_backward(LinearCall *self, PyObject *const *a, Py_ssize_t n)
{
    if (n != 5 && n != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "LinearCall.backward(dy, x, saved, w, need_dx[, device, stream])");
        return NULL;
    }
    PyObject *x = a[1], *saved = a[2], *w = a[3];
    int need_dx = PyObject_IsTrue(a[4]);
    int device = -1;
    void *stream = NULL;
    if (need_dx < 0 || device_stream_of(a[0], n == 7 ? a + 5 : NULL, &device, &stream) < 0 ||
        check_capture(self, device, stream) < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    const axc_linear_desc *d = &self->d;
    int easy = d->layout == AXC_LAYOUT_EASY;
    int64_t rows = dim0(x), t_max = rows;
    if (rows < 0)
        return NULL;
    axc_linear_shapes s;
    axc_status st = axc_linear_shapes_for(comm, d, rows, &s);
    if (st == AXC_OK && easy) { /* the plane's largest token count, as the forward used */
        int64_t saved_rows = dim0(saved);
        if (saved_rows < 0)
            return NULL;
        t_max = saved_rows / ((int64_t)s.gin_size * s.gout_size);
        st = axc_linear_shapes_for(comm, d, t_max, &s);
    }
    if (st != AXC_OK)
        return axc_py_raise(st);
    PyObject *dy = PyObject_CallMethodNoArgs(a[0], s_contiguous);
    PyObject *dx = NULL, *dw = NULL, *db = NULL, *ws = NULL, *out = NULL;
    if (!dy)
        return NULL;
    /* (x and w are contiguous: the forward and the shard check saw to it) */
    dx = need_dx ? empty_like(x) : (Py_INCREF(Py_None), Py_None);
    if (!dx || !(dw = empty_like(w)))
        goto done;
    if ( !(db = d->has_bias ? new_empty(dy, s.n_local, 0, 0) : (Py_INCREF(Py_None), Py_None)) ||
        !(ws = s.workspace_elems ? new_empty(dy, s.workspace_elems, 0, 0)
                                 : (Py_INCREF(Py_None), Py_None)))
        goto done;
    int err = 0;
    axc_linear_io io = {.device = device, .stream = stream, .rows = rows, .t_max = t_max,
                        .sched = axc_py_sched(), .layer = -1};
    io.x = io.saved = ptr_of(easy ? saved : x, &err);
    io.w = ptr_of(w, &err);
    io.dy = ptr_of(dy, &err);
    io.dx = dx == Py_None ? NULL : ptr_of(dx, &err);
    io.dw = ptr_of(dw, &err);
    io.db = db == Py_None ? NULL : ptr_of(db, &err);
    io.workspace = ws == Py_None ? NULL : ptr_of(ws, &err);
    uint64_t task = 0;
    io.task_number = &task;
    if (err)
        goto done;
    Py_BEGIN_ALLOW_THREADS st = axc_linear_backward(comm, d, &io);
    Py_END_ALLOW_THREADS if (st != AXC_OK)
    {
        axc_py_raise(st);
        goto done;
    }
    out = PyTuple_Pack(3, dx, dw, db);
done:
    Py_DECREF(dy);
    Py_XDECREF(dx);
    Py_XDECREF(dw);
    Py_XDECREF(db);
    Py_XDECREF(ws);
    return out;
}

/* torch_streams() -> whether forward/backward can read torch's current CUDA stream themselves
 * (stream None) */
static PyObject *call_torch_streams(PyObject *cls, PyObject *noargs)
{
    (void)cls;
    (void)noargs;
    const axc_torch_cuda_api *api = NULL;
    int ok = axc_torch_cuda_load(&api) == AXC_OK && api->get_current_stream;
    return PyBool_FromLong(ok);
}

static PyMethodDef call_methods[] = {
    {"torch_streams", call_torch_streams, METH_NOARGS | METH_STATIC,
     "Whether the calls can read torch's current CUDA stream themselves (stream None)."},
    {"forward", (PyCFunction)(void (*)(void))call_forward, METH_FASTCALL,
     "forward(x, w, b[, device, stream]) -> (y, saved or None)"},
    {"backward", (PyCFunction)(void (*)(void))call_backward, METH_FASTCALL,
     "backward(dy, x, saved, w, need_dx[, device, stream]) -> (dx, dw, db)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject LinearCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "axonn_c._C.LinearCall",
    .tp_basicsize = sizeof(LinearCall),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One axonn_c.Linear's description, parsed once, for its plain eager calls.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)call_init,
    .tp_dealloc = (destructor)call_dealloc,
    .tp_methods = call_methods,
};

int axc_py_linear_add_types(PyObject *module)
{
    if (!(s_shape = PyUnicode_InternFromString("shape")) ||
        !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
        !(s_new_empty = PyUnicode_InternFromString("new_empty")) ||
        !(s_contiguous = PyUnicode_InternFromString("contiguous")) ||
        !(s_numel = PyUnicode_InternFromString("numel")) ||
        !(s_get_device = PyUnicode_InternFromString("get_device")))
        return -1;
    if (PyType_Ready(&LinearCallType) < 0)
        return -1;
    Py_INCREF(&LinearCallType);
    if (PyModule_AddObject(module, "LinearCall", (PyObject *)&LinearCallType) < 0) {
        Py_DECREF(&LinearCallType);
        return -1;
    }
    return 0;
}
