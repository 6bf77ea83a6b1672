/* The per-parameter gradient hook (axonn_c/grads.py: hook) and the runtime state it decides
 * from. A GradHook is what a parameter's Tensor.register_hook holds: called with the gradient
 * of a backward pass, it asks the runtime (axc_runtime_grad_needs_work) whether there is
 * anything to do, and only then calls the Python gradient code it was made with. It holds a
 * weak reference to its parameter (the parameter holds the hook: no cycle) and reads the
 * parameter's `_axonn_overlap_data` (a Linear weight's own knob) and `_axonn_hook_groups` when
 * called, so both can change after it was registered. */
#include "py_common.h"

#include "axc/records.h"

static PyObject *s_overlap_attr, *s_groups_attr, *s_names[AXC_GROUP_COUNT];

typedef struct {
    PyObject_HEAD
    PyObject *ref;  /* weakref.ref to the parameter */
    PyObject *work; /* work(param, grad): the Python gradient code */
} GradHook;

/* getattr(obj, name, None) without raising and catching AttributeError (which costs more than
 * the whole decision): a new reference, NULL with nothing set when absent, NULL with an
 * exception set on an error. */
static PyObject *optional_attr(PyObject *obj, PyObject *name)
{
    PyObject *v = NULL;
#if PY_VERSION_HEX >= 0x030D0000
    (void)PyObject_GetOptionalAttr(obj, name, &v);
#else
    (void)_PyObject_LookupAttr(obj, name, &v);
#endif
    return v;
}

/* groups (a tuple of group names) -> kinds; 0 when one is not a group name (the Python code
 * then decides). */
static int parse_groups(PyObject *t, axc_groups *out)
{
    out->n = 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) > AXC_GROUP_COUNT)
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *name = PyTuple_GET_ITEM(t, i);
        int k = 0;
        while (k < AXC_GROUP_COUNT && name != s_names[k]) /* (interned: the common case) */
            k++;
        if (k == AXC_GROUP_COUNT) {
            const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
            axc_group_kind kind;
            if (!s || axc_group_from_name(s, &kind) != AXC_OK) {
                PyErr_Clear();
                return 0;
            }
            k = (int)kind;
        }
        out->g[out->n++] = (axc_group_kind)k;
    }
    return 1;
}

/* 1: the gradient needs the Python code, 0: autograd takes it untouched, -1: an error */
static int needs_work(PyObject *p)
{
    axc_runtime *rt = axc_py_runtime();
    int own = -1;
    PyObject *on = optional_attr(p, s_overlap_attr);
    if (on) {
        if (on != Py_None && (own = PyObject_IsTrue(on)) < 0) {
            Py_DECREF(on);
            return -1;
        }
        Py_DECREF(on);
    } else if (PyErr_Occurred()) {
        return -1;
    }
    PyObject *names = optional_attr(p, s_groups_attr);
    if (!names && PyErr_Occurred())
        return -1;
    axc_groups groups = {.n = 0};
    int known = !names || parse_groups(names, &groups);
    Py_XDECREF(names);
    if (!known)
        return 1;
    return axc_runtime_grad_needs_work(rt, own, &groups);
}

/* the hook's parameter (a new reference), or NULL once it is gone (or on an error, set) */
static PyObject *param_of(GradHook *h)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *p = NULL;
    (void)PyWeakref_GetRef(h->ref, &p);
    return p;
#else
    PyObject *p = PyWeakref_GetObject(h->ref); /* borrowed; None once the parameter is gone */
    return !p || p == Py_None ? NULL : Py_NewRef(p);
#endif
}

static PyObject *hook_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    GradHook *h = (GradHook *)self;
    PyObject *g;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "GradHook(grad) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "GradHook", 1, 1, &g))
        return NULL;
    if (g == Py_None || !h->ref) /* a deferred Linear weight's (nothing came); cleared by GC */
        Py_RETURN_NONE;
    PyObject *p = param_of(h);
    if (!p) { /* (gone: nothing to take a gradient into) */
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    int work = needs_work(p);
    PyObject *r = work < 0 ? NULL : work ? PyObject_CallFunctionObjArgs(h->work, p, g, NULL)
                                         : Py_NewRef(Py_None);
    Py_DECREF(p);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *param, *work;
    static char *kw[] = {"param", "work", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:GradHook", kw, &param, &work))
        return NULL;
    if (!PyCallable_Check(work)) {
        PyErr_Format(PyExc_TypeError, "GradHook: work must be callable, got %R", work);
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(param, NULL);
    if (!ref)
        return NULL;
    GradHook *h = (GradHook *)type->tp_alloc(type, 0);
    if (!h) {
        Py_DECREF(ref);
        return NULL;
    }
    h->ref = ref;
    h->work = Py_NewRef(work);
    return (PyObject *)h;
}

/* GC-tracked: a `work` callable that holds the parameter (a default argument, a bound method
 * of an object holding it) makes a cycle parameter -> hook -> work -> parameter that the
 * collector must see. */
static int hook_traverse(PyObject *self, visitproc visit, void *arg)
{
    GradHook *h = (GradHook *)self;
    Py_VISIT(h->ref);
    Py_VISIT(h->work);
    return 0;
}

static int hook_clear(PyObject *self)
{
    GradHook *h = (GradHook *)self;
    Py_CLEAR(h->ref);
    Py_CLEAR(h->work);
    return 0;
}

static void hook_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    (void)hook_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject GradHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "axonn_c._C.GradHook",
    .tp_basicsize = sizeof(GradHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "GradHook(param, work): a gradient hook for param (held weakly) that calls "
              "work(param, grad) only when the gradient needs the gradient code.",
    .tp_new = hook_new,
    .tp_dealloc = hook_dealloc,
    .tp_traverse = hook_traverse,
    .tp_clear = hook_clear,
    .tp_call = hook_call,
};

/* The runtime's flags the hooks read: each binding returns the value before and sets it when
 * given one (grad_sync_enabled(False) -> the previous value). */
enum { FLAG_SYNC, FLAG_OVERLAP_DATA, FLAG_MICROBATCH };

static PyObject *flag(PyObject *args, int which)
{
    PyObject *arg = NULL;
    static const char *const names[] = {[FLAG_SYNC] = "grad_sync_enabled",
                                        [FLAG_OVERLAP_DATA] = "grad_overlap_data",
                                        [FLAG_MICROBATCH] = "microbatch_thread"};
    if (!PyArg_UnpackTuple(args, names[which], 0, 1, &arg))
        return NULL;
    axc_runtime *rt = axc_py_runtime();
    int before = which == FLAG_SYNC           ? axc_runtime_grad_sync(rt)
                 : which == FLAG_OVERLAP_DATA ? axc_runtime_overlap_data(rt)
                                              : axc_microbatch_thread();
    int on = arg ? PyObject_IsTrue(arg) : -1;
    if (arg && on < 0)
        return NULL;
    if (on >= 0 && which == FLAG_SYNC)
        axc_runtime_set_grad_sync(rt, on);
    else if (on >= 0 && which == FLAG_OVERLAP_DATA)
        axc_runtime_set_overlap_data(rt, on);
    else if (on >= 0)
        axc_set_microbatch_thread(on);
    return PyBool_FromLong(before);
}

static PyObject *py_sync(PyObject *self, PyObject *args)
{
    (void)self;
    return flag(args, FLAG_SYNC);
}

static PyObject *py_overlap_data(PyObject *self, PyObject *args)
{
    (void)self;
    return flag(args, FLAG_OVERLAP_DATA);
}

static PyObject *py_microbatch(PyObject *self, PyObject *args)
{
    (void)self;
    return flag(args, FLAG_MICROBATCH);
}

int axc_py_grad_hook_add_types(PyObject *module)
{
    if (!(s_overlap_attr = PyUnicode_InternFromString("_axonn_overlap_data")) ||
        !(s_groups_attr = PyUnicode_InternFromString("_axonn_hook_groups")))
        return -1;
    for (int i = 0; i < AXC_GROUP_COUNT; i++)
        if (!(s_names[i] = PyUnicode_InternFromString(axc_group_name((axc_group_kind)i))))
            return -1;
    if (PyType_Ready(&GradHookType) < 0)
        return -1;
    Py_INCREF(&GradHookType);
    if (PyModule_AddObject(module, "GradHook", (PyObject *)&GradHookType) < 0) {
        Py_DECREF(&GradHookType);
        return -1;
    }
    return 0;
}

PyMethodDef axc_py_grad_hook_methods[] = {
    {"grad_sync_enabled", py_sync, METH_VARARGS,
     "grad_sync_enabled([on]) -> bool: backward starts gradient sums (off in no_grad_sync)"},
    {"grad_overlap_data", py_overlap_data, METH_VARARGS,
     "grad_overlap_data([on]) -> bool: the data overlap knob in force"},
    {"microbatch_thread", py_microbatch, METH_VARARGS,
     "microbatch_thread([on]) -> bool: the calling thread runs a run_concurrent micro-batch"},
    {NULL, NULL, 0, NULL},
};
