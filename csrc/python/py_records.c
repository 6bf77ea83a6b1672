/* Bindings of the records of pending gradients and the summed-over marks (csrc/grads/records.c,
 * held by the runtime). A parameter's key is its address: every table entry but a mark holds a
 * reference to the parameter; a mark holds weak references to the parameter (whose callback
 * forgets the mark when the parameter goes, before its address can be reused) and to the .grad
 * it was made for (the mark counts only while that tensor is still the .grad). The end of a
 * pass applies what the core hands over, in its order (axc_py_grad_records_finish / _drop, which
 * csrc/python/py_grad_pass.c calls). */
#include <stdint.h>

#include "axc/buckets.h"
#include "axc/keeps.h"
#include "axc/records.h"
#include "py_common.h"

static PyObject *s_grad, *s_view_as, *s_add_, *s_names[AXC_GROUP_COUNT];
static PyObject *g_counting; /* the chunk-counts capsule counts go into, or NULL */

static axc_grad_records *recs(void) { return axc_runtime_records(axc_py_runtime()); }

static uintptr_t key_of(PyObject *p) { return (uintptr_t)p; }

static int intern(void)
{
    if (s_grad)
        return 0;
    if (!(s_grad = PyUnicode_InternFromString("grad")) ||
        !(s_view_as = PyUnicode_InternFromString("view_as")) ||
        !(s_add_ = PyUnicode_InternFromString("add_")))
        return -1;
    for (int i = 0; i < AXC_GROUP_COUNT; i++)
        if (!(s_names[i] = PyUnicode_InternFromString(axc_group_name((axc_group_kind)i))))
            return -1;
    return 0;
}

static int parse_groups(PyObject *t, axc_groups *out)
{
    out->n = 0;
    if (!PyTuple_Check(t)) {
        PyErr_Format(PyExc_TypeError, "groups must be a tuple of group names, got %R", t);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(t, i));
        axc_groups one = {.n = 1};
        if (!name)
            return -1;
        axc_status st = axc_group_from_name(name, &one.g[0]);
        if (st != AXC_OK) {
            axc_py_raise(st);
            return -1;
        }
        axc_groups_union(out, &one);
    }
    return 0;
}

static PyObject *groups_tuple(const axc_groups *g)
{
    PyObject *t = PyTuple_New(g->n);
    for (int i = 0; t && i < g->n; i++) {
        Py_INCREF(s_names[g->g[i]]);
        PyTuple_SET_ITEM(t, i, s_names[g->g[i]]);
    }
    return t;
}

/* the object a weak reference names, or NULL when it is gone: only compared, never used (so
 * the reference 3.13's PyWeakref_GetRef returns can go at once) */
static PyObject *referent(PyObject *wr)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o = NULL;
    if (PyWeakref_GetRef(wr, &o) < 0)
        PyErr_Clear();
    Py_XDECREF(o);
    return o;
#else
    PyObject *o = PyWeakref_GetObject(wr);
    return o == Py_None ? NULL : o;
#endif
}

/* p's marked groups (and *synced, its synced scale or 0, and *scale, the scale its .grad
 * carries or 1, when not NULL) when the mark still names p.grad (or, with `dropped_ok`, p.grad
 * is None since: a copy under another attribute
 * was made from the marked one), else none; -1 with an exception */
static int summed_of(PyObject *p, int dropped_ok, axc_groups *out, double *synced,
                     double *scale)
{
    void *stamp = NULL;
    if (intern() < 0)
        return -1;
    out->n = 0;
    if (synced)
        *synced = 0;
    if (scale)
        *scale = 1.0;
    /* (.grad first: its getter may run Python code, which could replace or forget the mark and
     * free the stamp that axc_records_marked lends) */
    PyObject *grad = PyObject_GetAttr(p, s_grad);
    if (!grad)
        return -1;
    if (!axc_records_marked(recs(), key_of(p), &stamp, out)) {
        Py_DECREF(grad);
        return 0;
    }
    PyObject *t = (PyObject *)stamp;
    if (referent(PyTuple_GET_ITEM(t, 0)) != p ||
        (grad == Py_None ? !dropped_ok : referent(PyTuple_GET_ITEM(t, 1)) != grad))
        out->n = 0;
    else {
        if (synced)
            *synced = axc_records_synced(recs(), key_of(p), NULL);
        if (scale)
            *scale = axc_records_scale(recs(), key_of(p));
    }
    Py_DECREF(grad);
    return 0;
}

/* the weak-reference callback of a mark: its parameter is going */
static PyObject *forget_mark(PyObject *key, PyObject *wr)
{
    uintptr_t k = (uintptr_t)PyLong_AsVoidPtr(key);
    void *stamp = NULL;
    if (axc_records_marked(recs(), k, &stamp, NULL) && PyTuple_GET_ITEM((PyObject *)stamp, 0) == wr)
        axc_records_mark(recs(), k, NULL, NULL);
    Py_RETURN_NONE;
}

static PyMethodDef forget_def = {"forget_mark", forget_mark, METH_O, NULL};

/* marks p.grad (as it is now) summed over g (none, or no .grad: forgets), and with synced > 0
 * synced (sync_gradients completed its sums and multiplied it by `synced`; g may be none),
 * else with `dated` as sync_gradients_depth_parallel's, multiplied by `scaled` (1: not); -1
 * with an exception */
static int mark(PyObject *p, const axc_groups *g, double synced, double scaled, int dated)
{
    if (intern() < 0)
        return -1;
    int keep = g->n || synced > 0 || scaled != 1.0;
    PyObject *grad = keep ? PyObject_GetAttr(p, s_grad) : NULL;
    if (keep && !grad)
        return -1;
    if (!keep || grad == Py_None) {
        Py_XDECREF(grad);
        axc_records_mark(recs(), key_of(p), NULL, NULL);
        return 0;
    }
    /* a mark that already names p and this .grad keeps its stamp (no new weak references) */
    void *old = NULL;
    PyObject *stamp = NULL;
    if (axc_records_marked(recs(), key_of(p), &old, NULL) &&
        referent(PyTuple_GET_ITEM((PyObject *)old, 0)) == p &&
        referent(PyTuple_GET_ITEM((PyObject *)old, 1)) == grad) {
        stamp = Py_NewRef((PyObject *)old);
    } else {
        PyObject *key = PyLong_FromVoidPtr(p);
        PyObject *cb = key ? PyCFunction_New(&forget_def, key) : NULL;
        PyObject *wp = cb ? PyWeakref_NewRef(p, cb) : NULL;
        PyObject *wg = wp ? PyWeakref_NewRef(grad, NULL) : NULL;
        stamp = wg ? PyTuple_Pack(2, wp, wg) : NULL;
        Py_XDECREF(key);
        Py_XDECREF(cb);
        Py_XDECREF(wp);
        Py_XDECREF(wg);
    }
    Py_DECREF(grad);
    if (!stamp)
        return -1;
    unsigned long long gen = axc_runtime_grad_arrivals(axc_py_runtime());
    axc_status st = synced > 0 ? axc_records_mark_synced(recs(), key_of(p), stamp, g, synced, gen)
                    : dated    ? axc_records_mark_scaled(recs(), key_of(p), stamp, g, scaled, gen)
                               : axc_records_mark(recs(), key_of(p), stamp, g);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* grad_summed_over(p) -> the groups p.grad was summed over (() when its mark is not for it) */
static PyObject *py_summed_over(PyObject *self, PyObject *p)
{
    (void)self;
    axc_groups g;
    if (intern() < 0 || summed_of(p, 0, &g, NULL, NULL) < 0)
        return NULL;
    return groups_tuple(&g);
}

/* grad_mark_summed(p, groups): p.grad as it is now is summed over groups (() forgets) */
static PyObject *py_mark_summed(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *p, *groups;
    axc_groups g;
    if (!PyArg_ParseTuple(args, "OO", &p, &groups) || intern() < 0 || parse_groups(groups, &g) < 0 ||
        mark(p, &g, 0, 1.0, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* grad_marks() -> how many parameters have a mark */
static PyObject *py_marks(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromSize_t(axc_records_marks(recs()));
}

int axc_py_grad_summed(PyObject *p, axc_groups *out)
{
    return summed_of(p, 0, out, NULL, NULL);
}
int axc_py_grad_mark_of(PyObject *p, int dropped_ok, axc_groups *out, double *synced,
                        double *scale)
{
    return summed_of(p, dropped_ok, out, synced, scale);
}

int axc_py_grad_made_by_sync(PyObject *p, const axc_groups *summed, double synced, double scale,
                             unsigned long long *gen)
{
    if (gen)
        *gen = 0;
    /* (a valid mark has groups, a synced scale or a scale; a stale one reads as none) */
    return (summed->n || synced > 0 || scale != 1.0) &&
           axc_records_dated(recs(), key_of(p), gen);
}

int axc_py_grad_forget_dropped(PyObject *p)
{
    if (!axc_records_marks(recs()) || !axc_records_marked(recs(), key_of(p), NULL, NULL))
        return 0; /* (the common case: no mark, no attribute read) */
    if (intern() < 0)
        return -1;
    PyObject *grad = PyObject_GetAttr(p, s_grad);
    if (!grad)
        return -1;
    if (grad == Py_None)
        axc_records_mark(recs(), key_of(p), NULL, NULL);
    Py_DECREF(grad);
    return 0;
}
int axc_py_grad_mark(PyObject *p, const axc_groups *g) { return mark(p, g, 0, 1.0, 0); }
int axc_py_grad_mark_synced(PyObject *p, const axc_groups *g, double scale)
{
    return mark(p, g, scale, 1.0, 1);
}
int axc_py_grad_mark_scaled(PyObject *p, const axc_groups *g, double scale)
{
    return mark(p, g, 0, scale, 1);
}

int axc_py_grad_record(PyObject *p, PyObject *dw, PyObject *keep, int replace,
                       const axc_groups *groups, int bucket)
{
    /* (a piece whose bucket's pass ended meanwhile, e.g. another thread's finish(), is in no
     * sum: refused before it is recorded) */
    axc_buckets *b = axc_runtime_buckets(axc_py_runtime());
    axc_status st = bucket < 0 || !b ? AXC_OK : axc_buckets_check(b, bucket);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    axc_grad_record rec = {.key = key_of(p), .param = Py_NewRef(p), .dw = Py_NewRef(dw),
                           .keep = keep ? Py_NewRef(keep) : NULL, .replace = replace,
                           .groups = *groups};
    st = axc_records_add(recs(), &rec);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    if (bucket < 0)
        return 0;
    return axc_py_bucket_apply(bucket, axc_buckets_written);
}

int axc_py_grad_take(PyObject *p, PyObject *prev, PyObject *scratch)
{
    axc_taken_grad t = {key_of(p), Py_NewRef(p), prev == Py_None ? NULL : Py_NewRef(prev),
                        Py_NewRef(scratch)};
    axc_status st = axc_records_take(recs(), &t);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

static int idle(void) { return axc_runtime_grads_idle(axc_py_runtime()); }

/* grad_idle() -> nothing pending: no record, taken .grad, held result or open bucket */
static PyObject *py_idle(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(idle());
}

/* grad_chunk_dw(p) -> the gradient p's open chunk record accumulates into, or None */
static PyObject *py_chunk_dw(PyObject *self, PyObject *p)
{
    (void)self;
    PyObject *dw = axc_records_chunk_dw(recs(), key_of(p));
    return Py_NewRef(dw ? dw : Py_None);
}

int axc_py_grad_chunk_done(PyObject *p)
{
    int64_t bucket = -1;
    if (!axc_records_chunk_done(recs(), key_of(p), &bucket) || bucket < 0)
        return 0;
    return axc_py_bucket_apply((int)bucket, axc_buckets_unhold);
}

static PyObject *py_chunks_open(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromSize_t(axc_records_chunks_open(recs()));
}

/* grad_expect_chunk(p): one more chunk call of p (in the table that counts now) */
static PyObject *py_expect_chunk(PyObject *self, PyObject *p)
{
    (void)self;
    axc_status st = axc_records_expect_chunk(recs(), key_of(p), Py_NewRef(p));
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

static const char *const COUNTS = "axonn_c.chunk_counts";

static void counts_destroy(PyObject *cap)
{
    axc_chunk_counts_destroy(PyCapsule_GetPointer(cap, COUNTS), recs());
}

/* grad_chunk_counts() -> a table of chunk call counts of its own (a forward run ahead) */
static PyObject *py_chunk_counts(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_chunk_counts *c = NULL;
    axc_status st = axc_chunk_counts_create(&c);
    if (st != AXC_OK)
        return axc_py_raise(st);
    PyObject *cap = PyCapsule_New(c, COUNTS, counts_destroy);
    if (!cap)
        axc_chunk_counts_destroy(c, recs());
    return cap;
}

/* grad_count_into(counts or None) -> the previous one: where chunk calls are counted from now */
static PyObject *py_count_into(PyObject *self, PyObject *counts)
{
    (void)self;
    axc_chunk_counts *c = NULL;
    if (counts != Py_None && !(c = PyCapsule_GetPointer(counts, COUNTS)))
        return NULL;
    axc_records_count_into(recs(), c);
    PyObject *prev = g_counting ? g_counting : Py_NewRef(Py_None);
    g_counting = counts == Py_None ? NULL : Py_NewRef(counts);
    return prev;
}

static PyObject *py_counting_ahead(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(g_counting != NULL);
}

/* grad_add_counts(counts): its counts join the pass's (it is left empty) */
static PyObject *py_add_counts(PyObject *self, PyObject *counts)
{
    (void)self;
    axc_chunk_counts *c = PyCapsule_GetPointer(counts, COUNTS);
    if (!c)
        return NULL;
    axc_status st = axc_records_add_counts(recs(), c);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* puts back each taken .grad that is still the scratch; -1 with an exception (all are tried) */
static int restore(const axc_records_pass *pass)
{
    int rc = 0;
    for (size_t i = 0; i < pass->nrestore; i++) {
        const axc_taken_grad *t = &pass->restore[i];
        PyObject *cur = PyObject_GetAttr(t->param, s_grad);
        if (cur && cur == t->scratch &&
            PyObject_SetAttr(t->param, s_grad, t->prev ? t->prev : Py_None) < 0)
            rc = -1;
        if (!cur)
            rc = -1;
        Py_XDECREF(cur);
    }
    return rc;
}

/* sets or adds one record's gradient and marks what the .grad is then summed over */
static int apply(const axc_grad_record *r)
{
    PyObject *p = r->param, *cur = PyObject_GetAttr(p, s_grad);
    PyObject *view = cur ? PyObject_CallMethodOneArg(r->dw, s_view_as, p) : NULL;
    int rc = -1;
    axc_groups g = r->groups;
    if (!view)
        goto out;
    if (r->replace || cur == Py_None) {
        rc = PyObject_SetAttr(p, s_grad, view);
    } else { /* (added to a .grad summed like it: its groups join the mark's) */
        axc_groups now;
        PyObject *sum = summed_of(p, 0, &now, NULL, NULL) < 0 ? NULL : PyObject_CallMethodOneArg(cur, s_add_, view);
        axc_groups_union(&now, &r->groups);
        g = now;
        rc = sum ? 0 : -1;
        Py_XDECREF(sum);
    }
    if (rc == 0)
        rc = mark(p, &g, 0, 1.0, 0);
out:
    Py_XDECREF(view);
    Py_XDECREF(cur);
    return rc;
}

/* Completes every pending gradient (the caller switches grad mode off): the chunk call counts are forgotten; unless idle, every bucket's sums run and everything deferred
 * completes, then each record's gradient is set (or added) in order and marked, and the taken
 * .grads without a record are put back. When the sums fail, the records' .grads become None. */
PyObject *axc_py_grad_records_finish(void)
{
    axc_records_clear_counts(recs());
    if (idle())
        Py_RETURN_NONE;
    if (intern() < 0)
        return NULL;
    axc_records_pass pass;
    axc_status st = axc_records_detach(recs(), 1, &pass);
    if (st != AXC_OK)
        return axc_py_raise(st);
    /* (the generation of the uses of depth residuals whose work the wait below completes) */
    axc_layer_residuals *res = axc_runtime_layer_residuals(axc_py_runtime());
    uint64_t gen = axc_layer_residuals_pass_begin(res);
    PyObject *done = axc_py_grad_buckets_finish();
    {   /* (the tasks run even when one fails; the releases may run deallocators: not with the
         * sums' exception set) */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        axc_py_keeps_release_done();
        /* (everything deferred completed, also when a sum failed: the depth residuals it used
         * may go) */
        axc_layer_residuals_pass_done(res, gen);
        PyErr_Restore(et, ev, tb);
    }
    int rc = 0;
    if (!done) { /* do not leave half-reduced values where a gradient is expected */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        for (size_t i = 0; i < pass.nrecs; i++)
            if (PyObject_SetAttr(pass.recs[i].param, s_grad, Py_None) < 0)
                PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        rc = -1;
    } else {
        Py_DECREF(done);
        for (size_t i = 0; rc == 0 && i < pass.nrecs; i++)
            rc = apply(&pass.recs[i]);
        if (rc == 0)
            rc = restore(&pass);
    }
    axc_records_pass_release(recs(), &pass);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Forgets an abandoned pass (after its deferred work completed): the records and partial
 * buckets are dropped, the taken .grads put back. */
PyObject *axc_py_grad_records_drop(uint64_t gen)
{
    if (intern() < 0)
        return NULL;
    axc_records_pass pass;
    axc_status st = axc_records_detach(recs(), 0, &pass);
    if (st != AXC_OK)
        return axc_py_raise(st);
    axc_buckets_reset(axc_runtime_buckets(axc_py_runtime()));
    axc_layer_residuals_pass_done(axc_runtime_layer_residuals(axc_py_runtime()), gen);
    int rc = restore(&pass);
    axc_records_pass_release(recs(), &pass);
    axc_py_keeps_release_done();
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* grad_records_clear(): forgets everything pending, the pass and the marks a sync made (init,
 * finalize: what a sync of the old grid summed and scaled means nothing on the next one) */
static PyObject *py_records_clear(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_records_clear(recs());
    uintptr_t key;
    while (axc_records_dated_keys(recs(), &key, 1)) /* (a release may run Python: one by one) */
        axc_records_mark(recs(), key, NULL, NULL);
    PyObject *c = g_counting;
    g_counting = NULL;
    Py_XDECREF(c);
    Py_RETURN_NONE;
}

/* grad_records_stats() -> {"grad_records", "chunk_records_open", "summed_marks"} */
static PyObject *py_records_stats(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return Py_BuildValue("{snsnsn}", "grad_records", (Py_ssize_t)axc_records_count(recs()),
                         "chunk_records_open", (Py_ssize_t)axc_records_chunks_open(recs()),
                         "summed_marks", (Py_ssize_t)axc_records_marks(recs()));
}

PyMethodDef axc_py_records_methods[] = {
    {"grad_records_stats", py_records_stats, METH_NOARGS, "grad_records_stats() -> dict"},
    {"grad_summed_over", py_summed_over, METH_O, "grad_summed_over(p) -> tuple of group names"},
    {"grad_mark_summed", py_mark_summed, METH_VARARGS, "grad_mark_summed(p, groups)"},
    {"grad_marks", py_marks, METH_NOARGS, "grad_marks() -> int"},
    {"grad_idle", py_idle, METH_NOARGS, "grad_idle() -> bool"},
    {"grad_chunk_dw", py_chunk_dw, METH_O, "grad_chunk_dw(p) -> Tensor or None"},
    {"grad_chunks_open", py_chunks_open, METH_NOARGS, "grad_chunks_open() -> int"},
    {"grad_expect_chunk", py_expect_chunk, METH_O, "grad_expect_chunk(p)"},
    {"grad_chunk_counts", py_chunk_counts, METH_NOARGS, "grad_chunk_counts() -> counts"},
    {"grad_count_into", py_count_into, METH_O, "grad_count_into(counts or None) -> previous"},
    {"grad_counting_ahead", py_counting_ahead, METH_NOARGS, "grad_counting_ahead() -> bool"},
    {"grad_add_counts", py_add_counts, METH_O, "grad_add_counts(counts)"},
    {"grad_records_clear", py_records_clear, METH_NOARGS, "grad_records_clear()"},
    {NULL, NULL, 0, NULL}};
