/* Bindings of sync_gradients' sums: csrc/grads/sync.c decides per parameter what to sum and
 * in which order, the bucket engine (csrc/grads/buckets.c, through py_grads.c) packs the
 * gradients into flat buffers and starts their sums. This file reads the parameters'
 * attributes, updates their summed-over marks (through py_records.c's axc_py_grad_mark) and
 * copies the gradients in and out: a contiguous CPU gradient into its piece with memcpy, any
 * other with torch's copy_ (on the current stream, so CUDA gradients are ordered as any torch
 * op); the scale once per bucket; back into each gradient with torch's copy_. */
#include <stdio.h>
#include <string.h>

#include "axc/buckets.h"
#include "axc/sched.h"
#include "axc/sync.h"
#include "py_common.h"

static PyObject *s_numel, *s_reshape, *s_copy_, *s_mul_, *s_view_as, *s_grad, *s_grad_groups,
    *s_deferred, *s_minus_one, *s_is_cpu, *s_layout,
    *s_is_contiguous, *s_data_ptr, *s_ident, *g_strided, *s_names[AXC_GROUP_COUNT];

static int intern(void)
{
    if (s_numel)
        return 0;
    if (!(s_numel = PyUnicode_InternFromString("numel")) ||
        !(s_reshape = PyUnicode_InternFromString("reshape")) ||
        !(s_copy_ = PyUnicode_InternFromString("copy_")) ||
        !(s_mul_ = PyUnicode_InternFromString("mul_")) ||
        !(s_view_as = PyUnicode_InternFromString("view_as")) ||
        !(s_grad = PyUnicode_InternFromString("grad")) ||
        !(s_grad_groups = PyUnicode_InternFromString("_axonn_grad_groups")) ||
        !(s_deferred = PyUnicode_InternFromString("_axonn_deferred")) ||
        !(s_minus_one = PyLong_FromLong(-1)) ||
        !(s_is_cpu = PyUnicode_InternFromString("is_cpu")) ||
        !(s_layout = PyUnicode_InternFromString("layout")) ||
        !(s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) ||
        !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
        !(s_ident = PyUnicode_InternFromString("_axonn_grad_ident")))
        return -1;
    for (int i = 0; i < AXC_GROUP_COUNT; i++)
        if (!(s_names[i] = PyUnicode_InternFromString(axc_group_name((axc_group_kind)i))))
            return -1;
    return 0;
}

/* getattr(o, name, None) as a new reference, NULL without an exception for None or a missing
 * attribute (found without raising and catching an AttributeError, which would cost more than
 * the rest of a parameter's decision); NULL with one for any other error */
static PyObject *attr_or_null(PyObject *o, PyObject *name)
{
    PyObject *v = axc_py_optional_attr(o, name);
    if (v == Py_None)
        Py_CLEAR(v);
    return v;
}

/* a sequence of group names (in order, repeats kept) -> groups; -1 with an exception naming
 * `what` */
static int names_to_groups(PyObject *names, const char *what, axc_groups *out)
{
    /* (a tuple or list: an unordered container could order the groups differently on
     * different ranks, whose sums would then not match) */
    if (!PyTuple_Check(names) && !PyList_Check(names)) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple or list of group names (in the same "
                                      "order on every rank), got %R", what, names);
        return -1;
    }
    PyObject *seq = Py_NewRef(names);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int rc = 0;
    out->n = 0;
    if (n > AXC_GROUP_COUNT) {
        PyErr_Format(PyExc_ValueError, "%s names %zd groups, expected at most %d: %R", what, n,
                     AXC_GROUP_COUNT, names);
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        const char *name = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : NULL;
        if (!name || axc_group_from_name(name, &out->g[out->n++]) != AXC_OK) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: %R is not a group name (expected one of col, "
                                           "row, depth, data, intra, world)", what, item);
            rc = -1;
        }
    }
    Py_DECREF(seq);
    return rc;
}

/* Calls o.name(arg) for its effect; -1 with an exception. */
static int call1(PyObject *o, PyObject *name, PyObject *arg)
{
    PyObject *r = PyObject_CallMethodOneArg(o, name, arg);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* One tensor's piece of a bucket. */
typedef struct piece {
    PyObject *flat; /* the bucket's buffer (a reference) */
    size_t off, n;  /* the piece: elements [off, off + n) of flat */
    axc_bucket_key key;
    size_t want; /* elements of its key the call packs from this piece on */
    uint64_t tag; /* its gradient's name in the residuals' fingerprints (axc_buckets_take) */
    uint64_t ident; /* its name on every rank (axc_buckets_take_shared) */
} piece;

static PyTypeObject *g_tensor_type, *g_param_type;

static int torch_types(void)
{
    if (g_tensor_type)
        return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *t = torch ? PyObject_GetAttrString(torch, "Tensor") : NULL;
    PyObject *nn = torch ? PyObject_GetAttrString(torch, "nn") : NULL;
    PyObject *p = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
    g_strided = p ? PyObject_GetAttrString(torch, "strided") : NULL;
    Py_XDECREF(torch);
    Py_XDECREF(nn);
    if (!t || !p || !g_strided || !PyType_Check(t) || !PyType_Check(p)) {
        Py_XDECREF(t);
        Py_XDECREF(p);
        Py_CLEAR(g_strided);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "torch.Tensor is not a type");
        return -1;
    }
    g_tensor_type = (PyTypeObject *)t; /* (kept for the life of the process) */
    g_param_type = (PyTypeObject *)p;
    return 0;
}

/* a pointer-sized integer a method returns; 0 with no exception when it raised (the caller
 * then takes torch's path) */
static uintptr_t call_ptr(PyObject *o, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(o, name);
    uintptr_t v = r ? (uintptr_t)PyLong_AsVoidPtr(r) : 0;
    Py_XDECREF(r);
    if (PyErr_Occurred())
        PyErr_Clear();
    return v;
}

/* whether o.name() returned True (-1 with an exception) */
static int call_true(PyObject *o, const char *name)
{
    PyObject *r = PyObject_CallMethod(o, name, NULL);
    int v = r ? r == Py_True : -1;
    Py_XDECREF(r);
    return v;
}

/* t's memory when memcpy copies it exactly as t.copy_ would: a contiguous dense CPU tensor of
 * torch's own type (no subclass, whose copy_ may differ) without a lazy negation or
 * conjugation (torch._neg_view, .conj(): its memory is not its values), else NULL */
static char *cpu_memory(PyObject *t, int device)
{
    if (device != -1 || (Py_TYPE(t) != g_tensor_type && Py_TYPE(t) != g_param_type))
        return NULL;
    PyObject *cpu = PyObject_GetAttr(t, s_is_cpu);
    int is_cpu = cpu == Py_True;
    Py_XDECREF(cpu);
    PyObject *layout = is_cpu ? PyObject_GetAttr(t, s_layout) : NULL;
    int strided = layout && layout == g_strided;
    Py_XDECREF(layout);
    PyObject *c = strided ? PyObject_CallMethodNoArgs(t, s_is_contiguous) : NULL;
    int contiguous = c == Py_True && call_true(t, "is_neg") == 0 && call_true(t, "is_conj") == 0;
    Py_XDECREF(c);
    if (PyErr_Occurred())
        PyErr_Clear();
    return contiguous ? (char *)call_ptr(t, s_data_ptr) : NULL;
}

/* t's size and kind into its piece (pc->key holds the groups); -1 with an exception */
static int describe(PyObject *t, piece *pc)
{
    PyObject *num = PyObject_CallMethodNoArgs(t, s_numel);
    Py_ssize_t numel = num ? PyLong_AsSsize_t(num) : -1;
    Py_XDECREF(num);
    if (numel < 0 || axc_py_bucket_kind(t, &pc->key) < 0)
        return -1;
    pc->n = (size_t)numel;
    return 0;
}

/* Each piece's `want`: the elements of its kind (dtype, device) from it to the end, so that a
 * new bucket is no larger than what the call still packs into it (a small model's sum then
 * takes no more memory than its gradients). Past 8 kinds: 0, a full bucket. */
static void set_wants(piece *pcs, size_t n)
{
    struct kind_run {
        axc_dtype dtype;
        int device;
        size_t sum;
    } run[8];
    int nrun = 0;
    for (size_t i = n; i-- > 0;) {
        int r = 0;
        while (r < nrun && (run[r].dtype != pcs[i].key.dtype || run[r].device != pcs[i].key.device))
            r++;
        if (r == nrun && nrun < 8)
            run[nrun++] = (struct kind_run){pcs[i].key.dtype, pcs[i].key.device, 0};
        if (r == nrun) {
            pcs[i].want = 0;
            continue;
        }
        run[r].sum += pcs[i].n;
        pcs[i].want = run[r].sum ? run[r].sum : 1; /* (0 would mean unknown: a full bucket) */
    }
}

/* t into a piece of the open bucket of its key (described first); -1 with an exception */
static int pack(PyObject *t, size_t bytes, piece *pc)
{
    /* (what can fail on t's side before the piece is taken: a piece taken is always written,
     * so no bucket is left open with unwritten memory in it) */
    const char *mem = cpu_memory(t, pc->key.device);
    PyObject *src = mem ? NULL : PyObject_CallMethodOneArg(t, s_reshape, s_minus_one);
    if (!mem && !src)
        return -1;
    int bucket;
    pc->flat = axc_py_bucket_take(t, &pc->key, pc->n, pc->want, bytes, pc->tag, pc->ident,
                                  &bucket, &pc->off);
    if (!pc->flat) {
        Py_XDECREF(src);
        return -1;
    }
    char *base = mem ? (char *)call_ptr(pc->flat, s_data_ptr) : NULL;
    int ok = 1;
    if (mem && base) { /* (reading t: nothing of t changes, as with piece.copy_(t)) */
        size_t elem = axc_dtype_size(pc->key.dtype);
        memcpy(base + pc->off * elem, mem, pc->n * elem);
    } else {
        PyObject *part = PyObject_CallMethod(pc->flat, "narrow", "inn", 0, (Py_ssize_t)pc->off,
                                             (Py_ssize_t)pc->n);
        if (!src && part) /* (the bucket's pointer could not be read: torch's copy) */
            src = PyObject_CallMethodOneArg(t, s_reshape, s_minus_one);
        ok = part && src && call1(part, s_copy_, src) == 0;
        if (!ok && part) { /* zeros, not stale memory, in what the sum reads */
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyObject *z = PyObject_CallMethod(part, "zero_", NULL);
            Py_XDECREF(z);
            PyErr_Clear();
            PyErr_Restore(et, ev, tb);
        }
        Py_XDECREF(part);
    }
    Py_XDECREF(src);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb); /* (written also after a failed copy: its error kept) */
    int written = axc_py_bucket_apply(bucket, axc_buckets_written);
    if (!ok) { /* (the copy's error wins over the write's) */
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return written;
}

/* Multiplies the used part of each bucket by `scale`, once per bucket (elementwise as each
 * piece's mul_ would): the pieces of one call fill their buckets from the start. */
static int scale_buckets(const piece *pcs, size_t n, PyObject *scale)
{
    /* the buckets (few: one per dtype and device and 32 MiB) and how far each is used */
    PyObject **flats = PyMem_Calloc(n ? n : 1, sizeof *flats);
    size_t *ends = PyMem_Calloc(n ? n : 1, sizeof *ends);
    size_t nflats = 0;
    int rc = flats && ends ? 0 : -1;
    if (rc < 0)
        PyErr_NoMemory();
    for (size_t i = 0; rc == 0 && i < n; i++) {
        size_t f = nflats;
        while (f > 0 && flats[f - 1] != pcs[i].flat) /* (the latest bucket first) */
            f--;
        if (f == 0) {
            flats[nflats] = pcs[i].flat;
            f = ++nflats;
        }
        if (pcs[i].off + pcs[i].n > ends[f - 1])
            ends[f - 1] = pcs[i].off + pcs[i].n;
    }
    for (size_t f = 0; rc == 0 && f < nflats; f++) {
        PyObject *used = PyObject_CallMethod(flats[f], "narrow", "inn", 0, (Py_ssize_t)0,
                                             (Py_ssize_t)ends[f]);
        rc = !used || call1(used, s_mul_, scale) < 0 ? -1 : 0;
        Py_XDECREF(used);
    }
    PyMem_Free(flats);
    PyMem_Free(ends);
    return rc;
}

/* The summed piece back into t, by torch's copy_ on every device: t is the user's gradient,
 * whose version counter an in-place write must advance (autograd then refuses a graph that
 * saved it before, as with any in-place op); -1 with an exception */
static int unpack(PyObject *t, const piece *pc)
{
    PyObject *part = PyObject_CallMethod(pc->flat, "narrow", "inn", 0, (Py_ssize_t)pc->off,
                                         (Py_ssize_t)pc->n);
    PyObject *view = part ? PyObject_CallMethodOneArg(part, s_view_as, t) : NULL;
    int failed = !view || call1(t, s_copy_, view) < 0;
    Py_XDECREF(view);
    Py_XDECREF(part);
    return failed ? -1 : 0;
}

/* After a piece failed: the pieces packed so far are not summed, so that nothing of this call
 * is left in an open bucket for a later sum (or its error-feedback residual) to take in; sums
 * already started (a full bucket) complete first, as they write the buffers. The pending
 * exception is kept. */
static void drop_packed(void)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    axc_sched *s = axc_py_sched();
    if (s) {
        Py_BEGIN_ALLOW_THREADS (void)axc_sched_finish(s); /* (the first error is the piece's) */
        Py_END_ALLOW_THREADS
    }
    axc_buckets_reset(axc_runtime_buckets(axc_py_runtime()));
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* how long run_concurrent's reducer waits for its sums between looks for an interrupt */
#define REDUCE_SLICE_MS 50

/* run_concurrent's reducer: starts the packed sums and waits for them (axc_sched_finish, on a
 * thread of its own) in slices, without the GIL; an interrupt (Ctrl-C) between two slices
 * aborts the job's collectives (every rank's waits fail at once, as run_concurrent's own
 * interrupt does: axonn_c/microbatches.py _abort_interrupted), the finish is waited for all the
 * same (it still uses the buffers), and the interrupt is raised. The buckets are then let go.
 * -1 with an exception. */
static int finish_interruptibly(void)
{
    axc_sched *s = axc_py_sched();
    axc_buckets *b = axc_runtime_buckets(axc_py_runtime());
    if (!s || !b) { /* (it raises: not initialised) */
        PyObject *r = axc_py_grad_buckets_finish();
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    axc_buckets_close_all(b);
    axc_sched_finishing *f = NULL;
    axc_status st = axc_runtime_start_due_sums(axc_py_runtime()), ts = AXC_OK;
    char task_msg[512] = "";
    if (st == AXC_OK) {
        /* (queued tasks run here: a GEMM task on this thread's device; the finish only waits) */
        Py_BEGIN_ALLOW_THREADS ts = axc_sched_run_tasks(s);
        Py_END_ALLOW_THREADS
        if (ts != AXC_OK)
            snprintf(task_msg, sizeof task_msg, "%s", axc_last_error());
    }
    if (st == AXC_OK && axc_sched_finish_start(s, &f) != AXC_OK) {
        /* (no thread: waited for here, as without the interrupt) */
        Py_BEGIN_ALLOW_THREADS st = axc_sched_finish(s);
        Py_END_ALLOW_THREADS
        f = NULL;
    } else if (!f) { /* a sum did not start: what did completes before the buffers go */
        if (!PyErr_Occurred()) /* (an allocation's Python error is already set) */
            axc_py_raise(st);
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        Py_BEGIN_ALLOW_THREADS (void)axc_sched_finish(s);
        Py_END_ALLOW_THREADS
        axc_buckets_reset(b);
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    PyObject *et = NULL, *ev = NULL, *tb = NULL; /* the first interrupt */
    while (f) {
        int done;
        Py_BEGIN_ALLOW_THREADS done = axc_sched_finish_wait(f, REDUCE_SLICE_MS, &st);
        Py_END_ALLOW_THREADS
        if (done)
            break;
        if (PyErr_CheckSignals() == 0)
            continue;
        if (et) { /* (a further one: the abort is done, the finish still waited for) */
            PyErr_Clear();
            continue;
        }
        PyErr_Fetch(&et, &ev, &tb);
        axc_py_abort_interrupted(PyExceptionClass_Check(et) ? PyExceptionClass_Name(et)
                                                            : "a signal");
    }
    axc_buckets_reset(b);
    if (et) {
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    if (ts != AXC_OK) { /* (the first error: the tasks') */
        axc_set_last_error(task_msg);
        st = ts;
    }
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* Sums tensors[0 .. n) in place over `g` (in this order) and multiplies them by `scale`
 * (NULL: not), waiting for the result: packed into gradient buckets of `bytes` (the same ones
 * as backward's, emptied first by the caller) and copied back; `interruptible`: waits as
 * finish_interruptibly. owners[i] (the parameter whose gradient tensors[i] is: the same object
 * in every step, where a .grad may be a new tensor) tags its piece; NULL: the tensors tag
 * themselves. -1 with an exception. */
static int reduce(PyObject *const *tensors, PyObject *const *owners, const size_t *idents,
                  size_t n, const axc_groups *g, PyObject *scale, size_t bytes,
                  int interruptible)
{
    if (!g->n) {
        for (size_t i = 0; scale && i < n; i++)
            if (call1(tensors[i], s_mul_, scale) < 0)
                return -1;
        return 0;
    }
    if (g->n > AXC_BUCKET_MAX_GROUPS) {
        PyErr_Format(PyExc_ValueError, "a gradient is summed over %d groups, at most %d are "
                                       "supported", g->n, AXC_BUCKET_MAX_GROUPS);
        return -1;
    }
    if (torch_types() < 0)
        return -1;
    axc_bucket_key key = {.ngroups = g->n};
    memcpy(key.groups, g->g, (size_t)g->n * sizeof g->g[0]);
    piece *pcs = PyMem_Calloc(n ? n : 1, sizeof *pcs);
    if (!pcs) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = -1;
    size_t i;
    for (i = 0; i < n; i++) {
        pcs[i].key = key;
        pcs[i].tag = (uint64_t)(uintptr_t)(owners ? owners[i] : tensors[i]);
        pcs[i].ident = idents ? (uint64_t)idents[i] : (uint64_t)i + 1;
        if (describe(tensors[i], &pcs[i]) < 0) /* (nothing packed yet) */
            goto out;
    }
    set_wants(pcs, n);
    for (i = 0; i < n; i++)
        if (pack(tensors[i], bytes, &pcs[i]) < 0) {
            drop_packed();
            goto out;
        }
    if (interruptible) {
        if (finish_interruptibly() < 0)
            goto out;
    } else {
        PyObject *done = axc_py_grad_buckets_finish();
        if (!done)
            goto out;
        Py_DECREF(done);
    }
    if (scale && scale_buckets(pcs, n, scale) < 0)
        goto out;
    for (i = 0; i < n; i++)
        if (unpack(tensors[i], &pcs[i]) < 0)
            goto out;
    rc = 0;
out:
    for (i = 0; i < n; i++)
        Py_XDECREF(pcs[i].flat);
    PyMem_Free(pcs);
    return rc;
}

int axc_py_grad_reduce(PyObject *const *tensors, PyObject *const *params, const size_t *idents,
                       size_t n, const axc_groups *g, size_t bytes)
{
    return intern() < 0 ? -1 : reduce(tensors, params, idents, n, g, NULL, bytes, 1);
}

/* None -> NULL, else the number itself (borrowed); -1 with an exception */
static int parse_scale(PyObject **scale)
{
    if (*scale == Py_None) {
        *scale = NULL;
        return 0;
    }
    if (!PyFloat_Check(*scale) && !PyLong_Check(*scale)) {
        PyErr_Format(PyExc_TypeError, "scale must be a float or None, got %R", *scale);
        return -1;
    }
    return 0;
}

static int parse_bytes(Py_ssize_t bytes)
{
    if (bytes > 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "bucket_bytes=%zd, expected > 0", bytes);
    return -1;
}

/* grad_reduce_now(tensors, groups, scale, bucket_bytes): sums the tensors in place over
 * `groups` (names, in this order; none: only scaled) and multiplies them by `scale` (None:
 * not), waiting for the result, as run_concurrent's reducer does (axc_py_grad_reduce;
 * sync_gradients is grad_sync): an interrupt during the wait aborts the job's collectives and
 * raises KeyboardInterrupt */
static PyObject *py_reduce_now(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *tensors, *names, *scale;
    Py_ssize_t bytes;
    axc_groups g;
    if (!PyArg_ParseTuple(args, "OOOn", &tensors, &names, &scale, &bytes) || intern() < 0 ||
        parse_scale(&scale) < 0 || parse_bytes(bytes) < 0 ||
        names_to_groups(names, "grad_reduce_now: groups", &g) < 0)
        return NULL;
    /* (a tuple of its own: the list a caller passes may change while the sums release the GIL) */
    PyObject *seq = PySequence_Tuple(tensors);
    if (!seq)
        return NULL;
    int rc = reduce(PySequence_Fast_ITEMS(seq), NULL, NULL, (size_t)PySequence_Fast_GET_SIZE(seq), &g,
                    scale, (size_t)bytes, 1);
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* What one sync needs from its arguments. */
typedef struct sync_args {
    PyObject *attr, *replicated, *hook;
    unsigned several;
    const axc_groups *only;
    int marks_grad;
    double scale; /* 1 for none */
    unsigned long long arrivals; /* gradients arrived so far (axc_runtime_grad_arrivals) */
} sync_args;

int axc_py_grad_ident(PyObject *p, uint64_t *ident)
{
    *ident = 0;
    if (intern() < 0)
        return -1;
    PyObject *have = axc_py_optional_attr(p, s_ident);
    if (!have)
        return PyErr_Occurred() ? -1 : 0;
    if (PyTuple_CheckExact(have) && PyTuple_GET_SIZE(have) == 2 &&
        PyLong_CheckExact(PyTuple_GET_ITEM(have, 0)) &&
        PyLong_CheckExact(PyTuple_GET_ITEM(have, 1)) &&
        PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(have, 0)) ==
            axc_runtime_process_token(axc_py_runtime())) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(have, 1));
        *ident = v == (unsigned long long)-1 ? 0 : (uint64_t)v;
    }
    Py_DECREF(have);
    if (PyErr_Occurred()) { /* (a negative or huge number a user set: no name) */
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        *ident = 0;
    }
    return 0;
}

/* Names p's gradient in backward's overlapped buckets the first time a sync meets it: a name
 * unique in the process (axc_runtime_new_grad_ident), given in the order of the syncs' lists,
 * so the same on every rank, and distinct across models synced by separate calls (the
 * transport compares what the ranks packed into a sum). The attribute holds
 * (axc_runtime_process_token, name): one a pickle carries from another process, or any other
 * value, is no name and is replaced. -1 with an exception. */
static int name_param(PyObject *p)
{
    uint64_t have;
    if (axc_py_grad_ident(p, &have) < 0)
        return -1;
    if (have)
        return 0;
    PyObject *v = Py_BuildValue("(KK)", axc_runtime_process_token(axc_py_runtime()),
                                axc_runtime_new_grad_ident(axc_py_runtime()));
    if (!v || PyObject_SetAttr(p, s_ident, v) < 0) /* (an object that takes no attribute) */
        PyErr_Clear(); /* (unnamed: its buckets are not compared) */
    Py_XDECREF(v);
    return 0;
}

/* Decides param p's part (C: csrc/grads/sync.c); *grad: the gradient to sum (a new
 * reference), NULL when it has none. -1 with an exception. (The mark changes once the sum is
 * done: mark_summed.) */
static int decide_one(const sync_args *a, PyObject *p, axc_sync_choice *c, PyObject **grad)
{
    *grad = NULL;
    PyObject *own = attr_or_null(p, s_grad_groups);
    if (!own && PyErr_Occurred())
        return -1;
    PyObject *groups_obj = own ? own : a->replicated;
    int rc = -1;
    if (a->hook && a->marks_grad) { /* later backward passes sum this gradient while they run (grads.hook) */
        PyObject *deferred = attr_or_null(p, s_deferred);
        int is_deferred = deferred ? PyObject_IsTrue(deferred) : (PyErr_Occurred() ? -1 : 0);
        Py_XDECREF(deferred);
        PyObject *r = is_deferred == 0 ? PyObject_CallFunctionObjArgs(a->hook, p, groups_obj, NULL)
                                       : NULL;
        Py_XDECREF(r);
        if (is_deferred < 0 || (!is_deferred && !r))
            goto out;
    }
    PyObject *g = attr_or_null(p, a->attr);
    if (!g) {
        c->skip = 1;
        rc = PyErr_Occurred() ? -1 : 0;
        goto out;
    }
    axc_groups groups, done = {0};
    double synced = 0, carried = 1.0;
    int dated = 0;
    if (names_to_groups(groups_obj, "a parameter's _axonn_grad_groups", &groups) < 0)
        goto drop;
    if (axc_records_marks(axc_runtime_records(axc_py_runtime()))) { /* (else no mark to read) */
        /* (main_grad: a copy made from the marked .grad, which may be dropped since) */
        if (axc_py_grad_mark_of(p, !a->marks_grad, &done, &synced, &carried) < 0)
            goto drop;
        unsigned long long gen;
        dated = axc_py_grad_made_by_sync(p, &done, synced, carried, &gen);
        if (dated && a->marks_grad && gen != a->arrivals) {
            /* a sync marked it, a backward ran since, but not into this .grad (else it would
             * be unsynced, or its mark replaced): it takes part in the sums again as every
             * rank's share, as on the ranks where it did (an unused parameter, a .grad zeroed
             * in place) */
            if (axc_py_grad_unsync(p) < 0)
                goto drop;
            done.n = 0;
            synced = 0;
            carried = 1.0;
            dated = 0;
        }
    }
    axc_sync_decide(&groups, &done, synced, carried, dated, a->several, a->only, a->marks_grad,
                    a->scale, c);
    *grad = g;
    rc = 0;
    goto out;
drop:
    Py_DECREF(g);
out:
    Py_XDECREF(own);
    return rc;
}

/* After param p's sum succeeded: its mark says what its .grad is now summed over (only then,
 * so that a sum that failed is not skipped by a retry) */
static int mark_summed(PyObject *p, const axc_sync_choice *c)
{
    axc_groups none = {0};
    if (c->mark == AXC_SYNC_MARK_KEEP)
        return 0;
    if (c->mark == AXC_SYNC_MARK_SET && c->synced > 0)
        return axc_py_grad_mark_synced(p, &c->marked, c->synced);
    if (c->mark == AXC_SYNC_MARK_SET) /* (sync_gradients_depth_parallel's: `only`) */
        return axc_py_grad_mark_scaled(p, &c->marked, c->scaled);
    return axc_py_grad_mark(p, c->mark == AXC_SYNC_MARK_SET ? &c->marked : &none);
}

/* The gradients synced already: multiplied by the ratio of the scales when this sync asks for
 * another one (another mean=), and their marks updated. A new mark is set before the
 * multiplication (its failure puts the old mark back), a forgotten one after it, so that a
 * retry after a failure never multiplies twice. */
static int rescale_synced(PyObject *params, const axc_sync_choice *choices,
                          PyObject *const *grads, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const axc_sync_choice *c = &choices[i];
        if (!c->skip || !grads[i] || (!(c->rescale > 0) && c->mark == AXC_SYNC_MARK_KEEP))
            continue;
        PyObject *p = PyList_GET_ITEM(params, i);
        axc_groups was;
        double was_synced = 0;
        if (c->mark == AXC_SYNC_MARK_SET &&
            (axc_py_grad_mark_of(p, 0, &was, &was_synced, NULL) < 0 || mark_summed(p, c) < 0))
            return -1;
        PyObject *by = c->rescale > 0 ? PyFloat_FromDouble(c->rescale) : NULL;
        PyObject *r = by ? PyObject_CallMethod(grads[i], "mul_", "O", by) : NULL;
        Py_XDECREF(by);
        if (c->rescale > 0 && !r) { /* (.grad as it was: so is its mark) */
            if (c->mark == AXC_SYNC_MARK_SET && was_synced > 0) {
                PyObject *et, *ev, *tb;
                PyErr_Fetch(&et, &ev, &tb);
                if (axc_py_grad_mark_synced(p, &was, was_synced) < 0)
                    PyErr_Clear();
                PyErr_Restore(et, ev, tb);
            }
            return -1;
        }
        Py_XDECREF(r);
        if (c->mark == AXC_SYNC_MARK_FORGET && mark_summed(p, c) < 0)
            return -1;
    }
    return 0;
}

/* The sums of the plan, set by set (each set's gradients packed together, or one by one
 * without `vectorize`), each parameter's mark updated once its sum is done. */
static int run_plan(const axc_sync_plan *plan, PyObject *params, const axc_sync_choice *choices,
                    PyObject *const *grads, int vectorize, size_t bytes)
{
    /* the set's gradients, then their parameters (the tags of their pieces), and their
     * positions in `params` + 1 (their names on every rank) */
    PyObject **set = PyMem_Calloc(plan->n ? 2 * plan->n : 1, sizeof *set);
    size_t *idents = set ? PyMem_Calloc(plan->n ? plan->n : 1, sizeof *idents) : NULL;
    if (!idents) {
        PyMem_Free(set);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **owners = set + plan->n;
    int rc = 0;
    for (int s = 0; rc == 0 && s < plan->nsets; s++) {
        const axc_sync_set *ss = &plan->sets[s];
        /* (the set's factor: None for 1) */
        PyObject *scale = ss->factor != 1.0 ? PyFloat_FromDouble(ss->factor) : NULL;
        if (ss->factor != 1.0 && !scale) {
            rc = -1;
            break;
        }
        for (size_t k = 0; k < ss->count; k++) {
            set[k] = grads[plan->order[ss->first + k]];
            owners[k] = PyList_GET_ITEM(params, plan->order[ss->first + k]);
            idents[k] = plan->order[ss->first + k] + 1;
        }
        if (vectorize)
            rc = reduce(set, owners, idents, ss->count, &ss->groups, scale, bytes, 0);
        /* a packed set summed: every one of it marked, also past a mark that failed (the
         * first error kept); one by one, a failed mark stops before the next sum */
        axc_py_first_error err = {0};
        for (size_t k = 0; rc == 0 && k < ss->count && !(err.failed && !vectorize); k++) {
            size_t i = plan->order[ss->first + k];
            if (!vectorize)
                rc = reduce(&set[k], &owners[k], &idents[k], 1, &ss->groups, scale, bytes, 0);
            if (rc == 0 && mark_summed(PyList_GET_ITEM(params, i), &choices[i]) < 0)
                axc_py_first_error_take(&err);
        }
        if (axc_py_first_error_restore(&err) < 0)
            rc = -1;
        Py_XDECREF(scale);
    }
    PyMem_Free(idents);
    PyMem_Free(set);
    return rc;
}

/* grad_sync(params, attr, replicated, only, scale, vectorize, hook, bucket_bytes): sums each
 * parameter's gradient (its attribute `attr`) over its groups (`_axonn_grad_groups`, else
 * `replicated`) that have several ranks, less those its mark says are summed already, within
 * `only` (None: all), and multiplies it by `scale` (None: not); updates the marks of what was
 * summed (after its sum: a failed sum leaves its marks, so a retry sums it again); with `hook`
 * (None: none), first calls hook(p, groups) for each parameter that is not a deferred Linear
 * weight. The sums are packed per set of groups into buckets of `bucket_bytes`. */
static PyObject *py_sync(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *params, *only_obj, *scale;
    Py_ssize_t bytes;
    int vectorize;
    sync_args a = {0};
    axc_groups only;
    if (!PyArg_ParseTuple(args, "OUOOOpOn", &params, &a.attr, &a.replicated, &only_obj, &scale,
                          &vectorize, &a.hook, &bytes) ||
        intern() < 0 || parse_scale(&scale) < 0 || parse_bytes(bytes) < 0)
        return NULL;
    axc_comm *comm = axc_py_comm();
    if (!comm) {
        PyErr_SetString(PyExc_RuntimeError, "axonn_c is not initialised: call axonn_c.init(...) "
                                            "first");
        return NULL;
    }
    a.several = axc_sync_several(axc_comm_grid(comm));
    a.arrivals = axc_runtime_grad_arrivals(axc_py_runtime());
    a.scale = scale ? PyFloat_AsDouble(scale) : 1.0;
    if (a.scale == -1.0 && PyErr_Occurred())
        return NULL;
    a.marks_grad = PyUnicode_Compare(a.attr, s_grad) == 0;
    if (a.hook == Py_None)
        a.hook = NULL;
    if (only_obj != Py_None) {
        if (names_to_groups(only_obj, "grad_sync: only", &only) < 0)
            return NULL;
        a.only = &only;
    }
    PyObject *list = PySequence_List(params);
    size_t n = list ? (size_t)PyList_GET_SIZE(list) : 0;
    axc_sync_choice *choices = list ? PyMem_Calloc(n ? n : 1, sizeof *choices) : NULL;
    PyObject **grads = choices ? PyMem_Calloc(n ? n : 1, sizeof *grads) : NULL;
    int rc = -1;
    axc_sync_plan plan = {0};
    if (!grads) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto out;
    }
    /* (all named before anything that can fail on one rank only: the hooks decide_one calls) */
    for (size_t i = 0; i < n; i++)
        if (name_param(PyList_GET_ITEM(list, i)) < 0)
            goto out;
    for (size_t i = 0; i < n; i++)
        if (decide_one(&a, PyList_GET_ITEM(list, i), &choices[i], &grads[i]) < 0)
            goto out;
    axc_status st = axc_sync_plan_build(&plan, choices, n);
    if (st != AXC_OK) {
        axc_py_raise(st);
        goto out;
    }
    rc = run_plan(&plan, list, choices, grads, vectorize, (size_t)bytes);
    if (rc == 0)
        rc = rescale_synced(list, choices, grads, n);
out:
    axc_sync_plan_free(&plan);
    for (size_t i = 0; grads && i < n; i++)
        Py_XDECREF(grads[i]);
    PyMem_Free(grads);
    PyMem_Free(choices);
    Py_XDECREF(list);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyMethodDef axc_py_sync_methods[] = {
    {"grad_sync", py_sync, METH_VARARGS,
     "grad_sync(params, attr, replicated, only, scale, vectorize, hook, bucket_bytes)"},
    {"grad_reduce_now", py_reduce_now, METH_VARARGS,
     "grad_reduce_now(tensors, groups, scale, bucket_bytes)"},
    {NULL, NULL, 0, NULL}};
