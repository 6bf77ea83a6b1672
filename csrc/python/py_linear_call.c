/* axonn_c._C.LinearCall: one axonn_c.Linear's C handle, made once per init(), knob setting,
 * dtype, bias use and codecs (axonn_c/linear.py Linear._handle): the layer description, its
 * shapes, its scheduler id and what its calls need (csrc/layers/linear.c decides: whether a
 * call is self-contained, whether a backward defers dW). Each forward / backward is one call
 * that takes the tensors and the per-call facts, allocates the outputs with torch (new_empty on
 * the input) and runs csrc/layers/linear.c with the GIL released. */
#include <stdint.h>
#include <string.h>

#include "axc/bench_skip.h"
#include "axc/cuda_rt.h"
#include "axc/env.h"
#include "axc/layer_residuals.h"
#include "axc/linear.h"
#include "axc/sched.h"
#include "axc/torch_shim.h"
#include "py_common.h"
#include "structmember.h"

/* py_linear.c: the description's parser, the communicator or the "not initialised" error, the
 * shapes as a dict */
int axc_py_parse_linear_desc(PyObject *cfg, const char *dtype, axc_linear_desc *d);
axc_comm *axc_py_linear_comm(void);
PyObject *axc_py_linear_shapes(axc_comm *comm, const axc_linear_desc *d, int64_t rows);

typedef struct {
    PyObject_HEAD axc_linear_desc d;
    int layer;          /* the scheduler id (-1: none; set by the layer before a call needs it) */
    char self_contained; /* axc_linear_self_contained, decided when the handle is made */
    char scheduled, overlap_data; /* (char: read by T_BOOL members) */
    char keeps_dw_residual; /* its depth dW reduce-scatter keeps an error-feedback residual */
    PyObject *cfg;    /* the ints the handle was made from (torch.compile's custom ops) */
    PyObject *shapes; /* the row-independent shapes (shard, groups, blocks) as a dict */
    /* the error a call on a CUDA stream being captured into a graph raises (the layer's knobs
     * ask for the cross-layer scheduler, whose decisions are made at run time); NULL: allowed */
    PyObject *refuse_capture;
} LinearCall;

static PyObject *s_shape, *s_data_ptr, *s_new_empty, *s_contiguous, *s_numel, *s_get_device,
    *s_version, *s_detach;
static PyObject *g_empty_like; /* torch.empty_like: parses one argument, half new_empty's cost */

/* LinearCall(cfg, dtype[, device[, refuse_capture: str or None]]): cfg as
 * axc_py_parse_linear_desc reads it; dtype torch's name ("float32"); device the weights' (-1:
 * host: whether a residual is kept depends on the transport of the device) */
static int call_init(LinearCall *self, PyObject *args, PyObject *kwargs)
{
    PyObject *cfg, *refuse = Py_None;
    const char *dtype;
    int device = -1;
    axc_linear_desc d; /* (copied in on success: a failed re-init leaves the handle as it was) */
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "LinearCall takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "Os|iO", &cfg, &dtype, &device, &refuse) ||
        axc_py_parse_linear_desc(cfg, dtype, &d) < 0)
        return -1;
    if (refuse != Py_None && !PyUnicode_Check(refuse)) {
        PyErr_SetString(PyExc_TypeError, "LinearCall: refuse_capture must be a str or None");
        return -1;
    }
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return -1;
    PyObject *shapes = axc_py_linear_shapes(comm, &d, 0);
    PyObject *t = shapes ? PySequence_Tuple(cfg) : NULL;
    if (!t) {
        Py_XDECREF(shapes);
        return -1;
    }
    int64_t res_elems = 0;
    axc_status st = axc_linear_dw_residual_elems(comm, &d, device, &res_elems);
    if (st != AXC_OK) {
        Py_DECREF(shapes);
        Py_DECREF(t);
        axc_py_raise(st);
        return -1;
    }
    self->keeps_dw_residual = res_elems > 0;
    self->d = d;
    Py_XSETREF(self->shapes, shapes);
    Py_XSETREF(self->cfg, t);
    self->layer = -1;
    self->self_contained = axc_linear_self_contained(comm, &self->d, device);
    self->scheduled = self->d.scheduled;
    self->overlap_data = self->d.overlap_data;
    Py_XSETREF(self->refuse_capture, refuse == Py_None ? NULL : Py_NewRef(refuse));
    return 0;
}

static void call_dealloc(LinearCall *self)
{
    Py_XDECREF(self->refuse_capture);
    Py_XDECREF(self->cfg);
    Py_XDECREF(self->shapes);
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
 * computes them per call); a device None is read from the tensor, too. */
static int device_stream_of(PyObject *t, PyObject *const *given, int *device, void **stream)
{
    if (given && given[0] != Py_None) {
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
    if (*err) /* (an exception is set: no more calls into Python) */
        return NULL;
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

/* w._version: what the scheduler's cached gather of the shard is checked against */
static int64_t version_of(PyObject *w)
{
    PyObject *v = PyObject_GetAttr(w, s_version);
    if (!v)
        return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return n;
}

/* An optional tensor argument's data pointer (None: NULL) */
static void *opt_ptr(PyObject *t, int *err) { return t == Py_None ? NULL : ptr_of(t, err); }

/* The io fields the handle decides: its scheduler and layer id, and for a scheduled gather
 * the shard's version. (A self-contained handle has no id: with Gd == 1 nothing is gathered.) */
static int layer_io(const LinearCall *self, const axc_comm *comm, PyObject *w, int defer,
                    axc_linear_io *io)
{
    io->sched = axc_py_sched();
    io->layer = self->layer;
    int gathers = self->d.scheduled && axc_comm_grid(comm)->G_d > 1;
    if ((gathers || defer) && self->layer < 0) {
        PyErr_SetString(PyExc_ValueError, "a scheduled Linear call needs its layer id");
        return -1;
    }
    if (self->d.scheduled && self->layer >= 0) {
        io->prefetch_ok = 1;
        if ((io->w_version = version_of(w)) == -1 && PyErr_Occurred())
            return -1;
        /* Only a depth gather reads the shard after this call (a prefetch for the layer's
         * next call): with G_d == 1 there is nothing to keep. */
        if (!gathers || !io->sched)
            return 0;
        /* The prefetch reads this storage later: kept alive until the layer's next call
         * replaces it (or the layer is forgotten). Kept as w.detach(), which holds the
         * storage itself: the Parameter would not keep it once `p.data = ...`, `.to()` or
         * `.half()` gave the Parameter another one. The shard it replaces may be read by a
         * prefetch still in flight (a per-call autocast cast, a swapped weight): the
         * scheduler lets go of it first. */
        int err = 0;
        void *p = ptr_of(w, &err);
        if (err)
            return -1;
        PyObject *pin = PyObject_CallMethodNoArgs(w, s_detach);
        if (!pin)
            return -1;
        axc_status st;
        Py_BEGIN_ALLOW_THREADS st = axc_sched_shard_passing(io->sched, self->layer, p);
        Py_END_ALLOW_THREADS
        if (st != AXC_OK) {
            Py_DECREF(pin);
            axc_py_raise(st);
            return -1;
        }
        /* (keep_shard takes the reference, also when it fails) */
        if ((st = axc_runtime_keep_shard(axc_py_runtime(), self->layer, pin)) != AXC_OK) {
            axc_py_raise(st);
            return -1;
        }
    }
    return 0;
}

/* W's block gathered over depth once for all micro-batches when the call shares its depth
 * traffic (axc_py_mb_shares_depth), else None (the call gathers it itself): a new reference,
 * kept until the call returns; NULL with an exception. */
static PyObject *shared_gather(const LinearCall *self, const axc_comm *comm, PyObject *w, int bwd)
{
    int gd = axc_comm_grid(comm)->G_d;
    if (!axc_py_mb_shares_depth(self->layer, self->d.scheduled, gd))
        return Py_NewRef(Py_None);
    axc_linear_shapes s;
    axc_status st = axc_linear_shapes_for(comm, &self->d, 0, &s);
    if (st != AXC_OK)
        return axc_py_raise(st);
    return axc_py_mb_gather(self->layer, bwd, w, (Py_ssize_t)(s.shard * gd));
}

/* forward(x, w, b[, device, stream[, hold_result]]) -> (y, saved or None); x: [rows,
 * features], contiguous; device -1: CPU, None: x's; stream None: torch's current stream of
 * the device; both left out: x's device and torch's current stream. hold_result: y's
 * all-reduce is left in flight (axc_linear_io.hold_result). On a run_concurrent micro-batch
 * thread the long form may take W gathered over depth for all micro-batches (shared_gather). */
static PyObject *call_forward(LinearCall *self, PyObject *const *a, Py_ssize_t n)
{
    if (n != 3 && n != 5 && n != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "LinearCall.forward(x, w, b[, device, stream[, hold_result]])");
        return NULL;
    }
    PyObject *x = a[0], *w = a[1], *b = a[2];
    int hold = n == 6 ? PyObject_IsTrue(a[5]) : 0;
    int device = -1;
    void *stream = NULL;
    if (hold < 0 || device_stream_of(x, n >= 5 ? a + 3 : NULL, &device, &stream) < 0 ||
        check_capture(self, device, stream) < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    const axc_linear_desc *d = &self->d;
    int64_t rows = dim0(x), t_max = rows;
    if (rows < 0)
        return NULL;
    /* (the short forms are _PlainLinear's: never on a micro-batch thread, nothing shared) */
    PyObject *w_full = n == 6 ? shared_gather(self, comm, w, 0) : Py_NewRef(Py_None);
    PyObject *y = NULL, *saved = NULL, *ws = NULL, *out = NULL;
    if (!w_full)
        return NULL;
    axc_status st = AXC_OK;
    if (d->layout == AXC_LAYOUT_EASY) {
        Py_BEGIN_ALLOW_THREADS st = axc_linear_plane_tokens(comm, d, rows, device, stream, &t_max);
        Py_END_ALLOW_THREADS
    }
    axc_linear_shapes s;
    if (st == AXC_OK)
        st = axc_linear_shapes_for(comm, d, t_max, &s);
    if (st != AXC_OK) {
        axc_py_raise(st);
        goto done;
    }
    if (check_shard(self, w, &s) < 0)
        goto done;
    int easy = d->layout == AXC_LAYOUT_EASY;
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
                        .layer = -1, .hold_result = hold};
    if (layer_io(self, comm, w, 0, &io) < 0)
        goto done;
    io.x = ptr_of(x, &err);
    io.w = ptr_of(w, &err);
    io.bias = opt_ptr(b, &err);
    io.y = ptr_of(y, &err);
    io.saved = opt_ptr(saved, &err);
    io.workspace = opt_ptr(ws, &err);
    io.w_full = opt_ptr(w_full, &err);
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
    Py_DECREF(w_full);
    Py_XDECREF(y);
    Py_XDECREF(saved);
    Py_XDECREF(ws);
    return out;
}

/* After a successful backward: a held dX all-reduce's dx kept until the result is awaited
 * (and the end of the pass queued, which awaits what no hook did); a queued dW GEMM task's
 * inputs (task_reads, or NULL) kept until it has run; the deferred gradient recorded (dd->dw NULL: not deferred; a
 * scheduled call then queues the end of the pass, which ends the scheduler's step). */
static int after_backward(const LinearCall *self, const axc_linear_io *io, PyObject *dx,
                          PyObject *task_reads, PyObject *param, const axc_py_deferred_dw *dd,
                          PyObject *ws, int depth, PyObject *w, PyObject *shared_block)
{
    if (axc_test_fault("backward_keep")) {
        PyErr_SetString(PyExc_MemoryError, "AXONN_C_TEST_FAULT=backward_keep: the keep-alive "
                                           "step after a backward failed (test fault)");
        return -1;
    }
    if (io->hold_result) {
        axc_sched *sched = axc_py_sched();
        axc_sched_stats t;
        if (!sched) {
            PyErr_SetString(PyExc_RuntimeError, "a held dX all-reduce needs the scheduler");
            return -1;
        }
        Py_BEGIN_ALLOW_THREADS axc_sched_stats_get(sched, &t);
        Py_END_ALLOW_THREADS
        if (axc_py_keep_alive(AXC_KEEP_RESULT, t.results_held, dx) < 0 ||
            axc_py_grad_queue_finish() < 0)
            return -1;
    }
    if (shared_block != Py_None) /* (added to .grad when run_concurrent ends) */
        return axc_py_mb_scatter(self->layer, w, shared_block);
    if (dd->dw) {
        /* the dW GEMM runs later (a scheduler task, Gd == 1; chunk calls run it in the call) */
        if (task_reads && axc_py_keep_alive(AXC_KEEP_TASK, *io->task_number, task_reads) < 0)
            return -1;
        return axc_py_deferred_record(dd, param, ws, depth);
    }
    if (self->d.scheduled && self->layer >= 0)
        return axc_py_grad_queue_finish();
    return 0;
}

/* After after_backward failed: the work the backward queued (a dW GEMM task, a deferred
 * reduce-scatter, a held dX all-reduce) completes now, with the interpreter lock released, so
 * that nothing is left reading or writing the tensors the failed call lets go; the pending
 * exception is kept (the wait's own error is dropped: the first error wins). */
static void complete_queued(void)
{
    axc_sched *sched = axc_py_sched();
    if (!sched)
        return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    Py_BEGIN_ALLOW_THREADS (void)axc_sched_finish(sched);
    Py_END_ALLOW_THREADS
    axc_py_keeps_release_done();
    PyErr_Restore(et, ev, tb);
}

/* `trains`: a bool, or a callable asked (1, 0, -1 with an exception) */
static int ask(PyObject *trains)
{
    PyObject *r = PyCallable_Check(trains) ? PyObject_CallNoArgs(trains) : Py_NewRef(trains);
    int v = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    return v;
}

/* backward(dy, x, saved, w, need_dx[, device, stream[, param, chunk, trains, hold_result]])
 * -> (dx or None, dw or None, db or None).
 * param: the weight parameter whose gradient this call defers (axonn_c/linear.py
 * _deferred_param), or None. Deferred, the call does the whole deferred weight gradient
 * (py_grad_deferred.c): takes where dW goes (a slice of an open data bucket, with the .grad so
 * far to fold in; `chunk`: axonn_c.Sequential's chunk record, accumulated in the dW GEMM), hands
 * dW's reduce-scatter to the scheduler (axc_linear_io.defer), keeps what a queued dW GEMM task
 * reads until it has run, and records the gradient (a chunk call: its part done); dw is then
 * None. trains: whether this dW reaches a .grad (a bool, or a callable asked only when the
 * answer matters: autograd's, grads.accumulates): a call that keeps a depth error-feedback
 * residual takes scratch zeros instead of the layer's when it does not, or on a micro-batch
 * thread; on a run_concurrent micro-batch thread the long form's dW that does is handed to the
 * reduce-scatter the micro-batches share (shared_gather's calls; not param's), and dw is None. hold_result:
 * dx's all-reduce is left in flight, dx kept until it is awaited. A backward that raises
 * records nothing (a piece taken from a bucket stays unwritten, its pass dropped as abandoned);
 * one that raises after its work was queued first completes that work (complete_queued). */
static PyObject *call_backward(LinearCall *self, PyObject *const *a, Py_ssize_t n)
{
    if (n != 5 && n != 7 && n != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "LinearCall.backward(dy, x, saved, w, need_dx[, device, stream[, param, "
                        "chunk, trains, hold_result]])");
        return NULL;
    }
    PyObject *x = a[1], *saved = a[2], *w = a[3];
    PyObject *const *more = n == 11 ? a + 7 : NULL;
    PyObject *param = more && more[0] != Py_None ? more[0] : NULL;
    int need_dx = PyObject_IsTrue(a[4]), hold = more ? PyObject_IsTrue(more[3]) : 0;
    int chunk = param ? PyObject_IsTrue(more[1]) : 0;
    int defer = param != NULL;
    int device = -1;
    void *stream = NULL;
    if (need_dx < 0 || hold < 0 || chunk < 0 ||
        device_stream_of(a[0], n >= 7 ? a + 5 : NULL, &device, &stream) < 0 ||
        check_capture(self, device, stream) < 0)
        return NULL;
    hold = hold && need_dx;
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
    /* (the short forms: a self-contained call, which keeps no residual) */
    PyObject *trains_arg = more ? more[2] : Py_False;
    int trains = -1; /* (asked once, when needed) */
    PyObject *w_full = more ? shared_gather(self, comm, w, 1) : Py_NewRef(Py_None);
    PyObject *block = NULL;
    if (w_full && !param && w_full != Py_None) { /* dW's reduce-scatter shared, too */
        block = axc_py_mb_scatter_block(w, (Py_ssize_t)(s.shard * s.depth_size));
        if (block && block != Py_None && (trains = ask(trains_arg)) <= 0)
            Py_SETREF(block, trains < 0 ? NULL : Py_NewRef(Py_None));
    } else if (w_full) {
        block = Py_NewRef(Py_None);
    }
    if (!block) {
        Py_XDECREF(w_full);
        return NULL;
    }
    axc_py_deferred_dw dd = {.bucket = -1};
    PyObject *dy = NULL, *dx = NULL, *dw = NULL, *db = NULL, *ws = NULL, *out = NULL;
    if ((param && axc_py_deferred_prepare(param, (Py_ssize_t)s.shard, d->overlap_data, chunk,
                                          &dd) < 0) ||
        !(dy = PyObject_CallMethodNoArgs(a[0], s_contiguous)))
        goto done;
    /* (x and w are contiguous: the forward and the shard check saw to it) */
    dx = need_dx ? empty_like(x) : (Py_INCREF(Py_None), Py_None);
    if (!dx || !(dw = defer ? Py_NewRef(dd.dw) : empty_like(w)))
        goto done;
    if ( !(db = d->has_bias ? new_empty(dy, s.n_local, 0, 0) : (Py_INCREF(Py_None), Py_None)) ||
        !(ws = s.workspace_elems ? new_empty(dy, s.workspace_elems, 0, 0)
                                 : (Py_INCREF(Py_None), Py_None)))
        goto done;
    int err = 0;
    axc_linear_io io = {.device = device, .stream = stream, .rows = rows, .t_max = t_max,
                        .layer = -1, .defer = defer, .hold_result = hold};
    if (layer_io(self, comm, w, defer, &io) < 0)
        goto done;
    io.x = io.saved = ptr_of(easy ? saved : x, &err);
    io.w = ptr_of(w, &err);
    io.dy = ptr_of(dy, &err);
    io.dx = opt_ptr(dx, &err);
    io.skip_dx = !need_dx; /* (not from dx: a rank without tokens has a NULL one) */
    io.dw = ptr_of(dw, &err);
    io.db = opt_ptr(db, &err);
    io.workspace = opt_ptr(ws, &err);
    if (more)
        io.dw_prev = dd.fold ? ptr_of(dd.fold, &err) : NULL;
    io.w_full = opt_ptr(w_full, &err);
    io.dw_full = opt_ptr(block, &err);
    uint64_t task = 0;
    io.task_number = &task;
    if (err)
        goto done;
    /* dW's depth reduce-scatter: the error-feedback residual the runtime keeps by layer id
     * (axc/layer_residuals.h), where C says the call needs one; scratch zeros for a call that
     * must not train it (its dW reaches no .grad, or it runs on a micro-batch thread) */
    axc_layer_residuals *res = axc_runtime_layer_residuals(axc_py_runtime());
    void *scratch = NULL;
    int64_t elems = 0;
    if (io.layer >= 0 && !io.dw_full)
        st = axc_linear_dw_residual_elems(comm, d, device, &elems);
    if (st == AXC_OK && elems > 0) {
        if (trains < 0 && (trains = axc_microbatch_thread() ? 0 : ask(trains_arg)) < 0)
            goto done;
        st = axc_layer_residuals_for_call(res, io.layer, device, (size_t)elems, trains, defer,
                                          &io.dw_residual, &scratch);
    }
    if (st != AXC_OK) {
        if (!PyErr_Occurred()) /* (an allocation's error is set) */
            axc_py_raise(st);
        goto done;
    }
    /* the layer's residual, written with the interpreter lock released: held here, so that
     * another thread replacing or dropping it meanwhile (load_compression_state, a forgotten
     * layer) cannot free it under the call (a deferred one is kept by the table itself) */
    PyObject *held = NULL;
    if (io.dw_residual && !scratch && !defer) {
        void *owner = NULL;
        size_t n_held = 0;
        if (axc_layer_residuals_get(res, io.layer, &owner, &n_held))
            held = Py_XNewRef((PyObject *)owner);
    }
    Py_BEGIN_ALLOW_THREADS st = axc_linear_backward(comm, d, &io);
    Py_END_ALLOW_THREADS
    Py_XDECREF(held);
    axc_layer_residuals_release(res, scratch); /* (NULL: none, or kept until the pass's end) */
    if (defer) /* its deferred work is queued: its use ends with the next pass's wait */
        axc_layer_residuals_call_done(res, io.dw_residual);
    if (st != AXC_OK) {
        axc_py_raise(st);
        goto done;
    }
    if (more) {
        /* what a queued dW GEMM task reads */
        int keeps_task = task && defer && !chunk;
        PyObject *reads = keeps_task ? PyTuple_Pack(6, dy, x, saved, dw,
                                                    dd.fold ? dd.fold : Py_None, ws)
                                     : NULL;
        if ((keeps_task && !reads) ||
            after_backward(self, &io, dx, reads, param, &dd, ws, s.depth_size, w, block) < 0) {
            Py_XDECREF(reads);
            if (task || defer || hold) /* (what it reads and writes goes with this call) */
                complete_queued();
            goto done;
        }
        Py_XDECREF(reads);
    }
    out = PyTuple_Pack(3, dx, defer || block != Py_None ? Py_None : dw, db);
done:
    axc_py_deferred_clear(&dd);
    Py_DECREF(w_full);
    Py_DECREF(block);
    Py_XDECREF(dy);
    Py_XDECREF(dx);
    Py_XDECREF(dw);
    Py_XDECREF(db);
    Py_XDECREF(ws);
    return out;
}

/* shapes_for(rows) -> the shapes of a call with `rows` rows (expert: m; easy: the plane's
 * largest t), as a dict */
static PyObject *call_shapes_for(LinearCall *self, PyObject *arg)
{
    long long rows = PyLong_AsLongLong(arg);
    if (rows == -1 && PyErr_Occurred())
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    return comm ? axc_py_linear_shapes(comm, &self->d, rows) : NULL;
}

/* defers(hold, microbatch) -> whether a backward hands dW to the deferred completion, as far
 * as the layer and the grid decide (axc_linear_defers) */
static PyObject *call_defers(LinearCall *self, PyObject *const *a, Py_ssize_t n)
{
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "LinearCall.defers(hold, microbatch)");
        return NULL;
    }
    int hold = PyObject_IsTrue(a[0]), mb = PyObject_IsTrue(a[1]);
    if (hold < 0 || mb < 0)
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    return PyBool_FromLong(axc_linear_defers(axc_comm_grid(comm), &self->d,
                                             (hold ? AXC_LINEAR_HOLD : 0) |
                                                 (mb ? AXC_LINEAR_MICROBATCH : 0)));
}

/* dw_residual_elems(device) -> the error-feedback residual dW's depth reduce-scatter needs on
 * `device` (0: none), axc_linear_dw_residual_elems */
static PyObject *call_dw_residual_elems(LinearCall *self, PyObject *arg)
{
    int device = (int)PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    axc_comm *comm = axc_py_linear_comm();
    if (!comm)
        return NULL;
    int64_t elems = 0;
    axc_status st = axc_linear_dw_residual_elems(comm, &self->d, device, &elems);
    return st != AXC_OK ? axc_py_raise(st) : PyLong_FromLongLong(elems);
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
     "forward(x, w, b[, device, stream[, hold_result]]) -> (y, saved or None)"},
    {"backward", (PyCFunction)(void (*)(void))call_backward, METH_FASTCALL,
     "backward(dy, x, saved, w, need_dx[, device, stream[, param, chunk, trains, "
     "hold_result]]) -> (dx, dw or None (deferred, or shared by micro-batches), db)"},
    {"shapes_for", (PyCFunction)call_shapes_for, METH_O,
     "shapes_for(rows) -> the shapes of a call with `rows` rows (dict)"},
    {"defers", (PyCFunction)(void (*)(void))call_defers, METH_FASTCALL,
     "defers(hold, microbatch) -> whether a backward defers dW, as the layer and grid decide"},
    {"dw_residual_elems", (PyCFunction)call_dw_residual_elems, METH_O,
     "dw_residual_elems(device) -> the depth dW reduce-scatter's error-feedback residual "
     "length (0: none)"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef call_members[] = {
    {"layer", T_INT, offsetof(LinearCall, layer), 0, "the layer's scheduler id (-1: none)"},
    {"self_contained", T_BOOL, offsetof(LinearCall, self_contained), READONLY,
     "whether calls outside chunk pipelining and micro-batches need nothing cross-layer"},
    {"scheduled", T_BOOL, offsetof(LinearCall, scheduled), READONLY,
     "whether the depth gather goes through the scheduler"},
    {"keeps_dw_residual", T_BOOL, offsetof(LinearCall, keeps_dw_residual), READONLY,
     "whether its depth dW reduce-scatter keeps an error-feedback residual on its device"},
    {"overlap_data", T_BOOL, offsetof(LinearCall, overlap_data), READONLY,
     "whether dW's data-parallel reduction runs in a bucket during backward"},
    {"cfg", T_OBJECT_EX, offsetof(LinearCall, cfg), READONLY, "the ints the handle was made from"},
    {"shapes", T_OBJECT_EX, offsetof(LinearCall, shapes), READONLY,
     "the layer's shapes at 0 rows (shard, groups, blocks)"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject LinearCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "axonn_c._C.LinearCall",
    .tp_basicsize = sizeof(LinearCall),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One axonn_c.Linear's C handle: its description, shapes and scheduler id.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)call_init,
    .tp_dealloc = (destructor)call_dealloc,
    .tp_methods = call_methods,
    .tp_members = call_members,
};

int axc_py_linear_add_types(PyObject *module)
{
    if (!(s_shape = PyUnicode_InternFromString("shape")) ||
        !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
        !(s_new_empty = PyUnicode_InternFromString("new_empty")) ||
        !(s_contiguous = PyUnicode_InternFromString("contiguous")) ||
        !(s_numel = PyUnicode_InternFromString("numel")) ||
        !(s_get_device = PyUnicode_InternFromString("get_device")) ||
        !(s_version = PyUnicode_InternFromString("_version")) ||
        !(s_detach = PyUnicode_InternFromString("detach")))
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
