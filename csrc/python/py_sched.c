/* Bindings of the scheduler (csrc/sched/sched.c): one per communicator, opened and closed with
 * it by the runtime (csrc/runtime/runtime.c). Parsing only; the policy lives in the core. Every
 * call into it releases the GIL: the scheduler's lock is held while torch's CUDA caching
 * allocator runs (gathered weights), and that allocator may take the GIL (memory history
 * recording Python stacks), so a thread holding the GIL must never wait for that lock. */
#include <limits.h>
#include <stdint.h>

#include "axc/chunk_plan.h"
#include "axc/sched.h"
#include "py_common.h"

static axc_sched *sched_or_raise(void)
{
    axc_sched *s = axc_py_sched();
    if (!s)
        PyErr_SetString(PyExc_RuntimeError,
                        "axonn_c is not initialised: call axonn_c.init(...) first");
    return s;
}

/* sched_configure(prefetch, budget_bytes, cache) */
static PyObject *py_sched_configure(PyObject *self, PyObject *args)
{
    (void)self;
    axc_sched_config cfg;
    long long budget;
    if (!PyArg_ParseTuple(args, "iLp", &cfg.prefetch, &budget, &cfg.cache))
        return NULL;
    cfg.budget_bytes = budget;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_sched_configure(s, &cfg);
    Py_END_ALLOW_THREADS if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_sched_layer_new(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    int id;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_sched_layer_new(s, &id);
    Py_END_ALLOW_THREADS if (st != AXC_OK)
        return axc_py_raise(st);
    return PyLong_FromLong(id);
}

/* sched_forget(id): the layer is gone: its gathered weight, the last shard it passed and its
 * depth dW residual (an id reused by another layer starts from zeros); no-op when not
 * initialised (a layer outliving finalize) */
static PyObject *py_sched_forget(PyObject *self, PyObject *args)
{
    (void)self;
    int id;
    if (!PyArg_ParseTuple(args, "i", &id))
        return NULL;
    axc_sched *s = axc_py_sched(); /* (read with the GIL held) */
    if (s) {
        Py_BEGIN_ALLOW_THREADS axc_sched_forget(s, id);
        Py_END_ALLOW_THREADS
        axc_layer_residuals_forget(axc_runtime_layer_residuals(axc_py_runtime()), id);
        axc_runtime_forget_shard(axc_py_runtime(), id);
    }
    Py_RETURN_NONE;
}

typedef axc_status (*sched_fn)(axc_sched *);

static PyObject *run_blocking(sched_fn fn)
{
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = fn(s);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_sched_finish(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return run_blocking(axc_sched_finish);
}

static PyObject *py_sched_step_end(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return run_blocking(axc_sched_step_end);
}

static PyObject *py_sched_step_abort(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return run_blocking(axc_sched_step_abort);
}

/* sched_reduce_after_deferred(group, ptr, count, dtype, device, stream): all-reduce (sum) in
 * place on `group`, after everything deferred so far; completed by sched_finish */
static PyObject *py_sched_reduce(PyObject *self, PyObject *args)
{
    (void)self;
    const char *group, *dtype;
    unsigned long long p, stream;
    long long count;
    int device;
    if (!PyArg_ParseTuple(args, "sKLsiK", &group, &p, &count, &dtype, &device, &stream))
        return NULL;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_group_kind kind;
    axc_coll c = {0};
    axc_status st = axc_group_from_name(group, &kind);
    if (st == AXC_OK)
        st = axc_dtype_from_name(dtype, &c.dtype);
    if (st != AXC_OK)
        return axc_py_raise(st);
    c.kind = AXC_COLL_ALL_REDUCE;
    c.send = c.recv = (void *)(uintptr_t)p;
    c.count = (size_t)count;
    c.op = AXC_RED_SUM;
    c.device = device;
    c.stream = (void *)(uintptr_t)stream;
    Py_BEGIN_ALLOW_THREADS st = axc_sched_start_after_deferred(s, kind, &c, NULL);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_sched_stats(PyObject *self, PyObject *args)
{
    (void)self;
    int reset = 0;
    if (!PyArg_ParseTuple(args, "|p", &reset))
        return NULL;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_sched_stats t;
    Py_BEGIN_ALLOW_THREADS axc_sched_stats_get(s, &t);
    if (reset)
        axc_sched_stats_reset(s);
    Py_END_ALLOW_THREADS
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:i,s:K,s:L,s:L,s:K,s:K,s:K,s:K}",
        "visits",
        t.visits,
        "hits", t.hits, "waits", t.waits, "misses", t.misses, "prefetches", t.prefetches,
        "budget_skips", t.budget_skips, "stale", t.stale, "relearned", t.relearned, "off_order",
        t.off_order, "deferred", t.deferred, "alive_bytes", t.alive_bytes, "peak_bytes",
        t.peak_bytes, "alive_buffers", t.alive_buffers, "peak_buffers", t.peak_buffers,
        "torch_buffers", t.torch_buffers,
        "order_len", (long long)t.order_len, "pending", (long long)t.pending, "tasks", t.tasks,
        "tasks_run", t.tasks_run, "results_held", t.results_held, "results_done",
        t.results_done);
}

/* sched_counters() -> (tasks_run, results_held, results_done): the never-reset numbers that say
 * which deferred tasks have run (task k once k <= tasks_run) and which held results are done */
static PyObject *py_sched_counters(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_sched_stats t;
    Py_BEGIN_ALLOW_THREADS axc_sched_stats_get(s, &t);
    Py_END_ALLOW_THREADS return Py_BuildValue("(KKK)", t.tasks_run, t.results_held, t.results_done);
}

/* sched_await_result(ptr, bytes): completes the held results up to the newest one writing
 * [ptr, ptr + bytes) */
static PyObject *py_sched_await_result(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long p, bytes;
    if (!PyArg_ParseTuple(args, "KK", &p, &bytes))
        return NULL;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_sched_await_result(s, (const void *)(uintptr_t)p,
                                                       (size_t)bytes);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* sched_await_number(k): completes the held results numbered up to k */
static PyObject *py_sched_await_number(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long k;
    if (!PyArg_ParseTuple(args, "K", &k))
        return NULL;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_sched_await_number(s, (uint64_t)k);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_sched_await_results(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return run_blocking(axc_sched_await_results);
}

static const char *const event_names[] = {"hit", "wait", "miss", "prefetch"};
static const char *const phase_names[] = {"fwd", "bwd"};

static PyObject *events_to_list(const axc_sched_event *ev, size_t n, int with_kind)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *t = with_kind ? Py_BuildValue("(sis)", event_names[ev[i].kind], ev[i].layer,
                                                phase_names[ev[i].phase])
                                : Py_BuildValue("(is)", ev[i].layer, phase_names[ev[i].phase]);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    return out;
}

/* sched_log() -> [(event, layer, phase)] since the last call */
static PyObject *py_sched_log(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    axc_sched_event *ev = PyMem_Malloc(AXC_SCHED_LOG_CAP * sizeof *ev);
    if (!ev)
        return PyErr_NoMemory();
    size_t n;
    Py_BEGIN_ALLOW_THREADS n = axc_sched_log_take(s, ev, AXC_SCHED_LOG_CAP);
    Py_END_ALLOW_THREADS
    PyObject *out = events_to_list(ev, n, 1);
    PyMem_Free(ev);
    return out;
}

/* sched_order() -> [(layer, phase)]: the learned order */
static PyObject *py_sched_order(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    int64_t n;
    Py_BEGIN_ALLOW_THREADS n = axc_sched_order(s, NULL, 0);
    Py_END_ALLOW_THREADS axc_sched_event *ev =
        PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof *ev);
    if (!ev)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS n = axc_sched_order(s, ev, (size_t)n);
    Py_END_ALLOW_THREADS
    PyObject *out = events_to_list(ev, (size_t)n, 0);
    PyMem_Free(ev);
    return out;
}

/* ChunkPlan(chunks, holds): axonn_c.Sequential's chunk order (axc/chunk_plan.h) carried out on
 * the scheduler: next() awaits the oldest held reduction whenever every chunk waits and returns
 * (chunk, child) to call next, or None at the end; ran() after that call says whether it left
 * its chunk waiting (a result held, or a child planned to hold one). */
typedef struct {
    PyObject_HEAD
    axc_chunk_plan *plan;
    uint64_t held_before; /* the scheduler's held-result count when the call was handed out */
} ChunkPlan;

static uint64_t results_held(axc_sched *s) /* (releases the GIL: the scheduler's lock) */
{
    axc_sched_stats t;
    Py_BEGIN_ALLOW_THREADS axc_sched_stats_get(s, &t);
    Py_END_ALLOW_THREADS return t.results_held;
}

static PyObject *chunk_plan_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    int chunks;
    PyObject *holds_obj;
    static char *names[] = {"chunks", "holds", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO", names, &chunks, &holds_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(holds_obj, "ChunkPlan: holds must be a sequence of bools");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    unsigned char *holds = PyMem_Malloc(n ? (size_t)n : 1);
    int bad = !holds;
    for (Py_ssize_t i = 0; !bad && i < n; i++) {
        int v = PyObject_IsTrue(PySequence_Fast_GET_ITEM(seq, i));
        bad = v < 0;
        holds[i] = (unsigned char)(v > 0);
    }
    Py_DECREF(seq);
    ChunkPlan *self = NULL;
    if (!bad && n > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "ChunkPlan: %zd children (expected at most %d)", n,
                     INT_MAX);
        bad = 1;
    }
    if (!bad) {
        axc_chunk_plan *plan;
        axc_status st = axc_chunk_plan_new(chunks, (int)n, holds, &plan);
        if (st != AXC_OK)
            axc_py_raise(st);
        else if (!(self = (ChunkPlan *)type->tp_alloc(type, 0)))
            axc_chunk_plan_free(plan);
        else
            self->plan = plan;
    } else if (!holds)
        PyErr_NoMemory();
    PyMem_Free(holds);
    return (PyObject *)self;
}

static void chunk_plan_dealloc(PyObject *o)
{
    axc_chunk_plan_free(((ChunkPlan *)o)->plan);
    Py_TYPE(o)->tp_free(o);
}

static PyObject *chunk_plan_next(PyObject *o, PyObject *noargs)
{
    (void)noargs;
    ChunkPlan *self = (ChunkPlan *)o;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    for (;;) {
        int chunk, layer;
        uint64_t number;
        axc_chunk_step step = axc_chunk_plan_next(self->plan, &chunk, &layer, &number);
        if (step == AXC_CHUNK_DONE)
            Py_RETURN_NONE;
        if (step == AXC_CHUNK_RUN) {
            self->held_before = results_held(s);
            return Py_BuildValue("(ii)", chunk, layer);
        }
        if (number) { /* (the chunk's value, kept by the caller, keeps its memory alive) */
            axc_status st;
            Py_BEGIN_ALLOW_THREADS st = axc_sched_await_number(s, number);
            Py_END_ALLOW_THREADS
            if (st != AXC_OK)
                return axc_py_raise(st);
        }
    }
}

static PyObject *chunk_plan_ran(PyObject *o, PyObject *noargs)
{
    (void)noargs;
    ChunkPlan *self = (ChunkPlan *)o;
    axc_sched *s = sched_or_raise();
    if (!s)
        return NULL;
    uint64_t after = results_held(s);
    return PyBool_FromLong(
        axc_chunk_plan_ran(self->plan, after != self->held_before ? after : 0));
}

static PyMethodDef chunk_plan_methods[] = {
    {"next", chunk_plan_next, METH_NOARGS,
     "next() -> (chunk, child) to call next, or None: awaits the oldest held reduction while "
     "every chunk waits"},
    {"ran", chunk_plan_ran, METH_NOARGS,
     "ran() -> bool: the call next() handed out returned; whether its chunk now waits"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ChunkPlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "axonn_c._C.ChunkPlan",
    .tp_basicsize = sizeof(ChunkPlan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ChunkPlan(chunks, holds): axonn_c.Sequential's chunk order on the scheduler",
    .tp_new = chunk_plan_new,
    .tp_dealloc = chunk_plan_dealloc,
    .tp_methods = chunk_plan_methods,
};

int axc_py_sched_add_types(PyObject *module)
{
    return axc_py_add_type(module, &ChunkPlanType, "ChunkPlan");
}

PyMethodDef axc_py_sched_methods[] = {
    {"sched_configure", py_sched_configure, METH_VARARGS,
     "Prefetch depth, memory budget (bytes, 0 = none) and weight caching."},
    {"sched_layer_new", py_sched_layer_new, METH_NOARGS, "A new layer id."},
    {"sched_forget", py_sched_forget, METH_VARARGS, "Drops a layer's gathered weight."},
    {"sched_finish", py_sched_finish, METH_NOARGS, "Waits for every deferred collective."},
    {"sched_step_end", py_sched_step_end, METH_NOARGS, "Ends the step (learns the order)."},
    {"sched_step_abort", py_sched_step_abort, METH_NOARGS,
     "Ends a step that did not complete (does not learn its order)."},
    {"sched_reduce_after_deferred", py_sched_reduce, METH_VARARGS,
     "Starts an in-place sum all-reduce after the deferred collectives; finished by sched_finish."},
    {"sched_stats", py_sched_stats, METH_VARARGS, "Scheduler counters."},
    {"sched_counters", py_sched_counters, METH_NOARGS,
     "(tasks_run, results_held, results_done): deferred tasks run, results held and awaited."},
    {"sched_await_result", py_sched_await_result, METH_VARARGS,
     "Completes the held results up to the newest one writing [ptr, ptr + bytes)."},
    {"sched_await_number", py_sched_await_number, METH_VARARGS,
     "Completes the held results numbered up to k."},
    {"sched_await_results", py_sched_await_results, METH_NOARGS, "Completes every held result."},
    {"sched_log", py_sched_log, METH_NOARGS, "Events since the last call."},
    {"sched_order", py_sched_order, METH_NOARGS, "The learned layer order."},
    {NULL, NULL, 0, NULL}};
