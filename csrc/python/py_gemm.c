/* Bindings of the device compute layer (axc/gemm.h) for tests and benchmarks: raw pointers
 * (tensor.data_ptr()) and the stream come in as ints; the GIL is released around the call. */
#include <stdint.h>

#include "axc/comm.h"
#include "axc/gemm.h"
#include "py_common.h"

static int parse_dtype(const char *name, axc_dtype *dt)
{
    axc_status st = axc_dtype_from_name(name, dt);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

static PyObject *py_gemm(PyObject *self, PyObject *args)
{
    (void)self;
    axc_gemm_args g = {0};
    unsigned long long stream, a, b, c, bias;
    const char *dtype;
    int ta, tb;
    long long M, N, K, lda, ldb, ldc;
    double alpha, beta;
    if (!PyArg_ParseTuple(args, "iKsppLLLKLKLKLddK", &g.device, &stream, &dtype, &ta, &tb, &M, &N,
                          &K, &a, &lda, &b, &ldb, &c, &ldc, &alpha, &beta, &bias))
        return NULL;
    if (parse_dtype(dtype, &g.dtype) < 0)
        return NULL;
    g.stream = (void *)(uintptr_t)stream;
    g.trans_a = ta;
    g.trans_b = tb;
    g.M = M;
    g.N = N;
    g.K = K;
    g.A = (const void *)(uintptr_t)a;
    g.lda = lda;
    g.B = (const void *)(uintptr_t)b;
    g.ldb = ldb;
    g.C = (void *)(uintptr_t)c;
    g.ldc = ldc;
    g.alpha = (float)alpha;
    g.beta = (float)beta;
    g.bias = (const void *)(uintptr_t)bias;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_gemm(&g);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_bias_grad(PyObject *self, PyObject *args)
{
    (void)self;
    int device, accumulate;
    unsigned long long stream, dy, db;
    const char *dtype;
    long long M, N, ld;
    axc_dtype dt;
    if (!PyArg_ParseTuple(args, "iKsKLLLKp", &device, &stream, &dtype, &dy, &M, &N, &ld, &db,
                          &accumulate))
        return NULL;
    if (parse_dtype(dtype, &dt) < 0)
        return NULL;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_bias_grad(device, (void *)(uintptr_t)stream, dt,
                                              (const void *)(uintptr_t)dy, M, N, ld,
                                              (void *)(uintptr_t)db, accumulate);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_copy2d(PyObject *self, PyObject *args)
{
    (void)self;
    int device;
    unsigned long long stream, dst, src;
    Py_ssize_t dpitch, spitch, row_bytes, rows;
    if (!PyArg_ParseTuple(args, "iKKnKnnn", &device, &stream, &dst, &dpitch, &src, &spitch,
                          &row_bytes, &rows))
        return NULL;
    if (dpitch < 0 || spitch < 0 || row_bytes < 0 || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "gemm_copy2d: negative pitch or size");
        return NULL;
    }
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_copy2d(device, (void *)(uintptr_t)stream, (void *)(uintptr_t)dst,
                                           (size_t)dpitch, (const void *)(uintptr_t)src,
                                           (size_t)spitch, (size_t)row_bytes, (size_t)rows);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_zero(PyObject *self, PyObject *args)
{
    (void)self;
    int device;
    unsigned long long stream, dst;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "iKKn", &device, &stream, &dst, &bytes))
        return NULL;
    if (bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "gemm_zero: negative size");
        return NULL;
    }
    axc_status st;
    Py_BEGIN_ALLOW_THREADS st = axc_zero(device, (void *)(uintptr_t)stream, (void *)(uintptr_t)dst,
                                         (size_t)bytes);
    Py_END_ALLOW_THREADS if (st != AXC_OK) return axc_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_gemm_cuda_compiled(PyObject *self, PyObject *noargs)
{
    (void)self, (void)noargs;
    return PyBool_FromLong(axc_gemm_cuda_compiled());
}

PyMethodDef axc_py_gemm_methods[] = {
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(device, stream, dtype, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, alpha, beta, "
     "bias): C = alpha*op(A)@op(B) + beta*C + bias (row-major, raw pointers; internal)."},
    {"gemm_bias_grad", py_bias_grad, METH_VARARGS,
     "gemm_bias_grad(device, stream, dtype, dY, M, N, ld, db, accumulate) (internal)."},
    {"gemm_copy2d", py_copy2d, METH_VARARGS,
     "gemm_copy2d(device, stream, dst, dst_pitch, src, src_pitch, row_bytes, rows) (internal)."},
    {"gemm_zero", py_zero, METH_VARARGS, "gemm_zero(device, stream, dst, bytes) (internal)."},
    {"gemm_cuda_compiled", py_gemm_cuda_compiled, METH_NOARGS,
     "True when this build has the cuBLASLt GEMM path."},
    {NULL, NULL, 0, NULL}};
