/* Unit tests of the communication model, memory model and planner against hand-computed
 * volumes (docs/model.md has the formulas). */
#include <math.h>
#include <string.h>
#include <time.h>

#include "axc/model.h"
#include "ctest.h"

static axc_grid grid_of(int Gdata, int Gr, int Gc, int Gd)
{
    axc_grid g;
    axc_status s = axc_grid_make(&g, Gdata * Gr * Gc * Gd, Gdata, Gr, Gc, Gd, 1);
    (void)s;
    return g;
}

static axc_step_desc step_of(long long tokens, int grad_acc, int recompute)
{
    axc_step_desc s;
    axc_step_desc_default(&s);
    s.tokens = tokens;
    s.grad_acc = grad_acc;
    s.recompute = recompute;
    return s;
}

static axc_volume volume(const axc_grid *g, int rank, axc_layer_desc l, axc_step_desc s)
{
    axc_volume v;
    memset(&v, 0, sizeof v);
    CHECK_OK(axc_model_layer_volume(g, rank, &l, &s, &v));
    return v;
}

/* Normal layer in=8 out=12 on Gdata=1 Gr=2 Gc=2 Gd=2, 16 tokens, bf16, no recompute.
 * in_loc=4 out_loc=6 block=24 shard=12 rows=16/2=8.
 * depth: 2 all-gathers (fwd, bwd) of 1*12*2 B = 24 B each + reduce-scatter 24 B = 72 B.
 * col:  fwd all-reduce of 8*6=48 elems, own piece 24: 2*(48-24)*2 B = 96 B.
 * row:  bwd all-reduce of 8*4=32 elems, own piece 16: 2*(32-16)*2 B = 64 B. data: 0. */
static void test_normal_layer(void)
{
    axc_grid g = grid_of(1, 2, 2, 2);
    axc_layer_desc l = {8, 12, 0, 0, 0, 1};
    axc_volume v = volume(&g, 0, l, step_of(16, 1, 0));
    CHECK(v.sent[AXC_GROUP_DEPTH] == 72);
    CHECK(v.recv[AXC_GROUP_DEPTH] == 72);
    CHECK(v.sent[AXC_GROUP_COL] == 96);
    CHECK(v.sent[AXC_GROUP_ROW] == 64);
    CHECK(v.sent[AXC_GROUP_DATA] == 0);
    CHECK(v.calls[AXC_GROUP_DEPTH] == 3);
    CHECK(v.calls[AXC_GROUP_COL] == 1 && v.calls[AXC_GROUP_ROW] == 1);
    CHECK(v.calls[AXC_GROUP_DATA] == 0);
    CHECK(v.hops[AXC_GROUP_COL] == 2 && v.hops[AXC_GROUP_DEPTH] == 3);
    /* the same rank-independent numbers on the last rank */
    axc_volume w = volume(&g, 7, l, step_of(16, 1, 0));
    CHECK(memcmp(&v, &w, sizeof v) == 0);
    /* count multiplies everything */
    l.count = 5;
    axc_volume x = volume(&g, 0, l, step_of(16, 1, 0));
    CHECK(x.sent[AXC_GROUP_COL] == 5 * 96 && x.sent[AXC_GROUP_DEPTH] == 5 * 72);
}

/* Transposed layer in=10 out=12 on Gdata=2 Gr=2 Gc=3 Gd=1, 14 tokens: input features over the
 * row group (in_loc=10/2=5), output features over the col group (out_loc=12/3=4), rows=14/2=7,
 * block=20=shard.
 * row (fwd all-reduce of Y, 7*4=28 elems, G=2, piece 14): 2*(28-14)*2 = 56 B.
 * col (bwd all-reduce of dX, 7*5=35 elems, G=3, pieces 12,12,11):
 *     col rank 0: 2*(35-12)*2 = 92 B; col rank 2: 2*(35-11)*2 = 96 B.
 * data (fp32 all-reduce of the 20-element shard, G=2, piece 10): 2*(20-10)*4 = 80 B.
 * depth: G=1, nothing. */
static void test_transposed_layer(void)
{
    axc_grid g = grid_of(2, 2, 3, 1);
    axc_layer_desc l = {10, 12, 1, 0, 0, 1};
    axc_volume v0 = volume(&g, 0, l, step_of(14, 1, 0));
    CHECK(v0.sent[AXC_GROUP_ROW] == 56);
    CHECK(v0.sent[AXC_GROUP_COL] == 92);
    CHECK(v0.sent[AXC_GROUP_DATA] == 80);
    CHECK(v0.sent[AXC_GROUP_DEPTH] == 0);
    CHECK(v0.calls[AXC_GROUP_DEPTH] == 0);
    int last = g.world_size - 1; /* col rank 2 */
    axc_volume v2 = volume(&g, last, l, step_of(14, 1, 0));
    CHECK(v2.sent[AXC_GROUP_COL] == 96);
    CHECK(v2.recv[AXC_GROUP_COL] == 96);
    /* full recompute: the forward all-reduce runs twice, the backward one once */
    axc_volume r = volume(&g, 0, l, step_of(14, 1, 1));
    CHECK(r.sent[AXC_GROUP_ROW] == 112);
    CHECK(r.sent[AXC_GROUP_COL] == 92);
    CHECK(r.sent[AXC_GROUP_DATA] == 80);
    /* the same layer not transposed is rejected: out=12 over G_intra_r=2 ok, in=10 over
     * G_intra_c=3 is not */
    axc_layer_desc n = {10, 12, 0, 0, 0, 1};
    axc_step_desc s = step_of(14, 1, 0);
    axc_volume tmp;
    memset(&tmp, 0, sizeof tmp);
    CHECK(axc_model_layer_volume(&g, 0, &n, &s, &tmp) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "in_features=10") != NULL);
    CHECK(strstr(axc_last_error(), "G_intra_c=3") != NULL);
}

/* Gradient accumulation, recompute, weight caching, padded shards on a pure depth grid.
 * in=6 out=10, Gd=4: block 60, shard 15. 32 tokens, grad_acc 2 -> 16 per micro, rows 4.
 * recompute: per micro 2 forward gathers + 1 backward gather, each 3*15*2 = 90 B:
 *   6 gathers = 540 B, 2 reduce-scatters = 180 B -> 720 B.
 * cached weights: 1 gather per micro: 180 + 180 = 360 B. */
static void test_grad_acc_recompute_depth(void)
{
    axc_grid g = grid_of(1, 1, 1, 4);
    axc_layer_desc l = {6, 10, 0, 0, 0, 1};
    axc_volume v = volume(&g, 1, l, step_of(32, 2, 1));
    CHECK(v.sent[AXC_GROUP_DEPTH] == 720);
    CHECK(v.calls[AXC_GROUP_DEPTH] == 8);
    CHECK(v.sent[AXC_GROUP_COL] == 0 && v.sent[AXC_GROUP_ROW] == 0);
    l.cache_weights = 1;
    axc_volume c = volume(&g, 1, l, step_of(32, 2, 1));
    CHECK(c.sent[AXC_GROUP_DEPTH] == 360);
    CHECK(c.calls[AXC_GROUP_DEPTH] == 4);
    /* no recompute, no cache: 2 gathers + 1 reduce-scatter per micro = 6 * 90 = 540 */
    l.cache_weights = 0;
    axc_volume nr = volume(&g, 1, l, step_of(32, 2, 0));
    CHECK(nr.sent[AXC_GROUP_DEPTH] == 540);
    /* Gd=8 does not divide the 60-element block: shards padded to 8 elements;
     * 32 tokens / 8 = 4 rows; 1 micro, no recompute: 3 collectives of 7*8*2 = 112 B */
    axc_grid g8 = grid_of(1, 1, 1, 8);
    axc_volume p = volume(&g8, 0, l, step_of(32, 1, 0));
    CHECK(p.sent[AXC_GROUP_DEPTH] == 336);
}

/* Data-parallel term: fp32 by default, bf16 on request, compression ratio, bias reductions.
 * in=4 out=6 normal on Gdata=4 Gr=1 Gc=1 Gd=1: shard 24 elements, piece 6.
 * fp32: 2*(24-6)*4 = 144 B; bf16: 72 B; ratio 0.25 of fp32: 36 B.
 * bias: 6 elements over data (piece 2 for rank 0... 6/4 -> pieces 2,2,1,1), fp32:
 *   rank 0: 2*(6-2)*4 = 32 B extra; depth group of size 1: none. */
static void test_data_term(void)
{
    axc_grid g = grid_of(4, 1, 1, 1);
    axc_layer_desc l = {4, 6, 0, 0, 0, 1};
    axc_step_desc s = step_of(8, 1, 1);
    CHECK(volume(&g, 0, l, s).sent[AXC_GROUP_DATA] == 144);
    s.grad_dtype = AXC_DT_BF16;
    CHECK(volume(&g, 0, l, s).sent[AXC_GROUP_DATA] == 72);
    s.grad_dtype = AXC_DT_F32;
    s.ratio[AXC_GROUP_DATA] = 0.25;
    CHECK(volume(&g, 0, l, s).sent[AXC_GROUP_DATA] == 36);
    s.ratio[AXC_GROUP_DATA] = 1.0;
    l.bias = 1;
    axc_volume b = volume(&g, 0, l, s);
    CHECK(b.sent[AXC_GROUP_DATA] == 144 + 32);
    CHECK(b.calls[AXC_GROUP_DATA] == 2);
    axc_volume b3 = volume(&g, 3, l, s);
    CHECK(b3.sent[AXC_GROUP_DATA] == 144 + 40);
}

/* Over-decomposition: rows 8 in 3 chunks of 3,3,2 rows; out_loc 6 over a col group
 * of 4: chunks of 18 elems (pieces 5,5,4,4) and 12 elems (pieces 3,3,3,3).
 * col rank 0: 2*2*(18-5)*2 + 2*(12-3)*2 = 104 + 36 = 140 B (unchunked 48: 2*(48-12)*2 = 144). */
static void test_fwd_chunks(void)
{
    axc_grid g = grid_of(1, 1, 4, 1);
    axc_layer_desc l = {8, 6, 0, 0, 0, 1};
    axc_step_desc s = step_of(8, 1, 0);
    CHECK(volume(&g, 0, l, s).sent[AXC_GROUP_COL] == 144);
    s.fwd_chunks = 3;
    axc_volume v = volume(&g, 0, l, s);
    CHECK(v.sent[AXC_GROUP_COL] == 140);
    CHECK(v.calls[AXC_GROUP_COL] == 3);
    /* backward's dX all-reduce (over row) is cut the same way */
    axc_grid gr = grid_of(1, 2, 1, 1);
    s.fwd_chunks = 1;
    axc_volume whole = volume(&gr, 0, l, s);
    s.fwd_chunks = 3;
    axc_volume cut = volume(&gr, 0, l, s);
    CHECK(whole.calls[AXC_GROUP_ROW] == 1);
    CHECK(cut.calls[AXC_GROUP_ROW] == 3);
    CHECK(cut.sent[AXC_GROUP_ROW] <= whole.sent[AXC_GROUP_ROW]);
    CHECK(cut.sent[AXC_GROUP_ROW] > 0);
    s.fwd_chunks = 9;
    axc_volume tmp;
    memset(&tmp, 0, sizeof tmp);
    CHECK(axc_model_layer_volume(&g, 0, &l, &s, &tmp) == AXC_ERR_INVALID);
}

static void test_colls_listing(void)
{
    axc_grid g = grid_of(2, 2, 2, 2);
    axc_layer_desc l = {16, 8, 1, 0, 0, 1};
    axc_step_desc s = step_of(64, 2, 1);
    axc_model_coll c[AXC_MODEL_MAX_COLLS];
    int n = 0;
    CHECK_OK(axc_model_layer_colls(&g, &l, &s, c, AXC_MODEL_MAX_COLLS, &n));
    /* fwd AG, recompute+bwd AG, fwd AR, bwd AR, RS, data AR */
    CHECK(n == 6);
    int seen_fwd = 0, seen_bwd = 0;
    for (int i = 0; i < n; i++) {
        if (c[i].kind == AXC_COLL_ALL_REDUCE && strcmp(c[i].what, "fwd all-reduce Y") == 0) {
            seen_fwd = 1;
            /* transposed: forward over row, rows 64/2/(2*2)=8, out_loc 8/Gc=4 */
            CHECK(c[i].group == AXC_GROUP_ROW && c[i].count == 32 && c[i].repeat == 4);
        }
        if (strcmp(c[i].what, "bwd all-reduce dX") == 0) {
            seen_bwd = 1;
            CHECK(c[i].group == AXC_GROUP_COL && c[i].count == 8 * 8 && c[i].repeat == 2);
        }
    }
    CHECK(seen_fwd && seen_bwd);
    CHECK(axc_model_layer_colls(&g, &l, &s, c, 3, &n) == AXC_ERR_INVALID);
    s.tokens = 63;
    CHECK(axc_model_layer_colls(&g, &l, &s, c, AXC_MODEL_MAX_COLLS, &n) == AXC_ERR_INVALID);
}

static double gbps(const axc_machine *m, int stride, int size)
{
    double b, a;
    int inter;
    axc_machine_link(m, stride, size, &b, &a, &inter);
    return b / 1e9;
}

static void test_machines(void)
{
    axc_machine p, f, h;
    CHECK_OK(axc_machine_builtin("perlmutter", &p));
    CHECK_OK(axc_machine_builtin("frontier", &f));
    CHECK_OK(axc_machine_builtin("dgx-h100", &h));
    CHECK_OK(axc_machine_validate(&p));
    CHECK_OK(axc_machine_validate(&f));
    CHECK_OK(axc_machine_validate(&h));
    CHECK(axc_machine_builtin("summit", &p) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "summit") != NULL);
    CHECK_OK(axc_machine_builtin("perlmutter", &p));
    /* Perlmutter: the authors' table, reproduced by intra entries + node bandwidth / stride */
    CHECK(gbps(&p, 1, 2) == 76.0);
    CHECK(gbps(&p, 1, 4) == 225.0);
    CHECK(gbps(&p, 2, 2) == 76.0);
    CHECK(gbps(&p, 1, 8) == 80.0);
    CHECK(gbps(&p, 1, 64) == 80.0);
    CHECK(gbps(&p, 2, 4) == 40.0);
    CHECK(gbps(&p, 4, 2) == 20.0);
    CHECK(gbps(&p, 64, 16) == 20.0);
    CHECK(isinf(gbps(&p, 4, 1)));
    /* Frontier */
    CHECK(gbps(&f, 1, 8) == 135.0);
    CHECK(gbps(&f, 1, 16) == 40.0);
    CHECK(gbps(&f, 2, 8) == 20.0);
    CHECK(gbps(&f, 4, 4) == 10.0);
    CHECK(gbps(&f, 8, 2) == 5.0);
    CHECK(gbps(&f, 4, 2) == 36.0);
    /* a group of 3 on a 4-GPU node is not aligned to nodes: treated as spanning nodes */
    int inter = 0;
    double b, a;
    axc_machine_link(&p, 1, 3, &b, &a, &inter);
    CHECK(inter == 1);
    axc_machine bad = p;
    bad.gpus_per_node = 0;
    CHECK(axc_machine_validate(&bad) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "gpus_per_node") != NULL);
    CHECK(axc_machine_builtin_name(0) != NULL && axc_machine_builtin_name(3) == NULL);
}

static void gpt(axc_model_desc *d, axc_layer_desc *st, long long L, long long H, long long A,
                long long B)
{
    axc_model_desc_default(d);
    d->blocks = L;
    d->hidden = H;
    d->heads = A;
    d->seq = 2048;
    d->global_batch = B;
    CHECK_OK(axc_model_transformer(d, st));
}

static void test_transformer_evaluate(void)
{
    /* tiny transformer, hand-checked: L=1 H=4 heads=2 F=16, seq 4, batch 2 -> 8 tokens, on
     * Gc=2 (col only), no recompute, bf16. rows = 8. Forward all-reduces over col go to the
     * normal layers (QKV out_loc 12, FC1 out_loc 16): 2*(8*12/2)*2 + 2*(8*16/2)*2 = 192+256;
     * backward over col from the transposed ones (out-proj in_loc 4, FC2 in_loc 16):
     * 2*(32/2)*2 + 2*(128/2)*2 = 64 + 256. Row, depth, data: 0. */
    axc_model_desc d;
    axc_layer_desc st[AXC_TRANSFORMER_MAX_LAYERS];
    axc_model_desc_default(&d);
    d.blocks = 1;
    d.hidden = 4;
    d.heads = 2;
    d.ffn = 16;
    d.seq = 4;
    d.global_batch = 2;
    d.step.recompute = 0;
    CHECK_OK(axc_model_transformer(&d, st));
    CHECK(d.n_layers == 4);
    axc_machine m;
    CHECK_OK(axc_machine_builtin("dgx-h100", &m));
    axc_grid g = grid_of(1, 1, 2, 1);
    axc_plan_entry e;
    CHECK_OK(axc_model_evaluate(&d, &m, &g, &e));
    CHECK(e.valid && e.fits);
    CHECK(e.vol.sent[AXC_GROUP_COL] == 192 + 256 + 64 + 256);
    CHECK(e.vol.sent[AXC_GROUP_ROW] == 0 && e.vol.sent[AXC_GROUP_DEPTH] == 0);
    double expect = 768.0 / 360e9 + 8 * m.alpha_intra_us * 1e-6;
    CHECK(fabs(e.time[AXC_GROUP_COL] - expect) < 1e-12);
    /* heads=2 over G_intra_r=4 is not a valid grid */
    axc_grid g4 = grid_of(1, 4, 1, 1);
    CHECK_OK(axc_model_evaluate(&d, &m, &g4, &e));
    CHECK(!e.valid && strstr(e.reason, "heads") != NULL);
}

static void test_memory(void)
{
    /* 80B GPT on Perlmutter: 64-way tensor parallelism fits the 40 GiB A100s, 32-way does not */
    axc_model_desc d;
    axc_layer_desc st[AXC_TRANSFORMER_MAX_LAYERS];
    gpt(&d, st, 42, 12288, 96, 512);
    axc_machine m;
    CHECK_OK(axc_machine_builtin("perlmutter", &m));
    axc_plan_entry e;
    axc_grid g64 = grid_of(16, 2, 4, 8);
    CHECK_OK(axc_model_evaluate(&d, &m, &g64, &e));
    CHECK(e.valid && e.fits);
    /* 12*H^2*42 = 76.1e9 params over 64 GPUs, 2 B each */
    double p = 12.0 * 12288.0 * 12288.0 * 42.0 / 64.0;
    CHECK(fabs(e.mem.weights - 2.0 * p) < 1.0);
    CHECK(fabs(e.mem.optimizer - 12.0 * p) < 1.0);
    axc_grid g32 = grid_of(32, 2, 4, 4);
    CHECK_OK(axc_model_evaluate(&d, &m, &g32, &e));
    CHECK(e.valid && !e.fits);
    CHECK(strstr(e.reason, "GiB") != NULL);
}

static void test_planner(void)
{
    axc_model_desc d;
    axc_layer_desc st[AXC_TRANSFORMER_MAX_LAYERS];
    gpt(&d, st, 42, 12288, 96, 2048);
    axc_machine m;
    CHECK_OK(axc_machine_builtin("perlmutter", &m));
    axc_plan_entry *e = NULL;
    size_t n = 0;
    /* 12 = 2^2*3: C(5,3)*C(4,3) = 40 ordered 4-factorisations */
    CHECK_OK(axc_plan(&d, &m, 12, &e, &n));
    CHECK(n == 40);
    axc_plan_free(e);
    CHECK_OK(axc_plan(&d, &m, 1, &e, &n));
    CHECK(n == 1 && e[0].G_data == 1 && !e[0].fits);
    axc_plan_free(e);
    CHECK(axc_plan(&d, &m, 0, &e, &n) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "got 0") != NULL);
    d.grad_acc = 3;
    CHECK(axc_plan(&d, &m, 8, &e, &n) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "2048") && strstr(axc_last_error(), "grad_acc 3"));
    d.grad_acc = 1;
    /* the worked example: sorted, every fitting grid before every non-fitting one */
    CHECK_OK(axc_plan(&d, &m, 1024, &e, &n));
    CHECK(n == 286); /* C(13,3) */
    CHECK(e[0].fits);
    int order_ok = 1, seen_unfit = 0;
    for (size_t i = 0; i < n; i++) {
        if (!e[i].fits)
            seen_unfit = 1;
        else if (seen_unfit)
            order_ok = 0;
        if (i && e[i].fits && e[i - 1].fits && e[i].comm_time < e[i - 1].comm_time)
            order_ok = 0;
        if (e[i].G_data * e[i].G_r * e[i].G_c * e[i].G_d != 1024)
            order_ok = 0;
    }
    CHECK(order_ok);
    axc_plan_free(e);
    /* 65,536 GPUs and a highly composite non-power-of-two count, each well under a second */
    int worlds[] = {65536, 55440, 65521};
    for (int i = 0; i < 3; i++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        CHECK_OK(axc_plan(&d, &m, worlds[i], &e, &n));
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        printf("  plan %d GPUs: %zu grids in %.3f s\n", worlds[i], n, dt);
        CHECK(n > 0);
        CHECK(dt < 5.0); /* generous under sanitizers; the real bound is in tests/test_plan.py */
        axc_plan_free(e);
    }
}

/* Easy layout, in=8 out=12 on Gdata=1 Gr=2 Gc=2 Gd=1, 16 tokens (4 per rank), bf16, no
 * recompute. gin=col, gout=row, k_loc=4, n_loc=6.
 * row: fwd all-gather X 4*8=32 el -> 64 B; fwd all-to-all Y 4*6=24/peer -> 48 B;
 *      bwd all-to-all dY 48 B; bwd reduce-scatter dX, recv 2*4*4=32 -> 64 B: 224 B.
 * col: fwd all-to-all X 2*4*4=32/peer -> 64 B; fwd reduce-scatter Y, recv 2*4*6=48 -> 96 B;
 *      bwd all-gather dY 48 -> 96 B; bwd all-to-all dX 4*4=16/peer -> 32 B: 288 B.
 * Transposed (gin=row, gout=col): the same numbers with row and col swapped for in=8 out=12,
 * since both groups have 2 ranks. No feature sharding (Gr=Gc=1): nothing moves. */
static void test_easy_layout(void)
{
    axc_grid g = grid_of(1, 2, 2, 1);
    axc_layer_desc l = {8, 12, 0, 0, 0, 1, 1};
    axc_volume v = volume(&g, 3, l, step_of(16, 1, 0));
    CHECK(v.sent[AXC_GROUP_ROW] == 224 && v.recv[AXC_GROUP_ROW] == 224);
    CHECK(v.sent[AXC_GROUP_COL] == 288 && v.recv[AXC_GROUP_COL] == 288);
    CHECK(v.sent[AXC_GROUP_DEPTH] == 0 && v.sent[AXC_GROUP_DATA] == 0);
    CHECK(v.calls[AXC_GROUP_ROW] == 4 && v.calls[AXC_GROUP_COL] == 4);
    l.transpose = 1;
    v = volume(&g, 0, l, step_of(16, 1, 0));
    CHECK(v.sent[AXC_GROUP_COL] == 224 && v.sent[AXC_GROUP_ROW] == 288);
    axc_grid dp = grid_of(2, 1, 1, 2);
    axc_layer_desc e = {8, 12, 0, 0, 0, 1, 1};
    v = volume(&dp, 0, e, step_of(16, 1, 0));
    CHECK(v.sent[AXC_GROUP_ROW] == 0 && v.sent[AXC_GROUP_COL] == 0);
    /* tokens must split over every rank, and chunking is the expert layout's */
    axc_step_desc s = step_of(18, 1, 0);
    axc_volume w;
    memset(&w, 0, sizeof w);
    CHECK(axc_model_layer_volume(&g, 0, &l, &s, &w) == AXC_ERR_INVALID);
    s = step_of(16, 1, 0);
    s.fwd_chunks = 2;
    CHECK(axc_model_layer_volume(&g, 0, &l, &s, &w) == AXC_ERR_INVALID);
}

/* The easy Linear's token counts: one int64 all-gather over intra (4 ranks) per forward:
 * 3 * 8 B each way. Replicated parameters, 10 fp32 gradients: easy, a world all-reduce (rank 0
 * owns piece 3 of 10: 2*(10-3)*4 = 56 B); expert, depth then data (piece 5 of 10 over 2:
 * 40 B each). */
static void test_token_counts_and_replicated(void)
{
    axc_grid g = grid_of(1, 2, 2, 1);
    axc_layer_desc l = {8, 12, 0, 0, 0, 1, 1};
    axc_volume v = volume(&g, 3, l, step_of(16, 1, 0));
    CHECK(v.sent[AXC_GROUP_INTRA] == 24 && v.recv[AXC_GROUP_INTRA] == 24);
    CHECK(v.calls[AXC_GROUP_INTRA] == 1);
    axc_layer_desc r = {0};
    r.kind = AXC_LAYER_REPLICATED;
    r.count = 1;
    r.params = 10;
    r.easy = 1;
    axc_step_desc s = step_of(16, 1, 0);
    s.grad_dtype = AXC_DT_F32;
    v = volume(&g, 0, r, s);
    CHECK(v.sent[AXC_GROUP_WORLD] == 56 && v.calls[AXC_GROUP_WORLD] == 1);
    CHECK(v.sent[AXC_GROUP_ROW] == 0 && v.sent[AXC_GROUP_INTRA] == 0);
    axc_grid dd = grid_of(2, 1, 1, 2);
    r.easy = 0;
    v = volume(&dd, 0, r, s);
    CHECK(v.sent[AXC_GROUP_DEPTH] == 40 && v.sent[AXC_GROUP_DATA] == 40);
    CHECK(v.sent[AXC_GROUP_WORLD] == 0);
    r.params = 0;
    axc_volume w;
    memset(&w, 0, sizeof w);
    CHECK(axc_model_layer_volume(&g, 0, &r, &s, &w) == AXC_ERR_INVALID);
    r.kind = 9;
    CHECK(axc_model_layer_volume(&g, 0, &r, &s, &w) == AXC_ERR_INVALID);
}

/* Expert Embedding V=10 H=8 on Gr=2 Gc=2 Gd=1, 4 tokens, fp32, tied: Vp=3, block=shard=24,
 * t=4, hidden over col (4 per rank: t*H/2 = 16 elements).
 * col: lookup reduce-scatter 16 (64 B) + logits' backward reduce-scatter 16 (64 B) + the
 *      lookup's backward and the logits' forward all-gathers 16 (64 B each) + loss max [4]
 *      (piece 2: 2*2*4 = 16 B) + loss sums [8] (piece 4: 32 B) = 304 B;
 * row: the two all-reduces of [4, 4] (piece 8: 64 B each) + max 16 B + sums 32 B = 176 B;
 * intra: two int64[2] all-reduces over 4 ranks (rank 0's piece 1: 2*1*8 = 16 B each);
 * data: 0 (one replica). With seq=2 the loss covers 2 rows (max 8 B, sums 16 B a group); an
 * untied table with rows=2 looks up 2 rows (col 32 + 32 B, row 32 B). Norm (LayerNorm, H=8, params 16, split over col): 2 fwd + 2 bwd
 * all-reduces of [4] over col (piece 2: 16 B each), the 8-element gradient block over depth
 * and data (size 1: 0 B). */
static void test_embedding_and_norm(void)
{
    axc_grid g = grid_of(1, 2, 2, 1);
    axc_step_desc s = step_of(4, 1, 0);
    s.dtype = s.grad_dtype = AXC_DT_F32;
    axc_layer_desc e = {0};
    e.kind = AXC_LAYER_EMBEDDING;
    e.in_features = 10;
    e.out_features = 8;
    e.count = 1;
    e.tied = 1;
    axc_volume v = volume(&g, 0, e, s);
    CHECK(v.sent[AXC_GROUP_COL] == 304 && v.recv[AXC_GROUP_COL] == 304);
    CHECK(v.sent[AXC_GROUP_ROW] == 176);
    CHECK(v.sent[AXC_GROUP_INTRA] == 32 && v.calls[AXC_GROUP_INTRA] == 2);
    CHECK(v.sent[AXC_GROUP_DEPTH] == 0 && v.sent[AXC_GROUP_DATA] == 0);
    axc_volume w;
    memset(&w, 0, sizeof w);
    e.seq = 2; /* the shifted loss: 4 - 4/2 = 2 rows, the loss's all-reduces halve (24 B less) */
    v = volume(&g, 0, e, s);
    CHECK(v.sent[AXC_GROUP_COL] == 280 && v.sent[AXC_GROUP_ROW] == 152);
    CHECK(v.sent[AXC_GROUP_INTRA] == 32);
    e.seq = 3; /* does not divide the 4 tokens */
    CHECK(axc_model_layer_volume(&g, 0, &e, &s, &w) == AXC_ERR_INVALID);
    e.seq = 0;
    e.rows = 2; /* rows is for an untied (positional) table */
    CHECK(axc_model_layer_volume(&g, 0, &e, &s, &w) == AXC_ERR_INVALID);
    e.rows = 0;
    e.tied = 0; /* the lookup alone: its reduce-scatter, all-reduce and backward all-gather */
    v = volume(&g, 0, e, s);
    CHECK(v.sent[AXC_GROUP_COL] == 128 && v.sent[AXC_GROUP_ROW] == 64);
    e.rows = 2; /* a positional table: 2 lookups a rank whatever the tokens */
    v = volume(&g, 0, e, s);
    CHECK(v.sent[AXC_GROUP_COL] == 64 && v.sent[AXC_GROUP_ROW] == 32);
    e.seq = 2; /* seq is for a tied one */
    CHECK(axc_model_layer_volume(&g, 0, &e, &s, &w) == AXC_ERR_INVALID);
    e.seq = 0;
    e.rows = -1;
    CHECK(axc_model_layer_volume(&g, 0, &e, &s, &w) == AXC_ERR_INVALID);
    e.rows = 0;
    e.easy = 1;
    CHECK(axc_model_layer_volume(&g, 0, &e, &s, &w) == AXC_ERR_INVALID);
    axc_layer_desc n = {0};
    n.kind = AXC_LAYER_NORM;
    n.out_features = 8;
    n.params = 16;
    n.stats = 2;
    n.count = 1;
    v = volume(&g, 0, n, s);
    CHECK(v.sent[AXC_GROUP_COL] == 64 && v.calls[AXC_GROUP_COL] == 4);
    CHECK(v.sent[AXC_GROUP_ROW] == 0);
    n.stats = 3;
    CHECK(axc_model_layer_volume(&g, 0, &n, &s, &w) == AXC_ERR_INVALID);
    n.stats = 1;
    n.out_features = 7;
    CHECK(axc_model_layer_volume(&g, 0, &n, &s, &w) == AXC_ERR_INVALID);
}

/* Compressed collectives (step.codec): a Linear's own col/row/depth float32 collectives take
 * their group's codec; the data sums are packed into buckets (axc_model_data_buckets), each a
 * one-shot compressed all-reduce: E(ceil(n / G)) bytes each way per peer, twice. */
static void test_compressed_volumes(void)
{
    axc_grid g = grid_of(1, 2, 2, 2);
    axc_layer_desc l = {8, 12, 0, 0, 0, 1};
    axc_step_desc s = step_of(16, 1, 0);
    s.dtype = AXC_DT_F32;
    s.codec[AXC_GROUP_DEPTH] = AXC_CODEC_BF16;
    s.codec[AXC_GROUP_COL] = AXC_CODEC_INT8;
    s.block[AXC_GROUP_COL] = 32;
    axc_volume v = volume(&g, 0, l, s);
    CHECK(v.sent[AXC_GROUP_DEPTH] == 72); /* 3 x 12 elements as bf16 (f32: 144) */
    /* fwd all-reduce of 48: piece 24 -> 4 B scale + 24 B, sent twice */
    CHECK(v.sent[AXC_GROUP_COL] == 56 && v.recv[AXC_GROUP_COL] == 56);
    CHECK(v.sent[AXC_GROUP_ROW] == 128); /* no codec: 2 * 16 * 4 B */
    CHECK(v.calls[AXC_GROUP_DEPTH] == 3 && v.hops[AXC_GROUP_COL] == 2);

    /* data: two layers 8 -> 12 with bias on G_data = 2: pieces 96 (dW), 12 (db) each */
    axc_grid gd = grid_of(2, 1, 1, 1);
    axc_layer_desc two[2] = {{8, 12, 0, 1, 0, 1}, {8, 12, 0, 1, 0, 1}};
    axc_step_desc sd = step_of(16, 1, 0);
    sd.codec[AXC_GROUP_DATA] = AXC_CODEC_INT4;
    sd.block[AXC_GROUP_DATA] = 32;
    axc_volume w;
    memset(&w, 0, sizeof w);
    for (int i = 0; i < 2; i++)
        CHECK_OK(axc_model_layer_volume(&gd, 0, &two[i], &sd, &w));
    CHECK(w.sent[AXC_GROUP_DATA] == 2 * (2 * 48 + 2 * 6) * 4); /* per layer, uncompressed */
    CHECK_OK(axc_model_data_buckets(&gd, 0, two, 2, &sd, &w));
    /* one bucket of 216: piece 108 -> 4 scales (16 B) + 54 B = 70 B, twice */
    CHECK(w.sent[AXC_GROUP_DATA] == 140 && w.recv[AXC_GROUP_DATA] == 140);
    CHECK(w.calls[AXC_GROUP_DATA] == 1 && w.hops[AXC_GROUP_DATA] == 2);
    /* buckets of 100 elements: 96 | 12 | 96 | 12 (the next piece never fits) */
    sd.bucket_bytes = 400;
    CHECK_OK(axc_model_data_buckets(&gd, 0, two, 2, &sd, &w));
    CHECK(w.sent[AXC_GROUP_DATA] == 2 * (2 * 32 + 2 * 7) && w.calls[AXC_GROUP_DATA] == 4);
    /* the same in backward order */
    sd.bucket_reverse = 1;
    CHECK_OK(axc_model_data_buckets(&gd, 0, two, 2, &sd, &w));
    CHECK(w.sent[AXC_GROUP_DATA] == 2 * (2 * 32 + 2 * 7) && w.calls[AXC_GROUP_DATA] == 4);

    /* G_d = 2: the bias is summed over depth then data, a bucket of its own key */
    axc_grid gz = grid_of(2, 1, 1, 2);
    sd.bucket_bytes = 4 << 20;
    sd.bucket_reverse = 0;
    memset(&w, 0, sizeof w);
    CHECK_OK(axc_model_data_buckets(&gz, 0, two, 1, &sd, &w));
    /* buckets 48 (dW shard): 4 + 12 = 16 B; 12 (db): 4 + 3 = 7 B; each sent twice */
    CHECK(w.sent[AXC_GROUP_DATA] == 2 * (16 + 7) && w.calls[AXC_GROUP_DATA] == 2);

    /* uncompressed: nothing replaced */
    axc_step_desc plain = step_of(16, 1, 0);
    axc_volume before = w;
    CHECK_OK(axc_model_data_buckets(&gz, 0, two, 1, &plain, &w));
    CHECK(memcmp(&before, &w, sizeof w) == 0);

    /* a layer's own codecs replace the step's for its groups: depth off, row int8:32; col
     * keeps the step's int8:32 */
    axc_layer_desc own = l;
    own.own_codec[AXC_GROUP_DEPTH] = own.own_codec[AXC_GROUP_ROW] = 1;
    own.codec[AXC_GROUP_DEPTH] = AXC_CODEC_NONE;
    own.codec[AXC_GROUP_ROW] = AXC_CODEC_INT8;
    own.block[AXC_GROUP_ROW] = 32;
    axc_volume vo = volume(&g, 0, own, s);
    CHECK(vo.sent[AXC_GROUP_DEPTH] == 144); /* exact f32 */
    CHECK(vo.sent[AXC_GROUP_COL] == 56);
    /* row: the dX all-reduce of 32 elements, piece 16 -> 4 B scale + 16 B, twice */
    CHECK(vo.sent[AXC_GROUP_ROW] == 40 && vo.recv[AXC_GROUP_ROW] == 40);
    own.own_codec[AXC_GROUP_DATA] = 1; /* refused: data's codec is the step's */
    axc_volume junk;
    memset(&junk, 0, sizeof junk);
    CHECK(axc_model_layer_volume(&g, 0, &own, &s, &junk) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "col, row or depth") != NULL);

    /* refused: a codec on intra/world, a bad block */
    axc_step_desc bad = step_of(16, 1, 0);
    bad.codec[AXC_GROUP_WORLD] = AXC_CODEC_INT8;
    CHECK(axc_model_layer_volume(&gd, 0, &two[0], &bad, &w) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "world") != NULL);
    bad = step_of(16, 1, 0);
    bad.codec[AXC_GROUP_DATA] = AXC_CODEC_INT8;
    bad.block[AXC_GROUP_DATA] = 48;
    CHECK(axc_model_layer_volume(&gd, 0, &two[0], &bad, &w) == AXC_ERR_INVALID);
}

int main(void)
{
    test_token_counts_and_replicated();
    test_embedding_and_norm();
    test_easy_layout();
    test_normal_layer();
    test_transposed_layer();
    test_grad_acc_recompute_depth();
    test_data_term();
    test_fwd_chunks();
    test_compressed_volumes();
    test_colls_listing();
    test_machines();
    test_transformer_evaluate();
    test_memory();
    test_planner();
    return ctest_summary("test_model");
}
