/* The end of a backward pass for the deferred gradients (axonn_c/grads.py's finish,
 * drop_if_abandoned, queue_finish): an autograd engine callback, queued once per pass (keyed by
 * the pass's graph-task id), completes every pending gradient when the pass ends.
 *
 * The callback is an EndOfBackward object. The engine holds it while the pass is alive and lets
 * it go when the pass ends, also when the pass raised (then it never runs): the records hold a
 * weak reference to it, which tells whether pending gradients still belong to a running pass
 * (_C.grad_pass_alive). */
#include "py_common.h"

#include "axc/layer_residuals.h"
#include "axc/sched.h"

static PyObject *g_task_id;      /* torch._C._current_graph_task_id */
static PyObject *g_queue;        /* torch.autograd.Variable._execution_engine.queue_callback */
static PyObject *g_is_enabled, *g_set_enabled; /* torch._C.is_grad_enabled, _set_grad_enabled */
static unsigned long g_finishes; /* finish() calls: grad_records_stats()["finishes"] */

static axc_grad_records *recs(void) { return axc_runtime_records(axc_py_runtime()); }

/* the running pass's graph-task id (-1 outside backward); -2 with an exception */
static long long current_task(void)
{
    if (!g_task_id) {
        PyObject *tc = PyImport_ImportModule("torch._C");
        g_task_id = tc ? PyObject_GetAttrString(tc, "_current_graph_task_id") : NULL;
        Py_XDECREF(tc);
        if (!g_task_id)
            return -2;
    }
    PyObject *t = PyObject_CallNoArgs(g_task_id);
    long long v = t ? PyLong_AsLongLong(t) : -1;
    Py_XDECREF(t);
    return PyErr_Occurred() ? -2 : v;
}

static int pass_alive(void)
{
    PyObject *wr = axc_records_pass_owner(recs()), *o = NULL;
    if (!wr)
        return 0;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(wr, &o) < 0)
        PyErr_Clear();
    Py_XDECREF(o);
#else
    o = PyWeakref_GetObject(wr);
    o = o == Py_None ? NULL : o;
#endif
    return o != NULL;
}

/* the scheduler's fn without the GIL (nothing to do when not initialised); -1 with an exception */
static int sched_run(axc_status (*fn)(axc_sched *))
{
    axc_sched *s = axc_py_sched();
    if (!s)
        return 0;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = fn(s);
    Py_END_ALLOW_THREADS
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* Drops the pending work of a backward pass that raised before its end (its callback never ran,
 * and the engine let it go): its deferred work completes, so nothing is left reading freed
 * memory, and the deferred Linear weight gradients are dropped, not set, so the next backward or
 * sync_gradients does not find a half pass's values in .grad (a hooked parameter, e.g. a bias,
 * keeps what autograd accumulated before the error, as without overlap). A pass still running,
 * on any thread, keeps its records. Not on a micro-batch thread: those own no pass, and the
 * caller's run_concurrent reducer may be summing through the buckets meanwhile. */
int axc_py_grad_drop_if_abandoned(void)
{
    if (axc_runtime_grads_idle(axc_py_runtime()) || axc_microbatch_thread() || pass_alive())
        return 0;
    axc_records_set_task(recs(), AXC_NO_PASS);
    /* (the records hold what the queued dW GEMMs write: dropped after; the half step's layer
     * order is not learned; the depth residuals' uses the wait completes are released) */
    uint64_t gen = axc_layer_residuals_pass_begin(axc_runtime_layer_residuals(axc_py_runtime()));
    int rc = sched_run(axc_sched_finish);
    if (rc == 0)
        rc = sched_run(axc_sched_step_abort);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = axc_py_grad_records_drop(gen); /* taken .grads put back */
    if (et) { /* (the first error wins) */
        Py_XDECREF(r);
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    Py_XDECREF(r);
    return r ? rc : -1;
}

/* torch's grad mode: 1 on, 0 off, -1 with an exception */
int axc_py_grad_enabled(void)
{
    if (!g_is_enabled) {
        PyObject *tc = PyImport_ImportModule("torch._C");
        g_is_enabled = tc ? PyObject_GetAttrString(tc, "is_grad_enabled") : NULL;
        g_set_enabled = tc ? PyObject_GetAttrString(tc, "_set_grad_enabled") : NULL;
        Py_XDECREF(tc);
        if (!g_is_enabled || !g_set_enabled)
            return -1;
    }
    PyObject *r = PyObject_CallNoArgs(g_is_enabled);
    int on = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    return on;
}

int axc_py_set_grad_enabled(int on)
{
    PyObject *r = PyObject_CallOneArg(g_set_enabled, on ? Py_True : Py_False);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

PyObject *axc_py_grad_finish(void)
{
    g_finishes++;
    if (axc_py_grad_drop_if_abandoned() < 0) /* a pass that raised: dropped, not set */
        return NULL;
    /* (under no_grad: a .grad of create_graph=True has a graph the sums must not extend) */
    int on = axc_py_grad_enabled();
    if (on < 0 || (on && axc_py_set_grad_enabled(0) < 0))
        return NULL;
    PyObject *r = axc_py_grad_records_finish();
    if (on) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (axc_py_set_grad_enabled(1) < 0 && !et) {
            Py_XDECREF(r);
            return NULL;
        }
        PyErr_Restore(et, ev, tb);
    }
    return r;
}

/* ---- the engine callback */
typedef struct {
    PyObject_HEAD
    PyObject *weaklist;
} EndOfBackward;

static PyObject *end_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "EndOfBackward() takes no arguments");
        return NULL;
    }
    /* (this callback, alive while it runs, still tells that the pass is on) */
    axc_records_set_task(recs(), AXC_NO_PASS);
    PyObject *r = axc_py_grad_finish();
    if (!r)
        return NULL;
    Py_DECREF(r);
    if (sched_run(axc_sched_step_end) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static void end_dealloc(PyObject *self)
{
    EndOfBackward *e = (EndOfBackward *)self;
    if (e->weaklist)
        PyObject_ClearWeakRefs(self);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject EndOfBackwardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "axonn_c._C.EndOfBackward",
    .tp_basicsize = sizeof(EndOfBackward),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The end-of-backward callback: completes every pending gradient and ends the "
              "scheduler's step.",
    .tp_weaklistoffset = offsetof(EndOfBackward, weaklist),
    .tp_dealloc = end_dealloc,
    .tp_call = end_call,
};

/* Completes the pending gradients when the current backward pass ends (once per pass). Keyed by
 * the pass's graph-task id, so a pass that raised (its callbacks dropped) blocks no later one. */
int axc_py_grad_queue_finish(void)
{
    long long task = current_task();
    if (task == -2)
        return -1;
    if (task == axc_records_pass_task(recs()))
        return 0;
    if (!g_queue) {
        PyObject *ag = PyImport_ImportModule("torch.autograd");
        PyObject *var = ag ? PyObject_GetAttrString(ag, "Variable") : NULL;
        PyObject *eng = var ? PyObject_GetAttrString(var, "_execution_engine") : NULL;
        g_queue = eng ? PyObject_GetAttrString(eng, "queue_callback") : NULL;
        Py_XDECREF(ag);
        Py_XDECREF(var);
        Py_XDECREF(eng);
        if (!g_queue)
            return -1;
    }
    PyObject *cb = EndOfBackwardType.tp_alloc(&EndOfBackwardType, 0);
    PyObject *r = cb ? PyObject_CallOneArg(g_queue, cb) : NULL;
    PyObject *wr = r ? PyWeakref_NewRef(cb, NULL) : NULL;
    Py_XDECREF(r);
    Py_XDECREF(cb); /* (the engine holds it) */
    if (!wr)
        return -1;
    axc_records_set_pass(recs(), task, wr);
    return 0;
}

static PyObject *py_finish(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return axc_py_grad_finish();
}

static PyObject *none_unless_failed(int rc) { return rc < 0 ? NULL : Py_NewRef(Py_None); }

static PyObject *py_drop_if_abandoned(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return none_unless_failed(axc_py_grad_drop_if_abandoned());
}

static PyObject *py_queue_finish(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return none_unless_failed(axc_py_grad_queue_finish());
}

static PyObject *py_finishes(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromUnsignedLong(g_finishes);
}

int axc_py_grad_pass_add_types(PyObject *module)
{
    return axc_py_add_type(module, &EndOfBackwardType, "EndOfBackward");
}

PyMethodDef axc_py_grad_pass_methods[] = {
    {"grad_finish", py_finish, METH_NOARGS,
     "grad_finish(): completes every pending gradient (a pass that raised is dropped first)"},
    {"grad_drop_if_abandoned", py_drop_if_abandoned, METH_NOARGS,
     "grad_drop_if_abandoned(): drops the pending work of a backward pass that raised"},
    {"grad_queue_finish", py_queue_finish, METH_NOARGS,
     "grad_queue_finish(): completes the pending gradients when this backward pass ends"},
    {"grad_finishes", py_finishes, METH_NOARGS,
     "grad_finishes() -> int: how often grad_finish ran (tests count them)"},
    {NULL, NULL, 0, NULL},
};
