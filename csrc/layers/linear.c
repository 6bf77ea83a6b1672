/* Forward and backward of the 3D tensor-parallel linear layer (see axc/linear.h for layouts).
 * Every collective is issued on the group docs/linear.md names (the overview:
 * docs/ARCHITECTURE.md#the-sharded-linear-layer); GEMMs go to axc_gemm (torch's BLAS on CPU,
 * cuBLASLt on CUDA). Overlap inside the layer: dX's reduction runs during the dW GEMM, the
 * forward all-reduce in row chunks during the next chunk's GEMM. Across layers (csrc/sched/):
 * the weight's depth all-gather is prefetched and dW's reduce-scatter deferred. */
#include "axc/linear.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/cuda_rt.h"
#include "axc/gemm.h"
#include "axc/timeline.h"

/* ------------------------------------------------------------------ shapes */

static void groups_of(const axc_linear_desc *d, axc_group_kind *gin, axc_group_kind *gout)
{
    *gin = d->transpose ? AXC_GROUP_ROW : AXC_GROUP_COL;
    *gout = d->transpose ? AXC_GROUP_COL : AXC_GROUP_ROW;
}

axc_status axc_linear_check(const axc_comm *comm, const axc_linear_desc *d)
{
    if (!comm)
        return axc_fail(AXC_ERR_STATE, "axonn_c is not initialised: call axonn_c.init() first");
    if (d->dtype != AXC_DT_F32 && d->dtype != AXC_DT_BF16 && d->dtype != AXC_DT_F16)
        return axc_fail(AXC_ERR_INVALID,
                        "Linear supports float32, bfloat16 and float16, got %s",
                        axc_dtype_name(d->dtype));
    if (d->in_features < 1 || d->out_features < 1)
        return axc_fail(AXC_ERR_INVALID, "Linear needs in_features, out_features >= 1, got %lld, %lld",
                        (long long)d->in_features, (long long)d->out_features);
    const axc_grid *g = axc_comm_grid(comm);
    axc_group_kind gin, gout;
    groups_of(d, &gin, &gout);
    int nin = axc_grid_group_size(g, gin), nout = axc_grid_group_size(g, gout);
    if (d->in_features % nin)
        return axc_fail(AXC_ERR_INVALID,
                        "in_features=%lld is not divisible by the %s group size %d (G_intra_%c=%d%s)",
                        (long long)d->in_features, axc_group_name(gin), nin,
                        gin == AXC_GROUP_COL ? 'c' : 'r', nin,
                        d->transpose ? ", transpose=True" : "");
    if (d->out_features % nout)
        return axc_fail(AXC_ERR_INVALID,
                        "out_features=%lld is not divisible by the %s group size %d (G_intra_%c=%d%s)",
                        (long long)d->out_features, axc_group_name(gout), nout,
                        gout == AXC_GROUP_COL ? 'c' : 'r', nout,
                        d->transpose ? ", transpose=True" : "");
    return AXC_OK;
}

/* A bump allocator over the workspace; with base NULL it only measures. */
typedef struct bump {
    unsigned char *base;
    size_t used, es;
} bump;

static void *take(bump *b, int64_t elems)
{
    size_t bytes = ((size_t)elems * b->es + 63) / 64 * 64;
    void *p = b->base ? b->base + b->used : NULL;
    b->used += bytes;
    return p;
}

typedef struct fwd_bufs {
    void *xpad, *g1, *pack, *wfull, *ypart, *yr, *yrecv;
} fwd_bufs;

typedef struct bwd_bufs {
    void *dypack, *dyr, *dye, *wfull, *dxe, *dxperm, *dxr, *dxrecv, *dwpad;
} bwd_bufs;

static void layout_fwd(const axc_linear_desc *d, const axc_linear_shapes *s, int64_t rows, bump *b,
                       fwd_bufs *f)
{
    memset(f, 0, sizeof *f);
    if (s->depth_size > 1 && !d->scheduled)
        f->wfull = take(b, s->shard * s->depth_size);
    if (d->layout == AXC_LAYOUT_EASY) {
        int64_t P = (int64_t)s->gin_size * s->gout_size, K = d->in_features;
        f->xpad = take(b, rows * K);
        f->g1 = take(b, s->gout_size * rows * K);
        f->pack = take(b, s->gout_size * rows * K);
        f->ypart = take(b, P * rows * s->n_local);
        f->yr = take(b, s->gout_size * rows * s->n_local);
        f->yrecv = take(b, s->gout_size * rows * s->n_local);
    }
}

static void layout_bwd(const axc_linear_desc *d, const axc_linear_shapes *s, int64_t rows, bump *b,
                       bwd_bufs *w)
{
    memset(w, 0, sizeof *w);
    if (s->depth_size > 1) {
        if (!d->scheduled)
            w->wfull = take(b, s->shard * s->depth_size);
        w->dwpad = take(b, s->shard * s->depth_size);
    }
    if (d->layout == AXC_LAYOUT_EASY) {
        int64_t P = (int64_t)s->gin_size * s->gout_size;
        w->dypack = take(b, s->gout_size * rows * s->n_local);
        w->dyr = take(b, s->gout_size * rows * s->n_local);
        w->dye = take(b, P * rows * s->n_local);
        w->dxe = take(b, P * rows * s->k_local);
        w->dxperm = take(b, P * rows * s->k_local);
        w->dxr = take(b, s->gin_size * rows * s->k_local);
        w->dxrecv = take(b, s->gin_size * rows * s->k_local);
    }
}

axc_status axc_linear_shapes_for(const axc_comm *comm, const axc_linear_desc *d, int64_t rows,
                                 axc_linear_shapes *s)
{
    AXC_TRY(axc_linear_check(comm, d));
    if (rows < 0)
        return axc_fail(AXC_ERR_INVALID, "token count must be >= 0, got %lld", (long long)rows);
    const axc_grid *g = axc_comm_grid(comm);
    int rank = axc_comm_rank(comm);
    memset(s, 0, sizeof *s);
    groups_of(d, &s->gin, &s->gout);
    s->gin_size = axc_grid_group_size(g, s->gin);
    s->gout_size = axc_grid_group_size(g, s->gout);
    s->gin_rank = axc_grid_group_rank(g, s->gin, rank);
    s->gout_rank = axc_grid_group_rank(g, s->gout, rank);
    s->depth_size = g->G_d;
    s->k_local = d->in_features / s->gin_size;
    s->n_local = d->out_features / s->gout_size;
    s->block = s->k_local * s->n_local;
    s->shard = (s->block + g->G_d - 1) / g->G_d;
    s->saved_cols = s->k_local;
    s->saved_rows = d->layout == AXC_LAYOUT_EASY ? (int64_t)s->gin_size * s->gout_size * rows : 0;
    bump bf = {NULL, 0, axc_dtype_size(d->dtype)}, bb = bf;
    fwd_bufs f;
    bwd_bufs w;
    layout_fwd(d, s, rows, &bf, &f);
    layout_bwd(d, s, rows, &bb, &w);
    size_t bytes = bf.used > bb.used ? bf.used : bb.used;
    s->workspace_elems = (int64_t)((bytes + bf.es - 1) / bf.es);
    return AXC_OK;
}

/* ------------------------------------------------------------------ helpers */

typedef struct ctx {
    axc_comm *comm;
    const axc_linear_desc *d;
    const axc_linear_io *io;
    axc_linear_shapes s;
    size_t es;
} ctx;

/* A collective of the layer over `g` with its codec: the layer's own (own_codecs) or the
 * communicator's policy, where the transport compresses it. */
static axc_coll layer_coll(const axc_comm *comm, const axc_linear_desc *d, int device,
                           void *stream, axc_group_kind g, axc_coll_kind kind, const void *send,
                           void *recv, int64_t count)
{
    axc_coll a = {0};
    a.kind = kind;
    a.send = send;
    a.recv = recv;
    a.count = (size_t)count;
    a.dtype = d->dtype;
    a.op = AXC_RED_SUM;
    a.device = device;
    a.stream = stream;
    if (d->own_codecs)
        axc_comm_apply_codec(comm, d->codec[g], d->block[g], &a);
    else
        axc_comm_apply_layer_codec(comm, g, &a);
    return a;
}

/* Whether dW's depth reduce-scatter (on `device`) runs compressed with error feedback. */
static int dw_error_feedback(const axc_comm *comm, const axc_linear_desc *d, int device)
{
    if (axc_comm_grid(comm)->G_d == 1)
        return 0;
    int ef = d->own_codecs ? d->depth_error_feedback
                           : axc_comm_layer_error_feedback(comm, AXC_GROUP_DEPTH);
    axc_coll a = layer_coll(comm, d, device, NULL, AXC_GROUP_DEPTH, AXC_COLL_REDUCE_SCATTER,
                            NULL, NULL, 0);
    return ef && a.codec != AXC_CODEC_NONE;
}

axc_status axc_linear_dw_residual_elems(const axc_comm *comm, const axc_linear_desc *d,
                                        int device, int64_t *elems)
{
    axc_linear_shapes s;
    *elems = 0;
    AXC_TRY(axc_linear_shapes_for(comm, d, 0, &s));
    if (dw_error_feedback(comm, d, device))
        *elems = s.shard * s.depth_size;
    return AXC_OK;
}

/* Starts a collective on the layer's buffers; *w is NULL when the group has one rank and
 * nothing needs to move (the caller handles the local case). `residual`: the error feedback
 * (dW's depth reduce-scatter), or NULL. */
static axc_status coll_start_ef(ctx *c, axc_group_kind g, axc_coll_kind kind, const void *send,
                                void *recv, int64_t count, float *residual, axc_work **w)
{
    axc_coll a = layer_coll(c->comm, c->d, c->io->device, c->io->stream, g, kind, send, recv,
                            count);
    if (a.codec != AXC_CODEC_NONE)
        a.residual = residual;
    return axc_comm_start(c->comm, g, &a, w);
}

static axc_status coll_start(ctx *c, axc_group_kind g, axc_coll_kind kind, const void *send,
                             void *recv, int64_t count, axc_work **w)
{
    return coll_start_ef(c, g, kind, send, recv, count, NULL, w);
}

/* Waits for and frees *w (if any); keeps the first error. */
static axc_status coll_finish(axc_work **w, axc_status st)
{
    if (*w) {
        axc_status ws = axc_work_wait(*w);
        axc_work_free(*w);
        *w = NULL;
        if (st == AXC_OK)
            st = ws;
    }
    return st;
}

static axc_status coll(ctx *c, axc_group_kind g, axc_coll_kind kind, const void *send, void *recv,
                       int64_t count)
{
    axc_work *w = NULL;
    AXC_TRY(coll_start(c, g, kind, send, recv, count, &w));
    return coll_finish(&w, AXC_OK);
}

/* Runs the collective from `send` into `buf` on a group of several ranks and returns `buf`
 * in *out; on a one-rank group nothing moves and *out is `send` itself. */
static axc_status through(ctx *c, axc_group_kind g, axc_coll_kind kind, const void *send,
                          void *buf, int64_t count, const void **out)
{
    *out = send;
    if (axc_grid_group_size(axc_comm_grid(c->comm), g) == 1)
        return AXC_OK;
    AXC_TRY(coll(c, g, kind, send, buf, count));
    *out = buf;
    return AXC_OK;
}

/* `span`: the timeline's name for it ("gemm", or "gemm:dw" for weight gradients, so that a
 * trace shows where deferred ones ran) */
static axc_status gemm_beta(ctx *c, const char *span, int ta, int tb, int64_t M, int64_t N,
                            int64_t K, const void *A, int64_t lda, const void *B, int64_t ldb,
                            void *C, int64_t ldc, const void *bias, float beta)
{
    axc_gemm_args g = {0};
    g.device = c->io->device;
    g.stream = c->io->stream;
    g.dtype = c->d->dtype;
    g.trans_a = ta;
    g.trans_b = tb;
    g.M = M;
    g.N = N;
    g.K = K;
    g.A = A;
    g.lda = lda;
    g.B = B;
    g.ldb = ldb;
    g.C = C;
    g.ldc = ldc;
    g.alpha = 1.0f;
    g.beta = beta;
    g.bias = bias;
    axc_timeline *tl = axc_comm_timeline(c->comm); /* (the runtime's; NULL: none) */
    int64_t t0 = axc_timeline_begin(tl); /* 0 when the timeline is off */
    axc_status st = axc_gemm(&g);
    axc_timeline_end(tl, AXC_SPAN_COMPUTE, span, -1, t0, 0);
    return st;
}

static axc_status gemm(ctx *c, int ta, int tb, int64_t M, int64_t N, int64_t K, const void *A,
                       int64_t lda, const void *B, int64_t ldb, void *C, int64_t ldc,
                       const void *bias)
{
    return gemm_beta(c, "gemm", ta, tb, M, N, K, A, lda, B, ldb, C, ldc, bias, 0.0f);
}

static axc_status copy_rows(ctx *c, void *dst, int64_t dst_ld, const void *src, int64_t src_ld,
                            int64_t cols, int64_t rows)
{
    if (rows <= 0 || cols <= 0)
        return AXC_OK;
    return axc_copy2d(c->io->device, c->io->stream, dst, (size_t)dst_ld * c->es, src,
                      (size_t)src_ld * c->es, (size_t)cols * c->es, (size_t)rows);
}

static unsigned char *at(void *base, int64_t elems, size_t es)
{
    return (unsigned char *)base + (size_t)elems * es;
}

/* The [n_local x k_local] block of W: all-gathered over depth (unless Gd == 1), by the
 * scheduler (prefetched; *held = 1 and release_weight must follow), by the caller (io->w_full)
 * or into `wfull`. */
static axc_status gather_weight(ctx *c, int phase, void *wfull, const void **w, int *held)
{
    const axc_linear_io *io = c->io;
    *held = 0;
    if (c->s.depth_size == 1) {
        *w = io->w;
        return AXC_OK;
    }
    if (io->w_full && !c->d->scheduled) { /* gathered by the caller */
        *w = io->w_full;
        return AXC_OK;
    }
    if (c->d->scheduled) {
        if (!io->sched)
            return axc_fail(AXC_ERR_STATE, "Linear: scheduled gather without a scheduler");
        axc_sched_weight sw = {io->layer, phase, io->w, c->s.shard, io->w_version, c->d->dtype,
                               io->device, io->stream, io->prefetch_ok, c->d->own_codecs,
                               c->d->codec[AXC_GROUP_DEPTH], c->d->block[AXC_GROUP_DEPTH]};
        AXC_TRY(axc_sched_acquire(io->sched, &sw, w));
        *held = 1;
        return AXC_OK;
    }
    AXC_TRY(coll(c, AXC_GROUP_DEPTH, AXC_COLL_ALL_GATHER, io->w, wfull, c->s.shard));
    *w = wfull;
    return AXC_OK;
}

static axc_status release_weight(ctx *c, int held, axc_status st)
{
    if (!held)
        return st;
    axc_status rs = axc_sched_release(c->io->sched, c->io->layer, c->io->stream);
    return st != AXC_OK ? st : rs;
}

/* Row chunks of the expert layout's all-reduces (forward Y, backward dX) over a [rows x cols]
 * block: 0 picks by its size (chunking pays off once the all-reduce is long enough to hide
 * behind a GEMM). */
static int64_t reduce_chunks(const ctx *c, int64_t rows, int64_t cols)
{
    int64_t n = c->d->fwd_chunks;
    if (n == 0) {
        size_t bytes = (size_t)rows * (size_t)cols * c->es;
        n = bytes < ((size_t)256 << 10) ? 1 : bytes < ((size_t)4 << 20) ? 2 : 4;
    }
    if (n > rows)
        n = rows > 0 ? rows : 1;
    return n < 1 ? 1 : n > 64 ? 64 : n;
}

/* C[rows x N] = A[rows x K] * op(B) in row chunks, each chunk's all-reduce over `g` started as
 * soon as its GEMM is done, so that it runs while the next chunk computes (over-decomposition,
 * Tensor3D); the first rows % n chunks get one extra row (as the communication model counts
 * them). The works are left in works[0..n) for the caller to finish. */
static axc_status gemm_reduce_chunks(ctx *c, int64_t n, int64_t rows, int tb, int64_t N, int64_t K,
                                     const void *A, const void *B, void *C, const void *bias,
                                     axc_group_kind g, axc_work **works)
{
    int64_t q = rows / n, r = rows % n, row0 = 0;
    axc_status st = AXC_OK;
    for (int64_t i = 0; i < n && st == AXC_OK; i++) {
        int64_t len = q + (i < r ? 1 : 0);
        void *ci = at(C, row0 * N, c->es);
        st = gemm(c, 0, tb, len, N, K, at((void *)A, row0 * K, c->es), K, B, tb ? K : N, ci, N,
                  bias);
        if (st == AXC_OK)
            st = coll_start(c, g, AXC_COLL_ALL_REDUCE, ci, ci, len * N, &works[i]);
        row0 += len;
    }
    return st;
}

/* Hands works[0..n) (all writing [out, out + elems)) to the scheduler as held results: a later
 * call awaits them (axc_linear_io.hold_result). On an earlier error they are finished here. */
static axc_status hold_all(ctx *c, axc_work **works, int64_t n, const void *out, int64_t elems,
                           axc_status st)
{
    for (int64_t i = 0; i < n; i++) {
        if (st != AXC_OK) {
            st = coll_finish(&works[i], st);
            continue;
        }
        st = axc_sched_hold_result(c->io->sched, out, (size_t)elems * c->es, works[i], NULL);
        works[i] = NULL; /* the scheduler owns it now, also when holding failed */
    }
    return st;
}

/* Finishes works[0..n); keeps the first error. */
static axc_status finish_all(axc_work **works, int64_t n, axc_status st)
{
    for (int64_t i = 0; i < n; i++)
        st = coll_finish(&works[i], st);
    return st;
}

/* A failing call with held results: the caller drops what they write (y, dx) when it sees the
 * error, so they complete now (every held one: the failing call's, and older ones it may not
 * know about), keeping the first error. */
static axc_status await_on_error(ctx *c, axc_status st)
{
    if (st == AXC_OK || !c->io->hold_result)
        return st;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", axc_last_error());
    (void)axc_sched_await_results(c->io->sched);
    return axc_fail(st, "%s", msg);
}

/* ------------------------------------------------------------------ forward */

/* The forward after the weight is gathered (`w`: the [n_local x k_local] block). */
static axc_status forward_body(ctx *pc, fwd_bufs *pf, const void *w)
{
    ctx c = *pc;
    fwd_bufs f = *pf;
    const axc_linear_desc *d = c.d;
    const axc_linear_io *io = c.io;
    const axc_linear_shapes *s = &c.s;
    int64_t rows = d->layout == AXC_LAYOUT_EASY ? io->t_max : io->rows;
    /* the bias joins the partial sums once: on gin rank 0 */
    const void *bias = (d->has_bias && s->gin_rank == 0) ? io->bias : NULL;
    int64_t Kl = s->k_local, Nl = s->n_local, K = d->in_features, N = d->out_features;

    if (d->layout == AXC_LAYOUT_EXPERT) {
        if (s->gin_size == 1) {
            AXC_TRY(gemm(&c, 0, 1, rows, Nl, Kl, io->x, Kl, w, Kl, io->y, Nl, bias));
            return AXC_OK;
        }
        /* over-decomposition: chunk i's all-reduce runs while chunk i+1's GEMM computes */
        int64_t n = reduce_chunks(&c, rows, Nl);
        axc_work *works[64] = {0};
        axc_status st = gemm_reduce_chunks(&c, n, rows, 1, Nl, Kl, io->x, w, io->y, bias, s->gin,
                                           works);
        if (io->hold_result) /* the next layer awaits y (axonn_c.Sequential) */
            return hold_all(&c, works, n, io->y, rows * Nl, st);
        return finish_all(works, n, st);
    }

    /* easy: gather the gout peers' tokens, trade feature blocks within gin */
    int G_in = s->gin_size, G_out = s->gout_size;
    const void *x = io->x;
    if (io->rows < rows) { /* pad to the plane's largest token count */
        AXC_TRY(copy_rows(&c, f.xpad, K, io->x, K, K, io->rows));
        AXC_TRY(axc_zero(io->device, io->stream, at(f.xpad, io->rows * K, c.es),
                         (size_t)((rows - io->rows) * K) * c.es));
        x = f.xpad;
    }
    const void *g1;
    AXC_TRY(through(&c, s->gout, AXC_COLL_ALL_GATHER, x, f.g1, rows * K, &g1));
    /* piece j (for gin peer j) = column block j of every gathered row */
    int64_t grows = G_out * rows;
    if (G_in > 1) {
        for (int j = 0; j < G_in; j++)
            AXC_TRY(copy_rows(&c, at(f.pack, j * grows * Kl, c.es), Kl,
                              at((void *)g1, j * Kl, c.es), K, Kl, grows));
        AXC_TRY(coll(&c, s->gin, AXC_COLL_ALL_TO_ALL, f.pack, io->saved, grows * Kl));
    } else {
        AXC_TRY(copy_rows(&c, io->saved, Kl, g1, K, Kl, grows));
    }
    /* rows of `saved` are ordered (gin source, gout source, token) */
    int64_t P_rows = (int64_t)G_in * grows;
    AXC_TRY(gemm(&c, 0, 1, P_rows, Nl, Kl, io->saved, Kl, w, Kl, f.ypart, Nl, bias));
    const void *yr;
    AXC_TRY(through(&c, s->gin, AXC_COLL_REDUCE_SCATTER, f.ypart, f.yr, grows * Nl, &yr));
    /* yr: my gout group's tokens (gout source, token), my output block; give each its tokens */
    const void *yrecv;
    AXC_TRY(through(&c, s->gout, AXC_COLL_ALL_TO_ALL, yr, f.yrecv, rows * Nl, &yrecv));
    for (int k = 0; k < G_out && io->rows > 0; k++) /* (no rows: y is NULL) */
        AXC_TRY(copy_rows(&c, at(io->y, k * Nl, c.es), N, at((void *)yrecv, k * rows * Nl, c.es),
                          Nl, Nl, io->rows));
    return AXC_OK;
}

axc_status axc_linear_forward(axc_comm *comm, const axc_linear_desc *d, const axc_linear_io *io)
{
    ctx c = {comm, d, io, {0}, axc_dtype_size(d->dtype)};
    int64_t rows = d->layout == AXC_LAYOUT_EASY ? io->t_max : io->rows;
    if (d->layout == AXC_LAYOUT_EASY && io->t_max < io->rows)
        return axc_fail(AXC_ERR_INVALID, "t_max %lld < rows %lld", (long long)io->t_max,
                        (long long)io->rows);
    AXC_TRY(axc_linear_shapes_for(comm, d, rows, &c.s));
    if (io->hold_result && !io->sched)
        return axc_fail(AXC_ERR_STATE, "Linear: held forward result without a scheduler");
    bump b = {io->workspace, 0, c.es};
    fwd_bufs f;
    layout_fwd(d, &c.s, rows, &b, &f);
    const void *w;
    int held;
    AXC_TRY(gather_weight(&c, AXC_PHASE_FWD, f.wfull, &w, &held));
    return await_on_error(&c, release_weight(&c, held, forward_body(&c, &f, w)));
}

/* ------------------------------------------------------------------ backward */

/* dW block = dY^T X into the buffer that is reduce-scattered over depth (or straight into the
 * gradient when Gd == 1), zero-padded to shard * Gd. */
static axc_status dw_gemm(ctx *c, bwd_bufs *w, const void *dy, const void *x, int64_t rows)
{
    const axc_linear_shapes *s = &c->s;
    const axc_linear_io *io = c->io;
    int64_t Kl = s->k_local, Nl = s->n_local, padded = s->shard * s->depth_size;
    /* io->dw_full: the caller reduce-scatters dW itself (e.g. once for all micro-batches) */
    void *dwfull = s->depth_size == 1 ? io->dw : io->dw_full ? io->dw_full : w->dwpad;
    float beta = 0.0f;
    if (io->dw_prev) {
        /* accumulate: the gradient so far joins this rank's own piece before the reduction
         * (a reduce-scatter is linear, so my piece of the result gains exactly dw_prev) */
        int64_t depth = axc_grid_coords(axc_comm_grid(c->comm), axc_comm_rank(c->comm)).depth;
        if (s->depth_size > 1)
            AXC_TRY(axc_zero(io->device, io->stream, dwfull, (size_t)padded * c->es));
        void *mine = at(dwfull, s->depth_size > 1 ? depth * s->shard : 0, c->es);
        if (mine != io->dw_prev)
            AXC_TRY(copy_rows(c, mine, s->shard, io->dw_prev, s->shard, s->shard, 1));
        beta = 1.0f;
    }
    AXC_TRY(gemm_beta(c, "gemm:dw", 1, 0, Nl, Kl, rows, dy, Nl, x, Kl, dwfull, Kl, NULL, beta));
    if (padded > s->block && !io->dw_prev)
        AXC_TRY(axc_zero(io->device, io->stream, at(dwfull, s->block, c->es),
                         (size_t)(padded - s->block) * c->es));
    return AXC_OK;
}

/* Starts dW's depth reduce-scatter (Gd > 1, unless the caller does it): handed to the
 * scheduler when deferred, else left in *rs (already finished without overlap_reduce_scatter). */
static axc_status dw_scatter(ctx *c, bwd_bufs *w, axc_work **rs)
{
    const axc_linear_shapes *s = &c->s;
    const axc_linear_io *io = c->io;
    if (s->depth_size == 1 || io->dw_full)
        return AXC_OK;
    /* error feedback (gradient rules): what encoding lost joins the next step's contribution;
     * the residual is the caller's, kept across steps (axc_linear_io.dw_residual) */
    float *residual = NULL;
    if (dw_error_feedback(c->comm, c->d, io->device)) {
        if (!io->dw_residual)
            return axc_fail(AXC_ERR_INVALID,
                            "Linear(%lld, %lld): dW's depth reduce-scatter is compressed with "
                            "error feedback but the call has no residual (a torch.compile "
                            "graph keeps none): pass error_feedback=False for 'depth'",
                            (long long)c->d->in_features, (long long)c->d->out_features);
        residual = io->dw_residual;
    }
    axc_status st = coll_start_ef(c, AXC_GROUP_DEPTH, AXC_COLL_REDUCE_SCATTER, w->dwpad, io->dw,
                                  s->shard, residual, rs);
    if (st == AXC_OK && io->defer) { /* completed by axc_sched_finish */
        st = axc_sched_defer(io->sched, *rs);
        *rs = NULL;
    } else if (!c->d->overlap_reduce_scatter) {
        st = coll_finish(rs, st);
    }
    return st;
}

static axc_status bias_grad(ctx *c, const void *dy, int64_t rows)
{
    const axc_linear_io *io = c->io;
    if (!c->d->has_bias || !io->db)
        return AXC_OK;
    return axc_bias_grad(io->device, io->stream, c->d->dtype, dy, rows, c->s.n_local,
                         c->s.n_local, io->db, 0);
}

/* The depth reduce-scatter of dW (asynchronous with overlap_reduce_scatter, so it runs while the
 * bias gradient computes), db = column sums of dY, then every collective still in flight
 * (pending[0..npending), e.g. dX's reductions) completes. */
static axc_status dw_finish(ctx *c, bwd_bufs *w, const void *dy, int64_t rows, axc_work **pending,
                           int64_t npending)
{
    axc_work *rs = NULL;
    axc_status st = dw_scatter(c, w, &rs);
    if (st == AXC_OK)
        st = bias_grad(c, dy, rows);
    st = finish_all(pending, npending, st);
    return coll_finish(&rs, st);
}

/* ------------------------------------------------------------------ deferral */

/* The grid's part of defers_dw (below): a dW GEMM task is deferred only where a later dX
 * reduction can hide it (overlap_all_reduce, a tensor-parallel grid) and no depth
 * reduce-scatter follows it. */
static int defers_gemm_on(const axc_grid *g, const axc_linear_desc *d)
{
    return d->defer_dw_gemm && d->overlap_all_reduce && g->G_d == 1 && g->G_r * g->G_c > 1;
}

int axc_linear_defers(const axc_grid *g, const axc_linear_desc *d, int facts)
{
    if (facts & AXC_LINEAR_HOLD)
        return 1;
    if (facts & AXC_LINEAR_MICROBATCH)
        return 0;
    return (d->overlap_reduce_scatter && g->G_d > 1) || (d->overlap_data && g->G_data > 1) ||
           defers_gemm_on(g, d);
}

int axc_linear_self_contained(const axc_comm *comm, const axc_linear_desc *d, int device)
{
    const axc_grid *g = axc_comm_grid(comm);
    return !d->own_codecs && !axc_linear_defers(g, d, 0) && !(d->scheduled && g->G_d > 1) &&
           !(d->dtype == AXC_DT_F32 && dw_error_feedback(comm, d, device));
}

/* ------------------------------------------------------------------ deferred dW GEMM */

/* A layer's dW GEMM, run later by the scheduler: what it reads and writes, copied out of the
 * call (the caller keeps the tensors alive, axc_linear_io.task_number). Only with Gd == 1, so
 * no collective follows it. */
typedef struct dw_task {
    axc_comm *comm;
    axc_linear_desc d;
    axc_linear_io io;
    axc_linear_shapes s;
    bwd_bufs w;
    const void *dy, *x;
    int64_t rows;
} dw_task;

static axc_status dw_task_run(void *arg)
{
    dw_task *t = arg;
    ctx c = {t->comm, &t->d, &t->io, t->s, axc_dtype_size(t->d.dtype)};
    return dw_gemm(&c, &t->w, t->dy, t->x, t->rows);
}

/* Whether this backward hands its dW GEMM to the scheduler. Only where a later dX reduction can
 * hide it (overlap_all_reduce, a tensor-parallel grid: else nothing runs the queue before the
 * end of backward, and the tensors it reads pile up), and not when a depth reduce-scatter
 * follows it, which should start as early as it can (defers_gemm_on, which
 * axc_linear_defers uses too); nor without dX (no reduction in this layer: the layer then
 * computes dW in the call, which the caller's deferred bookkeeping allows). */
static int defers_dw(const ctx *c)
{
    return c->io->defer && !c->io->skip_dx && !c->io->hold_result &&
           defers_gemm_on(axc_comm_grid(c->comm), c->d);
}

static axc_status dw_defer(ctx *c, bwd_bufs *w, const void *dy, const void *x, int64_t rows)
{
    dw_task *t = malloc(sizeof *t);
    if (!t)
        return axc_fail(AXC_ERR_NOMEM, "Linear: out of memory deferring the dW GEMM");
    *t = (dw_task){c->comm, *c->d, *c->io, c->s, *w, dy, x, rows};
    t->io.task_number = NULL;
    return axc_sched_add_task(c->io->sched, (axc_sched_task){dw_task_run, free, t},
                              c->io->task_number);
}

/* The rest of a backward whose dW is deferred (so overlap_all_reduce is on): db; then, when
 * `flush` (a reduction of this layer is in flight), the queued dW GEMMs (earlier layers' and
 * this one's) run under it; then pending[0..npending) completes. `flush` is decided by the
 * grid and the knobs, not by timing, so the queue runs at the same points on every rank. */
static axc_status bias_flush_finish(ctx *c, const void *dy, int64_t rows, int flush,
                                    axc_work **pending, int64_t npending)
{
    axc_status st = bias_grad(c, dy, rows);
    if (st == AXC_OK && flush)
        st = axc_sched_run_tasks(c->io->sched);
    return finish_all(pending, npending, st);
}

/* The backward after the weight is gathered (`wt`). */
static axc_status backward_body(ctx *pc, bwd_bufs *pw, const void *wt)
{
    ctx c = *pc;
    bwd_bufs w = *pw;
    const axc_linear_desc *d = c.d;
    const axc_linear_io *io = c.io;
    const axc_linear_shapes *s = &c.s;
    int64_t rows = d->layout == AXC_LAYOUT_EASY ? io->t_max : io->rows;
    int64_t Kl = s->k_local, Nl = s->n_local, K = d->in_features, N = d->out_features;

    if (d->layout == AXC_LAYOUT_EXPERT) {
        /* dX = dY W, summed over the gout group: with overlap, in row chunks whose all-reduces
         * run while the next chunk and then dW compute */
        axc_work *ar[64] = {0};
        int64_t n = 1;
        axc_status st = AXC_OK;
        if (io->skip_dx) { /* the input needs no gradient */
            n = 0;
        } else if (s->gout_size == 1) {
            st = gemm(&c, 0, 0, rows, Kl, Nl, io->dy, Nl, wt, Kl, io->dx, Kl, NULL);
        } else {
            n = reduce_chunks(&c, rows, Kl);
            st = gemm_reduce_chunks(&c, n, rows, 0, Kl, Nl, io->dy, wt, io->dx, NULL, s->gout, ar);
            if (!d->overlap_all_reduce) {
                st = finish_all(ar, n, st);
            } else if (io->hold_result) { /* the previous layer's backward awaits dx */
                st = hold_all(&c, ar, n, io->dx, rows * Kl, st);
                n = 0;
            }
        }
        if (defers_dw(&c)) {
            if (st == AXC_OK)
                st = dw_defer(&c, &w, io->dy, io->x, rows);
            if (st != AXC_OK)
                return finish_all(ar, n, st);
            return bias_flush_finish(&c, io->dy, rows, s->gout_size > 1, ar, n);
        }
        if (st == AXC_OK)
            st = dw_gemm(&c, &w, io->dy, io->x, rows);
        if (st != AXC_OK)
            return finish_all(ar, n, st);
        return dw_finish(&c, &w, io->dy, rows, ar, n);
    }

    int G_in = s->gin_size, G_out = s->gout_size;
    int64_t grows = G_out * rows, P_rows = G_in * grows;
    /* dY's output block k, for my tokens, goes to gout peer k (padded rows are zero) */
    for (int k = 0; k < G_out; k++) {
        void *piece = at(w.dypack, k * rows * Nl, c.es);
        if (io->rows > 0) /* (no rows: dy may be NULL) */
            AXC_TRY(copy_rows(&c, piece, Nl, at((void *)io->dy, k * Nl, c.es), N, Nl,
                              io->rows));
        if (rows > io->rows)
            AXC_TRY(axc_zero(io->device, io->stream, at(piece, io->rows * Nl, c.es),
                             (size_t)((rows - io->rows) * Nl) * c.es));
    }
    const void *dyr, *dye;
    AXC_TRY(through(&c, s->gout, AXC_COLL_ALL_TO_ALL, w.dypack, w.dyr, rows * Nl, &dyr));
    AXC_TRY(through(&c, s->gin, AXC_COLL_ALL_GATHER, dyr, w.dye, grows * Nl, &dye));
    /* dye rows match `saved`: (gin source, gout source, token) */
    if (io->skip_dx) { /* the input needs no gradient: dW and db only (never deferred) */
        AXC_TRY(dw_gemm(&c, &w, dye, io->saved, P_rows));
        return dw_finish(&c, &w, dye, P_rows, NULL, 0);
    }
    AXC_TRY(gemm(&c, 0, 0, P_rows, Kl, Nl, dye, Nl, wt, Kl, w.dxe, Kl, NULL));
    /* regroup rows by gout source so the reduce-scatter over gout hands each its tokens */
    const void *dxperm = w.dxe;
    if (G_out > 1 && G_in > 1) {
        for (int i = 0; i < G_in; i++)
            for (int k = 0; k < G_out; k++)
                AXC_TRY(copy_rows(&c, at(w.dxperm, ((int64_t)k * G_in + i) * rows * Kl, c.es), Kl,
                                  at(w.dxe, ((int64_t)i * G_out + k) * rows * Kl, c.es), Kl, Kl,
                                  rows));
        dxperm = w.dxperm;
    }
    /* dX's reduce-scatter over gout runs while dW computes (with overlap); the all-to-all over
     * gin needs its result, and runs while the depth reduce-scatter and db proceed */
    const void *dxr = dxperm;
    axc_work *rs = NULL, *a2a = NULL;
    if (G_out > 1) {
        AXC_TRY(coll_start(&c, s->gout, AXC_COLL_REDUCE_SCATTER, dxperm, w.dxr, G_in * rows * Kl,
                           &rs));
        dxr = w.dxr;
        if (!d->overlap_all_reduce)
            AXC_TRY(coll_finish(&rs, AXC_OK));
    }
    /* deferred dW: the queued GEMMs run under the first reduction waited for */
    int defers = defers_dw(&c), flush_rs = defers && G_out > 1;
    axc_status st = defers ? dw_defer(&c, &w, dye, io->saved, P_rows)
                           : dw_gemm(&c, &w, dye, io->saved, P_rows);
    if (st == AXC_OK && flush_rs)
        st = axc_sched_run_tasks(io->sched);
    st = coll_finish(&rs, st);
    /* dxr: (gin source, token) of my gin group, my input block; send each its tokens */
    const void *dxrecv = dxr;
    if (st == AXC_OK && G_in > 1) {
        st = coll_start(&c, s->gin, AXC_COLL_ALL_TO_ALL, dxr, w.dxrecv, rows * Kl, &a2a);
        dxrecv = w.dxrecv;
        if (!d->overlap_all_reduce)
            st = coll_finish(&a2a, st);
    }
    if (st != AXC_OK)
        st = coll_finish(&a2a, st);
    else if (defers)
        st = bias_flush_finish(&c, dye, P_rows, !flush_rs && G_in > 1, &a2a, 1);
    else
        st = dw_finish(&c, &w, dye, P_rows, &a2a, 1);
    for (int i = 0; i < G_in && st == AXC_OK && io->rows > 0; i++) /* (no rows: dx is NULL) */
        st = copy_rows(&c, at(io->dx, i * Kl, c.es), K, at((void *)dxrecv, i * rows * Kl, c.es),
                       Kl, Kl, io->rows);
    return st;
}

axc_status axc_linear_backward(axc_comm *comm, const axc_linear_desc *d, const axc_linear_io *io)
{
    ctx c = {comm, d, io, {0}, axc_dtype_size(d->dtype)};
    int64_t rows = d->layout == AXC_LAYOUT_EASY ? io->t_max : io->rows;
    AXC_TRY(axc_linear_shapes_for(comm, d, rows, &c.s));
    if (io->task_number)
        *io->task_number = 0;
    if ((io->defer || io->hold_result) && !io->sched)
        return axc_fail(AXC_ERR_STATE, "Linear: deferred backward without a scheduler");
    bump b = {io->workspace, 0, c.es};
    bwd_bufs w;
    layout_bwd(d, &c.s, rows, &b, &w);
    const void *wt;
    int held;
    AXC_TRY(gather_weight(&c, AXC_PHASE_BWD, w.wfull, &wt, &held));
    axc_status st = await_on_error(&c, release_weight(&c, held, backward_body(&c, &w, wt)));
    if (st != AXC_OK && io->task_number && *io->task_number) {
        /* the caller frees what this call's task reads when the call fails: run the queue now
         * (dW GEMMs only, no collectives: safe on any rank), keeping the first error */
        char msg[512];
        snprintf(msg, sizeof msg, "%s", axc_last_error());
        (void)axc_sched_run_tasks(io->sched);
        *io->task_number = 0;
        return axc_fail(st, "%s", msg);
    }
    return st;
}

/* ------------------------------------------------------------------ token counts */

/* One int64 per intra rank all-gathered in `device` memory (-1: host), and waited for. */
static axc_status allgather_count(axc_comm *comm, int device, void *stream, const int64_t *send,
                                  int64_t *recv)
{
    axc_coll a = {.kind = AXC_COLL_ALL_GATHER, .send = send, .recv = recv, .count = 1,
                  .dtype = AXC_DT_I64, .device = device, .stream = stream};
    axc_work *w = NULL;
    return coll_finish(&w, axc_comm_start(comm, AXC_GROUP_INTRA, &a, &w));
}

/* The all-gather of one count per intra rank through device memory (NCCL-only jobs). */
static axc_status gather_counts_on_device(axc_comm *comm, int device, void *stream, int64_t t,
                                          int64_t *counts, int n)
{
    const axc_cuda_api *cu = NULL;
    int prev = -1;
    AXC_TRY(axc_cuda_device_enter(device, &cu, &prev, "Linear token counts"));
    size_t bytes = (size_t)(n + 1) * sizeof(int64_t);
    int64_t *buf = NULL; /* [0]: this rank's count, [1..n]: everyone's */
    /* stream-ordered when the runtime has it: cudaMalloc/cudaFree would synchronise the device
     * at every forward */
    axc_status st = cu->MallocAsync
                        ? axc_cuda_check(cu->MallocAsync((void **)&buf, bytes, stream),
                                         "cudaMallocAsync (token counts)")
                        : axc_cuda_check(cu->Malloc((void **)&buf, bytes),
                                         "cudaMalloc (token counts)");
    if (st == AXC_OK)
        st = axc_cuda_check(cu->MemcpyAsync(buf, &t, sizeof t, AXC_CUDA_MEMCPY_H2D, stream),
                            "cudaMemcpyAsync (token count)");
    if (st == AXC_OK) /* the stream waits for the gather */
        st = allgather_count(comm, device, stream, buf, buf + 1);
    if (st == AXC_OK)
        st = axc_cuda_check(cu->MemcpyAsync(counts, buf + 1, (size_t)n * sizeof(int64_t),
                                            AXC_CUDA_MEMCPY_D2H, stream),
                            "cudaMemcpyAsync (token counts)");
    if (st == AXC_OK)
        st = axc_cuda_check(cu->StreamSynchronize(stream), "cudaStreamSynchronize (token counts)");
    if (buf) {
        axc_status fs = cu->FreeAsync ? axc_cuda_check(cu->FreeAsync(buf, stream),
                                                       "cudaFreeAsync (token counts)")
                                      : axc_cuda_check(cu->Free(buf), "cudaFree (token counts)");
        st = st == AXC_OK ? fs : st;
    }
    return axc_cuda_device_leave(cu, device, prev, st);
}

axc_status axc_linear_plane_tokens(axc_comm *comm, const axc_linear_desc *d, int64_t t,
                                   int device, void *stream, int64_t *t_max)
{
    AXC_TRY(axc_linear_check(comm, d));
    const axc_grid *g = axc_comm_grid(comm);
    int n = axc_grid_group_size(g, AXC_GROUP_INTRA);
    int64_t counts[4096];
    if (n > 4096)
        return axc_fail(AXC_ERR_INVALID, "intra group of %d ranks exceeds 4096", n);
    for (int i = 0; i < n; i++) /* what a skipped gather (AXONN_C_BENCH_SKIP=comm) leaves */
        counts[i] = t;
    if (device >= 0 && !axc_comm_host_collectives(comm))
        AXC_TRY(gather_counts_on_device(comm, device, stream, t, counts, n));
    else
        AXC_TRY(allgather_count(comm, -1, NULL, &t, counts));
    /* the plane: intra ranks with my depth index (intra = depth-major, then row, col) */
    int plane = g->G_r * g->G_c;
    int depth = axc_grid_coords(g, axc_comm_rank(comm)).depth;
    int64_t mx = 0;
    for (int i = 0; i < plane; i++)
        mx = counts[depth * plane + i] > mx ? counts[depth * plane + i] : mx;
    *t_max = mx;
    return AXC_OK;
}
