/* axonn_c._C: the CPython module. Collects the method tables of the binding files and holds
 * the process's runtime (axc/runtime.h), the one piece of C state the bindings share. */
#include "py_common.h"

#include "axc/comm.h"

/* made when the module loads, kept for the life of the process (like the module itself) */
static axc_runtime *g_runtime = NULL;

axc_runtime *axc_py_runtime(void) { return g_runtime; }
axc_comm *axc_py_comm(void) { return axc_runtime_comm(g_runtime); }
axc_sched *axc_py_sched(void) { return axc_runtime_sched(g_runtime); }

PyObject *axc_py_CommError = NULL;
PyObject *axc_py_CommTimeoutError = NULL;

PyObject *axc_py_raise(axc_status status)
{
    const char *msg = axc_last_error();
    if (!msg || !*msg)
        msg = axc_status_name(status);
    PyObject *type = PyExc_RuntimeError;
    switch (status) {
    case AXC_ERR_INVALID: type = PyExc_ValueError; break;
    case AXC_ERR_NOMEM: type = PyExc_MemoryError; break;
    case AXC_ERR_TIMEOUT: type = axc_py_CommTimeoutError; break;
    case AXC_ERR_PEER:
    case AXC_ERR_BACKEND: type = axc_py_CommError; break;
    default: break;
    }
    PyErr_SetString(type, msg);
    return NULL;
}

static PyMethodDef *all_tables[] = {axc_py_comm_methods, axc_py_model_methods,
                                    axc_py_gemm_methods,
                                    axc_py_timeline_methods, axc_py_sched_methods,
                                    axc_py_compress_methods, axc_py_grads_methods,
                                    axc_py_records_methods, axc_py_grad_hook_methods,
                                    axc_py_grad_pass_methods,
                                    axc_py_microbatch_methods, axc_py_layer_residuals_methods,
                                    axc_py_sync_methods};

PyObject *axc_py_optional_attr(PyObject *obj, PyObject *name)
{
    PyObject *v = NULL;
#if PY_VERSION_HEX >= 0x030D0000
    (void)PyObject_GetOptionalAttr(obj, name, &v);
#else
    (void)_PyObject_LookupAttr(obj, name, &v);
#endif
    return v;
}

int axc_py_add_type(PyObject *module, PyTypeObject *type, const char *name)
{
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static struct PyModuleDef axc_module = {PyModuleDef_HEAD_INIT, "axonn_c._C",
                                        "C core of axonn_c (internal; use the axonn_c package).",
                                        -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void)
{
    if (!g_runtime) {
        axc_runtime_ops ops;
        axc_py_grads_runtime_ops(&ops);
        axc_status st = axc_runtime_create(&g_runtime, &ops);
        if (st != AXC_OK) { /* (before the module's exception types exist) */
            PyErr_SetString(PyExc_RuntimeError, axc_last_error());
            return NULL;
        }
    }
    PyObject *m = PyModule_Create(&axc_module);
    if (!m)
        return NULL;
    for (size_t t = 0; t < sizeof all_tables / sizeof all_tables[0]; t++) {
        if (PyModule_AddFunctions(m, all_tables[t]) < 0)
            goto fail;
    }
    axc_py_CommError = PyErr_NewExceptionWithDoc(
        "axonn_c.CommError", "A collective failed: a peer died, aborted, or the backend failed.",
        PyExc_RuntimeError, NULL);
    if (!axc_py_CommError)
        goto fail;
    PyObject *bases = PyTuple_Pack(2, axc_py_CommError, PyExc_TimeoutError);
    if (!bases)
        goto fail;
    axc_py_CommTimeoutError = PyErr_NewExceptionWithDoc(
        "axonn_c.CommTimeoutError", "A peer did not arrive within the timeout.", bases, NULL);
    Py_DECREF(bases);
    if (!axc_py_CommTimeoutError)
        goto fail;
    Py_INCREF(axc_py_CommError);
    Py_INCREF(axc_py_CommTimeoutError);
    if (PyModule_AddObject(m, "CommError", axc_py_CommError) < 0 ||
        PyModule_AddObject(m, "CommTimeoutError", axc_py_CommTimeoutError) < 0)
        goto fail;
    if (axc_py_comm_add_types(m) < 0 || axc_py_linear_add_types(m) < 0 ||
        axc_py_grads_add_types(m) < 0 || axc_py_grad_hook_add_types(m) < 0 ||
        axc_py_grad_pass_add_types(m) < 0 || axc_py_sched_add_types(m) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
