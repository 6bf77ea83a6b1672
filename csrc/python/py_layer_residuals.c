/* Bindings of the linear layers' depth dW residuals (csrc/grads/layer_residuals.c, held by the
 * runtime): read and set by layer id for checkpoints (axonn_c/compression.py names them by
 * module). The buffers are torch tensors (py_grads.c's allocator); the live ones are handed
 * out, the caller copies. */
#include <stdint.h>

#include "axc/layer_residuals.h"
#include "py_common.h"

static axc_layer_residuals *table(void) { return axc_runtime_layer_residuals(axc_py_runtime()); }

/* grad_layer_residuals_held() -> how many layers hold a residual */
static PyObject *py_held(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    int n = axc_layer_residuals_count(table()), held = 0;
    for (int i = 0; i < n; i++) {
        int layer;
        void *owner;
        size_t elems;
        axc_layer_residuals_at(table(), i, &layer, &owner, &elems);
        held += owner != NULL;
    }
    return PyLong_FromLong(held);
}

/* grad_layer_residual(layer) -> tensor or None (the live buffer) */
static PyObject *py_residual(PyObject *self, PyObject *arg)
{
    (void)self;
    long layer = PyLong_AsLong(arg);
    if (layer == -1 && PyErr_Occurred())
        return NULL;
    void *owner = NULL;
    size_t elems;
    if (layer < 0 || layer > INT32_MAX ||
        !axc_layer_residuals_get(table(), (int)layer, &owner, &elems) || !owner)
        Py_RETURN_NONE;
    return Py_NewRef((PyObject *)owner);
}

/* grad_layer_set_residual(layer, tensor): adopts a contiguous float32 tensor as the layer's
 * residual (the table keeps a reference and the reduce-scatters update it in place) */
static PyObject *py_set_residual(PyObject *self, PyObject *args)
{
    (void)self;
    int layer;
    PyObject *t;
    if (!PyArg_ParseTuple(args, "iO", &layer, &t))
        return NULL;
    void *ptr;
    size_t numel;
    axc_dtype dt;
    int device;
    if (axc_py_read_tensor(t, "residual", &ptr, &numel, &dt, &device) < 0)
        return NULL;
    if (dt != AXC_DT_F32) {
        PyErr_Format(PyExc_TypeError, "the depth residual of layer %d has dtype %s, expected "
                     "float32", layer, axc_dtype_name(dt));
        return NULL;
    }
    axc_status st = axc_layer_residuals_set(table(), layer, ptr, Py_NewRef(t), device, numel);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* grad_layer_clear_residuals(): drops every one (those in flight go at the pass's end) */
static PyObject *py_clear(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    axc_layer_residuals_clear(table());
    Py_RETURN_NONE;
}

/* grad_layer_residuals_kept() -> buffers kept for in-flight work until the pass's end */
static PyObject *py_kept(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(axc_layer_residuals_kept(table()));
}

PyMethodDef axc_py_layer_residuals_methods[] = {
    {"grad_layer_residuals_held", py_held, METH_NOARGS,
     "grad_layer_residuals_held() -> how many layers hold a depth dW error-feedback residual"},
    {"grad_layer_residual", py_residual, METH_O, "grad_layer_residual(layer) -> tensor or None"},
    {"grad_layer_set_residual", py_set_residual, METH_VARARGS,
     "grad_layer_set_residual(layer, tensor)"},
    {"grad_layer_clear_residuals", py_clear, METH_NOARGS, "grad_layer_clear_residuals()"},
    {"grad_layer_residuals_kept", py_kept, METH_NOARGS, "grad_layer_residuals_kept() -> int"},
    {NULL, NULL, 0, NULL}};
