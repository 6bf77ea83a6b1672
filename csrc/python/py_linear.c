/* The layer description of axonn_c._C.LinearCall (py_linear_call.c): parsed once, when a
 * Linear makes its handle, from a sequence of ints (axonn_c/linear.py Linear._handle). */
#include <stdint.h>

#include "axc/linear.h"
#include "py_common.h"

/* cfg: (in_features, out_features, transpose, has_bias, layout[, overlap_all_reduce,
 *       overlap_reduce_scatter, fwd_chunks[, scheduled, overlap_data, defer_dw_gemm[,
 *       depth codec, depth block, row codec, row block, col codec, col block,
 *       depth error feedback]]]): 5, 8, 11 or 18 ints; the last 7 are the layer's own codecs
 * (axonn_c/compression.py layer_codec_ints), without them the communicator's policy. */
int axc_py_parse_linear_desc(PyObject *cfg, const char *dtype, axc_linear_desc *d)
{
    PyObject *seq = PySequence_Fast(cfg, "LinearCall: cfg must be a sequence of ints");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long v[18] = {0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0};
    if (n != 5 && n != 8 && n != 11 && n != 18) {
        PyErr_Format(PyExc_TypeError, "LinearCall: cfg has 5, 8, 11 or 18 ints, got %zd", n);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        v[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    if (v[0] < 0 || v[0] > INT32_MAX || v[1] < 0 || v[1] > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "LinearCall: in_features and out_features must be in [0, 2**31 - 1], got "
                     "%lld and %lld", v[0], v[1]);
        return -1;
    }
    for (int i = 11; n == 18 && i <= 16; i++)
        if (v[i] < INT32_MIN || v[i] > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "LinearCall: codec %s %lld out of range",
                         i % 2 ? "id" : "block", v[i]);
            return -1;
        }
    if (v[7] < 0 || v[7] > 64) {
        PyErr_Format(PyExc_ValueError, "fwd_chunks must be in [1, 64] (0: by size), got %lld",
                     v[7]);
        return -1;
    }
    *d = (axc_linear_desc){.in_features = v[0], .out_features = v[1], .transpose = !!v[2],
                           .has_bias = !!v[3],
                           .layout = v[4] ? AXC_LAYOUT_EXPERT : AXC_LAYOUT_EASY,
                           .overlap_all_reduce = !!v[5], .overlap_reduce_scatter = !!v[6],
                           .fwd_chunks = (int)v[7], .scheduled = !!v[8], .overlap_data = !!v[9],
                           .defer_dw_gemm = !!v[10]};
    if (n == 18) {
        static const axc_group_kind groups[3] = {AXC_GROUP_DEPTH, AXC_GROUP_ROW, AXC_GROUP_COL};
        for (int i = 0; i < 3; i++) {
            axc_status st = axc_codec_check((axc_codec)v[11 + 2 * i], (int)v[12 + 2 * i], NULL);
            if (st != AXC_OK) {
                axc_py_raise(st);
                return -1;
            }
            d->codec[groups[i]] = (axc_codec)v[11 + 2 * i];
            d->block[groups[i]] = (int)v[12 + 2 * i];
        }
        d->own_codecs = 1;
        d->depth_error_feedback = !!v[17];
    }
    axc_status st = axc_dtype_from_name(dtype, &d->dtype);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

axc_comm *axc_py_linear_comm(void)
{
    axc_comm *c = axc_py_comm();
    if (!c)
        PyErr_SetString(PyExc_RuntimeError,
                        "axonn_c is not initialised: call axonn_c.init(...) before using "
                        "axonn_c.Linear");
    return c;
}

/* The shapes of a call with `rows` rows as the dict axonn_c/linear.py reads */
PyObject *axc_py_linear_shapes(axc_comm *comm, const axc_linear_desc *d, int64_t rows)
{
    axc_linear_shapes s;
    axc_status st = axc_linear_shapes_for(comm, d, rows, &s);
    if (st != AXC_OK)
        return axc_py_raise(st);
    return Py_BuildValue("{s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "gin",
                         axc_group_name(s.gin), "gout", axc_group_name(s.gout), "gin_size",
                         s.gin_size, "gout_size", s.gout_size, "gin_rank", s.gin_rank,
                         "gout_rank", s.gout_rank, "depth_size", s.depth_size, "k_local",
                         (long long)s.k_local, "n_local", (long long)s.n_local, "block",
                         (long long)s.block, "shard", (long long)s.shard, "saved_rows",
                         (long long)s.saved_rows, "saved_cols", (long long)s.saved_cols,
                         "workspace_elems", (long long)s.workspace_elems);
}
