/* The communication model, memory model and grid planner. Derivation: docs/model.md.
 *
 * Every byte count comes from axc_coll_volume() applied to the exact collectives a layer
 * issues (axc_model_layer_colls), so the model and the transport's counters cannot disagree. */
#include "axc/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------- */
/* defaults */

void axc_step_desc_default(axc_step_desc *s)
{
    memset(s, 0, sizeof *s);
    s->tokens = 0;
    s->grad_acc = 1;
    s->recompute = 1;
    s->dtype = AXC_DT_BF16;
    s->grad_dtype = AXC_DT_F32;
    s->fwd_chunks = 1;
    for (int g = 0; g < AXC_MODEL_NGROUPS; g++)
        s->ratio[g] = 1.0;
    /* init()'s default: overlap on, so backward sums the data gradients in 4 MiB buckets
     * (axonn_c/state.py bucket_bytes), last layer first */
    s->bucket_bytes = 4 << 20;
    s->bucket_reverse = 1;
}

void axc_model_desc_default(axc_model_desc *d)
{
    memset(d, 0, sizeof *d);
    axc_step_desc_default(&d->step);
    d->grad_acc = 1;
    d->optimizer_states = 2;
}

/* ---------------------------------------------------------------------------------------- */
/* one layer */

static int is_float_dtype(axc_dtype dt)
{
    return dt == AXC_DT_F32 || dt == AXC_DT_BF16 || dt == AXC_DT_F16 || dt == AXC_DT_F64;
}

static axc_status check_step_codecs(const axc_step_desc *s)
{
    for (int g = 0; g < AXC_MODEL_NGROUPS; g++) {
        if (s->codec[g] == AXC_CODEC_NONE)
            continue;
        if (g != AXC_GROUP_COL && g != AXC_GROUP_ROW && g != AXC_GROUP_DEPTH &&
            g != AXC_GROUP_DATA)
            return axc_fail(AXC_ERR_INVALID,
                            "compression of the %s group: only col, row, depth and data "
                            "collectives are compressed", axc_group_name((axc_group_kind)g));
        AXC_TRY(axc_codec_check(s->codec[g], s->block[g], NULL));
    }
    if (s->bucket_bytes < 1)
        return axc_fail(AXC_ERR_INVALID, "bucket_bytes must be >= 1, got %lld",
                        (long long)s->bucket_bytes);
    return AXC_OK;
}

/* A Linear's own codecs: col, row and depth only (its data gradients share the step's buckets) */
static axc_status check_layer_codecs(const axc_layer_desc *l)
{
    for (int g = 0; g < AXC_MODEL_NGROUPS; g++) {
        if (!l->own_codec[g])
            continue;
        if (g != AXC_GROUP_COL && g != AXC_GROUP_ROW && g != AXC_GROUP_DEPTH)
            return axc_fail(AXC_ERR_INVALID,
                            "a layer's own compression of the %s group: a layer names col, row "
                            "or depth only", axc_group_name((axc_group_kind)g));
        AXC_TRY(axc_codec_check(l->codec[g], l->block[g], NULL));
    }
    return AXC_OK;
}

static axc_status check_step(const axc_step_desc *s)
{
    if (s->grad_acc < 1)
        return axc_fail(AXC_ERR_INVALID, "grad_acc must be >= 1, got %d", s->grad_acc);
    if (s->fwd_chunks < 1)
        return axc_fail(AXC_ERR_INVALID, "fwd_chunks must be >= 1, got %d", s->fwd_chunks);
    if (s->tokens < 1)
        return axc_fail(AXC_ERR_INVALID, "tokens per step must be >= 1, got %lld",
                        (long long)s->tokens);
    if ((unsigned)s->dtype >= AXC_DT_COUNT || !is_float_dtype(s->dtype))
        return axc_fail(AXC_ERR_INVALID, "dtype %d is not a floating-point type", (int)s->dtype);
    if ((unsigned)s->grad_dtype >= AXC_DT_COUNT || !is_float_dtype(s->grad_dtype))
        return axc_fail(AXC_ERR_INVALID, "grad_dtype %d is not a floating-point type",
                        (int)s->grad_dtype);
    for (int g = 0; g < AXC_MODEL_NGROUPS; g++)
        if (!(s->ratio[g] >= 0.0 && s->ratio[g] <= 1.0))
            return axc_fail(AXC_ERR_INVALID,
                            "compression ratio of the %s group must be in [0, 1], got %g",
                            axc_group_name((axc_group_kind)g), s->ratio[g]);
    AXC_TRY(check_step_codecs(s));
    return AXC_OK;
}

/* Local shapes of a layer on a grid. */
typedef struct layer_geom {
    int64_t in_loc, out_loc; /* features of the rank's input/output */
    int64_t block, shard;    /* weight block (in_loc*out_loc) and its depth shard */
    int64_t rows;            /* rows (tokens) per rank per micro-batch */
    axc_group_kind fwd_group, bwd_group;
} layer_geom;

static axc_status layer_geometry(const axc_grid *g, const axc_layer_desc *l,
                                 const axc_step_desc *s, layer_geom *out)
{
    if (l->in_features < 1 || l->out_features < 1)
        return axc_fail(AXC_ERR_INVALID, "layer shape in=%lld out=%lld must be >= 1",
                        (long long)l->in_features, (long long)l->out_features);
    int in_split = l->transpose ? g->G_r : g->G_c;
    int out_split = l->transpose ? g->G_c : g->G_r;
    const char *in_name = l->transpose ? "G_intra_r" : "G_intra_c";
    const char *out_name = l->transpose ? "G_intra_c" : "G_intra_r";
    if (l->in_features % in_split)
        return axc_fail(AXC_ERR_INVALID,
                        "in_features=%lld of a %slayer is not divisible by %s=%d",
                        (long long)l->in_features, l->transpose ? "transposed " : "", in_name,
                        in_split);
    if (l->out_features % out_split)
        return axc_fail(AXC_ERR_INVALID,
                        "out_features=%lld of a %slayer is not divisible by %s=%d",
                        (long long)l->out_features, l->transpose ? "transposed " : "", out_name,
                        out_split);
    if (s->tokens % s->grad_acc)
        return axc_fail(AXC_ERR_INVALID, "tokens per step %lld not divisible by grad_acc=%d",
                        (long long)s->tokens, s->grad_acc);
    int64_t micro = s->tokens / s->grad_acc;
    /* expert layout: tokens split over data x depth; easy: every rank its own tokens */
    int64_t split = (int64_t)g->G_data * g->G_d * (l->easy ? (int64_t)g->G_r * g->G_c : 1);
    if (micro % split)
        return axc_fail(AXC_ERR_INVALID,
                        "%lld tokens per micro-batch not divisible by %s=%lld",
                        (long long)micro, l->easy ? "the world size" : "G_data*G_intra_d",
                        (long long)split);
    if (l->easy && s->fwd_chunks > 1)
        return axc_fail(AXC_ERR_INVALID, "fwd_chunks=%d applies to the expert layout only",
                        s->fwd_chunks);
    out->in_loc = l->in_features / in_split;
    out->out_loc = l->out_features / out_split;
    out->block = out->in_loc * out->out_loc;
    out->shard = (out->block + g->G_d - 1) / g->G_d; /* padded to equal shards */
    out->rows = micro / split;
    if (s->fwd_chunks > out->rows)
        return axc_fail(AXC_ERR_INVALID, "fwd_chunks=%d exceeds the %lld rows per rank",
                        s->fwd_chunks, (long long)out->rows);
    out->fwd_group = l->transpose ? AXC_GROUP_ROW : AXC_GROUP_COL;
    out->bwd_group = l->transpose ? AXC_GROUP_COL : AXC_GROUP_ROW;
    return AXC_OK;
}

static axc_status push(axc_model_coll *out, int cap, int *n, axc_group_kind group,
                       axc_coll_kind kind, int64_t count, axc_dtype dt, int64_t repeat,
                       const char *what)
{
    if (repeat <= 0 || count <= 0)
        return AXC_OK;
    if (*n >= cap)
        return axc_fail(AXC_ERR_INVALID, "collective list capacity %d too small", cap);
    axc_model_coll *c = &out[(*n)++];
    c->group = group;
    c->kind = kind;
    c->count = (size_t)count;
    c->dtype = dt;
    c->repeat = repeat;
    c->what = what;
    return AXC_OK;
}

/* The reduce-scatter of dW over depth (per micro-batch) and the once-per-step reductions of the
 * gradients over the groups whose ranks hold different tokens. */
static axc_status push_grad_reductions(axc_model_coll *out, int cap, int *n,
                                       const axc_layer_desc *l, const axc_step_desc *s,
                                       const layer_geom *g)
{
    AXC_TRY(push(out, cap, n, AXC_GROUP_DEPTH, AXC_COLL_REDUCE_SCATTER, g->shard, s->dtype,
                 s->grad_acc, "bwd reduce-scatter dW"));
    AXC_TRY(push(out, cap, n, AXC_GROUP_DATA, AXC_COLL_ALL_REDUCE, g->shard, s->grad_dtype, 1,
                 "data all-reduce dW"));
    if (l->bias) {
        AXC_TRY(push(out, cap, n, AXC_GROUP_DEPTH, AXC_COLL_ALL_REDUCE, g->out_loc,
                     s->grad_dtype, 1, "depth all-reduce db"));
        AXC_TRY(push(out, cap, n, AXC_GROUP_DATA, AXC_COLL_ALL_REDUCE, g->out_loc, s->grad_dtype,
                     1, "data all-reduce db"));
    }
    return AXC_OK;
}

/* Easy layout (csrc/layers/linear.c): the row x col plane pools its tokens. With t rows per
 * rank, gin the input-feature group and gout the output-feature group: forward all-gather of X
 * over gout, all-to-all over gin, reduce-scatter of Y over gin, all-to-all over gout; backward
 * the mirror image. Collectives on groups of size 1 are skipped by the layer (volume 0). First,
 * each forward exchanges the token counts (one int64 all-gather over the intra group). */
static axc_status push_easy(axc_model_coll *out, int cap, int *n, const axc_grid *grid,
                            const axc_layer_desc *l, const axc_step_desc *s, const layer_geom *g,
                            int64_t fwd_repeat, int64_t bwd_repeat)
{
    axc_group_kind gin = g->fwd_group, gout = g->bwd_group;
    int64_t n_in = l->transpose ? grid->G_r : grid->G_c;
    int64_t n_out = l->transpose ? grid->G_c : grid->G_r;
    int64_t t = g->rows, K = l->in_features;
    axc_dtype dt = s->dtype;
    if (n_in * n_out == 1)
        return AXC_OK; /* no feature sharding: nothing is redistributed */
    AXC_TRY(push(out, cap, n, AXC_GROUP_INTRA, AXC_COLL_ALL_GATHER, 1, AXC_DT_I64, fwd_repeat,
                 "fwd all-gather token counts"));
    AXC_TRY(push(out, cap, n, gout, AXC_COLL_ALL_GATHER, t * K, dt, fwd_repeat,
                 "fwd all-gather X"));
    AXC_TRY(push(out, cap, n, gin, AXC_COLL_ALL_TO_ALL, n_out * t * g->in_loc, dt, fwd_repeat,
                 "fwd all-to-all X"));
    AXC_TRY(push(out, cap, n, gin, AXC_COLL_REDUCE_SCATTER, n_out * t * g->out_loc, dt,
                 fwd_repeat, "fwd reduce-scatter Y"));
    AXC_TRY(push(out, cap, n, gout, AXC_COLL_ALL_TO_ALL, t * g->out_loc, dt, fwd_repeat,
                 "fwd all-to-all Y"));
    AXC_TRY(push(out, cap, n, gout, AXC_COLL_ALL_TO_ALL, t * g->out_loc, dt, bwd_repeat,
                 "bwd all-to-all dY"));
    AXC_TRY(push(out, cap, n, gin, AXC_COLL_ALL_GATHER, n_out * t * g->out_loc, dt, bwd_repeat,
                 "bwd all-gather dY"));
    AXC_TRY(push(out, cap, n, gout, AXC_COLL_REDUCE_SCATTER, n_in * t * g->in_loc, dt,
                 bwd_repeat, "bwd reduce-scatter dX"));
    AXC_TRY(push(out, cap, n, gin, AXC_COLL_ALL_TO_ALL, t * g->in_loc, dt, bwd_repeat,
                 "bwd all-to-all dX"));
    return AXC_OK;
}

/* Tokens per rank per micro-batch of an expert-layout layer (split over data x depth). */
static axc_status expert_rows(const axc_grid *g, const axc_step_desc *s, const char *what,
                              int64_t *rows)
{
    if (s->tokens % s->grad_acc)
        return axc_fail(AXC_ERR_INVALID, "tokens per step %lld not divisible by grad_acc=%d",
                        (long long)s->tokens, s->grad_acc);
    int64_t micro = s->tokens / s->grad_acc, split = (int64_t)g->G_data * g->G_d;
    if (micro % split)
        return axc_fail(AXC_ERR_INVALID, "%s: %lld tokens per micro-batch not divisible by "
                        "G_data*G_intra_d=%lld", what, (long long)micro, (long long)split);
    *rows = micro / split;
    return AXC_OK;
}

/* Replicated parameters (axonn_c/parallel.py sync_gradients): one sum of `params` gradient
 * elements per step, over world (easy layout) or depth then data (expert). */
static axc_status replicated_colls(const axc_layer_desc *l, const axc_step_desc *s,
                                   axc_model_coll *out, int cap, int *n)
{
    if (l->params < 1)
        return axc_fail(AXC_ERR_INVALID, "replicated parameters: params must be >= 1, got %lld",
                        (long long)l->params);
    if (l->easy)
        return push(out, cap, n, AXC_GROUP_WORLD, AXC_COLL_ALL_REDUCE, l->params, s->grad_dtype,
                    1, "world all-reduce replicated grads");
    AXC_TRY(push(out, cap, n, AXC_GROUP_DEPTH, AXC_COLL_ALL_REDUCE, l->params, s->grad_dtype, 1,
                 "depth all-reduce replicated grads"));
    return push(out, cap, n, AXC_GROUP_DATA, AXC_COLL_ALL_REDUCE, l->params, s->grad_dtype, 1,
                "data all-reduce replicated grads");
}

/* axonn_c.Embedding, expert layout (axonn_c/embedding.py): the table [V, H] split by
 * vocabulary over the plane (Vp = ceil(V / (G_r G_c)) words a rank) and its block by depth.
 * Per call (forward; with `tied` also logits + cross_entropy): the id check (an int64[2]
 * all-reduce over intra), the depth all-gather of the block (reduce-scatter in backward).
 * Forward's lookup is a partial sum over the plane: a reduce-scatter of [t, H] over the hidden
 * group and an all-reduce of [t, H/n] over the other plane group (backward: an all-gather over
 * the hidden group). The tied logits all-gather the hidden blocks (backward: that reduce-scatter
 * and all-reduce), and the loss all-reduces the row maxima [t] and the sums [2, t] (float32)
 * over row then col. The weight's gradient is summed over data once per step. */
static axc_status embedding_colls(const axc_grid *grid, const axc_layer_desc *l,
                                  const axc_step_desc *s, axc_model_coll *out, int cap, int *n)
{
    if (l->easy)
        return axc_fail(AXC_ERR_INVALID, "the model has the Embedding's expert layout only "
                        "(easy=1 is not modelled)");
    if (l->in_features < 1 || l->out_features < 1)
        return axc_fail(AXC_ERR_INVALID, "embedding shape vocab=%lld hidden=%lld must be >= 1",
                        (long long)l->in_features, (long long)l->out_features);
    axc_group_kind hid = l->transpose ? AXC_GROUP_ROW : AXC_GROUP_COL;
    axc_group_kind other = l->transpose ? AXC_GROUP_COL : AXC_GROUP_ROW;
    int nh = axc_grid_group_size(grid, hid);
    if (l->out_features % nh)
        return axc_fail(AXC_ERR_INVALID, "embedding hidden=%lld is not divisible by the %s "
                        "group (%d ranks)", (long long)l->out_features, axc_group_name(hid), nh);
    if (l->rows < 0 || l->seq < 0 || (l->rows > 0 && l->tied) || (l->seq > 0 && !l->tied))
        return axc_fail(AXC_ERR_INVALID, "embedding rows=%lld seq=%lld: rows (a positional "
                        "table's lookups) is for an untied embedding, seq (the shifted loss) for "
                        "a tied one, both >= 0", (long long)l->rows, (long long)l->seq);
    int64_t t;
    AXC_TRY(expert_rows(grid, s, "embedding", &t));
    /* rows looked up (forward), rows of the loss (the shift drops one per sequence) */
    int64_t tl = l->rows > 0 ? l->rows : t, tloss = t;
    if (l->seq > 0) {
        if (t % l->seq)
            return axc_fail(AXC_ERR_INVALID, "embedding seq=%lld does not divide the %lld tokens "
                            "per rank", (long long)l->seq, (long long)t);
        tloss = t - t / l->seq;
    }
    int64_t plane = (int64_t)grid->G_r * grid->G_c;
    int64_t block = (l->in_features + plane - 1) / plane * l->out_features;
    int64_t shard = (block + grid->G_d - 1) / grid->G_d, hn = l->out_features / nh;
    const int64_t N = s->grad_acc, f = N * (s->recompute ? 2 : 1); /* forward calls */
    const int64_t calls = l->tied ? 2 : 1; /* lookup, and logits + loss */
    /* the tied rows' calls (0: not issued, push skips them) */
    const int64_t tf = l->tied ? f : 0, tN = l->tied ? N : 0;
    const struct {
        axc_group_kind group;
        axc_coll_kind kind;
        int64_t elements;
        axc_dtype dtype;
        int64_t calls;
        const char *name;
    } rows[] = {
        {AXC_GROUP_INTRA, AXC_COLL_ALL_REDUCE, 2, AXC_DT_I64, f * calls, "fwd id check"},
        {AXC_GROUP_DEPTH, AXC_COLL_ALL_GATHER, shard, s->dtype, f * calls, "fwd all-gather table"},
        {AXC_GROUP_DEPTH, AXC_COLL_REDUCE_SCATTER, shard, s->dtype, N * calls,
         "bwd reduce-scatter dtable"},
        /* the lookup: partial sums (forward), its output gradient gathered (backward) */
        {hid, AXC_COLL_REDUCE_SCATTER, tl * hn, s->dtype, f, "fwd reduce-scatter lookup"},
        {other, AXC_COLL_ALL_REDUCE, tl * hn, s->dtype, f, "fwd all-reduce lookup block"},
        {hid, AXC_COLL_ALL_GATHER, tl * hn, s->dtype, N, "bwd all-gather lookup"},
        /* tied: the logits' input gathered (forward), its gradient summed back (backward) */
        {hid, AXC_COLL_ALL_GATHER, t * hn, s->dtype, tf, "fwd all-gather logits input"},
        {hid, AXC_COLL_REDUCE_SCATTER, t * hn, s->dtype, tN, "bwd reduce-scatter logits input"},
        {other, AXC_COLL_ALL_REDUCE, t * hn, s->dtype, tN, "bwd all-reduce logits input block"},
        /* tied: the loss's row maxima and sums over row then col */
        {AXC_GROUP_ROW, AXC_COLL_ALL_REDUCE, tloss, AXC_DT_F32, tf, "fwd all-reduce loss max"},
        {AXC_GROUP_COL, AXC_COLL_ALL_REDUCE, tloss, AXC_DT_F32, tf, "fwd all-reduce loss max"},
        {AXC_GROUP_ROW, AXC_COLL_ALL_REDUCE, 2 * tloss, AXC_DT_F32, tf, "fwd all-reduce loss sums"},
        {AXC_GROUP_COL, AXC_COLL_ALL_REDUCE, 2 * tloss, AXC_DT_F32, tf, "fwd all-reduce loss sums"},
        {AXC_GROUP_DATA, AXC_COLL_ALL_REDUCE, shard, s->grad_dtype, 1, "data all-reduce dtable"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        AXC_TRY(push(out, cap, n, rows[i].group, rows[i].kind, rows[i].elements, rows[i].dtype,
                     rows[i].calls, rows[i].name));
    return AXC_OK;
}

/* axonn_c.LayerNorm / RMSNorm, expert layout (axonn_c/norm.py): `stats` all-reduces of [t]
 * over the hidden group per forward and as many in backward; the parameter blocks' gradients
 * are summed over depth then data once per step. */
static axc_status norm_colls(const axc_grid *grid, const axc_layer_desc *l,
                             const axc_step_desc *s, axc_model_coll *out, int cap, int *n)
{
    if (l->easy)
        return axc_fail(AXC_ERR_INVALID, "an easy-layout norm is replicated: describe its "
                        "parameters as kind replicated");
    if (l->stats < 1 || l->stats > 2)
        return axc_fail(AXC_ERR_INVALID, "norm stats must be 1 (RMSNorm) or 2 (LayerNorm), "
                        "got %d", l->stats);
    axc_group_kind hid = l->transpose ? AXC_GROUP_ROW : AXC_GROUP_COL;
    int nh = axc_grid_group_size(grid, hid);
    if (l->out_features < 1 || l->out_features % nh || l->params < 0 || l->params % nh)
        return axc_fail(AXC_ERR_INVALID, "norm hidden=%lld (params %lld) must be >= 1 and "
                        "divisible by the %s group (%d ranks)", (long long)l->out_features,
                        (long long)l->params, axc_group_name(hid), nh);
    int64_t t;
    AXC_TRY(expert_rows(grid, s, "norm", &t));
    const int64_t N = s->grad_acc, f = N * (s->recompute ? 2 : 1);
    AXC_TRY(push(out, cap, n, hid, AXC_COLL_ALL_REDUCE, t, s->dtype, (f + N) * l->stats,
                 "fwd+bwd all-reduce norm statistics"));
    AXC_TRY(push(out, cap, n, AXC_GROUP_DEPTH, AXC_COLL_ALL_REDUCE, l->params / nh,
                 s->grad_dtype, 1, "depth all-reduce norm grads"));
    return push(out, cap, n, AXC_GROUP_DATA, AXC_COLL_ALL_REDUCE, l->params / nh, s->grad_dtype,
                1, "data all-reduce norm grads");
}

axc_status axc_model_layer_colls(const axc_grid *grid, const axc_layer_desc *l,
                                 const axc_step_desc *s, axc_model_coll *out, int cap, int *n)
{
    AXC_TRY(check_step(s));
    *n = 0;
    switch (l->kind) {
    case AXC_LAYER_LINEAR: break;
    case AXC_LAYER_REPLICATED: return replicated_colls(l, s, out, cap, n);
    case AXC_LAYER_EMBEDDING: return embedding_colls(grid, l, s, out, cap, n);
    case AXC_LAYER_NORM: return norm_colls(grid, l, s, out, cap, n);
    default:
        return axc_fail(AXC_ERR_INVALID, "layer kind %d is not one of linear (0), replicated "
                        "(1), embedding (2), norm (3)", l->kind);
    }
    layer_geom g;
    AXC_TRY(layer_geometry(grid, l, s, &g));
    const int64_t N = s->grad_acc;
    const int64_t passes = s->recompute ? 2 : 1; /* forward runs per micro-batch */
    /* depth all-gathers of W per micro-batch: one per forward pass and one for backward,
     * or a single one when the gathered weight is kept until backward */
    const int64_t gathers = l->cache_weights ? 1 : passes + 1;
    AXC_TRY(push(out, cap, n, AXC_GROUP_DEPTH, AXC_COLL_ALL_GATHER, g.shard, s->dtype, N,
                 "fwd all-gather W"));
    AXC_TRY(push(out, cap, n, AXC_GROUP_DEPTH, AXC_COLL_ALL_GATHER, g.shard, s->dtype,
                 N * (gathers - 1), s->recompute && !l->cache_weights
                                        ? "recompute+bwd all-gather W"
                                        : "bwd all-gather W"));
    if (l->easy) {
        AXC_TRY(push_easy(out, cap, n, grid, l, s, &g, N * passes, N));
        return push_grad_reductions(out, cap, n, l, s, &g);
    }
    /* forward all-reduce of Y [rows, out_loc], split into fwd_chunks row chunks (the first
     * rows % chunks chunks get one extra row) */
    int64_t q = g.rows / s->fwd_chunks, r = g.rows % s->fwd_chunks;
    AXC_TRY(push(out, cap, n, g.fwd_group, AXC_COLL_ALL_REDUCE, (q + 1) * g.out_loc, s->dtype,
                 N * passes * r, "fwd all-reduce Y"));
    AXC_TRY(push(out, cap, n, g.fwd_group, AXC_COLL_ALL_REDUCE, q * g.out_loc, s->dtype,
                 N * passes * (s->fwd_chunks - r), "fwd all-reduce Y"));
    /* backward all-reduce of dX [rows, in_loc], in the same row chunks */
    AXC_TRY(push(out, cap, n, g.bwd_group, AXC_COLL_ALL_REDUCE, (q + 1) * g.in_loc, s->dtype,
                 N * r, "bwd all-reduce dX"));
    AXC_TRY(push(out, cap, n, g.bwd_group, AXC_COLL_ALL_REDUCE, q * g.in_loc, s->dtype,
                 N * (s->fwd_chunks - r), "bwd all-reduce dX"));
    return push_grad_reductions(out, cap, n, l, s, &g);
}

static uint64_t ring_hops(axc_coll_kind kind, int G)
{
    if (G <= 1)
        return 0;
    switch (kind) {
    case AXC_COLL_ALL_REDUCE: return 2u * (uint64_t)(G - 1);
    case AXC_COLL_ALL_GATHER:
    case AXC_COLL_REDUCE_SCATTER:
    case AXC_COLL_ALL_TO_ALL: return (uint64_t)(G - 1);
    default: return 0;
    }
}

static uint64_t scale_bytes(uint64_t bytes, double ratio)
{
    if (ratio <= 0.0 || ratio >= 1.0)
        return bytes;
    return (uint64_t)llround((double)bytes * ratio);
}

/* The codec of a Linear's own float32 collective over col/row/depth, as the runtime picks it
 * (axc_comm_apply_layer_codec; a depth all-reduce is a gradient bucket's sum, exact): set in
 * *c, 1 when it compresses. Data sums: axc_model_data_buckets. */
static int layer_codec(const axc_layer_desc *l, const axc_model_coll *mc,
                       const axc_step_desc *s, axc_coll *c)
{
    int own = l->own_codec[mc->group];
    axc_codec codec = own ? l->codec[mc->group] : s->codec[mc->group];
    if (codec == AXC_CODEC_NONE || l->kind != AXC_LAYER_LINEAR || mc->dtype != AXC_DT_F32 ||
        mc->group == AXC_GROUP_DATA)
        return 0;
    if (mc->kind == AXC_COLL_ALL_REDUCE ? mc->group == AXC_GROUP_DEPTH
                                        : mc->kind != AXC_COLL_REDUCE_SCATTER &&
                                              mc->kind != AXC_COLL_ALL_GATHER)
        return 0;
    c->codec = codec;
    c->block = own ? l->block[mc->group] : s->block[mc->group];
    return 1;
}

axc_status axc_model_layer_volume(const axc_grid *grid, int rank, const axc_layer_desc *l,
                                  const axc_step_desc *s, axc_volume *vol)
{
    if (rank < 0 || rank >= grid->world_size)
        return axc_fail(AXC_ERR_INVALID, "rank %d outside the world of %d ranks", rank,
                        grid->world_size);
    if (l->count < 0)
        return axc_fail(AXC_ERR_INVALID, "layer count must be >= 0, got %lld",
                        (long long)l->count);
    AXC_TRY(check_layer_codecs(l));
    axc_model_coll colls[AXC_MODEL_MAX_COLLS];
    int n = 0;
    AXC_TRY(axc_model_layer_colls(grid, l, s, colls, AXC_MODEL_MAX_COLLS, &n));
    for (int i = 0; i < n; i++) {
        const axc_model_coll *mc = &colls[i];
        int G = axc_grid_group_size(grid, mc->group);
        int gr = axc_grid_group_rank(grid, mc->group, rank);
        axc_coll c;
        memset(&c, 0, sizeof c);
        c.kind = mc->kind;
        c.count = mc->count;
        c.dtype = mc->dtype;
        c.device = -1;
        int coded = layer_codec(l, mc, s, &c);
        uint64_t sent = 0, recv = 0;
        axc_coll_volume(&c, G, gr, &sent, &recv);
        uint64_t times = (uint64_t)mc->repeat * (uint64_t)l->count;
        double ratio = coded ? 1.0 : s->ratio[mc->group];
        vol->sent[mc->group] += scale_bytes(sent, ratio) * times;
        vol->recv[mc->group] += scale_bytes(recv, ratio) * times;
        if (G > 1) {
            vol->calls[mc->group] += times;
            vol->hops[mc->group] += ring_hops(mc->kind, G) * times;
        }
    }
    return AXC_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* machine profiles (sources: docs/machines.md) */

static const axc_machine builtin_machines[] = {
    {.name = "perlmutter",
     .gpus_per_node = 4,
     .mem_gib = 40.0,
     .mem_reserve_gib = 3.0,
     .intra_gbps = 76.0,
     .inter_node_gbps = 80.0,
     .alpha_intra_us = 5.0,
     .alpha_inter_us = 15.0,
     .n_entries = 3,
     .entries = {{1, 2, 76.0}, {1, 4, 225.0}, {2, 2, 76.0}}},
    {.name = "frontier",
     .gpus_per_node = 8,
     .mem_gib = 64.0,
     .mem_reserve_gib = 4.0,
     .intra_gbps = 50.0,
     .inter_node_gbps = 40.0,
     .alpha_intra_us = 8.0,
     .alpha_inter_us = 20.0,
     .n_entries = 6,
     .entries = {{1, 2, 129.0}, {1, 4, 52.0}, {1, 8, 135.0}, {2, 2, 50.0}, {2, 4, 72.0},
                 {4, 2, 36.0}}},
    {.name = "dgx-h100",
     .gpus_per_node = 8,
     .mem_gib = 80.0,
     .mem_reserve_gib = 4.0,
     .intra_gbps = 360.0,
     .inter_node_gbps = 360.0,
     .alpha_intra_us = 4.0,
     .alpha_inter_us = 10.0,
     .n_entries = 0},
};
#define N_BUILTIN ((int)(sizeof builtin_machines / sizeof builtin_machines[0]))

const char *axc_machine_builtin_name(int i)
{
    return (i >= 0 && i < N_BUILTIN) ? builtin_machines[i].name : NULL;
}

axc_status axc_machine_builtin(const char *name, axc_machine *out)
{
    if (!name)
        return axc_fail(AXC_ERR_INVALID, "machine name is NULL");
    for (int i = 0; i < N_BUILTIN; i++) {
        if (strcmp(name, builtin_machines[i].name) == 0) {
            *out = builtin_machines[i];
            return AXC_OK;
        }
    }
    return axc_fail(AXC_ERR_INVALID,
                    "unknown machine '%s': built-in machines are perlmutter, frontier, "
                    "dgx-h100 (or give a profile file)",
                    name);
}

axc_status axc_machine_validate(const axc_machine *m)
{
    if (m->gpus_per_node < 1)
        return axc_fail(AXC_ERR_INVALID, "machine '%s': gpus_per_node must be >= 1, got %d",
                        m->name, m->gpus_per_node);
    if (!(m->mem_gib > 0.0))
        return axc_fail(AXC_ERR_INVALID, "machine '%s': mem_gib must be > 0, got %g", m->name,
                        m->mem_gib);
    if (!(m->mem_reserve_gib >= 0.0 && m->mem_reserve_gib < m->mem_gib))
        return axc_fail(AXC_ERR_INVALID,
                        "machine '%s': mem_reserve_gib must be in [0, mem_gib=%g), got %g",
                        m->name, m->mem_gib, m->mem_reserve_gib);
    if (!(m->intra_gbps > 0.0))
        return axc_fail(AXC_ERR_INVALID, "machine '%s': intra_gbps must be > 0, got %g",
                        m->name, m->intra_gbps);
    if (!(m->inter_node_gbps > 0.0))
        return axc_fail(AXC_ERR_INVALID, "machine '%s': inter_node_gbps must be > 0, got %g",
                        m->name, m->inter_node_gbps);
    if (!(m->alpha_intra_us >= 0.0) || !(m->alpha_inter_us >= 0.0))
        return axc_fail(AXC_ERR_INVALID,
                        "machine '%s': alpha_intra_us/alpha_inter_us must be >= 0, got %g/%g",
                        m->name, m->alpha_intra_us, m->alpha_inter_us);
    if (m->n_entries < 0 || m->n_entries > AXC_MACHINE_MAX_ENTRIES)
        return axc_fail(AXC_ERR_INVALID, "machine '%s': %d bandwidth entries, at most %d",
                        m->name, m->n_entries, AXC_MACHINE_MAX_ENTRIES);
    for (int i = 0; i < m->n_entries; i++) {
        const axc_bw_entry *e = &m->entries[i];
        if (e->stride < 1 || e->size < 2 || !(e->gbps > 0.0))
            return axc_fail(AXC_ERR_INVALID,
                            "machine '%s': bandwidth entry %d (stride=%d size=%d gbps=%g) needs "
                            "stride >= 1, size >= 2, gbps > 0",
                            m->name, i, e->stride, e->size, e->gbps);
        if ((long long)e->stride * e->size > m->gpus_per_node)
            return axc_fail(AXC_ERR_INVALID,
                            "machine '%s': bandwidth entry %d (stride=%d size=%d) does not fit "
                            "in a node of %d GPUs",
                            m->name, i, e->stride, e->size, m->gpus_per_node);
    }
    return AXC_OK;
}

static double intra_gbps(const axc_machine *m, int stride, int size)
{
    for (int i = 0; i < m->n_entries; i++)
        if (m->entries[i].stride == stride && m->entries[i].size == size)
            return m->entries[i].gbps;
    return m->intra_gbps;
}

void axc_machine_link(const axc_machine *m, int stride, int size, double *beta, double *alpha,
                      int *inter)
{
    int gpn = m->gpus_per_node;
    *inter = 0;
    if (size <= 1) {
        *beta = INFINITY;
        *alpha = 0.0;
        return;
    }
    long long extent = (long long)stride * size;
    if (extent <= gpn && gpn % extent == 0) {
        /* every group of this kind lies inside one node */
        *beta = intra_gbps(m, stride, size) * 1e9;
        *alpha = m->alpha_intra_us * 1e-6;
        return;
    }
    /* The ring crosses nodes once per node it visits. The groups of this kind that have
     * members on one node share its injection bandwidth: min(stride, gpn) of them. */
    *inter = 1;
    int share = stride < gpn ? stride : gpn;
    double b_inter = m->inter_node_gbps / share;
    double b = b_inter;
    int per_node = stride < gpn ? gpn / stride : 1;
    if (per_node > size)
        per_node = size;
    if (per_node > 1) {
        double b_in = intra_gbps(m, stride, per_node);
        if (b_in < b)
            b = b_in;
    }
    *beta = b * 1e9;
    *alpha = m->alpha_inter_us * 1e-6;
}

/* ---------------------------------------------------------------------------------------- */
/* whole models */

axc_status axc_model_transformer(axc_model_desc *d,
                                 axc_layer_desc storage[AXC_TRANSFORMER_MAX_LAYERS])
{
    if (d->blocks < 1 || d->hidden < 1 || d->heads < 1)
        return axc_fail(AXC_ERR_INVALID,
                        "transformer needs layers >= 1, hidden >= 1, heads >= 1; got layers=%lld "
                        "hidden=%lld heads=%lld",
                        (long long)d->blocks, (long long)d->hidden, (long long)d->heads);
    if (d->hidden % d->heads)
        return axc_fail(AXC_ERR_INVALID, "hidden=%lld is not divisible by heads=%lld",
                        (long long)d->hidden, (long long)d->heads);
    if (d->ffn == 0)
        d->ffn = 4 * d->hidden;
    if (d->ffn < 1 || d->vocab < 0)
        return axc_fail(AXC_ERR_INVALID, "ffn=%lld must be >= 1 and vocab=%lld >= 0",
                        (long long)d->ffn, (long long)d->vocab);
    int64_t H = d->hidden, F = d->ffn;
    const axc_layer_desc block[4] = {
        {H, 3 * H, 0, 0, 0, d->blocks}, /* QKV */
        {H, H, 1, 0, 0, d->blocks},     /* attention output projection */
        {H, F, 0, 0, 0, d->blocks},     /* FC1 */
        {F, H, 1, 0, 0, d->blocks},     /* FC2 */
    };
    memcpy(storage, block, sizeof block);
    int n = 4;
    if (d->vocab > 0) {
        axc_layer_desc v = {H, d->vocab, 0, 0, 0, 1};
        storage[n++] = v;
    }
    d->layers = storage;
    d->n_layers = n;
    return AXC_OK;
}

static void set_reason(axc_plan_entry *e, const char *msg)
{
    snprintf(e->reason, sizeof e->reason, "%s", msg);
}

static double dsize(axc_dtype dt)
{
    return (double)axc_dtype_size(dt);
}

/* Layer i of the description as the planner evaluates it (the vocabulary rows padded). */
static axc_layer_desc planned_layer(const axc_model_desc *d, const axc_grid *grid, int i)
{
    axc_layer_desc l = d->layers[i];
    if (d->blocks > 0 && d->vocab > 0 && i == d->n_layers - 1) /* pad vocab rows */
        l.out_features = (l.out_features + grid->G_r - 1) / grid->G_r * grid->G_r;
    return l;
}

/* The compressed data-parallel gradient buckets of the planned layers (no-op uncompressed). */
static axc_status planned_data_buckets(const axc_model_desc *d, const axc_grid *grid,
                                       const axc_step_desc *s, axc_volume *vol)
{
    if (s->codec[AXC_GROUP_DATA] == AXC_CODEC_NONE || d->n_layers < 1)
        return AXC_OK;
    axc_layer_desc *ls = malloc((size_t)d->n_layers * sizeof *ls);
    if (!ls)
        return axc_fail(AXC_ERR_NOMEM, "planner: out of memory");
    for (int i = 0; i < d->n_layers; i++)
        ls[i] = planned_layer(d, grid, i);
    axc_status st = axc_model_data_buckets(grid, grid->world_size - 1, ls, d->n_layers, s, vol);
    free(ls);
    return st;
}

axc_status axc_model_evaluate(const axc_model_desc *d, const axc_machine *m, const axc_grid *grid,
                              axc_plan_entry *e)
{
    memset(e, 0, sizeof *e);
    e->G_data = grid->G_data;
    e->G_r = grid->G_r;
    e->G_c = grid->G_c;
    e->G_d = grid->G_d;
    if (!d->layers || d->n_layers < 1)
        return axc_fail(AXC_ERR_INVALID, "the model has no linear layers");
    /* gradient accumulation */
    int64_t N = d->grad_acc;
    if (d->micro_batch > 0) {
        int64_t per_replica = d->global_batch / grid->G_data;
        if (d->global_batch % grid->G_data || per_replica % d->micro_batch) {
            snprintf(e->reason, sizeof e->reason,
                     "global batch %lld is not a multiple of micro-batch %lld x G_data %d",
                     (long long)d->global_batch, (long long)d->micro_batch, grid->G_data);
            return AXC_OK;
        }
        N = per_replica / d->micro_batch;
    }
    e->grad_acc = (int)N;
    int64_t split = N * grid->G_data * grid->G_d;
    if (d->global_batch % split) {
        snprintf(e->reason, sizeof e->reason,
                 "global batch %lld not divisible by grad_acc %lld x G_data %d x G_intra_d %d",
                 (long long)d->global_batch, (long long)N, grid->G_data, grid->G_d);
        return AXC_OK;
    }
    if (d->heads > 0 && d->heads % grid->G_r) {
        snprintf(e->reason, sizeof e->reason, "heads %lld not divisible by G_intra_r %d",
                 (long long)d->heads, grid->G_r);
        return AXC_OK;
    }
    axc_step_desc s = d->step;
    s.tokens = d->global_batch * d->seq;
    s.grad_acc = (int)N;
    int world = grid->world_size;
    int64_t max_block = 0;
    double params_local = 0.0, generic_act = 0.0;
    int64_t rows = s.tokens / split;
    for (int i = 0; i < d->n_layers; i++) {
        axc_layer_desc l = planned_layer(d, grid, i);
        axc_status st = axc_model_layer_volume(grid, world - 1, &l, &s, &e->vol);
        if (st == AXC_ERR_INVALID) {
            set_reason(e, axc_last_error());
            memset(&e->vol, 0, sizeof e->vol);
            return AXC_OK;
        }
        AXC_TRY(st);
        if (l.kind != AXC_LAYER_LINEAR)
            continue; /* (the memory model counts the Linear layers) */
        layer_geom g;
        AXC_TRY(layer_geometry(grid, &l, &s, &g));
        if (g.block > max_block)
            max_block = g.block;
        params_local += (double)l.count * (double)(g.shard + (l.bias ? g.out_loc : 0));
        generic_act += (double)l.count * (double)rows * (double)(g.in_loc + g.out_loc);
    }
    AXC_TRY(planned_data_buckets(d, grid, &s, &e->vol));
    e->valid = 1;
    /* time */
    const int intra = grid->G_c * grid->G_r * grid->G_d;
    const int strides[AXC_MODEL_NGROUPS] = {1, grid->G_c, grid->G_c * grid->G_r, intra, 1, 1};
    const int sizes[AXC_MODEL_NGROUPS] = {grid->G_c, grid->G_r, grid->G_d, grid->G_data, intra,
                                          world};
    e->comm_time = 0.0;
    for (int gk = 0; gk < AXC_MODEL_NGROUPS; gk++) {
        double beta, alpha;
        int inter;
        axc_machine_link(m, strides[gk], sizes[gk], &beta, &alpha, &inter);
        double t = 0.0;
        if (e->vol.sent[gk] || e->vol.hops[gk])
            t = (double)e->vol.sent[gk] / beta + (double)e->vol.hops[gk] * alpha;
        e->time[gk] = t;
        e->comm_time += t;
    }
    /* memory */
    double ds = dsize(s.dtype), gs = dsize(s.grad_dtype);
    axc_memory *mem = &e->mem;
    mem->weights = params_local * ds;
    mem->grads = params_local * gs;
    mem->optimizer =
        params_local * (4.0 * d->optimizer_states + (s.dtype != AXC_DT_F32 ? 4.0 : 0.0));
    mem->gathered = grid->G_d > 1 ? 3.0 * (double)max_block * ds : 0.0;
    if (d->blocks > 0) {
        double t = (double)rows, H = (double)d->hidden, F = (double)d->ffn;
        double Hc = H / grid->G_c, Hr = H / grid->G_r, Fr = F / grid->G_r;
        double act_block = t * (ds * (6.0 * Hc + 4.0 * Hr + 2.0 * Fr) + 2.0 * Hc);
        if (s.recompute)
            mem->activations = (double)d->blocks * t * Hc * ds + 2.0 * act_block;
        else
            mem->activations = (double)d->blocks * act_block + act_block;
        if (d->vocab > 0) {
            double vpad = (double)((d->vocab + grid->G_r - 1) / grid->G_r);
            mem->activations += t * vpad * (ds + 4.0);
        }
    } else {
        mem->activations = generic_act * ds;
    }
    mem->total = mem->weights + mem->grads + mem->optimizer + mem->gathered + mem->activations;
    double usable = (m->mem_gib - m->mem_reserve_gib) * 1073741824.0;
    e->fits = mem->total <= usable;
    if (!e->fits)
        snprintf(e->reason, sizeof e->reason, "needs %.1f GiB per GPU, %.1f GiB usable",
                 mem->total / 1073741824.0, usable / 1073741824.0);
    return AXC_OK;
}

static int category(const axc_plan_entry *e)
{
    return e->fits ? 0 : (e->valid ? 1 : 2);
}

static int cmp_entries(const void *pa, const void *pb)
{
    const axc_plan_entry *a = pa, *b = pb;
    int ca = category(a), cb = category(b);
    if (ca != cb)
        return ca < cb ? -1 : 1;
    if (ca < 2 && a->comm_time != b->comm_time)
        return a->comm_time < b->comm_time ? -1 : 1;
    if (ca < 2 && a->mem.total != b->mem.total)
        return a->mem.total < b->mem.total ? -1 : 1;
    /* deterministic tie-break: larger data parallelism first, then depth, row, col */
    if (a->G_data != b->G_data)
        return a->G_data > b->G_data ? -1 : 1;
    if (a->G_d != b->G_d)
        return a->G_d > b->G_d ? -1 : 1;
    if (a->G_r != b->G_r)
        return a->G_r > b->G_r ? -1 : 1;
    return (a->G_c > b->G_c) - (a->G_c < b->G_c);
}

#define AXC_PLAN_MAX_WORLD (1 << 24)

axc_status axc_plan(const axc_model_desc *d, const axc_machine *m, int world_size,
                    axc_plan_entry **out, size_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    if (world_size < 1 || world_size > AXC_PLAN_MAX_WORLD)
        return axc_fail(AXC_ERR_INVALID, "number of GPUs must be in 1..%d, got %d",
                        AXC_PLAN_MAX_WORLD, world_size);
    if (d->seq < 1)
        return axc_fail(AXC_ERR_INVALID, "sequence length must be >= 1, got %lld",
                        (long long)d->seq);
    if (d->global_batch < 1)
        return axc_fail(AXC_ERR_INVALID, "global batch must be >= 1, got %lld",
                        (long long)d->global_batch);
    if (d->micro_batch < 0)
        return axc_fail(AXC_ERR_INVALID, "micro-batch must be >= 0, got %lld",
                        (long long)d->micro_batch);
    if (d->micro_batch == 0 && d->grad_acc < 1)
        return axc_fail(AXC_ERR_INVALID, "grad_acc must be >= 1, got %d", d->grad_acc);
    if (d->micro_batch > 0 && d->grad_acc > 1)
        return axc_fail(AXC_ERR_INVALID,
                        "give either grad_acc (%d) or micro-batch (%lld), not both",
                        d->grad_acc, (long long)d->micro_batch);
    if (d->micro_batch > 0 && d->global_batch % d->micro_batch)
        return axc_fail(AXC_ERR_INVALID, "global batch %lld is not divisible by micro-batch %lld",
                        (long long)d->global_batch, (long long)d->micro_batch);
    if (d->micro_batch == 0 && d->global_batch % d->grad_acc)
        return axc_fail(AXC_ERR_INVALID, "global batch %lld is not divisible by grad_acc %d",
                        (long long)d->global_batch, d->grad_acc);
    if (d->optimizer_states < 0)
        return axc_fail(AXC_ERR_INVALID, "optimizer_states must be >= 0, got %d",
                        d->optimizer_states);
    if (!d->layers || d->n_layers < 1)
        return axc_fail(AXC_ERR_INVALID, "the model has no linear layers");
    {
        axc_step_desc s = d->step;
        s.tokens = d->global_batch * d->seq;
        s.grad_acc = 1;
        AXC_TRY(check_step(&s));
    }
    AXC_TRY(axc_machine_validate(m));
    /* divisors of world_size */
    int ndiv = 0, cap_div = 64;
    int *divs = malloc(sizeof(int) * (size_t)cap_div);
    if (!divs)
        return axc_fail(AXC_ERR_NOMEM, "out of memory enumerating divisors");
    for (int i = 1; (long long)i * i <= world_size; i++) {
        if (world_size % i)
            continue;
        int pair[2] = {i, world_size / i};
        for (int k = 0; k < (pair[0] == pair[1] ? 1 : 2); k++) {
            if (ndiv == cap_div) {
                cap_div *= 2;
                int *nd = realloc(divs, sizeof(int) * (size_t)cap_div);
                if (!nd) {
                    free(divs);
                    return axc_fail(AXC_ERR_NOMEM, "out of memory enumerating divisors");
                }
                divs = nd;
            }
            divs[ndiv++] = pair[k];
        }
    }
    /* count ordered 4-factorisations */
    size_t total = 0;
    for (int a = 0; a < ndiv; a++) {
        int rest1 = world_size / divs[a];
        for (int b = 0; b < ndiv; b++) {
            if (rest1 % divs[b])
                continue;
            int rest2 = rest1 / divs[b];
            for (int c = 0; c < ndiv; c++)
                if (rest2 % divs[c] == 0)
                    total++;
        }
    }
    axc_plan_entry *entries = malloc(sizeof *entries * total);
    if (!entries) {
        free(divs);
        return axc_fail(AXC_ERR_NOMEM, "out of memory for %zu grids", total);
    }
    size_t n = 0;
    axc_status st = AXC_OK;
    for (int a = 0; a < ndiv && st == AXC_OK; a++) {
        int G_data = divs[a], rest1 = world_size / G_data;
        for (int b = 0; b < ndiv && st == AXC_OK; b++) {
            if (rest1 % divs[b])
                continue;
            int G_d = divs[b], rest2 = rest1 / G_d;
            for (int c = 0; c < ndiv; c++) {
                if (rest2 % divs[c])
                    continue;
                int G_r = divs[c], G_c = rest2 / G_r;
                axc_grid grid;
                st = axc_grid_make(&grid, world_size, G_data, G_r, G_c, G_d, 1);
                if (st == AXC_OK)
                    st = axc_model_evaluate(d, m, &grid, &entries[n++]);
                if (st != AXC_OK)
                    break;
            }
        }
    }
    free(divs);
    if (st != AXC_OK) {
        free(entries);
        return st;
    }
    qsort(entries, n, sizeof *entries, cmp_entries);
    *out = entries;
    *n_out = n;
    return AXC_OK;
}

void axc_plan_free(axc_plan_entry *entries)
{
    free(entries);
}
