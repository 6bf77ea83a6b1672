/* A Linear's deferred weight gradient, handled inside the layer handle's backward
 * (csrc/python/py_linear_call.c): where the layer's dW goes and what it records. The decision
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
    /* (a synced .grad first becomes this rank's share: the deferral is made only for a pass
     * that accumulates into .grad) */
    PyObject *prev = axc_py_grad_unsync(param) < 0 || axc_py_grad_summed(param, &summed) < 0
                         ? NULL : PyObject_GetAttrString(param, "grad");
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

/* A chunk call's (axonn_c.Sequential) weight gradient: the pass's chunk record of param, opened
 * by its first chunk call (its calls counted so far; its bucket's sums wait for the pass's last
 * chunk); the pass's later chunks add to dw itself (fold = dw) */
static int chunk_prepare(PyObject *param, Py_ssize_t n, int overlap, axc_py_deferred_dw *dd)
{
    PyObject *open = axc_records_chunk_dw(recs(), (uintptr_t)param);
    if (open) {
        dd->dw = Py_NewRef(open);
        dd->fold = Py_NewRef(open);
        return 0;
    }
    if (prepare(param, n, overlap, &dd->dw, &dd->fold, &dd->replace, &dd->bucket) < 0)
        return -1;
    int bucket = dd->bucket;
    PyObject *keep = PyTuple_Pack(1, dd->fold ? dd->fold : Py_None);
    int rc = keep ? axc_py_grad_record(param, dd->dw, keep, dd->replace,
                                       bucket < 0 ? &k_none : &k_data, -1)
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
        rc = axc_py_bucket_apply(bucket, axc_buckets_hold);
    }
    return rc == 0 ? axc_py_grad_queue_finish() : -1;
}

int axc_py_deferred_prepare(PyObject *param, Py_ssize_t n, int overlap_data, int chunk,
                            axc_py_deferred_dw *dd)
{
    *dd = (axc_py_deferred_dw){.bucket = -1, .chunk = chunk};
    axc_runtime_grad_arrived(axc_py_runtime(), -1);
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "a deferred gradient of n=%zd elements, expected n >= 0",
                     n);
        return -1;
    }
    int rc = chunk ? chunk_prepare(param, n, overlap_data, dd)
                   : prepare(param, n, overlap_data, &dd->dw, &dd->fold, &dd->replace,
                             &dd->bucket);
    if (rc < 0)
        axc_py_deferred_clear(dd);
    return rc;
}

int axc_py_deferred_record(const axc_py_deferred_dw *dd, PyObject *param, PyObject *ws,
                           int depth)
{
    if (dd->chunk) /* (an unknown count: finish() completes it) */
        return axc_py_grad_chunk_done(param);
    /* what C reads until the pass ends: the depth reduce-scatter's workspace (the residual is
     * the layer table's) and the fold */
    PyObject *fold = dd->fold ? dd->fold : Py_None;
    PyObject *keep = depth > 1 ? PyTuple_Pack(2, ws, fold) : PyTuple_Pack(1, fold);
    int rc = keep ? axc_py_grad_record(param, dd->dw, keep, dd->replace,
                                       dd->bucket < 0 ? &k_none : &k_data, dd->bucket)
                  : -1;
    Py_XDECREF(keep);
    return rc == 0 ? axc_py_grad_queue_finish() : -1;
}

void axc_py_deferred_clear(axc_py_deferred_dw *dd)
{
    Py_CLEAR(dd->dw);
    Py_CLEAR(dd->fold);
}
