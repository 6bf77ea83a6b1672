/* Bindings of the grid and the transport: argument parsing, validation of tensors, hand-off to
 * the core with the GIL released. The communicator lives in the runtime (module.c). */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/cuda_rt.h"
#include "axc/gemm.h"
#include "py_common.h"


/* ------------------------------------------------------------------ bootstrap over the store */

typedef struct py_store {
    PyObject *set;         /* callable(key: str, value: bytes) */
    PyObject *get;         /* callable(key: str, timeout: float) -> bytes */
    PyObject *peer_failed; /* callable() -> None or the message another rank's init failed with */
} py_store;

static axc_status store_error(const char *what, const char *key)
{
    /* Called with the GIL held and a Python error set: move it into the core's message. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *s = value ? PyObject_Str(value) : NULL;
    const char *msg = s ? PyUnicode_AsUTF8(s) : NULL;
    axc_status st = axc_fail(AXC_ERR_TIMEOUT, "store %s('%s') failed: %s", what, key,
                             msg ? msg : "unknown error");
    Py_XDECREF(s);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
    return st;
}

static axc_status store_set(void *ctx, const char *key, const void *value, size_t len)
{
    py_store *ps = ctx;
    PyGILState_STATE gs = PyGILState_Ensure();
    axc_status st = AXC_OK;
    PyObject *r = PyObject_CallFunction(ps->set, "sy#", key, (const char *)value, (Py_ssize_t)len);
    if (!r)
        st = store_error("set", key);
    Py_XDECREF(r);
    PyGILState_Release(gs);
    return st;
}

static axc_status store_get(void *ctx, const char *key, void *value, size_t cap, size_t *len,
                            double timeout_s)
{
    py_store *ps = ctx;
    PyGILState_STATE gs = PyGILState_Ensure();
    axc_status st = AXC_OK;
    PyObject *r = PyObject_CallFunction(ps->get, "sd", key, timeout_s);
    char *buf;
    Py_ssize_t n;
    if (!r) {
        st = store_error("get", key);
    } else if (PyBytes_AsStringAndSize(r, &buf, &n) < 0) {
        st = store_error("get", key);
    } else if ((size_t)n > cap) {
        st = axc_fail(AXC_ERR_INVALID, "store value for '%s' has %zd bytes, at most %zu expected",
                      key, n, cap);
    } else {
        memcpy(value, buf, (size_t)n);
        *len = (size_t)n;
    }
    Py_XDECREF(r);
    PyGILState_Release(gs);
    return st;
}

static axc_status store_peer_failed(void *ctx)
{
    py_store *ps = ctx;
    PyGILState_STATE gs = PyGILState_Ensure();
    axc_status st = AXC_OK;
    PyObject *r = PyObject_CallNoArgs(ps->peer_failed);
    if (!r) {
        st = store_error("check", "error");
    } else if (r != Py_None) {
        PyObject *s = PyObject_Str(r);
        const char *msg = s ? PyUnicode_AsUTF8(s) : NULL;
        st = axc_fail(AXC_ERR_PEER, "init failed on another rank: %s", msg ? msg : "?");
        Py_XDECREF(s);
        PyErr_Clear();
    }
    Py_XDECREF(r);
    PyGILState_Release(gs);
    return st;
}

/* ------------------------------------------------------------------ init / finalize / grid */

static PyObject *py_init(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"rank",   "world_size", "local_rank", "local_world_size",
                             "G_data", "G_intra_r",  "G_intra_c",  "G_intra_d",
                             "G_inter", "backend",   "job_id",     "timeout",
                             "cuda_device", "store_set", "store_get", "channels",
                             "store_peer_failed", NULL};
    int rank, world, local_rank, local_world, gdata, gr, gc, gd, ginter, cuda_device;
    int channels = 1;
    const char *backend = NULL, *job_id;
    double timeout;
    py_store ps = {NULL, NULL, Py_None};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiiiiiizsdiOO|iO", kwlist, &rank, &world,
                                     &local_rank, &local_world, &gdata, &gr, &gc, &gd, &ginter,
                                     &backend, &job_id, &timeout, &cuda_device, &ps.set, &ps.get,
                                     &channels, &ps.peer_failed))
        return NULL;
    axc_comm *cur = axc_py_comm();
    if (cur) {
        const axc_grid *g = axc_comm_grid(cur);
        if (g->G_data == gdata && g->G_r == gr && g->G_c == gc && g->G_d == gd &&
            axc_comm_channels(cur) == channels)
            Py_RETURN_NONE; /* idempotent */
        PyErr_Format(PyExc_RuntimeError,
                     "axonn_c is already initialised with G_data=%d G_intra_r=%d G_intra_c=%d "
                     "G_intra_d=%d (%d comm channels); call axonn_c.finalize() before init with "
                     "G_data=%d G_intra_r=%d G_intra_c=%d G_intra_d=%d (%d comm channels)",
                     g->G_data, g->G_r, g->G_c, g->G_d, axc_comm_channels(cur), gdata, gr,
                     gc, gd, channels);
        return NULL;
    }
    if (!(timeout > 0 && timeout <= AXC_MAX_TIMEOUT_S)) { /* NaN fails too */
        PyErr_Format(PyExc_ValueError, "timeout must be a finite number of seconds in (0, %.0f], "
                     "got %g", AXC_MAX_TIMEOUT_S, timeout);
        return NULL;
    }
    axc_comm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    axc_status st = axc_grid_make(&cfg.grid, world, gdata, gr, gc, gd, ginter);
    if (st != AXC_OK)
        return axc_py_raise(st);
    cfg.rank = rank;
    cfg.local_rank = local_rank;
    cfg.local_world_size = local_world;
    cfg.cuda_device = cuda_device;
    cfg.backend = backend;
    cfg.job_id = job_id;
    cfg.timeout_s = timeout;
    cfg.channels = channels;
    cfg.bootstrap.ctx = &ps;
    cfg.bootstrap.set = store_set;
    cfg.bootstrap.get = store_get;
    cfg.bootstrap.peer_failed = ps.peer_failed != Py_None ? store_peer_failed : NULL;
    st = axc_runtime_open(axc_py_runtime(), &cfg); /* (lets go of the GIL while it waits) */
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_finalize(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_status st = axc_runtime_close(axc_py_runtime()); /* scheduler, communicator, GEMM plans */
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* set_thread_channel(channel): the channel of the calling thread's collectives */
static PyObject *py_set_thread_channel(PyObject *self, PyObject *arg)
{
    (void)self;
    long c = PyLong_AsLong(arg);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    if (!axc_py_comm())
        return axc_py_raise(axc_fail(AXC_ERR_STATE,
                                     "axonn_c is not initialised: call axonn_c.init() first"));
    axc_status st = axc_comm_set_thread_channel(axc_py_comm(), (int)c);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

void axc_py_abort_interrupted(const char *why)
{
    axc_comm *comm = axc_py_comm(); /* (read with the GIL held) */
    if (!comm || axc_comm_grid(comm)->world_size < 2)
        return;
    char msg[160];
    snprintf(msg, sizeof msg, "run_concurrent was interrupted (%s) on rank %d", why,
             axc_comm_rank(comm));
    Py_BEGIN_ALLOW_THREADS (void)axc_comm_abort(comm, AXC_ERR_PEER, msg);
    Py_END_ALLOW_THREADS
}

/* abort_interrupted(why): axc_py_abort_interrupted */
static PyObject *py_abort_interrupted(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *why = PyUnicode_AsUTF8(arg); /* (kept alive by the caller's reference) */
    if (!why)
        return NULL;
    axc_py_abort_interrupted(why);
    Py_RETURN_NONE;
}

static PyObject *py_is_initialized(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(axc_py_comm() != NULL);
}

static int require_init(void)
{
    if (axc_py_comm())
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "axonn_c is not initialised: call axonn_c.init(G_data=..., G_intra_r=..., "
                    "G_intra_c=..., G_intra_d=...) first");
    return -1;
}

/* (G_data, G_intra_r, G_intra_c, G_intra_d, rank, data, depth, row, col, backends) */
static PyObject *py_grid_info(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    if (require_init() < 0)
        return NULL;
    const axc_grid *g = axc_comm_grid(axc_py_comm());
    int rank = axc_comm_rank(axc_py_comm());
    axc_coords c = axc_grid_coords(g, rank);
    return Py_BuildValue("(iiiiiiiiis)", g->G_data, g->G_r, g->G_c, g->G_d, rank, c.data, c.depth,
                         c.row, c.col, axc_comm_backends(axc_py_comm()));
}

/* Pure grid math, usable without init: members of `group` containing `rank` in a grid. */
static PyObject *py_grid_members(PyObject *self, PyObject *args)
{
    (void)self;
    int gdata, gr, gc, gd, rank;
    const char *name;
    if (!PyArg_ParseTuple(args, "iiiiis", &gdata, &gr, &gc, &gd, &rank, &name))
        return NULL;
    axc_grid g;
    axc_group_kind kind;
    axc_status st = axc_grid_make(&g, gdata * gr * gc * gd, gdata, gr, gc, gd, 1);
    if (st == AXC_OK)
        st = axc_group_from_name(name, &kind);
    if (st != AXC_OK)
        return axc_py_raise(st);
    if (rank < 0 || rank >= g.world_size) {
        PyErr_Format(PyExc_ValueError, "rank %d is outside the grid of %d ranks", rank,
                     g.world_size);
        return NULL;
    }
    int n = axc_grid_group_size(&g, kind);
    int members[4096];
    if (n > 4096) {
        PyErr_Format(PyExc_ValueError, "group of %d ranks is too large to list", n);
        return NULL;
    }
    axc_grid_group_members(&g, kind, rank, members);
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    for (int i = 0; i < n; i++)
        PyList_SET_ITEM(list, i, PyLong_FromLong(members[i]));
    return list;
}

/* ------------------------------------------------------------------ Work */

typedef struct {
    PyObject_HEAD axc_work *work;
    PyObject *keep; /* tensors that must outlive the collective; keep[0] is the output */
    int done;
    /* an async host collective works on this private copy (malloc'd: input, then output unless
     * in place), so that resizing or swapping the tensors' storage while it runs cannot make it
     * write into freed memory (issue 28 item 4); wait() copies the result into the output */
    unsigned char *stage;
    size_t stage_out_off, stage_out_bytes;
} WorkObject;

static int unstage(WorkObject *self);

static int work_finish(WorkObject *self)
{
    if (self->done)
        return 0;
    axc_status st;
    axc_work *w = self->work;
    Py_BEGIN_ALLOW_THREADS st = axc_work_wait(w);
    Py_END_ALLOW_THREADS if (st == AXC_ERR_TIMEOUT && !axc_work_done(w))
    {
        axc_py_raise(st); /* the backend still owns the buffers: keep them alive */
        return -1;
    }
    self->done = 1;
    axc_work_free(w);
    self->work = NULL;
    int rc = st == AXC_OK && self->stage ? unstage(self) : 0;
    free(self->stage);
    self->stage = NULL;
    Py_CLEAR(self->keep);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return rc;
}

static PyObject *work_wait(WorkObject *self, PyObject *noargs)
{
    (void)noargs;
    if (work_finish(self) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *work_is_completed(WorkObject *self, PyObject *noargs)
{
    (void)noargs;
    return PyBool_FromLong(self->done || axc_work_done(self->work));
}

static void work_dealloc(WorkObject *self)
{
    if (!self->done && self->work) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (work_finish(self) < 0)
            PyErr_Clear(); /* a dropped handle cannot report; the next collective will */
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(self->keep);
    if (self->done || !self->work)
        free(self->stage); /* else the backend may still write into it after a timeout: leaked */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)work_wait, METH_NOARGS,
     "Waits for the collective; raises CommError/CommTimeoutError if it failed."},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS,
     "True once the collective has finished (never blocks)."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject WorkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "axonn_c.Work",
    .tp_basicsize = sizeof(WorkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Handle of an asynchronous collective.",
    .tp_dealloc = (destructor)work_dealloc,
    .tp_methods = work_methods,
};

int axc_py_comm_add_types(PyObject *m)
{
    if (PyType_Ready(&WorkType) < 0)
        return -1;
    Py_INCREF(&WorkType);
    return PyModule_AddObject(m, "Work", (PyObject *)&WorkType);
}

/* ------------------------------------------------------------------ tensor views */

typedef struct tensor_view {
    void *ptr;
    size_t numel;
    axc_dtype dtype;
    int device; /* -1 cpu */
} tensor_view;

static long long call_ll(PyObject *obj, const char *method)
{
    PyObject *r = PyObject_CallMethod(obj, method, NULL);
    if (!r)
        return -1;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return v;
}

/* Reads a torch.Tensor: data pointer, element count, dtype, device; rejects what the transport
 * cannot take with a message naming the argument and what was expected. */
/* torch.Tensor and torch.nn.Parameter, looked up once (torch is imported before the
 * extension). Only these two exact types are read: any other object, subclasses included, could
 * answer data_ptr() with any number (issue 28 item 3). */
static PyObject *g_tensor_type, *g_param_type;

static int torch_types(void)
{
    if (g_param_type)
        return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch)
        return -1;
    PyObject *nn = PyObject_GetAttrString(torch, "nn");
    g_tensor_type = PyObject_GetAttrString(torch, "Tensor");
    g_param_type = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
    Py_XDECREF(nn);
    Py_DECREF(torch);
    if (!g_tensor_type || !g_param_type) {
        Py_CLEAR(g_tensor_type);
        Py_CLEAR(g_param_type);
        return -1;
    }
    return 0;
}

static int read_tensor(PyObject *t, const char *argname, tensor_view *v)
{
    if (torch_types() < 0)
        return -1;
    if (Py_TYPE(t) != (PyTypeObject *)g_tensor_type && Py_TYPE(t) != (PyTypeObject *)g_param_type) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a torch.Tensor (or nn.Parameter), got %s; pass a tensor "
                     "subclass as x.as_subclass(torch.Tensor)",
                     argname, Py_TYPE(t)->tp_name);
        return -1;
    }
    PyObject *nested = PyObject_GetAttrString(t, "is_nested");
    int is_nested = nested ? PyObject_IsTrue(nested) : -1;
    Py_XDECREF(nested);
    if (is_nested != 0) {
        if (is_nested > 0)
            PyErr_Format(PyExc_TypeError,
                         "%s is a nested tensor: collectives take dense tensors; pass "
                         "t.values() or a padded tensor",
                         argname);
        return -1;
    }
    PyObject *layout = PyObject_GetAttrString(t, "layout");
    PyObject *layout_s = layout ? PyObject_Str(layout) : NULL;
    Py_XDECREF(layout);
    const char *ls = layout_s ? PyUnicode_AsUTF8(layout_s) : NULL;
    if (!ls || strcmp(ls, "torch.strided") != 0) {
        if (ls)
            PyErr_Format(PyExc_TypeError, "%s has layout %s, expected torch.strided (dense)",
                         argname, ls);
        Py_XDECREF(layout_s);
        return -1;
    }
    Py_DECREF(layout_s);
    PyObject *contig = PyObject_CallMethod(t, "is_contiguous", NULL);
    if (!contig)
        return -1;
    int ok = PyObject_IsTrue(contig);
    Py_DECREF(contig);
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be contiguous (call .contiguous() first); got strides that are not",
                     argname);
        return -1;
    }
    PyObject *dt = PyObject_GetAttrString(t, "dtype");
    PyObject *dts = dt ? PyObject_Str(dt) : NULL;
    Py_XDECREF(dt);
    if (!dts)
        return -1;
    const char *name = PyUnicode_AsUTF8(dts);
    if (name && strncmp(name, "torch.", 6) == 0)
        name += 6;
    axc_status st = name ? axc_dtype_from_name(name, &v->dtype) : AXC_ERR_INVALID;
    if (st != AXC_OK) {
        PyErr_Format(PyExc_TypeError, "%s has dtype %s: %s", argname, name ? name : "?",
                     axc_last_error());
        Py_DECREF(dts);
        return -1;
    }
    Py_DECREF(dts);
    PyObject *dev = PyObject_GetAttrString(t, "device");
    if (!dev)
        return -1;
    PyObject *type = PyObject_GetAttrString(dev, "type");
    PyObject *index = PyObject_GetAttrString(dev, "index");
    Py_DECREF(dev);
    if (!type || !index) {
        Py_XDECREF(type);
        Py_XDECREF(index);
        return -1;
    }
    const char *tname = PyUnicode_AsUTF8(type);
    if (tname && strcmp(tname, "cpu") == 0) {
        v->device = -1;
    } else if (tname && strcmp(tname, "cuda") == 0) {
        v->device = index == Py_None ? 0 : (int)PyLong_AsLong(index);
    } else {
        PyErr_Format(PyExc_ValueError, "%s is on device type '%s', expected cpu or cuda", argname,
                     tname ? tname : "?");
        Py_DECREF(type);
        Py_DECREF(index);
        return -1;
    }
    Py_DECREF(type);
    Py_DECREF(index);
    long long numel = call_ll(t, "numel");
    long long ptr = call_ll(t, "data_ptr");
    if (numel < 0 || (ptr == -1 && PyErr_Occurred()))
        return -1;
    v->numel = (size_t)numel;
    v->ptr = (void *)(uintptr_t)ptr;
    return 0;
}

/* For py_compress.c: read_tensor's checks with the view's fields as out-parameters. */
int axc_py_read_tensor(PyObject *t, const char *argname, void **ptr, size_t *numel,
                       axc_dtype *dtype, int *device)
{
    tensor_view v;
    if (read_tensor(t, argname, &v) < 0)
        return -1;
    *ptr = v.ptr;
    *numel = v.numel;
    *dtype = v.dtype;
    *device = v.device;
    return 0;
}

/* The staged result into the output's current memory (after a resize_, its first bytes). */
static int unstage(WorkObject *self)
{
    tensor_view out;
    if (read_tensor(PyTuple_GET_ITEM(self->keep, 0), "output", &out) < 0)
        return -1;
    size_t bytes = out.numel * axc_dtype_size(out.dtype);
    memcpy(out.ptr, self->stage + self->stage_out_off,
           bytes < self->stage_out_bytes ? bytes : self->stage_out_bytes);
    return 0;
}

/* ------------------------------------------------------------------ collectives */

/* Starts `c` on group `gk` and returns its Work (async_op) or None once it finished. Steals
 * `keep` (the tensors that must outlive the collective; may be NULL) and `stage` (a private
 * copy the collective works on, or NULL: see WorkObject; its result is at stage_out_off).
 * Also used by py_compress.c. */
PyObject *axc_py_start_collective(axc_group_kind gk, const axc_coll *c, PyObject *keep,
                                  int async_op, unsigned char *stage, size_t stage_out_off,
                                  size_t stage_out_bytes)
{
    axc_work *w = NULL;
    axc_status st;
    axc_comm *comm = axc_py_comm(); /* (read with the GIL held) */
    /* without the GIL: a start can block (NCCL connects lazily, on a communicator's first
     * collective, until the peers issue theirs), and other threads may be the ones to issue */
    Py_BEGIN_ALLOW_THREADS st = axc_comm_start(comm, gk, c, &w);
    Py_END_ALLOW_THREADS if (st != AXC_OK)
    {
        Py_XDECREF(keep);
        free(stage);
        return axc_py_raise(st);
    }
    WorkObject *wo = PyObject_New(WorkObject, &WorkType);
    if (!wo) {
        Py_BEGIN_ALLOW_THREADS axc_work_wait(w); /* (it works on `stage`) */
        Py_END_ALLOW_THREADS axc_work_free(w);
        Py_XDECREF(keep);
        free(stage);
        return NULL;
    }
    wo->work = w;
    wo->keep = keep;
    wo->done = 0;
    wo->stage = stage;
    wo->stage_out_off = stage_out_off;
    wo->stage_out_bytes = stage_out_bytes;
    if (async_op)
        return (PyObject *)wo;
    int rc = work_finish(wo);
    Py_DECREF(wo);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* coll(kind, group, output, input, op, root, stream, async) */
static PyObject *py_collective(PyObject *self, PyObject *args)
{
    (void)self;
    int kind, root, async_op;
    const char *group, *opname;
    PyObject *out_t, *in_t;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "isOOsiKp", &kind, &group, &out_t, &in_t, &opname, &root,
                          &stream, &async_op))
        return NULL;
    if (require_init() < 0)
        return NULL;
    axc_group_kind gk;
    axc_redop op;
    axc_status st = axc_group_from_name(group, &gk);
    if (st == AXC_OK)
        st = axc_redop_from_name(opname, &op);
    if (st != AXC_OK)
        return axc_py_raise(st);
    if (kind < 0 || kind >= AXC_COLL_COUNT) {
        PyErr_Format(PyExc_ValueError, "unknown collective %d", kind);
        return NULL;
    }
    axc_coll c;
    memset(&c, 0, sizeof c);
    c.kind = (axc_coll_kind)kind;
    c.op = op;
    c.root = root;
    c.device = -1;
    c.stream = (void *)(uintptr_t)stream;
    PyObject *keep = NULL;
    unsigned char *stage = NULL;
    size_t in_bytes = 0, out_bytes = 0;
    int same = 0;
    if (c.kind != AXC_COLL_BARRIER) {
        tensor_view out, in;
        if (read_tensor(out_t, "output", &out) < 0 || read_tensor(in_t, "input", &in) < 0)
            return NULL;
        if (out.dtype != in.dtype || out.device != in.device) {
            PyErr_Format(PyExc_ValueError,
                         "%s: input (%s, %s%d) and output (%s, %s%d) must have the same dtype "
                         "and device",
                         axc_coll_name(c.kind), axc_dtype_name(in.dtype),
                         in.device < 0 ? "cpu" : "cuda:", in.device < 0 ? 0 : in.device,
                         axc_dtype_name(out.dtype), out.device < 0 ? "cpu" : "cuda:",
                         out.device < 0 ? 0 : out.device);
            return NULL;
        }
        int G = axc_grid_group_size(axc_comm_grid(axc_py_comm()), gk);
        size_t expect_out = in.numel;
        switch (c.kind) {
        case AXC_COLL_ALL_GATHER: expect_out = in.numel * (size_t)G; break;
        case AXC_COLL_REDUCE_SCATTER:
            if (in.numel % (size_t)G) {
                PyErr_Format(PyExc_ValueError,
                             "reduce_scatter: input has %zu elements, not divisible by the %s "
                             "group size %d",
                             in.numel, group, G);
                return NULL;
            }
            expect_out = in.numel / (size_t)G;
            break;
        case AXC_COLL_ALL_TO_ALL:
            if (in.numel % (size_t)G) {
                PyErr_Format(PyExc_ValueError,
                             "all_to_all: input has %zu elements, not divisible by the %s group "
                             "size %d",
                             in.numel, group, G);
                return NULL;
            }
            break;
        default: break;
        }
        if (out.numel != expect_out) {
            PyErr_Format(PyExc_ValueError,
                         "%s over the %s group of size %d: output has %zu elements, expected %zu "
                         "(input has %zu)",
                         axc_coll_name(c.kind), group, G, out.numel, expect_out, in.numel);
            return NULL;
        }
        int aliasing_ok = c.kind == AXC_COLL_ALL_REDUCE || c.kind == AXC_COLL_BROADCAST;
        size_t esize = axc_dtype_size(in.dtype);
        uintptr_t ib = (uintptr_t)in.ptr, ie = ib + in.numel * esize;
        uintptr_t ob = (uintptr_t)out.ptr, oe = ob + out.numel * esize;
        same = ib == ob && ie == oe;
        int overlap = in.numel && out.numel && ib < oe && ob < ie;
        if (overlap && !(same && (aliasing_ok || G == 1))) {
            PyErr_Format(PyExc_ValueError,
                         "%s: input and output %s (only all_reduce and broadcast work in place, "
                         "on one tensor); pass separate tensors",
                         axc_coll_name(c.kind),
                         same ? "are the same memory" : "partially overlap in memory");
            return NULL;
        }
        if (async_op && in.device < 0) { /* stage: see WorkObject */
            in_bytes = same ? 0 : in.numel * esize;
            out_bytes = out.numel * esize;
            stage = malloc(in_bytes + out_bytes + 1);
            if (!stage)
                return PyErr_NoMemory();
            memcpy(stage, same ? out.ptr : in.ptr, same ? out_bytes : in_bytes);
            out.ptr = stage + in_bytes;
            in.ptr = same ? out.ptr : stage;
        }
        c.send = in.ptr;
        c.recv = out.ptr;
        c.dtype = in.dtype;
        c.device = in.device;
        c.count = (c.kind == AXC_COLL_REDUCE_SCATTER)  ? out.numel
                  : (c.kind == AXC_COLL_ALL_TO_ALL) ? in.numel / (size_t)G
                                                        : in.numel;
        if (c.device >= 0 && c.kind == AXC_COLL_ALL_TO_ALL && G == 0)
            return NULL;
        keep = PyTuple_Pack(2, out_t, in_t);
        if (!keep) {
            free(stage);
            return NULL;
        }
    }
    return axc_py_start_collective(gk, &c, keep, async_op, stage, in_bytes, out_bytes);
}

/* ------------------------------------------------------------------ stats and build info */

static PyObject *py_comm_stats(PyObject *self, PyObject *args)
{
    (void)self;
    int reset = 0;
    if (!PyArg_ParseTuple(args, "|p", &reset))
        return NULL;
    if (require_init() < 0)
        return NULL;
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    for (int k = 0; k < AXC_GROUP_COUNT; k++) {
        axc_counters c;
        axc_comm_counters(axc_py_comm(), (axc_group_kind)k, &c);
        /* bytes_*: wire bytes; logical_bytes_*: the same traffic uncompressed */
        PyObject *e = Py_BuildValue(
            "{s:K,s:K,s:K,s:K,s:K,s:K}", "bytes_sent", (unsigned long long)c.bytes_sent,
            "bytes_recv", (unsigned long long)c.bytes_recv, "calls", (unsigned long long)c.calls,
            "logical_bytes_sent", (unsigned long long)c.logical_bytes_sent, "logical_bytes_recv",
            (unsigned long long)c.logical_bytes_recv, "compressed_calls",
            (unsigned long long)c.compressed_calls);
        if (!e || PyDict_SetItemString(d, axc_group_name((axc_group_kind)k), e) < 0) {
            Py_XDECREF(e);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(e);
    }
    if (reset)
        axc_comm_reset_counters(axc_py_comm());
    return d;
}

static PyObject *py_reset_comm_stats(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    if (require_init() < 0)
        return NULL;
    axc_comm_reset_counters(axc_py_comm());
    Py_RETURN_NONE;
}

#ifndef AXC_BUILD_SUMMARY
#define AXC_BUILD_SUMMARY "unknown"
#endif

static PyObject *py_build_info(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    const axc_cuda_api *cu = NULL;
    axc_status st = axc_cuda_load(&cu);
    PyObject *cuda_rt;
    if (st == AXC_OK)
        cuda_rt = PyLong_FromLong(cu->runtime_version);
    else
        cuda_rt = PyUnicode_FromFormat("unavailable: %s", axc_last_error());
    int nccl_rt = axc_nccl_runtime_version();
    PyObject *nccl = nccl_rt > 0 ? PyLong_FromLong(nccl_rt)
                                 : PyUnicode_FromFormat("unavailable: %s", axc_last_error());
    return Py_BuildValue("{s:s,s:O,s:i,s:O,s:i,s:N,s:N,s:s}", "summary", AXC_BUILD_SUMMARY,
                         "cuda_compiled", axc_cuda_compiled() ? Py_True : Py_False,
                         "cuda_header_version", axc_cuda_header_version(), "nccl_compiled",
                         axc_nccl_header_version() > 0 ? Py_True : Py_False,
                         "nccl_header_version", axc_nccl_header_version(), "cuda_runtime", cuda_rt,
                         "nccl_runtime", nccl, "backends",
                         axc_py_comm() ? axc_comm_backends(axc_py_comm()) : "");
}

PyMethodDef axc_py_comm_methods[] = {
    {"init", (PyCFunction)(void (*)(void))py_init, METH_VARARGS | METH_KEYWORDS,
     "Creates the communicator (internal; use axonn_c.init)."},
    {"finalize", py_finalize, METH_NOARGS, "Releases the communicator."},
    {"is_initialized", py_is_initialized, METH_NOARGS, "True between init and finalize."},
    {"abort_interrupted", py_abort_interrupted, METH_O,
     "abort_interrupted(why): with peers, every collective of the job, pending or later, fails "
     "naming the interrupted run_concurrent (every rank's on shm); init() again to go on."},
    {"set_thread_channel", py_set_thread_channel, METH_O,
     "set_thread_channel(c): the calling thread's collectives use channel c."},
    {"grid_info", py_grid_info, METH_NOARGS, "Sizes, this rank's coordinates, backends."},
    {"grid_members", py_grid_members, METH_VARARGS, "Group members for a grid (pure math)."},
    {"collective", py_collective, METH_VARARGS, "Starts a collective (internal)."},
    {"comm_stats", py_comm_stats, METH_VARARGS, "Per-group byte counters."},
    {"reset_comm_stats", py_reset_comm_stats, METH_NOARGS, "Zeroes the byte counters."},
    {"build_info", py_build_info, METH_NOARGS, "What was compiled in and what was found."},
    {NULL, NULL, 0, NULL}};
