/* The CUDA calls of one Linear forward + backward, on the CPU mocks of libcudart and libcublasLt
 * (built and run by run_gemm_mock_test.sh). A world of one (grid 1x1x1, the shm backend, which
 * moves nothing at that size), device buffers from the mock's cudaMalloc, the calls the Python
 * layer makes per step (axc_linear_plane_tokens for the easy layout, axc_linear_forward,
 * axc_linear_backward). After one warm-up step, a step must make no host synchronisation, no
 * allocation, no cuBLASLt descriptor, layout or preference creation and no heuristic query;
 * its results must match the host computation (warm-up and counted step alike). The calls are
 * counted by API name in the mocks (MOCK_API(), mock_api_count.c) and printed per step.
 *
 *   test_linear_mock           the checks, with the table of every configuration
 *   test_linear_mock --table   only the table of the first configuration (4 tokens, 16 -> 16,
 *                              float32, bias, expert layout: what axonn_c.Linear runs at a grid
 *                              of one feature shard), for benchmarks/cuda_call_counts.sh;
 *                              the exit status still says whether the checks passed */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/cuda_rt.h"
#include "axc/gemm.h"
#include "axc/linear.h"
#include "../ctest.h"
#include "mock_api_counts.h"
#include "mock_order_check.h"

/* calls a warmed-up step must not make */
static const char *const forbidden[] = {
    "cudaStreamSynchronize",         "cudaDeviceSynchronize",
    "cudaEventSynchronize",          "cudaMalloc",
    "cudaMallocAsync",               "cudaMallocHost",
    "cudaFree",                      "cudaFreeAsync",
    "cudaFreeHost",                  "cublasLtCreate",
    "cublasLtMatmulDescCreate",      "cublasLtMatmulDescDestroy",
    "cublasLtMatrixLayoutCreate",    "cublasLtMatrixLayoutDestroy",
    "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
};
enum { N_FORBIDDEN = sizeof forbidden / sizeof forbidden[0] };

/* ------------------------------------------------------------------ a one-rank store */

static char kv_key_[128], kv_value_[256];
static size_t kv_len_;
static int kv_set_;

static axc_status kv_set(void *ctx, const char *key, const void *value, size_t len)
{
    (void)ctx;
    if (len > sizeof kv_value_)
        return axc_fail(AXC_ERR_INVALID, "value of %zu bytes for %s", len, key);
    snprintf(kv_key_, sizeof kv_key_, "%s", key);
    memcpy(kv_value_, value, len);
    kv_len_ = len;
    kv_set_ = 1;
    return AXC_OK;
}

static axc_status kv_get(void *ctx, const char *key, void *value, size_t cap, size_t *len,
                         double timeout_s)
{
    (void)ctx, (void)timeout_s;
    if (!kv_set_ || strcmp(key, kv_key_) != 0 || kv_len_ > cap)
        return axc_fail(AXC_ERR_STATE, "key %s was not set", key);
    memcpy(value, kv_value_, kv_len_);
    *len = kv_len_;
    return AXC_OK;
}

/* ------------------------------------------------------------------ one configuration */

typedef struct config {
    const char *name;
    axc_layout layout;
    axc_dtype dtype;
    int has_bias;
    int64_t rows, in, out;
} config;

typedef struct bufs {
    void *x, *w, *bias, *y, *saved, *dy, *dx, *dw, *db, *ws;
} bufs;

static const axc_cuda_api *cu;
static api_counts counts;

static void *dev_alloc(int64_t elems, size_t es)
{
    void *p = NULL;
    CHECK_OK(axc_cuda_check(cu->Malloc(&p, (size_t)(elems > 0 ? elems : 1) * es), "cudaMalloc"));
    return p;
}

static float bf_to_f(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* host values k/8 - 2 (exact in bf16), uploaded to device memory on the stream */
static void upload(axc_dtype dt, void *dev, float *host, int64_t n, int seed)
{
    size_t es = axc_dtype_size(dt);
    unsigned char *buf = malloc((size_t)n * es);
    for (int64_t i = 0; i < n; i++) {
        host[i] = (float)((i * 7 + seed * 3) % 33) / 8.0f - 2.0f;
        if (dt == AXC_DT_F32) {
            memcpy(buf + i * 4, &host[i], 4);
        } else {
            uint32_t x;
            memcpy(&x, &host[i], 4);
            uint16_t h = (uint16_t)(x >> 16);
            memcpy(buf + i * 2, &h, 2);
        }
    }
    CHECK_OK(axc_cuda_check(cu->MemcpyAsync(dev, buf, (size_t)n * es, AXC_CUDA_MEMCPY_H2D, NULL),
                            "cudaMemcpyAsync (H2D)"));
    CHECK_OK(axc_cuda_check(cu->StreamSynchronize(NULL), "cudaStreamSynchronize"));
    free(buf);
}

/* whether the device buffer holds `want` (n values) within the dtype's precision */
static int matches(axc_dtype dt, const void *dev, const double *want, int64_t n, const char *what,
                   const char *cfg)
{
    size_t es = axc_dtype_size(dt);
    unsigned char *buf = malloc((size_t)n * es);
    CHECK_OK(axc_cuda_check(cu->MemcpyAsync(buf, dev, (size_t)n * es, AXC_CUDA_MEMCPY_D2H, NULL),
                            "cudaMemcpyAsync (D2H)"));
    CHECK_OK(axc_cuda_check(cu->StreamSynchronize(NULL), "cudaStreamSynchronize"));
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++) {
        float got;
        if (dt == AXC_DT_F32) {
            memcpy(&got, buf + i * 4, 4);
        } else {
            uint16_t h;
            memcpy(&h, buf + i * 2, 2);
            got = bf_to_f(h);
        }
        double tol = (dt == AXC_DT_F32 ? 1e-5 : 1.0 / 64) * (fabs(want[i]) + 1);
        if (fabs(got - want[i]) > tol) {
            fprintf(stderr, "%s: %s[%lld] = %g, expected %g\n", cfg, what, (long long)i, got,
                    want[i]);
            ok = 0;
        }
    }
    free(buf);
    return ok;
}

/* One step as the Python layer makes it: the plane's token count (easy layout), forward,
 * backward. */
static axc_status step(axc_comm *comm, const axc_linear_desc *d, const config *c, const bufs *b)
{
    int64_t t_max = c->rows;
    if (c->layout == AXC_LAYOUT_EASY)
        AXC_TRY(axc_linear_plane_tokens(comm, d, c->rows, 0, NULL, &t_max));
    axc_linear_io io = {.device = 0, .stream = NULL, .rows = c->rows, .t_max = t_max, .x = b->x,
                        .w = b->w, .bias = c->has_bias ? b->bias : NULL, .y = b->y,
                        .saved = b->saved, .dy = b->dy, .dx = b->dx, .dw = b->dw,
                        .db = c->has_bias ? b->db : NULL, .workspace = b->ws, .layer = -1};
    AXC_TRY(axc_linear_forward(comm, d, &io));
    return axc_linear_backward(comm, d, &io);
}

/* y = x W^T + b, dx = dy W, dw = dy^T x, db = column sums of dy, against the host */
static int results_match(const config *c, const bufs *b, const float *x, const float *w,
                         const float *bias, const float *dy)
{
    int64_t R = c->rows, K = c->in, N = c->out;
    double *y = calloc((size_t)(R * N), sizeof *y), *dx = calloc((size_t)(R * K), sizeof *dx);
    double *dw = calloc((size_t)(N * K), sizeof *dw), *db = calloc((size_t)N, sizeof *db);
    for (int64_t r = 0; r < R; r++)
        for (int64_t n = 0; n < N; n++) {
            y[r * N + n] = c->has_bias ? bias[n] : 0;
            for (int64_t k = 0; k < K; k++) {
                y[r * N + n] += (double)x[r * K + k] * w[n * K + k];
                dx[r * K + k] += (double)dy[r * N + n] * w[n * K + k];
                dw[n * K + k] += (double)dy[r * N + n] * x[r * K + k];
            }
            db[n] += dy[r * N + n];
        }
    int ok = matches(c->dtype, b->y, y, R * N, "y", c->name) &&
             matches(c->dtype, b->dx, dx, R * K, "dx", c->name) &&
             matches(c->dtype, b->dw, dw, N * K, "dw", c->name) &&
             (!c->has_bias || matches(c->dtype, b->db, db, N, "db", c->name));
    free(y), free(dx), free(dw), free(db);
    return ok;
}

static void print_table(const config *c)
{
    printf("API: calls per Linear forward+backward (CUDA mocks, grid 1x1x1, %s, after a warm-up)\n",
           c->name);
    int total = 0;
    for (int i = 0; i < counts.n(); i++) {
        const char *api = counts.name(i);
        int k = counts.calls(api);
        if (k) {
            printf("  %-40s %d\n", api, k);
            total += k;
        }
    }
    printf("  %-40s %d\n", "total", total);
}

/* Runs `c`: a warm-up step, then a counted one, whose table it prints (unless quiet). */
static void run_config(axc_comm *comm, const config *c, int quiet)
{
    axc_linear_desc d = {.in_features = c->in, .out_features = c->out, .has_bias = c->has_bias,
                         .layout = c->layout, .dtype = c->dtype, .fwd_chunks = 1};
    axc_linear_shapes s;
    CHECK_OK(axc_linear_shapes_for(comm, &d, c->rows, &s));
    size_t es = axc_dtype_size(c->dtype);
    int64_t R = c->rows, K = c->in, N = c->out;
    bufs b = {dev_alloc(R * K, es),         dev_alloc(s.shard, es),
              dev_alloc(N, es),             dev_alloc(R * N, es),
              dev_alloc(s.saved_rows * s.saved_cols, es), dev_alloc(R * N, es),
              dev_alloc(R * K, es),         dev_alloc(s.shard, es),
              dev_alloc(N, es),             dev_alloc(s.workspace_elems, es)};
    float *x = malloc(sizeof(float) * (size_t)(R * K)), *w = malloc(sizeof(float) * (size_t)(N * K));
    float *bias = malloc(sizeof(float) * (size_t)N), *dy = malloc(sizeof(float) * (size_t)(R * N));
    upload(c->dtype, b.x, x, R * K, 1);
    upload(c->dtype, b.w, w, N * K, 2);
    upload(c->dtype, b.bias, bias, N, 3);
    upload(c->dtype, b.dy, dy, R * N, 4);

    CHECK_OK(step(comm, &d, c, &b)); /* warm-up: workspaces, constant vectors, plans */
    CHECK(results_match(c, &b, x, w, bias, dy));
    counts.reset();
    CHECK_OK(step(comm, &d, c, &b));
    if (!quiet)
        print_table(c);
    int bad = 0;
    for (int i = 0; i < N_FORBIDDEN; i++)
        if (counts.calls(forbidden[i])) {
            fprintf(stderr, "%s: a warmed-up forward+backward called %s %d time(s)\n", c->name,
                    forbidden[i], counts.calls(forbidden[i]));
            bad++;
        }
    CHECK(bad == 0);
    /* forward, dX, dW and (with a bias) db: one launch each */
    CHECK(counts.calls("cublasLtMatmul") == 3 + c->has_bias);
    CHECK(results_match(c, &b, x, w, bias, dy));
    void **all = (void **)&b;
    for (size_t i = 0; i < sizeof b / sizeof(void *); i++)
        CHECK_OK(axc_cuda_check(cu->Free(all[i]), "cudaFree"));
    free(x), free(w), free(bias), free(dy);
}

static void preload(const char *env)
{
    const char *p = getenv(env);
    if (!(p && *p && dlopen(p, RTLD_NOW | RTLD_GLOBAL)))
        fprintf(stderr, "cannot preload %s=%s: %s\n", env, p ? p : "(unset)", dlerror());
}

int main(int argc, char **argv)
{
    int table_only = argc > 1 && strcmp(argv[1], "--table") == 0;
    preload("AXC_TEST_CUDART");
    preload("AXC_TEST_CUBLASLT");
    CHECK(axc_gemm_cuda_compiled() == 1);
    CHECK_OK(axc_cuda_load(&cu));
    int have_counts = api_counts_find(&counts);
    CHECK(have_counts);
    if (!cu || !have_counts)
        return ctest_summary("test_linear_mock");
    axc_comm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    CHECK_OK(axc_grid_make(&cfg.grid, 1, 1, 1, 1, 1, 1));
    cfg.local_world_size = 1;
    cfg.cuda_device = -1; /* the shm backend alone: nothing moves in a world of one */
    cfg.backend = "shm";
    cfg.job_id = "test_linear_mock";
    cfg.timeout_s = 60;
    cfg.bootstrap = (axc_bootstrap){NULL, kv_set, kv_get};
    axc_comm *comm = NULL;
    CHECK_OK(axc_comm_create(&comm, &cfg));
    if (!comm)
        return ctest_summary("test_linear_mock");
    /* first (the table's): what the Python layer runs at a grid of one feature shard, where
     * it takes the expert layout (both layouts hold full features there; the expert one makes
     * no row copies) */
    const config configs[] = {
        {"expert layout, 4 tokens, 16 -> 16, float32, bias", AXC_LAYOUT_EXPERT, AXC_DT_F32, 1, 4,
         16, 16},
        {"easy layout, 4 tokens, 16 -> 16, float32, bias", AXC_LAYOUT_EASY, AXC_DT_F32, 1, 4, 16,
         16},
        {"easy layout, 4 tokens, 16 -> 16, bfloat16, bias", AXC_LAYOUT_EASY, AXC_DT_BF16, 1, 4,
         16, 16},
        {"easy layout, 8 tokens, 24 -> 40, float32, no bias", AXC_LAYOUT_EASY, AXC_DT_F32, 0, 8,
         24, 40},
    };
    int n = table_only ? 1 : (int)(sizeof configs / sizeof configs[0]);
    for (int i = 0; i < n; i++)
        run_config(comm, &configs[i], 0);
    axc_comm_destroy(comm);
    /* teardown (what finalize calls): every cached plan's descriptor and three layouts are
     * destroyed (also under LeakSanitizer) */
    int cached = axc_cublaslt_cached_plans(NULL);
    counts.reset();
    CHECK_OK(axc_gemm_release());
    CHECK(cached > 0 && axc_cublaslt_cached_plans(NULL) == 0);
    CHECK(counts.calls("cublasLtMatmulDescDestroy") == cached &&
          counts.calls("cublasLtMatrixLayoutDestroy") == 3 * cached);
    counts.reset(); /* a second teardown finds nothing to destroy */
    CHECK_OK(axc_gemm_release());
    CHECK(counts.calls("cublasLtMatmulDescDestroy") == 0);
    order_checker oc;
    if (order_checker_find(&oc))
        CHECK(order_violations(&oc, "test_linear_mock") == 0);
    if (table_only)
        return ctest_failed_ ? 1 : 0;
    return ctest_summary("test_linear_mock");
}
