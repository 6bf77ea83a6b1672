/* The communication model of compressed data-parallel gradient sums (axc/model.h): a
 * compressed bucket's wire bytes are not the sum of its pieces' (block scales, the per-rank
 * split of the one-shot reduce-scatter), so the pieces are packed into buckets as
 * csrc/grads/buckets.c packs them and each bucket is one compressed all-reduce. */
#include <string.h>

#include "axc/model.h"

/* The two bucket keys a step's data sums use: over data alone, over depth then data. */
enum { KEY_DATA = 0, KEY_DEPTH_DATA = 1, NKEYS = 2 };

typedef struct packer {
    const axc_grid *grid;
    int rank;
    const axc_step_desc *step;
    size_t per;                /* elements of a bucket (bucket_bytes / 4) */
    size_t cap[NKEYS], used[NKEYS];
    axc_volume *vol;
} packer;

static void retire(packer *p, int key)
{
    if (p->used[key]) {
        axc_coll c;
        memset(&c, 0, sizeof c);
        c.kind = AXC_COLL_ALL_REDUCE;
        c.count = p->used[key];
        c.dtype = AXC_DT_F32;
        c.device = -1;
        c.codec = p->step->codec[AXC_GROUP_DATA];
        c.block = p->step->block[AXC_GROUP_DATA];
        int G = p->grid->G_data;
        uint64_t sent = 0, recv = 0;
        axc_coll_volume(&c, G, axc_grid_group_rank(p->grid, AXC_GROUP_DATA, p->rank), &sent,
                        &recv);
        p->vol->sent[AXC_GROUP_DATA] += sent;
        p->vol->recv[AXC_GROUP_DATA] += recv;
        p->vol->calls[AXC_GROUP_DATA] += 1;
        p->vol->hops[AXC_GROUP_DATA] += 2u * (uint64_t)(G - 1);
    }
    p->cap[key] = p->used[key] = 0;
}

/* axc_buckets_take then axc_buckets_written for a piece of n elements. */
static void take(packer *p, int key, size_t n)
{
    if (p->cap[key] && p->used[key] + n > p->cap[key])
        retire(p, key);
    if (!p->cap[key])
        p->cap[key] = n > p->per ? n : p->per;
    p->used[key] += n;
    if (p->used[key] == p->cap[key])
        retire(p, key);
}

/* The pieces one copy of a layer puts into the data buckets, in the order the layer lists its
 * sums (reversed for backward's order). */
static axc_status layer_pieces(packer *p, const axc_layer_desc *l, int reverse)
{
    axc_model_coll colls[AXC_MODEL_MAX_COLLS];
    int n = 0;
    AXC_TRY(axc_model_layer_colls(p->grid, l, p->step, colls, AXC_MODEL_MAX_COLLS, &n));
    for (int j = 0; j < n; j++) {
        int i = reverse ? n - 1 - j : j;
        const axc_model_coll *mc = &colls[i];
        if (mc->group != AXC_GROUP_DATA || mc->kind != AXC_COLL_ALL_REDUCE)
            continue;
        /* summed over depth first (a bias, a norm, a replicated parameter): the bucket of
         * both groups, unless depth has one rank (a group of one is dropped from the key) */
        int depth_first = i > 0 && colls[i - 1].group == AXC_GROUP_DEPTH &&
                          colls[i - 1].kind == AXC_COLL_ALL_REDUCE &&
                          colls[i - 1].count == mc->count && p->grid->G_d > 1;
        for (int64_t r = 0; r < mc->repeat; r++)
            take(p, depth_first ? KEY_DEPTH_DATA : KEY_DATA, mc->count);
    }
    return AXC_OK;
}

axc_status axc_model_data_buckets(const axc_grid *grid, int rank, const axc_layer_desc *layers,
                                  int n_layers, const axc_step_desc *s, axc_volume *vol)
{
    if (s->codec[AXC_GROUP_DATA] == AXC_CODEC_NONE || s->grad_dtype != AXC_DT_F32)
        return AXC_OK; /* (buckets of other dtypes are summed exactly: additive per layer) */
    if (rank < 0 || rank >= grid->world_size)
        return axc_fail(AXC_ERR_INVALID, "rank %d outside the world of %d ranks", rank,
                        grid->world_size);
    if (s->bucket_bytes < 4)
        return axc_fail(AXC_ERR_INVALID, "bucket_bytes must be >= 4, got %lld",
                        (long long)s->bucket_bytes);
    vol->sent[AXC_GROUP_DATA] = vol->recv[AXC_GROUP_DATA] = 0;
    vol->calls[AXC_GROUP_DATA] = vol->hops[AXC_GROUP_DATA] = 0;
    if (grid->G_data < 2)
        return AXC_OK;
    packer p = {.grid = grid, .rank = rank, .step = s, .per = (size_t)s->bucket_bytes / 4,
                .vol = vol};
    for (int j = 0; j < n_layers; j++) {
        const axc_layer_desc *l = &layers[s->bucket_reverse ? n_layers - 1 - j : j];
        for (int64_t c = 0; c < l->count; c++)
            AXC_TRY(layer_pieces(&p, l, s->bucket_reverse));
    }
    for (int key = 0; key < NKEYS; key++) /* (the end of the pass) */
        retire(&p, key);
    return AXC_OK;
}
