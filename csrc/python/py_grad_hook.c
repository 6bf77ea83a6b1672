/* The per-parameter gradient hook (axonn_c/grads.py: hook) and the runtime state it decides
 * from. A GradHook is what a parameter's Tensor.register_hook holds: called with the gradient
 * of a backward pass (all its uses summed, before autograd accumulates it into .grad), it first
 * asks the runtime (axc_runtime_grad_needs_work) whether there is anything to do (the common
 * case: nothing pending, no .grad marked summed, no sum to start now); otherwise it gathers the
 * facts the decision (axc_grad_decide, csrc/grads/grad_policy.c) reads and carries the decision
 * out on torch tensors: the gradient goes into a bucket with the gradient accumulated so far
 * folded in (the bucket's sum is the reduced total, which replaces .grad when backward ends), is
 * recorded after a pending record, or is left to autograd. It holds a weak reference to its
 * parameter (the parameter holds the hook: no cycle) and reads the parameter's
 * `_axonn_overlap_data` (a Linear weight's own knob) and `_axonn_hook_groups` when called, so
 * both can change after it was registered. Whether the pass accumulates into .grad (rather than
 * handing the gradient back, torch.autograd.grad) is asked of the callable it was made with
 * (grads.accumulates: only autograd's Python API knows), only when the decision needs it. A
 * parameter that no longer requires grad when its hook fires (frozen since its forward) is left
 * alone, as autograd leaves it. */
#include <math.h>
#include <sched.h>

#include "py_common.h"

#include "axc/grad_policy.h"
#include "axc/records.h"

static PyObject *s_overlap_attr, *s_groups_attr, *s_requires_grad,
    *s_names[AXC_GROUP_COUNT];
static PyObject *s_grad, *s_dtype, *s_layout, *s_numel, *s_reshape, *s_copy_, *s_add_, *s_div_,
    *s_detach, *s_clone, *s_alpha, *s_minus_one;
static PyObject *g_strided, *g_empty_like; /* torch.strided, torch.empty_like */
/* torch._C._current_graph_task_id (Py_None where torch has none) */
static PyObject *g_pass_id;
static unsigned long g_works; /* gradients past the fast path: grad_hook_works() */

typedef struct {
    PyObject_HEAD
    PyObject *ref;         /* weakref.ref to the parameter */
    PyObject *accumulates; /* accumulates(param) -> bool: the pass accumulates into .grad */
} GradHook;


/* groups (a tuple of group names) -> kinds; 0 when one is not a group name (the Python code
 * then decides). */
static int parse_groups(PyObject *t, axc_groups *out)
{
    out->n = 0;
    /* (a tuple, as grads.hook stores it, or a list a user set; not an unordered container,
     * which could order the groups differently on different ranks) */
    if (!PyTuple_Check(t) && !PyList_Check(t))
        return 0;
    PyObject *seq = Py_NewRef(t);
    int ok = PySequence_Fast_GET_SIZE(seq) <= AXC_GROUP_COUNT;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *name = PySequence_Fast_GET_ITEM(seq, i);
        int k = 0;
        while (k < AXC_GROUP_COUNT && name != s_names[k]) /* (interned: the common case) */
            k++;
        if (k == AXC_GROUP_COUNT) {
            const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
            axc_group_kind kind;
            if (!s || axc_group_from_name(s, &kind) != AXC_OK) {
                PyErr_Clear();
                ok = 0;
                break;
            }
            k = (int)kind;
        }
        out->g[out->n++] = (axc_group_kind)k;
    }
    Py_DECREF(seq);
    return ok;
}

/* the grid of the communicator (NULL with an exception after finalize(): another thread may
 * have finalized while this hook released the GIL) */
static const axc_grid *grid_now(void)
{
    axc_comm *comm = axc_py_comm();
    if (!comm)
        PyErr_SetString(PyExc_RuntimeError, "axonn_c was finalized during a backward pass: "
                                            "call finalize() only after backward() returned");
    return comm ? axc_comm_grid(comm) : NULL;
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

/* The parameter's own overlap knob (-1: none, the session's) and its hooked groups; -1 with an
 * exception (unknown group names are a ValueError). */
static int hook_settings(PyObject *p, int *own, axc_groups *groups)
{
    *own = -1;
    groups->n = 0;
    PyObject *on = axc_py_optional_attr(p, s_overlap_attr);
    if (on) {
        int v = on == Py_None ? -1 : PyObject_IsTrue(on);
        Py_DECREF(on);
        if (on != Py_None && v < 0)
            return -1;
        *own = v;
    } else if (PyErr_Occurred()) {
        return -1;
    }
    PyObject *names = axc_py_optional_attr(p, s_groups_attr);
    if (!names)
        return PyErr_Occurred() ? -1 : 0;
    int known = parse_groups(names, groups);
    if (!known)
        PyErr_Format(PyExc_ValueError, "a hooked parameter's _axonn_hook_groups must be a "
                     "tuple or list of group names (col, row, depth, data, intra, world), got %R", names);
    Py_DECREF(names);
    return known ? 0 : -1;
}

static PyObject *method1(PyObject *obj, PyObject *name, PyObject *arg)
{
    return PyObject_CallMethodOneArg(obj, name, arg);
}

/* t.reshape(-1) */
static PyObject *flat(PyObject *t) { return method1(t, s_reshape, s_minus_one); }

/* whether g is a strided gradient of p's dtype; -1 with an exception */
static int plain_grad(PyObject *p, PyObject *g)
{
    if (!g_empty_like) { /* (torch, once: not when the module loads) */
        PyObject *torch = PyImport_ImportModule("torch");
        g_strided = torch ? PyObject_GetAttrString(torch, "strided") : NULL;
        g_empty_like = g_strided ? PyObject_GetAttrString(torch, "empty_like") : NULL;
        Py_XDECREF(torch);
        if (!g_empty_like)
            return -1;
    }
    PyObject *gd = PyObject_GetAttr(g, s_dtype), *pd = gd ? PyObject_GetAttr(p, s_dtype) : NULL;
    PyObject *lay = pd ? PyObject_GetAttr(g, s_layout) : NULL;
    int r = lay ? gd == pd && lay == g_strided : -1;
    Py_XDECREF(gd);
    Py_XDECREF(pd);
    Py_XDECREF(lay);
    return r;
}

static long copies_of(PyObject *p)
{
    axc_groups summed;
    const axc_grid *grid;
    if (axc_py_grad_summed(p, &summed) < 0 || !(grid = grid_now()))
        return -1;
    return axc_grad_copies(grid, &summed);
}

/* A .grad summed over groups during an earlier backward, about to absorb a gradient that is not
 * summed (no_grad_sync, the overlap off): its share of the sum, so that the later
 * sync_gradients, which sums the whole .grad again, restores it. */
static int unreduce(PyObject *p)
{
    long copies = copies_of(p);
    if (copies < 0)
        return -1;
    if (copies == 1)
        return 0;
    PyObject *grad = PyObject_GetAttr(p, s_grad);
    if (!grad)
        return -1;
    PyObject *n = grad != Py_None ? PyLong_FromLong(copies) : NULL;
    PyObject *r = n ? method1(grad, s_div_, n) : NULL;
    int failed = grad != Py_None && !r;
    Py_XDECREF(n);
    Py_XDECREF(r);
    Py_DECREF(grad);
    static const axc_groups none = {.n = 0};
    return failed ? -1 : axc_py_grad_mark(p, &none);
}

/* The parameters whose .grad a thread is unsyncing now (the GIL guards the list; the division
 * lets it go): another run_concurrent micro-batch thread's gradient for one of them waits until
 * it is done, so that no accumulation into that .grad runs during the division, nor a second
 * division. */
enum { UNSYNCING_MAX = 64 };
static PyObject *g_unsyncing[UNSYNCING_MAX];
static int g_nunsyncing;

static int unsyncing(PyObject *p)
{
    for (int i = 0; i < g_nunsyncing; i++)
        if (g_unsyncing[i] == p)
            return 1;
    return 0;
}

int axc_py_grad_unsync(PyObject *p)
{
    axc_groups summed;
    double synced;
    const axc_grid *grid;
    while (unsyncing(p) || g_nunsyncing == UNSYNCING_MAX) { /* (rare: a short wait) */
        Py_BEGIN_ALLOW_THREADS
        sched_yield();
        Py_END_ALLOW_THREADS
    }
    double scale;
    if (axc_py_grad_mark_of(p, 0, &summed, &synced, &scale) < 0)
        return -1;
    if (!axc_py_grad_made_by_sync(p, &summed, synced, scale, NULL))
        return 0;
    if (!(grid = grid_now()))
        return -1;
    /* .grad = scale * (the sum over `summed`); this rank's share of it is sum / copies */
    double by = scale * (double)axc_grad_copies(grid, &summed);
    g_unsyncing[g_nunsyncing++] = p;
    int rc = 0;
    if (fabs(by - 1.0) > 1e-12) {
        PyObject *grad = PyObject_GetAttr(p, s_grad);
        PyObject *d = grad && grad != Py_None ? PyFloat_FromDouble(by) : NULL;
        PyObject *r = d ? method1(grad, s_div_, d) : NULL;
        rc = !grad || (grad != Py_None && !r) ? -1 : 0;
        Py_XDECREF(grad);
        Py_XDECREF(d);
        Py_XDECREF(r);
    }
    static const axc_groups none = {.n = 0};
    if (rc == 0)
        rc = axc_py_grad_mark(p, &none);
    for (int i = 0; i < g_nunsyncing; i++) /* (others may have come and gone meanwhile) */
        if (g_unsyncing[i] == p) {
            g_unsyncing[i] = g_unsyncing[--g_nunsyncing];
            break;
        }
    return rc;
}

/* n = p.numel() elements of the open bucket over `groups` for gradients like p's */
static PyObject *bucket_view(PyObject *p, const axc_groups *groups, int *id)
{
    PyObject *n = PyObject_CallMethodNoArgs(p, s_numel);
    Py_ssize_t numel = n ? PyLong_AsSsize_t(n) : -1;
    Py_XDECREF(n);
    return numel < 0 ? NULL : axc_py_grad_bucket_view(p, numel, groups, id);
}

PyObject *axc_py_grad_bucket_view(PyObject *p, Py_ssize_t numel, const axc_groups *groups,
                                  int *id)
{
    axc_bucket_key key;
    if (axc_py_bucket_kind(p, &key) < 0)
        return NULL;
    if (groups->n > AXC_BUCKET_MAX_GROUPS) {
        PyErr_Format(PyExc_ValueError, "a gradient is summed over at most %d groups, got %d",
                     AXC_BUCKET_MAX_GROUPS, groups->n);
        return NULL;
    }
    key.ngroups = groups->n;
    for (int i = 0; i < groups->n; i++)
        key.groups[i] = groups->g[i];
    /* (its name on every rank, given by the first sync_gradients that met it: py_sync.c; none
     * before, and no check of this bucket then) */
    uint64_t ident;
    if (axc_py_grad_ident(p, &ident) < 0)
        return NULL;
    return axc_py_bucket_piece(p, &key, (size_t)numel,
                               axc_runtime_grad_bucket_bytes(axc_py_runtime()), ident, id);
}

/* view.copy_(g.reshape(-1)): -1 with an exception */
static int copy_into(PyObject *view, PyObject *g)
{
    PyObject *gf = flat(g), *r = gf ? method1(view, s_copy_, gf) : NULL;
    Py_XDECREF(gf);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* AXC_GRAD_RECORD: g goes into a bucket over `groups`, the .grad so far folded in (a .grad summed
 * in an earlier pass, no sync_gradients since, is identical on all ranks of its groups: it
 * enters divided by their rank count); the record replaces .grad when the pass ends. */
static int record(PyObject *p, PyObject *g, const axc_groups *groups)
{
    long copies = copies_of(p);
    PyObject *prev = copies < 0 ? NULL : PyObject_GetAttr(p, s_grad);
    if (!prev)
        return -1;
    int id = -1, rc = -1;
    PyObject *view = bucket_view(p, groups, &id);
    if (!view || copy_into(view, g) < 0)
        goto out;
    if (prev != Py_None) {
        PyObject *pf = flat(prev), *r = NULL;
        if (!pf)
            goto out;
        if (copies == 1) {
            r = method1(view, s_add_, pf);
        } else {
            PyObject *alpha = PyFloat_FromDouble(1.0 / (double)copies);
            PyObject *kw = alpha ? PyDict_New() : NULL;
            PyObject *args = kw && PyDict_SetItem(kw, s_alpha, alpha) == 0 ? PyTuple_Pack(1, pf)
                                                                           : NULL;
            PyObject *add = args ? PyObject_GetAttr(view, s_add_) : NULL;
            r = add ? PyObject_Call(add, args, kw) : NULL;
            Py_XDECREF(alpha);
            Py_XDECREF(kw);
            Py_XDECREF(args);
            Py_XDECREF(add);
        }
        Py_DECREF(pf);
        if (!r)
            goto out;
        Py_DECREF(r);
        /* autograd now adds g, not summed, into .grad: a summed .grad takes its share first, so
         * that if the pass raises (the record dropped) .grad is a consistent unsummed total for
         * sync_gradients, not a summed one with an unsummed part in it */
        if (unreduce(p) < 0)
            goto out;
    }
    if (axc_py_grad_record(p, view, NULL, 1, groups, id) == 0)
        rc = axc_py_grad_queue_finish();
out:
    Py_XDECREF(view);
    Py_DECREF(prev);
    return rc;
}

/* AXC_GRAD_ADD_AFTER: another gradient of this pass for a parameter whose pending record
 * replaces .grad (what autograd accumulates there is dropped): a record of its own, reduced like
 * the pending one (over `groups`), which the end of the pass adds after it. */
static int add_after(PyObject *p, PyObject *g, axc_groups groups)
{
    axc_grad_records *recs = axc_runtime_records(axc_py_runtime());
    if (!axc_records_is_taken(recs, (uintptr_t)p)) {
        /* autograd then adds in place into the scratch, not into the .grad that a deferred dW
         * GEMM may still read (its fold); the end of the pass drops both, an abandoned pass
         * puts the .grad back unless the scratch was replaced meanwhile */
        PyObject *prev = PyObject_GetAttr(p, s_grad);
        PyObject *scratch = prev ? PyObject_CallOneArg(g_empty_like, prev == Py_None ? p : prev)
                                 : NULL;
        int rc = scratch ? axc_py_grad_take(p, prev, scratch) : -1;
        if (rc == 0)
            rc = PyObject_SetAttr(p, s_grad, scratch);
        Py_XDECREF(prev);
        Py_XDECREF(scratch);
        if (rc < 0)
            return -1;
    }
    int id = -1;
    PyObject *part;
    if (groups.n) {
        part = bucket_view(p, &groups, &id);
        if (part && copy_into(part, g) < 0)
            Py_CLEAR(part);
    } else { /* (summed with the rest by sync_gradients; a copy: autograd may keep g as .grad) */
        PyObject *d = PyObject_CallMethodNoArgs(g, s_detach), *df = d ? flat(d) : NULL;
        part = df ? PyObject_CallMethodNoArgs(df, s_clone) : NULL;
        Py_XDECREF(d);
        Py_XDECREF(df);
    }
    if (!part)
        return -1;
    int rc = axc_py_grad_record(p, part, NULL, 0, &groups, id);
    Py_DECREF(part);
    return rc;
}

/* A .grad already summed over ranks (an overlapped backward, or run_concurrent's reducer) cannot
 * take unsummed micro-batch gradients: sync_gradients() must run first. */
int axc_py_grad_check_unsynced(PyObject *p)
{
    axc_groups summed;
    double synced, scale;
    int rc = axc_py_grad_mark_of(p, 0, &summed, &synced, &scale);
    /* (one a sync made is unsynced as its gradient comes) */
    if (rc < 0 || !summed.n || axc_py_grad_made_by_sync(p, &summed, synced, scale, NULL))
        return rc;
    PyErr_SetString(PyExc_RuntimeError,
                    "run_concurrent: a parameter's .grad was already summed over ranks (by an "
                    "earlier backward with overlap on, or an earlier run_concurrent with model=), "
                    "and sync_gradients() has not run since; call axonn_c.sync_gradients(model) "
                    "(or zero the gradients) before run_concurrent (without model=, its "
                    "micro-batches may have added to other parameters' .grad before this "
                    "refusal: zero the gradients before running this step again)");
    return -1;
}

/* h's accumulates(p): 1 when the running pass accumulates into p.grad, 0 when not, -1 with an
 * exception */
static int ask_accumulates(GradHook *h, PyObject *p)
{
    PyObject *r = PyObject_CallOneArg(h->accumulates, p);
    int acc = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    return acc;
}

/* Carries out what axc_grad_decide says for p's gradient g, gathering the facts it asks for;
 * `accumulates`: whether the pass accumulates into .grad when count_arrival asked already, else
 * -1. */
static int take_grad(GradHook *h, PyObject *p, PyObject *g, int own, const axc_groups *hooked,
                     int accumulates)
{
    axc_runtime *rt = axc_py_runtime();
    axc_grad_records *recs = axc_runtime_records(rt);
    axc_grad_facts f = {.microbatch = axc_microbatch_thread(), .initialized = axc_py_comm() != NULL,
                        .accumulates = -1, .synced = -1};
    axc_groups groups = {.n = 0};
    int grad_mode = 0; /* torch's grad mode was on (create_graph=True): off while acting */
    int rc = 0;
    for (int done = 0; !done && rc == 0;) {
        const axc_grad_record *last = axc_records_last(recs, (uintptr_t)p);
        f.pending = last != NULL;
        f.last_replace = last && last->replace;
        if (f.synced < 0) {
            axc_groups summed;
            double synced, scale;
            if (axc_py_grad_mark_of(p, 0, &summed, &synced, &scale) < 0) {
                rc = -1;
                break;
            }
            /* (sync_gradients_depth_parallel's marks too) */
            f.synced = axc_py_grad_made_by_sync(p, &summed, synced, scale, NULL);
        }
        axc_groups last_groups = last ? last->groups : groups;
        switch (axc_grad_decide(&f)) {
        case AXC_GRAD_NOTHING:
            done = 1;
            break;
        case AXC_GRAD_ASK_ACCUMULATES: {
            f.accumulates = accumulates >= 0 ? accumulates : ask_accumulates(h, p);
            if (f.accumulates < 0) {
                rc = -1;
                break;
            }
            /* the rest of the facts (grad mode is on in a hook exactly when backward builds a
             * graph: create_graph=True) */
            grad_mode = axc_py_grad_enabled();
            f.plain = grad_mode < 0 ? -1 : plain_grad(p, g);
            if (f.plain < 0 || (grad_mode && axc_py_set_grad_enabled(0) < 0)) {
                grad_mode = 0; /* (not switched off: nothing to switch back) */
                rc = -1;
                break;
            }
            f.create_graph = grad_mode;
            f.sync = axc_runtime_grad_sync(rt);
            f.overlap = own < 0 ? axc_runtime_overlap_data(rt) : own;
            const axc_grid *grid = grid_now();
            if (!grid) {
                rc = -1;
                break;
            }
            axc_grad_groups_to_sum(grid, hooked, &groups);
            f.groups = groups.n;
            break;
        }
        case AXC_GRAD_DROP_ABANDONED:
            rc = axc_py_grad_drop_if_abandoned();
            f.abandoned_checked = 1;
            break;
        case AXC_GRAD_UNSYNC:
            rc = axc_py_grad_unsync(p);
            f.synced = 0;
            break;
        case AXC_GRAD_CHECK_UNSYNCED:
            rc = axc_py_grad_check_unsynced(p);
            done = 1;
            break;
        case AXC_GRAD_ADD_AFTER:
            rc = add_after(p, g, last_groups);
            done = 1;
            break;
        case AXC_GRAD_FINISH_FIRST: {
            PyObject *r = axc_py_grad_finish();
            Py_XDECREF(r);
            rc = r ? 0 : -1;
            break;
        }
        case AXC_GRAD_UNREDUCE:
            rc = unreduce(p);
            done = 1;
            break;
        case AXC_GRAD_RECORD:
            rc = record(p, g, &groups);
            done = 1;
            break;
        }
    }
    if (grad_mode > 0) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (axc_py_set_grad_enabled(1) < 0 && !et)
            return -1;
        PyErr_Restore(et, ev, tb);
    }
    return rc;
}

/* The backward pass the calling thread runs: its graph task's number (>= 0), -1 when torch
 * cannot tell (outside the engine, or no such function), -2 with an exception. */
static long long current_pass(void)
{
    if (!g_pass_id) { /* (torch, once: not when the module loads) */
        PyObject *tc = PyImport_ImportModule("torch._C");
        g_pass_id = tc ? PyObject_GetAttrString(tc, "_current_graph_task_id") : NULL;
        Py_XDECREF(tc);
        if (!g_pass_id) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -2;
            PyErr_Clear();
            g_pass_id = Py_NewRef(Py_None);
        }
    }
    if (g_pass_id == Py_None)
        return -1;
    PyObject *r = PyObject_CallNoArgs(g_pass_id);
    long long id = r ? PyLong_AsLongLong(r) : -1;
    Py_XDECREF(r);
    if (id == -1 && PyErr_Occurred())
        return -2;
    return id < 0 ? -1 : id;
}

/* Counts p's gradient as an arrival (what a sync's mark is compared with:
 * axc_runtime_grad_arrivals) once per backward pass that accumulates into .grad, asking the
 * hook's `accumulates` at the pass's first gradient while a sync's mark exists (without one
 * the count is compared with nothing: counted unasked). torch.autograd.grad hands its
 * gradients back: it is no backward into .grad, and counting it would make a rank that alone
 * ran one (a diagnostic) read its synced gradients as stale and sum them again, out of step
 * with the other ranks. *accumulates: the answer when asked, else -1. -1 with an exception. */
static int count_arrival(GradHook *h, PyObject *p, int *accumulates)
{
    axc_runtime *rt = axc_py_runtime();
    *accumulates = -1;
    if (!axc_records_dated_count(axc_runtime_records(rt))) {
        axc_runtime_grad_arrived(rt, -1);
        return 0;
    }
    long long pass = current_pass();
    if (pass < -1)
        return -1;
    if (pass >= 0 && axc_runtime_grad_pass_counted(rt, pass))
        return 0;
    *accumulates = ask_accumulates(h, p);
    if (*accumulates > 0)
        axc_runtime_grad_arrived(rt, pass);
    return *accumulates < 0 ? -1 : 0;
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
    /* frozen since its forward: autograd accumulates nothing into it (AccumulateGrad skips a
     * tensor that no longer requires grad, after running this hook), and neither does this */
    PyObject *req = PyObject_GetAttr(p, s_requires_grad);
    int frozen = req ? req == Py_False : -1;
    Py_XDECREF(req);
    if (frozen) {
        Py_DECREF(p);
        if (frozen < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    int own, accumulates;
    axc_groups groups;
    int rc = count_arrival(h, p, &accumulates);
    if (rc == 0)
        rc = axc_py_grad_forget_dropped(p);
    if (rc == 0)
        rc = hook_settings(p, &own, &groups);
    if (rc == 0 && axc_runtime_grad_needs_work(axc_py_runtime(), (uintptr_t)p, own, &groups)) {
        g_works++;
        rc = take_grad(h, p, g, own, &groups, accumulates);
    }
    Py_DECREF(p);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *param, *accumulates;
    static char *kw[] = {"param", "accumulates", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:GradHook", kw, &param, &accumulates))
        return NULL;
    if (!PyCallable_Check(accumulates)) {
        PyErr_Format(PyExc_TypeError, "GradHook: accumulates must be callable, got %R",
                     accumulates);
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
    h->accumulates = Py_NewRef(accumulates);
    return (PyObject *)h;
}

/* GC-tracked: an `accumulates` callable that holds the parameter (a default argument, a bound
 * method of an object holding it) makes a cycle parameter -> hook -> callable -> parameter that
 * the collector must see. */
static int hook_traverse(PyObject *self, visitproc visit, void *arg)
{
    GradHook *h = (GradHook *)self;
    Py_VISIT(h->ref);
    Py_VISIT(h->accumulates);
    return 0;
}

static int hook_clear(PyObject *self)
{
    GradHook *h = (GradHook *)self;
    Py_CLEAR(h->ref);
    Py_CLEAR(h->accumulates);
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
    .tp_doc = "GradHook(param, accumulates): a gradient hook for param (held weakly) that sums, "
              "records or leaves its gradient as the gradient policy decides; "
              "accumulates(param) -> bool tells whether the pass accumulates into .grad.",
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

/* grad_bucket_bytes([n]) -> the bucket size of backward's sums before (set to n when given) */
static PyObject *py_bucket_bytes(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t n = 0;
    if (!PyArg_ParseTuple(args, "|n", &n))
        return NULL;
    if (n < 0 || (PyTuple_GET_SIZE(args) && n == 0)) {
        PyErr_Format(PyExc_ValueError, "grad_bucket_bytes: expected a positive size, got %zd", n);
        return NULL;
    }
    axc_runtime *rt = axc_py_runtime();
    size_t before = axc_runtime_grad_bucket_bytes(rt);
    axc_runtime_set_grad_bucket_bytes(rt, (size_t)n);
    return PyLong_FromSize_t(before);
}

/* grad_check_unsynced(p): raises when p.grad was already summed over ranks (run_concurrent) */
static PyObject *py_check_unsynced(PyObject *self, PyObject *p)
{
    (void)self;
    if (axc_py_grad_check_unsynced(p) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_hook_works(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromUnsignedLong(g_works);
}

int axc_py_grad_hook_add_types(PyObject *module)
{
    static const struct {
        PyObject **at;
        const char *name;
    } names[] = {{&s_overlap_attr, "_axonn_overlap_data"}, {&s_groups_attr, "_axonn_hook_groups"},
                 {&s_requires_grad, "requires_grad"},
                 {&s_grad, "grad"}, {&s_dtype, "dtype"}, {&s_layout, "layout"},
                 {&s_numel, "numel"}, {&s_reshape, "reshape"}, {&s_copy_, "copy_"},
                 {&s_add_, "add_"}, {&s_div_, "div_"}, {&s_detach, "detach"},
                 {&s_clone, "clone"}, {&s_alpha, "alpha"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].at = PyUnicode_InternFromString(names[i].name)))
            return -1;
    if (!(s_minus_one = PyLong_FromLong(-1)))
        return -1;
    for (int i = 0; i < AXC_GROUP_COUNT; i++)
        if (!(s_names[i] = PyUnicode_InternFromString(axc_group_name((axc_group_kind)i))))
            return -1;
    return axc_py_add_type(module, &GradHookType, "GradHook");
}

PyMethodDef axc_py_grad_hook_methods[] = {
    {"grad_sync_enabled", py_sync, METH_VARARGS,
     "grad_sync_enabled([on]) -> bool: backward starts gradient sums (off in no_grad_sync)"},
    {"grad_overlap_data", py_overlap_data, METH_VARARGS,
     "grad_overlap_data([on]) -> bool: the data overlap knob in force"},
    {"microbatch_thread", py_microbatch, METH_VARARGS,
     "microbatch_thread([on]) -> bool: the calling thread runs a run_concurrent micro-batch"},
    {"grad_bucket_bytes", py_bucket_bytes, METH_VARARGS,
     "grad_bucket_bytes([n]) -> int: the bucket size of backward's sums (init(bucket_size=))"},
    {"grad_check_unsynced", py_check_unsynced, METH_O,
     "grad_check_unsynced(p): raises RuntimeError when p.grad was already summed over ranks"},
    {"grad_hook_works", py_hook_works, METH_NOARGS,
     "grad_hook_works() -> int: gradients the hooks had something to do for (tests count them)"},
    {NULL, NULL, 0, NULL},
};
