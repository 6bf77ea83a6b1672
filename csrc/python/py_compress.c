/* Bindings of the codecs and the compressed collectives: argument parsing and checks, then the
 * core (axc/compress.h, the codec fields of axc_coll). */
#include <stdint.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/compress.h"
#include "axc/cuda_rt.h"
#include "py_common.h"

/* py_comm.c */
PyObject *axc_py_start_collective(axc_group_kind gk, const axc_coll *c, PyObject *keep,
                                  int async_op, unsigned char *stage, size_t stage_out_off,
                                  size_t stage_out_bytes);

typedef struct py_tensor {
    void *ptr;
    size_t numel;
    axc_dtype dtype;
    int device;
} py_tensor;

static int read_as(PyObject *t, const char *argname, axc_dtype want, py_tensor *v)
{
    if (axc_py_read_tensor(t, argname, &v->ptr, &v->numel, &v->dtype, &v->device) < 0)
        return -1;
    if (v->dtype != want) {
        PyErr_Format(PyExc_TypeError, "%s has dtype %s, expected %s", argname,
                     axc_dtype_name(v->dtype), axc_dtype_name(want));
        return -1;
    }
    return 0;
}

/* The codec and block of a call, checked (unknown names list the valid ones). */
static int codec_args(const char *name, int block, axc_codec *codec, int *block_out)
{
    axc_status st = axc_codec_from_name(name, codec);
    if (st == AXC_OK)
        st = axc_codec_check(*codec, block, block_out);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* encoded_bytes(codec, n, block) -> int */
static PyObject *py_codec_encoded_bytes(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    Py_ssize_t n;
    int block;
    axc_codec codec;
    if (!PyArg_ParseTuple(args, "sni", &name, &n, &block) || codec_args(name, block, &codec, &block) < 0)
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "element count %zd is negative", n);
        return NULL;
    }
    size_t bytes = 0;
    axc_status st = axc_codec_encoded_bytes(codec, (size_t)n, block, &bytes);
    if (st != AXC_OK)
        return axc_py_raise(st);
    return PyLong_FromSize_t(bytes);
}

/* Tensors of one call all on the CPU or all on one CUDA device (-2 otherwise, with the error). */
static int same_device(const char *what, const py_tensor *a, const py_tensor *b, const py_tensor *c)
{
    if (a->device != b->device || (c && c->device != a->device)) {
        PyErr_Format(PyExc_ValueError, "%s: the tensors must all be on the CPU or on one CUDA "
                                       "device", what);
        return -2;
    }
    return a->device;
}

/* codec_encode(codec, block, input f32, output u8, residual f32 or None, stream): CPU tensors,
 * or CUDA tensors (the kernels, launched on their device whichever is current, ordered on
 * `stream`: one of that device's, 0 for its default stream) */
static PyObject *py_codec_encode(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    int block;
    PyObject *in_t, *out_t, *res_t;
    unsigned long long stream = 0;
    axc_codec codec;
    if (!PyArg_ParseTuple(args, "siOOO|K", &name, &block, &in_t, &out_t, &res_t, &stream) ||
        codec_args(name, block, &codec, &block) < 0)
        return NULL;
    py_tensor in, out, res = {0};
    if (read_as(in_t, "input", AXC_DT_F32, &in) < 0 || read_as(out_t, "output", AXC_DT_U8, &out) < 0 ||
        (res_t != Py_None && read_as(res_t, "residual", AXC_DT_F32, &res) < 0))
        return NULL;
    size_t bytes = 0;
    axc_codec_encoded_bytes(codec, in.numel, block, &bytes);
    int device = same_device("codec_encode", &in, &out, res_t != Py_None ? &res : NULL);
    if (device == -2)
        return NULL;
    if (out.numel != bytes || (res_t != Py_None && res.numel != in.numel)) {
        PyErr_Format(PyExc_ValueError,
                     "codec_encode: %zu elements as %s need an output of %zu bytes (got %zu) "
                     "and a residual of %zu elements",
                     in.numel, name, bytes, out.numel, in.numel);
        return NULL;
    }
    axc_status st;
    void *sp = (void *)(uintptr_t)stream;
    const axc_cuda_api *cu;
    int prev;
    Py_BEGIN_ALLOW_THREADS
    if (device >= 0) { /* (launched on the tensors' device, whichever is current) */
        st = axc_cuda_device_enter(device, &cu, &prev, "codec_encode");
        if (st == AXC_OK)
            st = axc_cuda_device_leave(cu, device, prev,
                                       axc_codec_cuda_encode(codec, block, in.ptr, res.ptr,
                                                             in.numel, out.ptr, sp));
    } else if (res_t != Py_None)
        st = axc_codec_encode_ef(codec, block, in.ptr, res.ptr, in.numel, out.ptr);
    else
        st = axc_codec_encode(codec, block, in.ptr, in.numel, out.ptr);
    Py_END_ALLOW_THREADS
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* codec_feedback(codec, block, x f32, decoded f32, residual f32, mult, stream): residual +=
 * mult * (x - decoded) on the codec blocks where x and decoded are finite (the error feedback of
 * a compressed sum's owner), CPU tensors or CUDA tensors (the kernel, ordered on `stream`) */
static PyObject *py_codec_feedback(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    int block;
    double mult;
    PyObject *x_t, *dec_t, *res_t;
    unsigned long long stream = 0;
    axc_codec codec;
    if (!PyArg_ParseTuple(args, "siOOOd|K", &name, &block, &x_t, &dec_t, &res_t, &mult,
                          &stream) ||
        codec_args(name, block, &codec, &block) < 0)
        return NULL;
    py_tensor x, dec, res;
    if (read_as(x_t, "x", AXC_DT_F32, &x) < 0 || read_as(dec_t, "decoded", AXC_DT_F32, &dec) < 0 ||
        read_as(res_t, "residual", AXC_DT_F32, &res) < 0)
        return NULL;
    int device = same_device("codec_feedback", &x, &dec, &res);
    if (device == -2)
        return NULL;
    if (dec.numel != x.numel || res.numel != x.numel) {
        PyErr_Format(PyExc_ValueError,
                     "codec_feedback: x has %zu elements, decoded %zu and residual %zu (expected "
                     "the same count)", x.numel, dec.numel, res.numel);
        return NULL;
    }
    axc_status st = AXC_OK;
    void *sp = (void *)(uintptr_t)stream;
    const axc_cuda_api *cu;
    int prev;
    Py_BEGIN_ALLOW_THREADS
    if (device >= 0) {
        st = axc_cuda_device_enter(device, &cu, &prev, "codec_feedback");
        if (st == AXC_OK)
            st = axc_cuda_device_leave(cu, device, prev,
                                       axc_codec_cuda_feedback(codec, block, x.ptr, dec.ptr,
                                                               x.numel, (float)mult, res.ptr, sp));
    } else
        axc_codec_feedback(codec, block, x.ptr, dec.ptr, x.numel, (float)mult, res.ptr);
    Py_END_ALLOW_THREADS
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* codec_decode(codec, block, input u8, output f32, accumulate, stream): as codec_encode */
static PyObject *py_codec_decode(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    int block, accumulate;
    PyObject *in_t, *out_t;
    unsigned long long stream = 0;
    axc_codec codec;
    if (!PyArg_ParseTuple(args, "siOOp|K", &name, &block, &in_t, &out_t, &accumulate, &stream) ||
        codec_args(name, block, &codec, &block) < 0)
        return NULL;
    py_tensor in, out;
    if (read_as(in_t, "input", AXC_DT_U8, &in) < 0 || read_as(out_t, "output", AXC_DT_F32, &out) < 0)
        return NULL;
    size_t bytes = 0;
    axc_codec_encoded_bytes(codec, out.numel, block, &bytes);
    int device = same_device("codec_decode", &in, &out, NULL);
    if (device == -2)
        return NULL;
    if (in.numel != bytes) {
        PyErr_Format(PyExc_ValueError,
                     "codec_decode: %zu elements as %s are %zu encoded bytes, input has %zu",
                     out.numel, name, bytes, in.numel);
        return NULL;
    }
    axc_status st;
    const axc_cuda_api *cu;
    int prev;
    Py_BEGIN_ALLOW_THREADS
    if (device >= 0) {
        st = axc_cuda_device_enter(device, &cu, &prev, "codec_decode");
        if (st == AXC_OK)
            st = axc_cuda_device_leave(cu, device, prev,
                                       axc_codec_cuda_decode(codec, block, in.ptr, out.numel,
                                                             out.ptr, accumulate,
                                                             (void *)(uintptr_t)stream));
    } else
        st = axc_codec_decode(codec, block, in.ptr, out.numel, out.ptr, accumulate);
    Py_END_ALLOW_THREADS
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

/* compressed_collective(kind, group, output, input, op, stream, async, codec, block,
 * residual or None): all_reduce (output may be input), reduce_scatter, all_gather */
static PyObject *py_compressed_collective(PyObject *self, PyObject *args)
{
    (void)self;
    int kind, async_op, block;
    const char *group, *opname, *name;
    PyObject *out_t, *in_t, *res_t;
    unsigned long long stream;
    axc_codec codec;
    if (!PyArg_ParseTuple(args, "isOOsKpsiO", &kind, &group, &out_t, &in_t, &opname, &stream,
                          &async_op, &name, &block, &res_t) ||
        codec_args(name, block, &codec, &block) < 0)
        return NULL;
    axc_comm *comm = axc_py_comm();
    if (!comm)
        return axc_py_raise(axc_fail(AXC_ERR_STATE,
                                     "axonn_c is not initialised: call axonn_c.init() first"));
    axc_group_kind gk;
    axc_redop op;
    axc_status st = axc_group_from_name(group, &gk);
    if (st == AXC_OK)
        st = axc_redop_from_name(opname, &op);
    if (st != AXC_OK)
        return axc_py_raise(st);
    const char *what = axc_coll_name((axc_coll_kind)kind);
    if (kind != AXC_COLL_ALL_REDUCE && kind != AXC_COLL_REDUCE_SCATTER &&
        kind != AXC_COLL_ALL_GATHER) {
        PyErr_Format(PyExc_ValueError, "%s cannot be compressed", what);
        return NULL;
    }
    py_tensor out, in, res = {0};
    if (read_as(out_t, "output", AXC_DT_F32, &out) < 0 || read_as(in_t, "input", AXC_DT_F32, &in) < 0 ||
        (res_t != Py_None && read_as(res_t, "error_feedback residual", AXC_DT_F32, &res) < 0))
        return NULL;
    int G = axc_grid_group_size(axc_comm_grid(comm), gk);
    size_t expect = kind == AXC_COLL_ALL_GATHER ? in.numel * (size_t)G
                    : kind == AXC_COLL_REDUCE_SCATTER ? in.numel / (size_t)G
                                                      : in.numel;
    if ((kind == AXC_COLL_REDUCE_SCATTER && in.numel % (size_t)G) || out.numel != expect) {
        PyErr_Format(PyExc_ValueError,
                     "compressed %s over the %s group of size %d: input has %zu elements, output "
                     "%zu (expected %zu; reduce_scatter needs an input divisible by %d)",
                     what, group, G, in.numel, out.numel, expect, G);
        return NULL;
    }
    if (kind != AXC_COLL_ALL_REDUCE && G > 1 && out.numel && out.ptr == in.ptr) {
        PyErr_Format(PyExc_ValueError, "%s: input and output must be different tensors", what);
        return NULL;
    }
    /* memory ranges: only an all_reduce may work in place, on exactly one tensor; the residual
     * is memory of its own */
    const py_tensor *views[3] = {&out, &in, res_t != Py_None ? &res : NULL};
    static const char *const names[3] = {"output", "input", "error_feedback residual"};
    for (int i = 0; i < 3; i++)
        for (int j = i + 1; j < 3; j++) {
            if (!views[i] || !views[j] || !views[i]->numel || !views[j]->numel)
                continue;
            uintptr_t ib = (uintptr_t)views[i]->ptr, ie = ib + views[i]->numel * 4;
            uintptr_t jb = (uintptr_t)views[j]->ptr, je = jb + views[j]->numel * 4;
            int same = ib == jb && ie == je && i == 0 && j == 1 && kind == AXC_COLL_ALL_REDUCE;
            if (ib < je && jb < ie && !same) {
                PyErr_Format(PyExc_ValueError,
                             "compressed %s: the %s and the %s overlap in memory; pass separate "
                             "tensors", what, names[i], names[j]);
                return NULL;
            }
        }
    /* an asynchronous call would write into the tensors while Python may resize or free them
     * (the uncompressed collectives stage host tensors for that; these do not yet) */
    if (async_op && in.device < 0) {
        PyErr_Format(PyExc_NotImplementedError,
                     "compressed %s with async_op=True on CPU tensors is not supported yet: call "
                     "it with async_op=False", what);
        return NULL;
    }
    if (res_t != Py_None && (res.numel != in.numel || res.device != in.device)) {
        PyErr_Format(PyExc_ValueError,
                     "the error_feedback residual must be a float32 tensor like the input (%zu "
                     "elements on the same device), got %zu elements",
                     in.numel, res.numel);
        return NULL;
    }
    if (out.device != in.device) {
        PyErr_Format(PyExc_ValueError, "%s: input and output must be on the same device", what);
        return NULL;
    }
    axc_coll c;
    memset(&c, 0, sizeof c);
    c.kind = (axc_coll_kind)kind;
    c.op = op;
    c.send = in.ptr;
    c.recv = out.ptr;
    c.dtype = AXC_DT_F32;
    c.device = in.device;
    c.stream = (void *)(uintptr_t)stream;
    c.count = kind == AXC_COLL_REDUCE_SCATTER ? out.numel : in.numel;
    c.codec = codec;
    c.block = block;
    c.residual = res_t != Py_None ? res.ptr : NULL;
    PyObject *keep = PyTuple_Pack(3, out_t, in_t, res_t);
    if (!keep)
        return NULL;
    return axc_py_start_collective(gk, &c, keep, async_op, NULL, 0, 0);
}

static PyObject *py_codec_default_block(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    axc_codec codec;
    int block;
    if (!PyArg_ParseTuple(args, "s", &name) || codec_args(name, 0, &codec, &block) < 0)
        return NULL;
    return PyLong_FromLong(block);
}

static PyObject *py_codec_cuda_compiled(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(axc_codec_cuda_compiled());
}

/* set_layer_codec(group, codec, block[, error_feedback]): the compression of the layers' own
 * collectives over `group` ("none": exact) on the current communicator */
static PyObject *py_set_layer_codec(PyObject *self, PyObject *args)
{
    (void)self;
    const char *group, *codec;
    int block, ef = 0;
    if (!PyArg_ParseTuple(args, "ssi|p", &group, &codec, &block, &ef))
        return NULL;
    axc_comm *comm = axc_py_comm();
    if (!comm) {
        PyErr_SetString(PyExc_RuntimeError,
                        "axonn_c is not initialised: call axonn_c.init(...) first");
        return NULL;
    }
    axc_group_kind kind;
    axc_codec c;
    axc_status st = axc_group_from_name(group, &kind);
    if (st == AXC_OK)
        st = axc_codec_from_name(codec, &c);
    if (st == AXC_OK)
        st = axc_comm_set_layer_codec(comm, kind, c, block, ef);
    if (st != AXC_OK)
        return axc_py_raise(st);
    Py_RETURN_NONE;
}

PyMethodDef axc_py_compress_methods[] = {
    {"set_layer_codec", py_set_layer_codec, METH_VARARGS,
     "set_layer_codec(group, codec, block[, error_feedback]): compression of the layers' "
     "collectives."},
    {"codec_cuda_compiled", py_codec_cuda_compiled, METH_NOARGS,
     "True when the build embeds the CUDA codec kernels (nvcc was found)."},
    {"codec_default_block", py_codec_default_block, METH_VARARGS,
     "codec_default_block(codec): the block size that block=0 selects."},
    {"codec_encoded_bytes", py_codec_encoded_bytes, METH_VARARGS,
     "codec_encoded_bytes(codec, n, block) -> bytes of the encoding of n float32 values."},
    {"codec_encode", py_codec_encode, METH_VARARGS,
     "codec_encode(codec, block, input, output, residual[, stream]): encodes."},
    {"codec_decode", py_codec_decode, METH_VARARGS,
     "codec_decode(codec, block, input, output, accumulate[, stream]): decodes."},
    {"codec_feedback", py_codec_feedback, METH_VARARGS,
     "codec_feedback(codec, block, x, decoded, residual, mult[, stream]): residual += mult * "
     "(x - decoded) where finite."},
    {"compressed_collective", py_compressed_collective, METH_VARARGS,
     "Starts a compressed collective (internal)."},
    {NULL, NULL, 0, NULL},
};
