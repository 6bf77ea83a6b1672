/* Bindings of the communication model and planner (core: csrc/core/model.c). Parsing of
 * dicts into the core's structs and building the result objects; no modelling here. */
#include <math.h>
#include <string.h>

#include "py_common.h"

#include "axc/model.h"

static const char *const group_keys[AXC_MODEL_NGROUPS] = {"col",   "row",   "depth",
                                                          "data",  "intra", "world"};
static const char *const kind_names[] = {"linear", "replicated", "embedding", "norm"};

/* ---- reading dict fields (absent or None keeps the default) ---- */

static int get_i64(PyObject *d, const char *key, int64_t *out)
{
    PyObject *v = PyDict_GetItemString(d, key); /* borrowed */
    if (!v || v == Py_None)
        return 0;
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "'%s' must be an integer", key);
        return -1;
    }
    *out = (int64_t)x;
    return 0;
}

static int get_int(PyObject *d, const char *key, int *out)
{
    int64_t v = *out;
    if (get_i64(d, key, &v) < 0)
        return -1;
    if (v < -2147483647LL || v > 2147483647LL) {
        PyErr_Format(PyExc_ValueError, "'%s'=%lld is out of range", key, (long long)v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int get_double(PyObject *d, const char *key, double *out)
{
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v || v == Py_None)
        return 0;
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "'%s' must be a number", key);
        return -1;
    }
    *out = x;
    return 0;
}

static int get_dtype(PyObject *d, const char *key, axc_dtype *out)
{
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v || v == Py_None)
        return 0;
    const char *s = PyUnicode_AsUTF8(v);
    if (!s)
        return -1;
    axc_status st = axc_dtype_from_name(s, out);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

static int check_dict(PyObject *d, const char *what)
{
    if (!PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict", what);
        return -1;
    }
    return 0;
}

static int group_of_key(const char *k, const char *what)
{
    for (int i = 0; i < AXC_MODEL_NGROUPS; i++)
        if (strcmp(k, group_keys[i]) == 0)
            return i;
    PyErr_Format(PyExc_ValueError,
                 "unknown group '%s' in '%s' (expected col, row, depth, data, intra, world)", k,
                 what);
    return -1;
}

/* A 'compression' dict {group: (codec name, block)} into codec/block by group (own[g] set for
 * each group named, when own is given); the C model checks the codec and block. `layer`: a
 * layer's own codecs, which name col, row or depth only. */
static int parse_codecs(PyObject *c, axc_codec *codec, int *block, int *own, int layer)
{
    if (check_dict(c, "'compression'") < 0)
        return -1;
    PyObject *key, *val;
    Py_ssize_t pos = 0;
    while (PyDict_Next(c, &pos, &key, &val)) {
        const char *k = PyUnicode_AsUTF8(key), *name = NULL;
        if (!k)
            return -1;
        int g = group_of_key(k, "compression"), b = 0;
        if (g < 0)
            return -1;
        if (layer && g != AXC_GROUP_COL && g != AXC_GROUP_ROW && g != AXC_GROUP_DEPTH) {
            PyErr_Format(PyExc_ValueError, "a layer's own 'compression' names col, row or depth, "
                         "got '%s'", k);
            return -1;
        }
        if (!PyTuple_Check(val) ||
            !PyArg_ParseTuple(val, "si;'compression' values are (codec name, block)", &name,
                              &b)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "'compression'['%s'] must be (codec name, block), "
                             "got %s", k, Py_TYPE(val)->tp_name);
            return -1;
        }
        axc_status st = axc_codec_from_name(name, &codec[g]);
        if (st == AXC_OK)
            st = axc_codec_check(codec[g], b, NULL);
        if (st != AXC_OK) {
            axc_py_raise(st);
            return -1;
        }
        block[g] = b;
        if (own)
            own[g] = 1;
    }
    return 0;
}

/* the step's 'compression' (axonn_c.plan.codecs_of turns init's policy into it) */
static int parse_step_codecs(PyObject *d, axc_step_desc *s)
{
    PyObject *c = PyDict_GetItemString(d, "compression"); /* borrowed */
    if (!c || c == Py_None)
        return 0;
    return parse_codecs(c, s->codec, s->block, NULL, 0);
}

static int parse_step(PyObject *d, axc_step_desc *s)
{
    axc_step_desc_default(s);
    if (get_i64(d, "tokens", &s->tokens) < 0 || get_int(d, "grad_acc", &s->grad_acc) < 0 ||
        get_int(d, "recompute", &s->recompute) < 0 || get_dtype(d, "dtype", &s->dtype) < 0 ||
        get_dtype(d, "grad_dtype", &s->grad_dtype) < 0 ||
        get_int(d, "fwd_chunks", &s->fwd_chunks) < 0)
        return -1;
    PyObject *r = PyDict_GetItemString(d, "ratio");
    if (r && r != Py_None) {
        if (check_dict(r, "'ratio'") < 0)
            return -1;
        PyObject *key, *val;
        Py_ssize_t pos = 0;
        while (PyDict_Next(r, &pos, &key, &val)) {
            const char *k = PyUnicode_AsUTF8(key);
            if (!k)
                return -1;
            int g = group_of_key(k, "ratio");
            if (g < 0)
                return -1;
            double x = val == Py_None ? 1.0 : PyFloat_AsDouble(val);
            if (x == -1.0 && PyErr_Occurred())
                return -1;
            s->ratio[g] = x;
        }
    }
    if (get_i64(d, "bucket_bytes", &s->bucket_bytes) < 0 ||
        get_int(d, "bucket_reverse", &s->bucket_reverse) < 0)
        return -1;
    return parse_step_codecs(d, s);
}

static int parse_layer(PyObject *d, axc_layer_desc *l)
{
    if (check_dict(d, "a layer") < 0)
        return -1;
    memset(l, 0, sizeof *l);
    l->count = 1;
    if (get_i64(d, "in_features", &l->in_features) < 0 ||
        get_i64(d, "out_features", &l->out_features) < 0 ||
        get_int(d, "transpose", &l->transpose) < 0 || get_int(d, "bias", &l->bias) < 0 ||
        get_int(d, "cache_weights", &l->cache_weights) < 0 || get_int(d, "easy", &l->easy) < 0 ||
        get_i64(d, "count", &l->count) < 0 || get_int(d, "tied", &l->tied) < 0 ||
        get_int(d, "stats", &l->stats) < 0 || get_i64(d, "params", &l->params) < 0 ||
        get_i64(d, "rows", &l->rows) < 0 || get_i64(d, "seq", &l->seq) < 0)
        return -1;
    PyObject *c = PyDict_GetItemString(d, "compression"); /* borrowed; a Linear's own codecs */
    if (c && c != Py_None && parse_codecs(c, l->codec, l->block, l->own_codec, 1) < 0)
        return -1;
    PyObject *k = PyDict_GetItemString(d, "kind"); /* borrowed */
    if (k && k != Py_None) {
        const char *name = PyUnicode_AsUTF8(k);
        if (!name)
            return -1;
        l->kind = -1;
        for (int i = 0; i < (int)(sizeof kind_names / sizeof kind_names[0]); i++)
            if (strcmp(name, kind_names[i]) == 0)
                l->kind = i;
        if (l->kind < 0) {
            PyErr_Format(PyExc_ValueError, "unknown layer kind '%s' (expected linear, "
                         "replicated, embedding or norm)", name);
            return -1;
        }
    }
    return 0;
}

/* Layers (list of dicts) into a malloc'd array; *n set. */
static axc_layer_desc *parse_layers(PyObject *list, int *n)
{
    PyObject *seq = PySequence_Fast(list, "'layers' must be a list of dicts");
    if (!seq)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    axc_layer_desc *out = PyMem_Calloc(len ? (size_t)len : 1, sizeof *out);
    if (!out) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        if (parse_layer(PySequence_Fast_GET_ITEM(seq, i), &out[i]) < 0) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    *n = (int)len;
    return out;
}

/* A model description dict (see axonn_c/plan.py::_desc). Fills storage for transformers;
 * *owned is a PyMem block to free (generic layers) or NULL. */
static int parse_model(PyObject *d, axc_model_desc *m,
                       axc_layer_desc storage[AXC_TRANSFORMER_MAX_LAYERS],
                       axc_layer_desc **owned)
{
    *owned = NULL;
    if (check_dict(d, "the model description") < 0)
        return -1;
    axc_model_desc_default(m);
    if (parse_step(d, &m->step) < 0 || get_i64(d, "seq", &m->seq) < 0 ||
        get_i64(d, "global_batch", &m->global_batch) < 0 ||
        get_int(d, "grad_acc", &m->grad_acc) < 0 ||
        get_i64(d, "micro_batch", &m->micro_batch) < 0 || get_i64(d, "blocks", &m->blocks) < 0 ||
        get_i64(d, "hidden", &m->hidden) < 0 || get_i64(d, "heads", &m->heads) < 0 ||
        get_i64(d, "ffn", &m->ffn) < 0 || get_i64(d, "vocab", &m->vocab) < 0 ||
        get_int(d, "optimizer_states", &m->optimizer_states) < 0)
        return -1;
    int cache = 0;
    if (get_int(d, "cache_weights", &cache) < 0)
        return -1;
    PyObject *layers = PyDict_GetItemString(d, "layers");
    if (layers && layers != Py_None) {
        m->blocks = 0;
        *owned = parse_layers(layers, &m->n_layers);
        if (!*owned)
            return -1;
        m->layers = *owned;
        return 0;
    }
    axc_status st = axc_model_transformer(m, storage);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    for (int i = 0; i < m->n_layers; i++)
        storage[i].cache_weights = cache;
    return 0;
}

static int parse_machine(PyObject *d, axc_machine *m)
{
    memset(m, 0, sizeof *m);
    if (PyUnicode_Check(d)) {
        axc_status st = axc_machine_builtin(PyUnicode_AsUTF8(d), m);
        if (st != AXC_OK) {
            axc_py_raise(st);
            return -1;
        }
        return 0;
    }
    if (check_dict(d, "the machine profile") < 0)
        return -1;
    PyObject *name = PyDict_GetItemString(d, "name");
    const char *s = name && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : "custom";
    snprintf(m->name, sizeof m->name, "%s", s ? s : "custom");
    m->mem_reserve_gib = 0.0;
    if (get_int(d, "gpus_per_node", &m->gpus_per_node) < 0 ||
        get_double(d, "mem_gib", &m->mem_gib) < 0 ||
        get_double(d, "mem_reserve_gib", &m->mem_reserve_gib) < 0 ||
        get_double(d, "intra_gbps", &m->intra_gbps) < 0 ||
        get_double(d, "inter_node_gbps", &m->inter_node_gbps) < 0 ||
        get_double(d, "alpha_intra_us", &m->alpha_intra_us) < 0 ||
        get_double(d, "alpha_inter_us", &m->alpha_inter_us) < 0)
        return -1;
    PyObject *entries = PyDict_GetItemString(d, "entries");
    if (entries && entries != Py_None) {
        PyObject *seq = PySequence_Fast(entries, "'entries' must be a list of [stride, size, gbps]");
        if (!seq)
            return -1;
        Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
        if (len > AXC_MACHINE_MAX_ENTRIES) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "machine '%s': %zd bandwidth entries, at most %d",
                         m->name, len, AXC_MACHINE_MAX_ENTRIES);
            return -1;
        }
        for (Py_ssize_t i = 0; i < len; i++) {
            axc_bw_entry *e = &m->entries[i];
            PyObject *t = PySequence_Tuple(PySequence_Fast_GET_ITEM(seq, i));
            int ok = t && PyArg_ParseTuple(t, "iid", &e->stride, &e->size, &e->gbps);
            Py_XDECREF(t);
            if (!ok) {
                Py_DECREF(seq);
                return -1;
            }
        }
        m->n_entries = (int)len;
        Py_DECREF(seq);
    }
    axc_status st = axc_machine_validate(m);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

static int parse_grid(PyObject *t, axc_grid *g)
{
    int G_data, G_r, G_c, G_d;
    if (!PyArg_ParseTuple(t, "iiii", &G_data, &G_r, &G_c, &G_d))
        return -1;
    long long w = (long long)G_data * G_r * G_c * G_d;
    if (w < 1 || w > 2147483647LL) {
        PyErr_Format(PyExc_ValueError,
                     "grid (G_data=%d, G_intra_r=%d, G_intra_c=%d, G_intra_d=%d) is not valid",
                     G_data, G_r, G_c, G_d);
        return -1;
    }
    axc_status st = axc_grid_make(g, (int)w, G_data, G_r, G_c, G_d, 1);
    if (st != AXC_OK) {
        axc_py_raise(st);
        return -1;
    }
    return 0;
}

/* ---- building results ---- */

static int set_item(PyObject *d, const char *key, PyObject *v)
{
    if (!v)
        return -1;
    int r = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return r;
}

/* {col, row, depth, data} -> value, from exact integers `u` or, when u is NULL, doubles `f`. */
static PyObject *per_group(const uint64_t *u, const double *f)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    for (int g = 0; g < AXC_MODEL_NGROUPS; g++) {
        PyObject *v = u ? PyLong_FromUnsignedLongLong(u[g]) : PyFloat_FromDouble(f[g]);
        if (set_item(d, group_keys[g], v) < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

static PyObject *volume_dict(const axc_volume *v)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (set_item(d, "sent", per_group(v->sent, NULL)) < 0 ||
        set_item(d, "recv", per_group(v->recv, NULL)) < 0 ||
        set_item(d, "calls", per_group(v->calls, NULL)) < 0 ||
        set_item(d, "hops", per_group(v->hops, NULL)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *entry_dict(const axc_plan_entry *e)
{
    const double gib = 1073741824.0;
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    PyObject *mem = Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:d}", "weights", e->mem.weights / gib,
                                  "grads", e->mem.grads / gib, "optimizer",
                                  e->mem.optimizer / gib, "gathered", e->mem.gathered / gib,
                                  "activations", e->mem.activations / gib, "total",
                                  e->mem.total / gib);
    PyObject *ct = e->valid ? PyFloat_FromDouble(e->comm_time) : Py_NewRef(Py_None);
    PyObject *mg = e->valid ? PyFloat_FromDouble(e->mem.total / gib) : Py_NewRef(Py_None);
    if (set_item(d, "G_data", PyLong_FromLong(e->G_data)) < 0 ||
        set_item(d, "G_intra_r", PyLong_FromLong(e->G_r)) < 0 ||
        set_item(d, "G_intra_c", PyLong_FromLong(e->G_c)) < 0 ||
        set_item(d, "G_intra_d", PyLong_FromLong(e->G_d)) < 0 ||
        set_item(d, "grad_acc", PyLong_FromLong(e->grad_acc)) < 0 ||
        set_item(d, "valid", PyBool_FromLong(e->valid)) < 0 ||
        set_item(d, "fits", PyBool_FromLong(e->fits)) < 0 ||
        set_item(d, "reason", PyUnicode_FromString(e->reason)) < 0 ||
        set_item(d, "comm_time_s", ct) < 0 ||
        set_item(d, "time_s", per_group(NULL, e->time)) < 0 ||
        set_item(d, "bytes", per_group(e->vol.sent, NULL)) < 0 ||
        set_item(d, "bytes_recv", per_group(e->vol.recv, NULL)) < 0 ||
        set_item(d, "calls", per_group(e->vol.calls, NULL)) < 0 ||
        set_item(d, "mem_gib", mg) < 0 || set_item(d, "mem", mem) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* ---- methods ---- */

static PyObject *py_model_layer_colls(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *grid_t, *layer_d, *step_d;
    if (!PyArg_ParseTuple(args, "OO!O!", &grid_t, &PyDict_Type, &layer_d, &PyDict_Type, &step_d))
        return NULL;
    axc_grid g;
    axc_layer_desc l;
    axc_step_desc s;
    if (parse_grid(grid_t, &g) < 0 || parse_layer(layer_d, &l) < 0 || parse_step(step_d, &s) < 0)
        return NULL;
    axc_model_coll c[AXC_MODEL_MAX_COLLS];
    int n = 0;
    axc_status st = axc_model_layer_colls(&g, &l, &s, c, AXC_MODEL_MAX_COLLS, &n);
    if (st != AXC_OK)
        return axc_py_raise(st);
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *item = Py_BuildValue(
            "{s:s,s:s,s:n,s:s,s:L,s:s}", "group", group_keys[c[i].group], "kind",
            axc_coll_name(c[i].kind), "count", (Py_ssize_t)c[i].count, "dtype",
            axc_dtype_name(c[i].dtype), "repeat", (long long)c[i].repeat, "what", c[i].what);
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *py_model_volume(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *grid_t, *layers, *step_d;
    int rank;
    if (!PyArg_ParseTuple(args, "OiOO!", &grid_t, &rank, &layers, &PyDict_Type, &step_d))
        return NULL;
    axc_grid g;
    axc_step_desc s;
    if (parse_grid(grid_t, &g) < 0 || parse_step(step_d, &s) < 0)
        return NULL;
    int n = 0;
    axc_layer_desc *ls = parse_layers(layers, &n);
    if (!ls)
        return NULL;
    axc_volume v;
    memset(&v, 0, sizeof v);
    axc_status st = AXC_OK;
    for (int i = 0; i < n && st == AXC_OK; i++)
        st = axc_model_layer_volume(&g, rank, &ls[i], &s, &v);
    if (st == AXC_OK)
        st = axc_model_data_buckets(&g, rank, ls, n, &s, &v);
    PyMem_Free(ls);
    if (st != AXC_OK)
        return axc_py_raise(st);
    return volume_dict(&v);
}

static PyObject *py_model_evaluate(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *grid_t, *desc, *mach;
    if (!PyArg_ParseTuple(args, "OOO", &grid_t, &desc, &mach))
        return NULL;
    axc_grid g;
    axc_model_desc d;
    axc_machine m;
    axc_layer_desc storage[AXC_TRANSFORMER_MAX_LAYERS], *owned = NULL;
    if (parse_grid(grid_t, &g) < 0 || parse_machine(mach, &m) < 0 ||
        parse_model(desc, &d, storage, &owned) < 0)
        return NULL;
    axc_plan_entry e;
    axc_status st = axc_model_evaluate(&d, &m, &g, &e);
    PyMem_Free(owned);
    if (st != AXC_OK)
        return axc_py_raise(st);
    return entry_dict(&e);
}

static PyObject *py_model_plan(PyObject *self, PyObject *args)
{
    (void)self;
    int world;
    PyObject *desc, *mach;
    if (!PyArg_ParseTuple(args, "iOO", &world, &desc, &mach))
        return NULL;
    axc_model_desc d;
    axc_machine m;
    axc_layer_desc storage[AXC_TRANSFORMER_MAX_LAYERS], *owned = NULL;
    if (parse_machine(mach, &m) < 0 || parse_model(desc, &d, storage, &owned) < 0)
        return NULL;
    axc_plan_entry *entries = NULL;
    size_t n = 0;
    axc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = axc_plan(&d, &m, world, &entries, &n);
    Py_END_ALLOW_THREADS
    PyMem_Free(owned);
    if (st != AXC_OK)
        return axc_py_raise(st);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) {
        axc_plan_free(entries);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        PyObject *item = entry_dict(&entries[i]);
        if (!item) {
            Py_DECREF(list);
            axc_plan_free(entries);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    axc_plan_free(entries);
    return list;
}

static PyObject *machine_dict(const axc_machine *m)
{
    PyObject *entries = PyList_New(m->n_entries);
    if (!entries)
        return NULL;
    for (int i = 0; i < m->n_entries; i++) {
        PyObject *e = Py_BuildValue("[iid]", m->entries[i].stride, m->entries[i].size,
                                    m->entries[i].gbps);
        if (!e) {
            Py_DECREF(entries);
            return NULL;
        }
        PyList_SET_ITEM(entries, i, e);
    }
    return Py_BuildValue("{s:s,s:i,s:d,s:d,s:d,s:d,s:d,s:d,s:N}", "name", m->name,
                         "gpus_per_node", m->gpus_per_node, "mem_gib", m->mem_gib,
                         "mem_reserve_gib", m->mem_reserve_gib, "intra_gbps", m->intra_gbps,
                         "inter_node_gbps", m->inter_node_gbps, "alpha_intra_us",
                         m->alpha_intra_us, "alpha_inter_us", m->alpha_inter_us, "entries",
                         entries);
}

static PyObject *py_model_machine(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *spec;
    if (!PyArg_ParseTuple(args, "O", &spec))
        return NULL;
    axc_machine m;
    if (parse_machine(spec, &m) < 0)
        return NULL;
    return machine_dict(&m);
}

static PyObject *py_model_machines(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    for (int i = 0; axc_machine_builtin_name(i); i++) {
        PyObject *s = PyUnicode_FromString(axc_machine_builtin_name(i));
        if (!s || PyList_Append(list, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(s);
    }
    return list;
}

static PyObject *py_model_link(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *spec;
    int stride, size;
    if (!PyArg_ParseTuple(args, "Oii", &spec, &stride, &size))
        return NULL;
    if (stride < 1 || size < 1) {
        PyErr_Format(PyExc_ValueError, "stride=%d and size=%d must be >= 1", stride, size);
        return NULL;
    }
    axc_machine m;
    if (parse_machine(spec, &m) < 0)
        return NULL;
    double beta, alpha;
    int inter;
    axc_machine_link(&m, stride, size, &beta, &alpha, &inter);
    return Py_BuildValue("{s:d,s:d,s:O}", "gbps", isinf(beta) ? INFINITY : beta / 1e9,
                         "alpha_us", alpha * 1e6, "inter_node", inter ? Py_True : Py_False);
}

PyMethodDef axc_py_model_methods[] = {
    {"model_layer_colls", py_model_layer_colls, METH_VARARGS,
     "model_layer_colls((G_data, G_r, G_c, G_d), layer, step) -> the layer's collectives"},
    {"model_volume", py_model_volume, METH_VARARGS,
     "model_volume(grid, rank, layers, step) -> {sent, recv, calls, hops} per group"},
    {"model_evaluate", py_model_evaluate, METH_VARARGS,
     "model_evaluate(grid, desc, machine) -> one planner entry"},
    {"model_plan", py_model_plan, METH_VARARGS,
     "model_plan(world_size, desc, machine) -> every grid, ranked"},
    {"model_machine", py_model_machine, METH_VARARGS,
     "model_machine(name or dict) -> the validated profile as a dict"},
    {"model_machines", py_model_machines, METH_NOARGS, "names of the built-in machine profiles"},
    {"model_link", py_model_link, METH_VARARGS,
     "model_link(machine, stride, size) -> {gbps, alpha_us, inter_node}"},
    {NULL, NULL, 0, NULL},
};
