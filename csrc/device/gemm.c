/* GEMM, bias gradient, 2-D copy and zero fill: argument checks shared by both devices, the CPU
 * path (torch's own BLAS kernel through its C shim; plain loops for the rest) and the dispatch to
 * CUDA (cuBLASLt in cublaslt.c; the CUDA runtime for copies and fills).
 *
 * CPU GEMM: A, B and C are wrapped as non-owning strided tensors. A transposed operand is the
 * same memory with swapped strides, and a leading dimension larger than the width is just a
 * larger row stride, so torch's addmm/mm see exactly what torch.matmul would see for the same
 * views and run the same BLAS call (MKL/OpenBLAS/oneDNN), without copies. */
#include "axc/gemm.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "axc/bench_skip.h"
#include "axc/cuda_rt.h"
#include "axc/torch_shim.h"

/* ------------------------------------------------------------------ scalar conversions */

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and a NaN */
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(x >> 16);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t man = (uint32_t)h & 0x3ffu;
    uint32_t x;
    if (exp == 0) {
        if (man == 0) {
            x = sign;
        } else { /* subnormal: man * 2^-24, exact in fp32 */
            float f = (float)man * 0x1p-24f;
            memcpy(&x, &f, sizeof x);
            x |= sign;
        }
    } else if (exp == 31) {
        x = sign | 0x7f800000u | (man << 13);
    } else {
        x = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static inline uint16_t f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* Inf, NaN */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) /* >= 65520 rounds to Inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* below 2^-14: a half subnormal (or zero) */
        if (ax <= 0x33000000u) /* <= 2^-25: rounds to zero (the tie goes to even 0) */
            return (uint16_t)sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* value in units of 2^-24 is m >> shift; 14..24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u)))
            r++;
        return (uint16_t)(sign | r);
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

static inline float load_elem(axc_dtype dt, const void *p, int64_t i)
{
    switch (dt) {
    case AXC_DT_BF16:
        return bf16_to_f32(((const uint16_t *)p)[i]);
    case AXC_DT_F16:
        return f16_to_f32(((const uint16_t *)p)[i]);
    default:
        return ((const float *)p)[i];
    }
}

static inline void store_elem(axc_dtype dt, void *p, int64_t i, float v)
{
    switch (dt) {
    case AXC_DT_BF16:
        ((uint16_t *)p)[i] = f32_to_bf16(v);
        break;
    case AXC_DT_F16:
        ((uint16_t *)p)[i] = f32_to_f16(v);
        break;
    default:
        ((float *)p)[i] = v;
        break;
    }
}

/* ------------------------------------------------------------------ argument checks */

static axc_status check_float_dtype(axc_dtype dt, const char *fn)
{
    if (dt == AXC_DT_F32 || dt == AXC_DT_BF16 || dt == AXC_DT_F16)
        return AXC_OK;
    return axc_fail(AXC_ERR_INVALID, "%s: dtype %s is not supported (float32, bfloat16, float16)",
                    fn, axc_dtype_name(dt));
}

static axc_status check_device(int device, const char *fn)
{
    if (device < -1)
        return axc_fail(AXC_ERR_INVALID, "%s: device %d (use -1 for the CPU or a CUDA index)", fn,
                        device);
    return AXC_OK;
}

static int64_t max1(int64_t v) { return v > 1 ? v : 1; }

static axc_status check_gemm(const axc_gemm_args *g)
{
    if (!g)
        return axc_fail(AXC_ERR_INVALID, "axc_gemm: NULL arguments");
    AXC_TRY(check_device(g->device, "axc_gemm"));
    AXC_TRY(check_float_dtype(g->dtype, "axc_gemm"));
    if (g->M < 0 || g->N < 0 || g->K < 0)
        return axc_fail(AXC_ERR_INVALID, "axc_gemm: negative shape M=%lld N=%lld K=%lld",
                        (long long)g->M, (long long)g->N, (long long)g->K);
    int64_t a_cols = g->trans_a ? g->M : g->K, b_cols = g->trans_b ? g->K : g->N;
    if (g->lda < max1(a_cols))
        return axc_fail(AXC_ERR_INVALID,
                        "axc_gemm: lda=%lld is smaller than the stored width of A (%lld, %s)",
                        (long long)g->lda, (long long)max1(a_cols), g->trans_a ? "M" : "K");
    if (g->ldb < max1(b_cols))
        return axc_fail(AXC_ERR_INVALID,
                        "axc_gemm: ldb=%lld is smaller than the stored width of B (%lld, %s)",
                        (long long)g->ldb, (long long)max1(b_cols), g->trans_b ? "K" : "N");
    if (g->ldc < max1(g->N))
        return axc_fail(AXC_ERR_INVALID, "axc_gemm: ldc=%lld is smaller than N=%lld",
                        (long long)g->ldc, (long long)max1(g->N));
    if (g->M > 0 && g->N > 0) {
        if (!g->C)
            return axc_fail(AXC_ERR_INVALID, "axc_gemm: C is NULL");
        if (g->K > 0 && (!g->A || !g->B))
            return axc_fail(AXC_ERR_INVALID, "axc_gemm: %s is NULL", g->A ? "B" : "A");
    }
    return AXC_OK;
}

/* ------------------------------------------------------------------ CPU GEMM */

typedef struct blob_set {
    const axc_torch_api *t;
    axc_aten_tensor h[4];
    int n;
} blob_set;

static axc_status blob(blob_set *bs, const void *data, int64_t ndim, const int64_t *sizes,
                       const int64_t *strides, int32_t dtype, axc_aten_tensor *out)
{
    axc_aten_tensor h = NULL;
    int32_t err = bs->t->create_tensor_from_blob((void *)(uintptr_t)data, ndim, sizes, strides, 0,
                                                 dtype, bs->t->device_cpu, 0, &h);
    if (err != 0 || !h)
        return axc_torch_check(err ? err : -1, "aoti_torch_create_tensor_from_blob");
    bs->h[bs->n++] = h;
    *out = h;
    return AXC_OK;
}

static axc_status blob_release(blob_set *bs, axc_status st)
{
    for (int i = bs->n - 1; i >= 0; i--) {
        int32_t err = bs->t->delete_tensor_object(bs->h[i]);
        if (err != 0 && st == AXC_OK)
            st = axc_torch_check(err, "aoti_torch_delete_tensor_object");
    }
    bs->n = 0;
    return st;
}

/* C = beta*C (+ bias), computed in fp32 with one rounding; beta == 0 does not read C. */
static void scale_add_bias_cpu(const axc_gemm_args *g)
{
    for (int64_t i = 0; i < g->M; i++) {
        void *row = (char *)g->C + (size_t)(i * g->ldc) * axc_dtype_size(g->dtype);
        for (int64_t j = 0; j < g->N; j++) {
            float v = g->beta != 0.0f ? g->beta * load_elem(g->dtype, row, j) : 0.0f;
            if (g->bias)
                v += load_elem(g->dtype, g->bias, j);
            store_elem(g->dtype, row, j, v);
        }
    }
}

static axc_status gemm_cpu(const axc_gemm_args *g)
{
    if (g->K == 0) {
        scale_add_bias_cpu(g);
        return AXC_OK;
    }
    const axc_torch_api *t;
    AXC_TRY(axc_torch_load(&t));
    int32_t dt = g->dtype == AXC_DT_F32 ? t->dtype_f32
                 : g->dtype == AXC_DT_BF16 ? t->dtype_bf16
                                            : t->dtype_f16;
    blob_set bs = {t, {NULL, NULL, NULL, NULL}, 0};
    axc_aten_tensor A, B, C, bias = NULL;
    const int64_t a_size[2] = {g->M, g->K}, b_size[2] = {g->K, g->N}, c_size[2] = {g->M, g->N};
    int64_t a_str[2] = {g->lda, 1}, b_str[2] = {g->ldb, 1};
    const int64_t c_str[2] = {g->ldc, 1};
    if (g->trans_a) {
        a_str[0] = 1;
        a_str[1] = g->lda;
    }
    if (g->trans_b) {
        b_str[0] = 1;
        b_str[1] = g->ldb;
    }
    axc_status st = blob(&bs, g->A, 2, a_size, a_str, dt, &A);
    if (st == AXC_OK)
        st = blob(&bs, g->B, 2, b_size, b_str, dt, &B);
    if (st == AXC_OK)
        st = blob(&bs, g->C, 2, c_size, c_str, dt, &C);
    if (st != AXC_OK)
        return blob_release(&bs, st);

    if (!g->bias) {
        if (g->beta == 0.0f && g->alpha == 1.0f)
            st = axc_torch_check(t->cpu_mm_out(C, A, B), "aoti_torch_cpu_mm_out");
        else /* beta == 0: torch's addmm ignores self (NaN in C does not propagate) */
            st = axc_torch_check(t->cpu_addmm_out(C, C, A, B, (double)g->beta, (double)g->alpha),
                                 "aoti_torch_cpu_addmm_out");
    } else if (g->beta == 0.0f) {
        /* C = alpha*AB + bias: bias [N] is broadcast over the rows by addmm */
        const int64_t n_size[1] = {g->N}, n_str[1] = {1};
        st = blob(&bs, g->bias, 1, n_size, n_str, dt, &bias);
        if (st == AXC_OK)
            st = axc_torch_check(t->cpu_addmm_out(C, bias, A, B, 1.0, (double)g->alpha),
                                 "aoti_torch_cpu_addmm_out");
    } else {
        /* C = alpha*AB + (beta*C + bias) */
        scale_add_bias_cpu(g);
        st = axc_torch_check(t->cpu_addmm_out(C, C, A, B, 1.0, (double)g->alpha),
                             "aoti_torch_cpu_addmm_out");
    }
    return blob_release(&bs, st);
}

/* Benchmark only (axc/bench_skip.h): with AXONN_C_BENCH_SKIP=compute axc_gemm and axc_bias_grad
 * check their arguments and return AXC_OK without computing, leaving C / db as they were. */
axc_status axc_gemm(const axc_gemm_args *g)
{
    AXC_TRY(check_gemm(g));
    if (g->M == 0 || g->N == 0 || axc_bench_skips("compute"))
        return AXC_OK;
    if (g->device < 0)
        return gemm_cpu(g);
    return axc_cublaslt_gemm(g);
}

/* ------------------------------------------------------------------ bias gradient */

enum { BG_COLS = 256, BG_ROWS = 64 };

/* Two-level fp32 sums (blocks of BG_ROWS rows, then the blocks) over a BG_COLS column panel. */
#define AXC_BIAS_GRAD_PANEL(TYPE, LOAD)                                                          \
    do {                                                                                         \
        for (int64_t i0 = 0; i0 < M; i0 += BG_ROWS) {                                            \
            int64_t i1 = i0 + BG_ROWS < M ? i0 + BG_ROWS : M;                                    \
            for (int64_t j = 0; j < w; j++)                                                      \
                part[j] = 0.0f;                                                                  \
            for (int64_t i = i0; i < i1; i++) {                                                  \
                const TYPE *row = (const TYPE *)dY + (size_t)(i * ld + j0);                      \
                for (int64_t j = 0; j < w; j++)                                                  \
                    part[j] += LOAD(row[j]);                                                     \
            }                                                                                    \
            for (int64_t j = 0; j < w; j++)                                                      \
                total[j] += part[j];                                                             \
        }                                                                                        \
    } while (0)

#define AXC_LOAD_F32(x) (x)

static void bias_grad_cpu(axc_dtype dt, const void *dY, int64_t M, int64_t N, int64_t ld,
                          void *db, int accumulate)
{
    float total[BG_COLS], part[BG_COLS];
    for (int64_t j0 = 0; j0 < N; j0 += BG_COLS) {
        int64_t w = N - j0 < BG_COLS ? N - j0 : BG_COLS;
        for (int64_t j = 0; j < w; j++)
            total[j] = 0.0f;
        if (dt == AXC_DT_F32)
            AXC_BIAS_GRAD_PANEL(float, AXC_LOAD_F32);
        else if (dt == AXC_DT_BF16)
            AXC_BIAS_GRAD_PANEL(uint16_t, bf16_to_f32);
        else
            AXC_BIAS_GRAD_PANEL(uint16_t, f16_to_f32);
        for (int64_t j = 0; j < w; j++) {
            float v = total[j];
            if (accumulate)
                v += load_elem(dt, db, j0 + j);
            store_elem(dt, db, j0 + j, v);
        }
    }
}

/* Large CPU bias gradients go through torch's multi-threaded BLAS as ones[1 x M] @ dY[M x N]
 * (the plain loop is single-threaded). The ones vector is cached and grown under a lock, held
 * across the GEMM so a concurrent grow cannot free it mid-use. */
enum { BIAS_GEMM_MIN = 1 << 16 };
static pthread_mutex_t ones_mu = PTHREAD_MUTEX_INITIALIZER;
static void *ones_buf[3];
static int64_t ones_len[3];

static axc_status bias_grad_cpu_gemm(axc_dtype dt, const void *dY, int64_t M, int64_t N,
                                     int64_t ld, void *db, int accumulate)
{
    int slot = dt == AXC_DT_F32 ? 0 : dt == AXC_DT_BF16 ? 1 : 2;
    size_t es = axc_dtype_size(dt);
    pthread_mutex_lock(&ones_mu);
    if (ones_len[slot] < M) {
        void *p = realloc(ones_buf[slot], (size_t)M * es);
        if (!p) {
            pthread_mutex_unlock(&ones_mu);
            return axc_fail(AXC_ERR_NOMEM, "axc_bias_grad: no memory for %lld ones",
                            (long long)M);
        }
        for (int64_t i = 0; i < M; i++) {
            if (dt == AXC_DT_F32) {
                ((float *)p)[i] = 1.0f;
            } else {
                ((uint16_t *)p)[i] = dt == AXC_DT_BF16 ? 0x3f80 : 0x3c00; /* 1.0 */
            }
        }
        ones_buf[slot] = p;
        ones_len[slot] = M;
    }
    axc_gemm_args g = {0};
    g.device = -1;
    g.dtype = dt;
    g.M = 1;
    g.N = N;
    g.K = M;
    g.A = ones_buf[slot];
    g.lda = M;
    g.B = dY;
    g.ldb = ld;
    g.C = db;
    g.ldc = N;
    g.alpha = 1.0f;
    g.beta = accumulate ? 1.0f : 0.0f;
    axc_status st = axc_gemm(&g);
    pthread_mutex_unlock(&ones_mu);
    return st;
}

axc_status axc_bias_grad(int device, void *stream, axc_dtype dt, const void *dY, int64_t M,
                         int64_t N, int64_t ld, void *db, int accumulate)
{
    AXC_TRY(check_device(device, "axc_bias_grad"));
    AXC_TRY(check_float_dtype(dt, "axc_bias_grad"));
    if (M < 0 || N < 0)
        return axc_fail(AXC_ERR_INVALID, "axc_bias_grad: negative shape M=%lld N=%lld",
                        (long long)M, (long long)N);
    if (ld < max1(N))
        return axc_fail(AXC_ERR_INVALID, "axc_bias_grad: ld=%lld is smaller than N=%lld",
                        (long long)ld, (long long)N);
    if (N == 0)
        return AXC_OK;
    if (!db || (M > 0 && !dY))
        return axc_fail(AXC_ERR_INVALID, "axc_bias_grad: %s is NULL", db ? "dY" : "db");
    if (axc_bench_skips("compute")) /* benchmark only: measures communication alone */
        return AXC_OK;
    if (device >= 0)
        return axc_cublaslt_bias_grad(device, stream, dt, dY, M, N, ld, db, accumulate);
    const axc_torch_api *torch_api;
    if (M * N >= BIAS_GEMM_MIN && axc_torch_load(&torch_api) == AXC_OK)
        return bias_grad_cpu_gemm(dt, dY, M, N, ld, db, accumulate);
    bias_grad_cpu(dt, dY, M, N, ld, db, accumulate);
    return AXC_OK;
}

/* ------------------------------------------------------------------ copies and fills */

axc_status axc_copy2d(int device, void *stream, void *dst, size_t dst_pitch, const void *src,
                      size_t src_pitch, size_t row_bytes, size_t rows)
{
    AXC_TRY(check_device(device, "axc_copy2d"));
    if (rows == 0 || row_bytes == 0)
        return AXC_OK;
    if (!dst || !src)
        return axc_fail(AXC_ERR_INVALID, "axc_copy2d: %s is NULL", dst ? "src" : "dst");
    if (rows > 1 && (dst_pitch < row_bytes || src_pitch < row_bytes))
        return axc_fail(AXC_ERR_INVALID,
                        "axc_copy2d: pitches (dst %zu, src %zu) are smaller than a row (%zu bytes)",
                        dst_pitch, src_pitch, row_bytes);
    int contiguous = rows == 1 || (dst_pitch == row_bytes && src_pitch == row_bytes);
    if (contiguous && row_bytes > SIZE_MAX / rows)
        return axc_fail(AXC_ERR_INVALID, "axc_copy2d: %zu rows of %zu bytes overflow", rows,
                        row_bytes);
    if (device < 0) {
        if (contiguous) {
            memmove(dst, src, rows * row_bytes);
        } else {
            for (size_t i = 0; i < rows; i++)
                memmove((char *)dst + i * dst_pitch, (const char *)src + i * src_pitch, row_bytes);
        }
        return AXC_OK;
    }
    const axc_cuda_api *api;
    int prev;
    AXC_TRY(axc_cuda_device_enter(device, &api, &prev, "axc_copy2d"));
    axc_status st;
    if (contiguous) {
        st = axc_cuda_check(api->MemcpyAsync(dst, src, rows * row_bytes, AXC_CUDA_MEMCPY_DEFAULT,
                                             stream),
                            "cudaMemcpyAsync");
    } else if (!api->Memcpy2DAsync) {
        st = axc_fail(AXC_ERR_UNAVAILABLE, "axc_copy2d: the CUDA runtime has no cudaMemcpy2DAsync");
    } else {
        st = axc_cuda_check(api->Memcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                               AXC_CUDA_MEMCPY_DEFAULT, stream),
                            "cudaMemcpy2DAsync");
    }
    return axc_cuda_device_leave(api, device, prev, st);
}

axc_status axc_zero(int device, void *stream, void *dst, size_t bytes)
{
    AXC_TRY(check_device(device, "axc_zero"));
    if (bytes == 0)
        return AXC_OK;
    if (!dst)
        return axc_fail(AXC_ERR_INVALID, "axc_zero: dst is NULL");
    if (device < 0) {
        memset(dst, 0, bytes);
        return AXC_OK;
    }
    const axc_cuda_api *api;
    int prev;
    AXC_TRY(axc_cuda_device_enter(device, &api, &prev, "axc_zero"));
    axc_status st;
    if (!api->MemsetAsync)
        st = axc_fail(AXC_ERR_UNAVAILABLE, "axc_zero: the CUDA runtime has no cudaMemsetAsync");
    else
        st = axc_cuda_check(api->MemsetAsync(dst, 0, bytes, stream), "cudaMemsetAsync");
    return axc_cuda_device_leave(api, device, prev, st);
}

axc_status axc_gemm_release(void) { return axc_cublaslt_release(); }
