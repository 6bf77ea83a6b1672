/* Bindings of the runtime's timeline (axc/timeline.h, axc_runtime_timeline): enable/clear, the
 * recorded spans, the summary, and a compute-span recorder for Python callers. */
#include "py_common.h"

#include "axc/grid.h"
#include "axc/timeline.h"

/* the runtime's timeline (made with the module, kept across init/finalize) */
static axc_timeline *timeline(void) { return axc_runtime_timeline(axc_py_runtime()); }

static PyObject *py_timeline_enable(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    axc_status st = axc_timeline_enable_checked(timeline(), on);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_timeline_enabled(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(axc_timeline_enabled(timeline()));
}

static PyObject *py_timeline_clear(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_timeline_clear(timeline());
    Py_RETURN_NONE;
}

static PyObject *py_timeline_free(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_timeline_free(timeline());
    Py_RETURN_NONE;
}

static PyObject *py_timeline_set_capacity(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n <= 0) {
        PyErr_Format(PyExc_ValueError, "timeline capacity must be in [1, %zu] spans, got %zd",
                     AXC_TIMELINE_MAX_CAPACITY, n);
        return NULL;
    }
    axc_status st = axc_timeline_set_capacity(timeline(), (size_t)n);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_timeline_now(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLongLong((long long)axc_timeline_now());
}

static PyObject *group_name_or_none(int group)
{
    if (group < 0 || group >= AXC_GROUP_COUNT)
        Py_RETURN_NONE;
    return PyUnicode_FromString(axc_group_name((axc_group_kind)group));
}

static PyObject *py_timeline_spans(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_timeline *tl = timeline();
    size_t n = axc_timeline_count(tl);
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        axc_span s;
        if (axc_timeline_get(tl, i, &s) != AXC_OK)
            continue; /* being written or cleared concurrently */
        PyObject *g = group_name_or_none(s.kind != AXC_SPAN_COMPUTE ? s.group : -1);
        if (!g)
            goto fail;
        PyObject *t = Py_BuildValue("(isNLLKi)", s.kind, s.name, g, (long long)s.t_begin,
                                    (long long)s.t_end, (unsigned long long)s.bytes, s.channel);
        if (!t)
            goto fail;
        int rc = PyList_Append(list, t);
        Py_DECREF(t);
        if (rc < 0)
            goto fail;
    }
    return list;
fail:
    Py_DECREF(list);
    return NULL;
}

static PyObject *py_timeline_summary(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_timeline_stats st;
    axc_status s;
    axc_timeline *tl = timeline();
    Py_BEGIN_ALLOW_THREADS
    s = axc_timeline_summary(tl, &st);
    Py_END_ALLOW_THREADS
    if (s != AXC_OK)
        return axc_py_raise(s);
    PyObject *per = PyDict_New();
    if (!per)
        return NULL;
    for (int g = 0; g < AXC_GROUP_COUNT; g++) {
        const axc_timeline_group_stats *gs = &st.group[g];
        if (!gs->spans)
            continue;
        PyObject *d = Py_BuildValue("{s:d,s:d,s:K,s:K}", "comm_s", gs->comm_ns * 1e-9, "exposed_s",
                                    gs->exposed_ns * 1e-9, "bytes", (unsigned long long)gs->bytes,
                                    "spans", (unsigned long long)gs->spans);
        if (!d || PyDict_SetItemString(per, axc_group_name((axc_group_kind)g), d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(per);
            return NULL;
        }
        Py_DECREF(d);
    }
    return Py_BuildValue("{s:d,s:d,s:d,s:d,s:N,s:n,s:n,s:n,s:n,s:K,s:d}", "compute_s",
                         st.compute_ns * 1e-9, "comm_s", st.comm_ns * 1e-9, "exposed_comm_s",
                         st.exposed_comm_ns * 1e-9, "wait_s", st.wait_ns * 1e-9, "per_group",
                         per, "spans", (Py_ssize_t)st.spans, "compute_spans",
                         (Py_ssize_t)st.compute_spans, "comm_spans", (Py_ssize_t)st.comm_spans,
                         "wait_spans", (Py_ssize_t)st.wait_spans,
                         "dropped", (unsigned long long)st.dropped, "wall_s",
                         (st.t_last - st.t_first) * 1e-9);
}

static PyObject *py_timeline_record_compute(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    long long t0, t1;
    long long bytes = 0; /* signed: -1 or 2^64 is an error, not a wrapped count */
    if (!PyArg_ParseTuple(args, "sLL|L:timeline_record_compute", &name, &t0, &t1, &bytes))
        return NULL;
    if (bytes < 0) {
        PyErr_Format(PyExc_ValueError, "timeline_record_compute: nbytes must be >= 0, got %lld",
                     bytes);
        return NULL;
    }
    if (t1 < t0) {
        PyErr_SetString(PyExc_ValueError, "timeline_record_compute: t1 < t0");
        return NULL;
    }
    axc_timeline *tl = timeline();
    if (!axc_timeline_enabled(tl))
        Py_RETURN_NONE;
    /* (names from Python are copied into the timeline, which keeps AXC_TIMELINE_MAX_NAMES:
     * beyond them spans are named "python") */
    const char *kept = axc_timeline_intern(tl, name);
    axc_timeline_record(tl, AXC_SPAN_COMPUTE, kept ? kept : "python", -1, t0, t1,
                        (uint64_t)bytes);
    Py_RETURN_NONE;
}

PyMethodDef axc_py_timeline_methods[] = {
    {"timeline_enable", py_timeline_enable, METH_O, "Turns span recording on or off."},
    {"timeline_enabled", py_timeline_enabled, METH_NOARGS, "True while recording."},
    {"timeline_clear", py_timeline_clear, METH_NOARGS, "Forgets the recorded spans."},
    {"timeline_free", py_timeline_free, METH_NOARGS, "Stops recording and frees the buffer."},
    {"timeline_set_capacity", py_timeline_set_capacity, METH_O,
     "Buffer capacity in spans (before the first enable)."},
    {"timeline_now", py_timeline_now, METH_NOARGS, "The timeline's clock (monotonic ns)."},
    {"timeline_spans", py_timeline_spans, METH_NOARGS,
     "[(kind, name, group or None, t_begin_ns, t_end_ns, bytes)]; kind 0 compute, 1 comm, 2 wait."},
    {"timeline_summary", py_timeline_summary, METH_NOARGS,
     "{compute_s, comm_s, exposed_comm_s, per_group, spans, dropped, ...}"},
    {"timeline_record_compute", py_timeline_record_compute, METH_VARARGS,
     "timeline_record_compute(name, t0_ns, t1_ns, bytes=0): records a compute span."},
    {NULL, NULL, 0, NULL}};
