/* A Linear's deferred weight gradient (axonn_c/grads.py's prepare, add, chunk_prepare, called by
 * axonn_c/linear.py's backward): where the layer's dW goes and what it records. The decision
 * (reduce over data now, fold the .grad so far, replace or add) is axc_grad_plan_deferred
 * (csrc/grads/grad_policy.c); this carries it out on torch tensors. */
#include "py_common.h"

#include "axc/grad_policy.h"

static const axc_groups k_data = {.n = 1, .g = {AXC_GROUP_DATA}};
static const axc_groups k_none = {.n = 0};

static axc_grad_records *recs(void) { return axc_runtime_records(axc_py_runtime()); }

/* prepare's work: *dw, *fold (a new reference or NULL), *replace, *bucket (-1: none) */
static int prepare(PyObject *param, Py_ssize_t n, int overlap_data, PyObject **dw,
                   PyObject **fold, int *replace, int *bucket)
{
    *dw = *fold = NULL;
    *bucket = -1;
    /* e.g. a second backward over a retained graph after one that raised */
    if (axc_py_grad_drop_if_abandoned() < 0)
        return -1;
    if (axc_records_pending(recs(), (uintptr_t)param)) { /* the layer ran twice (shared weights) */
        PyObject *r = axc_py_grad_finish();
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    axc_groups summed;
    PyObject *prev = axc_py_grad_summed(param, &summed) < 0 ? NULL : PyObject_GetAttrString(param, "grad");
    if (!prev)
        return -1;
    int summed_data = 0;
    for (int i = 0; i < summed.n; i++)
        summed_data |= summed.g[i] == AXC_GROUP_DATA;
    axc_comm *comm = axc_py_comm();
    int data_size = comm ? axc_grid_group_size(axc_comm_grid(comm), AXC_GROUP_DATA) : 1;
    axc_dw_plan plan = axc_grad_plan_deferred(data_size, overlap_data,
                                              axc_runtime_grad_sync(axc_py_runtime()), summed_data,
                                              prev != Py_None);
    int rc = -1;
    if (plan.fold) { /* (as it is when it is contiguous and of the parameter's dtype) */
        PyObject *c = PyObject_CallMethod(prev, "is_contiguous", NULL);
        PyObject *pd = c ? PyObject_GetAttrString(param, "dtype") : NULL;
        PyObject *gd = pd ? PyObject_GetAttrString(prev, "dtype") : NULL;
        int as_is = gd ? PyObject_IsTrue(c) : -1;
        if (as_is > 0 && gd != pd)
            as_is = 0;
        if (as_is > 0) {
            *fold = Py_NewRef(prev);
        } else if (as_is == 0) {
            PyObject *d = PyObject_CallMethod(prev, "detach", NULL);
            PyObject *t = d ? PyObject_CallMethod(d, "to", "O", pd) : NULL;
            *fold = t ? PyObject_CallMethod(t, "contiguous", NULL) : NULL;
            Py_XDECREF(d);
            Py_XDECREF(t);
        }
        Py_XDECREF(c);
        Py_XDECREF(pd);
        Py_XDECREF(gd);
        if (!*fold)
            goto out;
    }
    *dw = plan.reduce ? axc_py_grad_bucket_view(param, n, &k_data, bucket)
                      : PyObject_CallMethod(param, "new_empty", "((n))", n);
    if (!*dw) {
        Py_CLEAR(*fold);
        goto out;
    }
    *replace = plan.replace;
    rc = 0;
out:
    Py_DECREF(prev);
    return rc;
}

static int parse(PyObject *args, const char *fmt, PyObject **param, Py_ssize_t *n, int *overlap)
{
    if (!PyArg_ParseTuple(args, fmt, param, n, overlap))
        return -1;
    if (*n < 0) {
        PyErr_Format(PyExc_ValueError, "a deferred gradient of n=%zd elements, expected n >= 0",
                     *n);
        return -1;
    }
    return 0;
}

static PyObject *bucket_or_none(int bucket)
{
    return bucket < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(bucket);
}

/* grad_prepare(param, n, overlap_data) -> (dw, fold, replace, bucket) */
static PyObject *py_prepare(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *param, *dw, *fold;
    Py_ssize_t n;
    int overlap, replace, bucket;
    if (parse(args, "Onp:grad_prepare", &param, &n, &overlap) < 0 ||
        prepare(param, n, overlap, &dw, &fold, &replace, &bucket) < 0)
        return NULL;
    return Py_BuildValue("(NNON)", dw, fold ? fold : Py_NewRef(Py_None),
                         replace ? Py_True : Py_False, bucket_or_none(bucket));
}

/* grad_add(param, dw, keep, replace, bucket): records the deferred gradient (in `bucket` when it
 * is reduced over data) and queues the end of the pass */
static PyObject *py_add(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *param, *dw, *keep, *bucket;
    int replace;
    if (!PyArg_ParseTuple(args, "OOOpO:grad_add", &param, &dw, &keep, &replace, &bucket))
        return NULL;
    long b = bucket == Py_None ? -1 : PyLong_AsLong(bucket);
    if (b == -1 && PyErr_Occurred())
        return NULL;
    if (axc_py_grad_record(param, dw, keep == Py_None ? NULL : keep, replace,
                           b < 0 ? &k_none : &k_data, (int)b) < 0 ||
        axc_py_grad_queue_finish() < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* grad_chunk_prepare(param, n, overlap_data) -> (dw, fold): the pass's chunk record of param
 * (opened by the pass's first chunk call, whose bucket waits for the last one) */
static PyObject *py_chunk_prepare(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *param, *dw, *fold;
    Py_ssize_t n;
    int overlap, replace, bucket;
    if (parse(args, "Onp:grad_chunk_prepare", &param, &n, &overlap) < 0)
        return NULL;
    PyObject *open = axc_records_chunk_dw(recs(), (uintptr_t)param);
    if (open) /* the pass's later chunks add to dw itself */
        return Py_BuildValue("(OO)", open, open);
    if (prepare(param, n, overlap, &dw, &fold, &replace, &bucket) < 0)
        return NULL;
    PyObject *keep = PyTuple_Pack(1, fold ? fold : Py_None);
    /* its calls counted so far; its bucket's sums wait for the pass's last chunk */
    int rc = keep ? axc_py_grad_record(param, dw, keep, replace, bucket < 0 ? &k_none : &k_data, -1)
                  : -1;
    Py_XDECREF(keep);
    if (rc == 0) {
        axc_status st = axc_records_chunk_open(recs(), (uintptr_t)param, bucket,
                                               axc_records_take_count(recs(), (uintptr_t)param));
        if (st != AXC_OK) {
            axc_py_raise(st);
            rc = -1;
        }
    }
    if (rc == 0 && bucket >= 0) {
        PyObject *b = PyLong_FromLong(bucket);
        PyObject *r = b ? axc_py_bucket_op(b, axc_buckets_hold) : NULL;
        Py_XDECREF(b);
        Py_XDECREF(r);
        rc = r ? 0 : -1;
    }
    if (rc == 0)
        rc = axc_py_grad_queue_finish();
    if (rc < 0) {
        Py_DECREF(dw);
        Py_XDECREF(fold);
        return NULL;
    }
    return Py_BuildValue("(NN)", dw, fold ? fold : Py_NewRef(Py_None));
}

PyMethodDef axc_py_grad_deferred_methods[] = {
    {"grad_prepare", py_prepare, METH_VARARGS,
     "grad_prepare(param, n, overlap_data) -> (dw, fold, replace, bucket): where a Linear's "
     "deferred weight gradient goes"},
    {"grad_add", py_add, METH_VARARGS,
     "grad_add(param, dw, keep, replace, bucket): records a deferred weight gradient"},
    {"grad_chunk_prepare", py_chunk_prepare, METH_VARARGS,
     "grad_chunk_prepare(param, n, overlap_data) -> (dw, fold): a chunk call's weight gradient"},
    {NULL, NULL, 0, NULL},
};
