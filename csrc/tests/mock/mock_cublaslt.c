/* CPU stand-in for libcublasLt.so.13 (plus the two runtime entry points the GEMM layer adds to
 * the cudart mock), so the cuBLASLt path of csrc/device/cublaslt.c - row-major to column-major
 * mapping, bias epilogue, ones-vector bias gradient, K == 0, descriptor and cache handling - runs
 * on a machine without a GPU. "Device" memory is host memory and cublasLtMatmul computes on the
 * host, checking that every descriptor is consistent. f32 and bf16 only. Every call that touches
 * device memory reports its accesses to the stream-order checker (mock_stream_order.c; the
 * libcublasLt copy binds to libcudart's, loaded first), and every entry point counts its calls
 * (MOCK_API(), mock_api_count.c; one table, libcudart's, likewise).
 * Build and run: see csrc/tests/mock/run_gemm_mock_test.sh. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mock_api_count.h"
#include "mock_stream_order.h"

#ifdef MOCK_CUDART_EXTRA
/* appended to the cudart mock */
/* (cudaStreamIsCapturing and mock_capturing_stream: in mock_cuda_nccl.c) */
int cudaMemcpy2DAsync(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, int k,
                      void *st)
{
    MOCK_API();
    (void)k;
    if (h > 0) /* the rows' whole span (the checker works per allocation) */
        mock_order_rw("cudaMemcpy2DAsync", st, s, (h - 1) * sp + w, d, (h - 1) * dp + w);
    for (size_t i = 0; i < h; i++)
        memmove((char *)d + i * dp, (const char *)s + i * sp, w);
    return 0;
}
int cudaMemsetAsync(void *d, int v, size_t n, void *st)
{
    MOCK_API();
    mock_order_rw("cudaMemsetAsync", st, NULL, 0, d, n);
    memset(d, v, n);
    return 0;
}
#else

#include <cublasLt.h>

typedef struct mdesc { int32_t ta, tb; uint32_t epi; const void *bias; int32_t bias_type; } mdesc;
typedef struct mlayout { cudaDataType type; uint64_t rows, cols; int64_t ld; } mlayout;
int mock_lt_matmuls, mock_lt_heuristics; /* counters the test reads through dlsym */
/* set by test_gemm_mock: while nonzero the heuristic finds no algorithm; at k > 0 the k-th
 * cublasLtMatrixLayoutCreate from now fails (then it is 0 again) */
int mock_lt_no_algo, mock_lt_fail_layout_at;
/* set by test_gemm_mock: every cublasLtMatmul takes this long before it reads its descriptor
 * (so that GEMMs on several threads overlap) */
int mock_lt_matmul_us;

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h)
{
    MOCK_API();
    *h = (cublasLtHandle_t)malloc(8);
    return 0;
}
const char *cublasLtGetStatusString(cublasStatus_t s) { return s ? "mock failure" : "ok"; }
size_t cublasLtGetVersion(void) { MOCK_API(); return 130100; }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t c,
                                        cudaDataType_t s)
{
    MOCK_API();
    if (c != CUBLAS_COMPUTE_32F || s != CUDA_R_32F)
        return CUBLAS_STATUS_INVALID_VALUE;
    *d = (cublasLtMatmulDesc_t)calloc(1, sizeof(mdesc));
    return 0;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { MOCK_API(); free(d); return 0; }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t a, const void *buf,
                                              size_t n)
{
    MOCK_API();
    mdesc *m = (mdesc *)d;
    switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA: if (n != 4) return 7; memcpy(&m->ta, buf, 4); return 0;
    case CUBLASLT_MATMUL_DESC_TRANSB: if (n != 4) return 7; memcpy(&m->tb, buf, 4); return 0;
    case CUBLASLT_MATMUL_DESC_EPILOGUE: if (n != 4) return 7; memcpy(&m->epi, buf, 4); return 0;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: if (n != sizeof(void *)) return 7; memcpy(&m->bias, buf, n); return 0;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: if (n != 4) return 7; memcpy(&m->bias_type, buf, 4); return 0;
    default: return CUBLAS_STATUS_INVALID_VALUE;
    }
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType t, uint64_t r,
                                          uint64_t c, int64_t ld)
{
    MOCK_API();
    if (__atomic_load_n(&mock_lt_fail_layout_at, __ATOMIC_SEQ_CST) > 0 &&
        __atomic_sub_fetch(&mock_lt_fail_layout_at, 1, __ATOMIC_SEQ_CST) == 0)
        return CUBLAS_STATUS_ALLOC_FAILED;
    if (ld < (int64_t)(r ? r : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    mlayout *m = calloc(1, sizeof *m);
    m->type = t, m->rows = r, m->cols = c, m->ld = ld;
    *l = (cublasLtMatrixLayout_t)m;
    return 0;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l)
{
    MOCK_API();
    free(l);
    return 0;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p)
{
    MOCK_API();
    *p = (cublasLtMatmulPreference_t)calloc(1, 16); /* [0]: max workspace bytes (default 0) */
    return 0;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p)
{
    MOCK_API();
    free(p);
    return 0;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a,
                                                    const void *buf, size_t n)
{
    MOCK_API();
    if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (n != 8)
            return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(p, buf, 8);
        return 0;
    }
    return n == 4 ? 0 : CUBLAS_STATUS_INVALID_VALUE;
}

/* m, n, k from the descriptors; 0 when they are inconsistent */
static int dims(const mdesc *d, const mlayout *A, const mlayout *B, const mlayout *C,
                uint64_t *m, uint64_t *n, uint64_t *k)
{
    *m = C->rows, *n = C->cols;
    uint64_t am = d->ta ? A->cols : A->rows, ak = d->ta ? A->rows : A->cols;
    uint64_t bk = d->tb ? B->cols : B->rows, bn = d->tb ? B->rows : B->cols;
    *k = ak;
    return am == *m && bn == *n && bk == ak && A->type == B->type;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
                                              cublasLtMatmulPreference_t p, int req,
                                              cublasLtMatmulHeuristicResult_t res[], int *found)
{
    MOCK_API();
    (void)h, (void)dd;
    uint64_t m, n, k, max_ws;
    if (req < 1 || !dims((mdesc *)d, (mlayout *)a, (mlayout *)b, (mlayout *)c, &m, &n, &k)) {
        *found = 0;
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    memcpy(&max_ws, p, 8);
    __atomic_add_fetch(&mock_lt_heuristics, 1, __ATOMIC_SEQ_CST);
    memset(&res[0], 0, sizeof res[0]);
    if (mock_lt_no_algo) {
        *found = 0;
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    res[0].algo.data[0] = 42;
    /* like cuBLASLt: an algorithm within the preference's workspace (1024 bytes when allowed) */
    res[0].workspaceSize = max_ws >= 1024 ? 1024 : 0;
    res[0].algo.data[1] = res[0].workspaceSize;
    res[0].state = CUBLAS_STATUS_SUCCESS;
    *found = 1;
    return 0;
}

/* the bytes a column-major layout spans */
static size_t extent(const mlayout *l)
{
    size_t es = l->type == CUDA_R_32F ? 4 : 2;
    if (!l->rows || !l->cols)
        return 0;
    return ((size_t)(l->cols - 1) * (size_t)l->ld + (size_t)l->rows) * es;
}

static float ld_el(cudaDataType t, const void *p, int64_t i)
{
    if (t == CUDA_R_32F)
        return ((const float *)p)[i];
    uint32_t x = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static void st_el(cudaDataType t, void *p, int64_t i, float v)
{
    if (t == CUDA_R_32F) {
        ((float *)p)[i] = v;
        return;
    }
    uint32_t x;
    memcpy(&x, &v, 4);
    x += 0x7fffu + ((x >> 16) & 1u);
    ((uint16_t *)p)[i] = (uint16_t)(x >> 16);
}

/* set by test_gemm_mock: a matmul on this stream fails to launch (CUBLAS_STATUS_EXECUTION_FAILED),
 * as a launch on a stream whose capture was invalidated does */
void *mock_lt_fail_stream;

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t dsc, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t Al, const void *B,
                              cublasLtMatrixLayout_t Bl, const void *beta, const void *C,
                              cublasLtMatrixLayout_t Cl, void *D, cublasLtMatrixLayout_t Dl,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t wss,
                              cudaStream_t s)
{
    MOCK_API();
    (void)h;
    if (s && (void *)s == mock_lt_fail_stream)
        return CUBLAS_STATUS_EXECUTION_FAILED;
    if (mock_lt_matmul_us) {
        struct timespec t = {0, (long)mock_lt_matmul_us * 1000};
        nanosleep(&t, NULL);
    }
    const mdesc *d = (const mdesc *)dsc;
    const mlayout *a = (const mlayout *)Al, *b = (const mlayout *)Bl, *c = (const mlayout *)Cl,
                  *dl = (const mlayout *)Dl;
    uint64_t m, n, k;
    if (!dims(d, a, b, c, &m, &n, &k) || c->rows != dl->rows || c->cols != dl->cols ||
        algo->data[0] != 42 || wss < algo->data[1] || (wss && !ws) || C != D)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (d->epi == CUBLASLT_EPILOGUE_BIAS && (!d->bias || d->bias_type != (int32_t)c->type))
        return CUBLAS_STATUS_INVALID_VALUE;
    float al, be;
    memcpy(&al, alpha, 4);
    memcpy(&be, beta, 4);
    /* reads A, B, C (when beta != 0) and the bias; writes D and the workspace (scratch) */
    int with_bias = d->epi == CUBLASLT_EPILOGUE_BIAS;
    size_t bias_bytes = (size_t)m * (c->type == CUDA_R_32F ? 4 : 2);
    mock_span spans[] = {
        {A, extent(a), 0},
        {B, extent(b), 0},
        {C, be != 0.0f ? extent(c) : 0, 0},
        {with_bias ? d->bias : NULL, with_bias ? bias_bytes : 0, 0},
        {D, extent(dl), 1},
        {ws, wss, 1},
    };
    mock_order_op("cublasLtMatmul", s, spans, (int)(sizeof spans / sizeof spans[0]));
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++) {
            float acc = 0.0f;
            for (uint64_t kk = 0; kk < k; kk++) {
                int64_t ai = d->ta ? (int64_t)(kk + i * a->ld) : (int64_t)(i + kk * a->ld);
                int64_t bi = d->tb ? (int64_t)(j + kk * b->ld) : (int64_t)(kk + j * b->ld);
                acc += ld_el(a->type, A, ai) * ld_el(b->type, B, bi);
            }
            int64_t ci = (int64_t)(i + j * c->ld);
            float v = al * acc + (be != 0.0f ? be * ld_el(c->type, C, ci) : 0.0f);
            if (d->epi == CUBLASLT_EPILOGUE_BIAS)
                v += ld_el(c->type, d->bias, (int64_t)i);
            st_el(dl->type, D, ci, v);
        }
    __atomic_add_fetch(&mock_lt_matmuls, 1, __ATOMIC_SEQ_CST);
    return 0;
}
#endif
