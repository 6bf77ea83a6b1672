/* The cuBLASLt path of the GEMM layer against CPU mocks of libcudart and libcublasLt (built and
 * run by run_gemm_mock_test.sh): the row-major -> column-major mapping for every transpose
 * combination and padded leading dimensions, alpha/beta, the bias epilogue, the bias gradient
 * through the ones vector, K == 0 through the zeros vector, the algorithm cache, copies/fills.
 * The workspaces and constant vectors are the mock's device memory, so its stream-order checker
 * sees their use; a second stream grows the ones vector that the first then reads, and the
 * checker must find no violation (every stream's GEMMs after the vector is complete), also when
 * a new stream gets a destroyed one's address (its own workspace: cudaStreamGetId). */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/cuda_rt.h"
#include "axc/gemm.h"
#include "../ctest.h"
#include "mock_api_counts.h"
#include "mock_order_check.h"

static void *lt_lib;

static void preload(const char *env, void **out)
{
    const char *p = getenv(env);
    void *h = p && *p ? dlopen(p, RTLD_NOW | RTLD_GLOBAL) : NULL;
    if (!h)
        fprintf(stderr, "cannot preload %s=%s: %s\n", env, p ? p : "(unset)", dlerror());
    if (out)
        *out = h;
}

/* cudaStreamDestroy returns while the stream's work may still run, and a stream created next
 * may get the same address: lt_workspace() tells them apart by cudaStreamGetId, so the new
 * stream does not share the workspace the old one's GEMM may still use (it was keyed by the
 * handle alone before: a race the checker reported). Here the mock is told that the handle was
 * destroyed and made again (malloc's reuse is not to be relied on). In torch's use streams come
 * from its pool and are never destroyed. */
static void check_reused_stream_handle(const order_checker *oc)
{
    void *destroyed = dlsym(RTLD_DEFAULT, "mock_order_stream_destroyed");
    void *created = dlsym(RTLD_DEFAULT, "mock_order_stream_created");
    void (*destroy)(void *), (*create)(void *);
    memcpy(&destroy, &destroyed, sizeof destroyed);
    memcpy(&create, &created, sizeof created);
    CHECK(destroyed && created);
    if (!destroyed || !created)
        return;
    CHECK(order_violations(oc, "test_gemm_mock (before the probe)") == 0);
    static char handle; /* one address, two streams in turn */
    static float a[64], b[64], c[64];
    axc_gemm_args g = {.device = 0, .dtype = AXC_DT_F32, .M = 3, .N = 4, .K = 5, .A = a,
                       .lda = 5, .B = b, .ldb = 4, .C = c, .ldc = 4, .alpha = 1.0f,
                       .stream = &handle};
    create(&handle);
    CHECK_OK(axc_gemm(&g));
    destroy(&handle); /* cudaStreamDestroy: its GEMM may still be running */
    create(&handle);  /* cudaStreamCreate returns the same address */
    CHECK_OK(axc_gemm(&g));
    CHECK(order_violations(oc, "test_gemm_mock (a GEMM on a new stream at a destroyed stream's "
                               "address)") == 0);
    oc->reset();
}

static int counter(const char *name)
{
    int *p = lt_lib ? dlsym(lt_lib, name) : NULL;
    return p ? *p : -1;
}

static float bf(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static double get(axc_dtype dt, const void *p, int64_t i)
{
    return dt == AXC_DT_F32 ? ((const float *)p)[i] : bf(((const uint16_t *)p)[i]);
}

static void fill(axc_dtype dt, void *p, int64_t n, uint64_t *s)
{
    for (int64_t i = 0; i < n; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        float v = (float)((int)((*s >> 33) % 31) - 15) / 8.0f;
        if (dt == AXC_DT_F32) {
            ((float *)p)[i] = v;
        } else {
            uint32_t x;
            memcpy(&x, &v, 4);
            ((uint16_t *)p)[i] = (uint16_t)(x >> 16); /* exact: few mantissa bits */
        }
    }
}

static int check_one(axc_dtype dt, int64_t M, int64_t N, int64_t K, int ta, int tb, int64_t pad,
                     float alpha, float beta, int with_bias)
{
    size_t es = axc_dtype_size(dt);
    axc_gemm_args g = {.device = 0, .stream = NULL, .dtype = dt, .trans_a = ta, .trans_b = tb,
                       .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta};
    int64_t a_rows = ta ? K : M, b_rows = tb ? N : K;
    g.lda = (ta ? M : K) + pad;
    g.ldb = (tb ? K : N) + pad + 1;
    g.ldc = N + pad + 2;
    if (g.lda < 1)
        g.lda = 1;
    uint64_t s = (uint64_t)(M * 131 + N * 17 + K * 7 + ta * 3 + tb);
    void *A = calloc((size_t)((a_rows ? a_rows : 1) * g.lda), es);
    void *B = calloc((size_t)((b_rows ? b_rows : 1) * g.ldb), es);
    void *C = malloc((size_t)(M * g.ldc) * es), *C0 = malloc((size_t)(M * g.ldc) * es);
    void *bias = malloc((size_t)N * es);
    fill(dt, A, a_rows * g.lda, &s);
    fill(dt, B, b_rows * g.ldb, &s);
    fill(dt, C, M * g.ldc, &s);
    fill(dt, bias, N, &s);
    memcpy(C0, C, (size_t)(M * g.ldc) * es);
    g.A = A, g.B = B, g.C = C, g.bias = with_bias ? bias : NULL;
    axc_status st = axc_gemm(&g);
    int ok = st == AXC_OK;
    if (!ok)
        fprintf(stderr, "axc_gemm failed: %s\n", axc_last_error());
    double tol = dt == AXC_DT_F32 ? 1e-6 : 1.0 / 128;
    for (int64_t i = 0; ok && i < M; i++)
        for (int64_t j = 0; j < g.ldc; j++) {
            double want;
            if (j < N) {
                double acc = 0;
                for (int64_t k = 0; k < K; k++)
                    acc += get(dt, A, ta ? k * g.lda + i : i * g.lda + k) *
                           get(dt, B, tb ? j * g.ldb + k : k * g.ldb + j);
                want = alpha * acc + (beta != 0 ? beta * get(dt, C0, i * g.ldc + j) : 0) +
                       (with_bias ? get(dt, bias, j) : 0);
            } else {
                want = get(dt, C0, i * g.ldc + j); /* padding untouched */
            }
            double got = get(dt, C, i * g.ldc + j);
            if (fabs(got - want) > tol * (fabs(want) + 1)) {
                fprintf(stderr, "mismatch dt=%d M=%lld N=%lld K=%lld ta=%d tb=%d (%lld,%lld): "
                                "%g vs %g\n",
                        (int)dt, (long long)M, (long long)N, (long long)K, ta, tb, (long long)i,
                        (long long)j, got, want);
                ok = 0;
                break;
            }
        }
    free(A), free(B), free(C), free(C0), free(bias);
    return ok;
}

/* ------------------------------------------------------------------ the plan cache */

static api_counts calls_;

static int *lt_knob(const char *name)
{
    return lt_lib ? dlsym(lt_lib, name) : NULL;
}

/* plans made and not destroyed since the last reset of the counts, of which `failed_layouts`
 * layout creations failed (the mock counts calls) */
static int plans_alive(int failed_layouts)
{
    int d = calls_.calls("cublasLtMatmulDescCreate") - calls_.calls("cublasLtMatmulDescDestroy");
    int l = calls_.calls("cublasLtMatrixLayoutCreate") - failed_layouts -
            calls_.calls("cublasLtMatrixLayoutDestroy");
    int p = calls_.calls("cublasLtMatmulPreferenceCreate") -
            calls_.calls("cublasLtMatmulPreferenceDestroy");
    CHECK(l == 3 * d && p == 0); /* three layouts per descriptor, no preference kept */
    return d;
}

/* A small GEMM with a bias, checked: C[M x 2] = A[M x 2] B[2 x 2] + bias. A, B and C are
 * 256-byte aligned (the key holds the pointers' alignments). */
static int small_gemm(void *stream, int64_t M, const float *bias)
{
    size_t bytes = (sizeof(float) * (size_t)(2 * M) + 255) / 256 * 256;
    float *a = aligned_alloc(256, bytes), *c = aligned_alloc(256, bytes);
    _Alignas(256) static const float b[4] = {1, 2, 3, 4};
    for (int64_t i = 0; i < 2 * M; i++)
        a[i] = (float)(i % 5);
    axc_gemm_args g = {.device = 0, .stream = stream, .dtype = AXC_DT_F32, .M = M, .N = 2, .K = 2,
                       .A = a, .lda = 2, .B = b, .ldb = 2, .C = c, .ldc = 2, .alpha = 1.0f,
                       .bias = bias};
    int ok = axc_gemm(&g) == AXC_OK;
    if (!ok)
        fprintf(stderr, "small_gemm: %s\n", axc_last_error());
    for (int64_t i = 0; ok && i < M; i++)
        for (int j = 0; j < 2; j++)
            ok &= c[i * 2 + j] == a[i * 2] * b[j] + a[i * 2 + 1] * b[2 + j] + bias[j];
    free(a), free(c);
    return ok;
}

typedef struct thread_arg {
    char stream; /* its address: the thread's stream */
    float bias[2];
    int ok;
} thread_arg;

static pthread_barrier_t start_;

static void *gemm_thread(void *p)
{
    thread_arg *t = p;
    t->ok = 1;
    pthread_barrier_wait(&start_); /* all at once: they contend for the plan from the start */
    for (int i = 0; i < 40; i++) /* one shape: the threads contend for the same plan */
        t->ok &= small_gemm(&t->stream, 3, t->bias);
    return NULL;
}

/* The descriptors and the heuristic's algorithm are built once per key: warmed-up GEMMs with
 * other pointers (a bias too) make nothing; the cache stays within its bound, evicting and
 * destroying; a failed build (no algorithm, a layout that cannot be made) leaves nothing
 * cached and nothing alive; threads running one shape each get a plan of their own (each sets
 * its own bias pointer); axc_cublaslt_release destroys every plan. */
static void test_plan_cache(void)
{
    int *no_algo = lt_knob("mock_lt_no_algo"), *fail_layout = lt_knob("mock_lt_fail_layout_at");
    int *matmul_us = lt_knob("mock_lt_matmul_us");
    CHECK(api_counts_find(&calls_) && no_algo && fail_layout && matmul_us);
    if (!calls_.calls || !no_algo || !fail_layout || !matmul_us)
        return;
    int capacity = 0;
    CHECK_OK(axc_cublaslt_release());
    CHECK(axc_cublaslt_cached_plans(&capacity) == 0 && capacity == 512);
    calls_.reset();
    _Alignas(256) static float bias1[2] = {0.5f, -1}, bias2[2] = {2, 0.25f};
    _Alignas(256) static float bias3[4] = {0, 0, 7, 8};
    /* per call: the bias pointer, nothing else */
    CHECK(small_gemm(NULL, 3, bias1));
    CHECK(plans_alive(0) == 1 && calls_.calls("cublasLtMatmulAlgoGetHeuristic") == 1);
    calls_.reset();
    CHECK(small_gemm(NULL, 3, bias2) && small_gemm(NULL, 3, bias1));
    CHECK(calls_.calls("cublasLtMatmulDescCreate") == 0 &&
          calls_.calls("cublasLtMatmulAlgoGetHeuristic") == 0 &&
          calls_.calls("cublasLtMatmulDescSetAttribute") == 2 &&
          calls_.calls("cublasLtMatmul") == 2);
    /* a bias of another alignment (8 bytes) is another key: the heuristic was told it */
    CHECK(small_gemm(NULL, 3, bias3 + 2));
    CHECK(calls_.calls("cublasLtMatmulAlgoGetHeuristic") == 1);

    /* the bound: more keys than plans; evicted plans are destroyed */
    CHECK_OK(axc_cublaslt_release());
    calls_.reset();
    int good = 1;
    for (int64_t M = 1; M <= capacity + 100; M++)
        good &= small_gemm(NULL, M, bias1);
    CHECK(good);
    int cached = axc_cublaslt_cached_plans(NULL);
    printf("plan cache: %d keys, %d plans cached (bound %d), %d destroyed\n", capacity + 100,
           cached, capacity, calls_.calls("cublasLtMatmulDescDestroy"));
    CHECK(cached <= capacity && cached >= capacity * 3 / 4);
    CHECK(plans_alive(0) == cached && calls_.calls("cublasLtMatmulDescDestroy") >= 100);
    CHECK_OK(axc_cublaslt_release());
    CHECK(axc_cublaslt_cached_plans(NULL) == 0 && plans_alive(0) == 0);

    /* failed builds: nothing cached, nothing alive; the next call builds the plan */
    calls_.reset();
    *no_algo = 1;
    float c1[6];
    static float a1[6], b1[4];
    axc_gemm_args g = {.device = 0, .dtype = AXC_DT_F32, .M = 3, .N = 2, .K = 2, .A = a1,
                       .lda = 2, .B = b1, .ldb = 2, .C = c1, .ldc = 2, .alpha = 1.0f};
    CHECK(axc_gemm(&g) == AXC_ERR_BACKEND &&
          strstr(axc_last_error(), "cublasLtMatmulAlgoGetHeuristic"));
    *no_algo = 0;
    CHECK(axc_cublaslt_cached_plans(NULL) == 0 && plans_alive(0) == 0);
    *fail_layout = 2; /* B's */
    CHECK(axc_gemm(&g) == AXC_ERR_BACKEND &&
          strstr(axc_last_error(), "cublasLtMatrixLayoutCreate(B)"));
    CHECK(axc_cublaslt_cached_plans(NULL) == 0 && plans_alive(1) == 0);
    CHECK_OK(axc_gemm(&g));
    CHECK_OK(axc_gemm(&g));
    CHECK(axc_cublaslt_cached_plans(NULL) == 1 && plans_alive(1) == 1 &&
          calls_.calls("cublasLtMatmulAlgoGetHeuristic") == 2); /* the failed one, then this */

    /* threads on one shape, each with its own bias and stream; each launch takes 1 ms, so
     * they overlap (a plan shared by two at once would mix up their bias pointers) */
    CHECK_OK(axc_cublaslt_release());
    calls_.reset();
    *matmul_us = 1000;
    enum { THREADS = 4 };
    static thread_arg args[THREADS];
    pthread_t th[THREADS];
    CHECK(pthread_barrier_init(&start_, NULL, THREADS) == 0);
    for (int i = 0; i < THREADS; i++) {
        args[i].bias[0] = (float)i;
        args[i].bias[1] = (float)(10 * i);
        CHECK(pthread_create(&th[i], NULL, gemm_thread, &args[i]) == 0);
    }
    good = 1;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        good &= args[i].ok;
    }
    pthread_barrier_destroy(&start_);
    *matmul_us = 0;
    CHECK(good);
    cached = axc_cublaslt_cached_plans(NULL);
    printf("plan cache: %d threads on one shape: %d plans, %d heuristic queries\n", THREADS,
           cached, calls_.calls("cublasLtMatmulAlgoGetHeuristic"));
    CHECK(cached >= 1 && cached <= THREADS && plans_alive(0) == cached);
    CHECK_OK(axc_cublaslt_release());
    CHECK(plans_alive(0) == 0);
}

int main(void)
{
    preload("AXC_TEST_CUDART", NULL);
    preload("AXC_TEST_CUBLASLT", &lt_lib);
    CHECK(axc_gemm_cuda_compiled() == 1);
    const axc_dtype dts[2] = {AXC_DT_F32, AXC_DT_BF16};
    const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {17, 9, 33}};
    const float co[][3] = {{1, 0, 0}, {0.5f, 0, 1}, {1, 1, 0}, {-1.5f, 0.25f, 1}};
    int ok = 1, n = 0;
    for (int d = 0; d < 2; d++)
        for (int sh = 0; sh < 3; sh++)
            for (int t = 0; t < 4; t++)
                for (int pad = 0; pad < 4; pad += 3)
                    for (int c = 0; c < 4; c++, n++)
                        ok &= check_one(dts[d], shapes[sh][0], shapes[sh][1], shapes[sh][2], t & 1,
                                        t >> 1, pad, co[c][0], co[c][1], co[c][2] != 0);
    CHECK(ok);
    /* K == 0 through the zeros vector */
    CHECK(check_one(AXC_DT_F32, 4, 6, 0, 0, 0, 0, 1.0f, 0.5f, 1));
    CHECK(check_one(AXC_DT_BF16, 4, 6, 0, 1, 1, 2, 1.0f, 0.0f, 1));
    /* the algorithm cache: the same call (same shapes, same pointer alignments) asks no new
     * heuristic; a different shape does */
    {
        static float a[64], b[64], c[64];
        axc_gemm_args g = {.device = 0, .dtype = AXC_DT_F32, .M = 3, .N = 4, .K = 5, .A = a,
                           .lda = 5, .B = b, .ldb = 4, .C = c, .ldc = 4, .alpha = 1.0f};
        CHECK_OK(axc_gemm(&g));
        int h1 = counter("mock_lt_heuristics"), m1 = counter("mock_lt_matmuls");
        CHECK_OK(axc_gemm(&g));
        CHECK_OK(axc_gemm(&g));
        CHECK(counter("mock_lt_heuristics") == h1 && counter("mock_lt_matmuls") == m1 + 2);
        g.K = 4;
        g.lda = 4;
        CHECK_OK(axc_gemm(&g));
        CHECK(counter("mock_lt_heuristics") == h1 + 1);
    }

    /* bias gradient: db = column sums, through the ones vector (grows past 65536 rows) */
    const int64_t bg[][3] = {{1, 1, 1}, {7, 13, 16}, {70000, 3, 5}, {0, 4, 4}};
    for (int i = 0; i < 4; i++)
        for (int d = 0; d < 2; d++)
            for (int acc = 0; acc < 2; acc++) {
                axc_dtype dt = dts[d];
                int64_t M = bg[i][0], N = bg[i][1], ld = bg[i][2];
                size_t es = axc_dtype_size(dt);
                uint64_t s = 5;
                void *dy = malloc((size_t)((M ? M : 1) * ld) * es), *db = malloc((size_t)N * es);
                fill(dt, dy, (M ? M : 1) * ld, &s);
                fill(dt, db, N, &s);
                double *want = calloc((size_t)N, sizeof *want);
                for (int64_t j = 0; j < N; j++) {
                    for (int64_t r = 0; r < M; r++)
                        want[j] += get(dt, dy, r * ld + j);
                    want[j] += acc ? get(dt, db, j) : 0;
                }
                CHECK_OK(axc_bias_grad(0, NULL, dt, dy, M, N, ld, db, acc));
                int good = 1;
                for (int64_t j = 0; j < N; j++)
                    good &= fabs(get(dt, db, j) - want[j]) <=
                            (dt == AXC_DT_F32 ? 1e-6 : 1.0 / 128) * (fabs(want[j]) + 1);
                CHECK(good);
                free(dy), free(db), free(want);
            }

    /* a stream being captured into a CUDA graph: its workspace is allocated with the thread in
     * the relaxed capture mode (the global mode's cudaMalloc would invalidate the capture, and a
     * GEMM without one would take another algorithm than the warm-up, whose kernel CUDA loads
     * lazily inside the capture), and kept after it; a bias gradient that would have to grow
     * the ones vector is refused, naming the warm-up */
    {
        const char *rt = getenv("AXC_TEST_CUDART");
        void *h = rt ? dlopen(rt, RTLD_NOW | RTLD_NOLOAD) : NULL;
        void **capturing = h ? dlsym(h, "mock_capturing_stream") : NULL;
        int *mallocs = h ? dlsym(h, "mock_cuda_mallocs") : NULL;
        int *exchanges = h ? dlsym(h, "g_mode_exchanges") : NULL;
        int *invalidated = h ? dlsym(h, "mock_capture_invalidations") : NULL;
        CHECK(capturing && mallocs && exchanges && invalidated);
        if (capturing && mallocs && exchanges && invalidated) {
            static char capture_stream; /* any non-NULL handle */
            static float a[64], b[64], c[64];
            axc_gemm_args g = {.device = 0, .dtype = AXC_DT_F32, .M = 3, .N = 4, .K = 5, .A = a,
                               .lda = 5, .B = b, .ldb = 4, .C = c, .ldc = 4, .alpha = 1.0f,
                               .stream = &capture_stream};
            *capturing = &capture_stream;
            int before = *mallocs, switched = *exchanges;
            CHECK_OK(axc_gemm(&g));
            CHECK(*mallocs == before + 1);        /* the capture stream's workspace */
            CHECK(*exchanges == switched + 2);    /* relaxed for the cudaMalloc, then back */
            /* no call CUDA forbids on a capturing stream (cudaStreamGetId was one, 2026-11-26) */
            CHECK(*invalidated == 0);
            static float dy[4], db[4];
            CHECK(axc_bias_grad(0, &capture_stream, AXC_DT_F32, dy, 1 << 20, 1, 1, db, 0) ==
                      AXC_ERR_STATE &&
                  strstr(axc_last_error(), "warm-up"));
            /* a launch that fails inside the capture is reported as a capture refusal */
            void **fail_stream = h ? dlsym(RTLD_DEFAULT, "mock_lt_fail_stream") : NULL;
            CHECK(fail_stream != NULL);
            if (fail_stream) {
                *fail_stream = &capture_stream;
                axc_status fs = axc_gemm(&g);
                printf("a GEMM whose launch fails in the capture: %s: %s\n",
                       axc_status_name(fs), axc_last_error());
                CHECK(fs == AXC_ERR_STATE && strstr(axc_last_error(), "CUDA-graph capture") &&
                      strstr(axc_last_error(), "axc_gemm"));
                *capturing = NULL; /* the same failure outside a capture is cuBLASLt's */
                fs = axc_gemm(&g);
                CHECK(fs == AXC_ERR_BACKEND && strstr(axc_last_error(), "cublasLtMatmul"));
                *fail_stream = NULL;
            }
            CHECK(*invalidated == 0);
            *capturing = NULL;
            CHECK_OK(axc_gemm(&g));
            CHECK(*mallocs == before + 1); /* the same workspace after the capture */
        }
    }

    /* a second stream: its first bias gradient grows the ones vector (made on that stream) and
     * gets a workspace of its own; the legacy stream's next GEMMs read the new vector, a K == 0
     * GEMM on the second stream the zeros vector made on the legacy stream */
    {
        static char s2; /* any non-NULL handle */
        enum { BIG = 200000 }; /* past the ones vector's 131072 elements */
        float *dy = malloc(sizeof(float) * BIG), db[1] = {0};
        CHECK(dy != NULL);
        if (dy) {
            for (int i = 0; i < BIG; i++)
                dy[i] = (float)(i % 3);
            CHECK_OK(axc_bias_grad(0, &s2, AXC_DT_F32, dy, BIG, 1, 1, db, 0));
            CHECK(db[0] == (float)(BIG / 3 + 2 * (BIG / 3) + (BIG % 3 == 2 ? 1 : 0)));
            CHECK_OK(axc_bias_grad(0, NULL, AXC_DT_F32, dy, BIG, 1, 1, db, 1));
            free(dy);
        }
        CHECK(check_one(AXC_DT_F32, 4, 6, 0, 0, 0, 0, 1.0f, 0.5f, 1)); /* the legacy stream */
        static float a[4], b[4], c[24];
        axc_gemm_args g = {.device = 0, .stream = &s2, .dtype = AXC_DT_F32, .M = 4, .N = 6,
                           .K = 0, .A = a, .lda = 1, .B = b, .ldb = 6, .C = c, .ldc = 6,
                           .alpha = 1.0f, .beta = 0.5f};
        CHECK_OK(axc_gemm(&g));
    }

    /* copies and fills through the runtime */
    unsigned char src[6 * 10], dst[6 * 12];
    for (int i = 0; i < 60; i++)
        src[i] = (unsigned char)i;
    memset(dst, 0xee, sizeof dst);
    CHECK_OK(axc_copy2d(0, NULL, dst, 12, src, 10, 8, 6));
    int good = 1;
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 12; c++)
            good &= dst[r * 12 + c] == (c < 8 ? src[r * 10 + c] : 0xee);
    CHECK(good);
    CHECK_OK(axc_zero(0, NULL, dst, 12));
    CHECK(dst[0] == 0 && dst[11] == 0 && dst[12] == src[10]);
    /* a device that does not exist */
    float x = 0;
    axc_gemm_args g = {.device = 3, .dtype = AXC_DT_F32, .M = 1, .N = 1, .K = 1, .A = &x,
                       .lda = 1, .B = &x, .ldb = 1, .C = &x, .ldc = 1, .alpha = 1.0f};
    CHECK(axc_gemm(&g) == AXC_ERR_INVALID && strstr(axc_last_error(), "device 3"));
    test_plan_cache();
    printf("test_gemm_mock: %d GEMM configurations through the cuBLASLt path\n", n);
    order_checker oc;
    CHECK(order_checker_find(&oc));
    if (oc.violations)
        check_reused_stream_handle(&oc);
    CHECK(order_violations(&oc, "test_gemm_mock") == 0);
    return ctest_summary("test_gemm_mock");
}
