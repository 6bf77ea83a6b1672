/* Device compute the layers call: GEMMs (torch's CPU BLAS through its C shim; cuBLASLt on CUDA),
 * the bias gradient, strided copies and zero fills. All matrices are row-major; every call is
 * asynchronous on `stream` for CUDA and synchronous on the CPU. */
#ifndef AXC_GEMM_H
#define AXC_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "axc/comm.h" /* axc_dtype */
#include "axc/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct axc_gemm_args {
    int device;      /* -1 CPU, >= 0 CUDA device */
    void *stream;    /* CUDA stream (torch's current stream), ignored on CPU */
    axc_dtype dtype; /* F32, BF16, F16 for A, B, C and bias; accumulation in fp32 */
    int trans_a, trans_b; /* row-major: op(A) is M x K, op(B) is K x N */
    int64_t M, N, K;
    const void *A; int64_t lda; /* leading dimension (row stride, elements) of A as stored */
    const void *B; int64_t ldb;
    void *C; int64_t ldc;       /* C is M x N, row-major, ldc >= N */
    float alpha, beta;          /* C = alpha*op(A)@op(B) + beta*C */
    const void *bias;           /* optional [N], added to every row (after alpha), NULL = none */
} axc_gemm_args;

/* C = alpha*op(A)@op(B) + beta*C (+ bias[j] on every row j-th column).
 * - A is stored M x K (trans_a = 0, lda >= K) or K x M (trans_a = 1, lda >= M); B likewise
 *   K x N (ldb >= N) or N x K (ldb >= K). Leading dimensions are in elements and at least 1.
 * - beta == 0: C is not read (NaN/Inf in it do not propagate), so C may be uninitialised.
 * - bias with beta == 0: C = alpha*AB + bias, one rounding on both devices.
 *   bias with beta != 0: C = alpha*AB + beta*C + bias; CUDA rounds once (epilogue), the CPU
 *   rounds beta*C + bias to the dtype first (exact for F32 up to one fp32 rounding).
 * - K == 0: C = beta*C (+ bias). M == 0 or N == 0: nothing happens.
 * - fp32 accumulation; F32 is full fp32 (no TF32) on CUDA, like torch's default.
 * - CUDA: on `stream`, on device `device` (the caller's current device is restored). The first
 *   call per (device, stream) cudaMallocs a 32 MiB cuBLASLt workspace (kept for the process), and
 *   K == 0 / axc_bias_grad grow a device zeros/ones vector with one stream synchronisation, so
 *   warm up with the largest shapes before CUDA-graph capture. The cuBLASLt descriptors and the
 *   heuristic's algorithm are cached per shape, leading dimensions, pointer alignments, dtype,
 *   transposes and bias (at most 512 plans, least recently used evicted): a warmed-up call
 *   creates nothing and queries no heuristic. */
axc_status axc_gemm(const axc_gemm_args *g);

/* db[N] (+)= sum over the M rows of dY[M x N] (row stride ld); accumulate=1 adds into db.
 * fp32 accumulation, one rounding to the dtype at the end. M == 0 gives db = 0 (or db unchanged
 * when accumulating). */
axc_status axc_bias_grad(int device, void *stream, axc_dtype dt, const void *dY, int64_t M,
                         int64_t N, int64_t ld, void *db, int accumulate);

/* 2-D strided copy of `rows` rows of `row_bytes` bytes (memcpy on CPU, cudaMemcpy2DAsync on CUDA,
 * on `stream`; on CUDA either side may be host or device memory: unified addressing). */
axc_status axc_copy2d(int device, void *stream, void *dst, size_t dst_pitch, const void *src,
                      size_t src_pitch, size_t row_bytes, size_t rows);

/* Fills `bytes` bytes with zero (memset / cudaMemsetAsync). */
axc_status axc_zero(int device, void *stream, void *dst, size_t bytes);

/* 1 when this build has the cuBLASLt path (compiled against cublasLt.h). */
int axc_gemm_cuda_compiled(void);

/* Teardown of the GEMM layer (finalize): destroys the cuBLASLt plans cached so far (descriptors,
 * layouts; a plan in use by a GEMM on another thread when that GEMM returns). GEMMs still work
 * afterwards: they build their plans again. */
axc_status axc_gemm_release(void);

/* ---- internal: the cuBLASLt backend (csrc/device/cublaslt.c), called after validation ---- */
axc_status axc_cublaslt_gemm(const axc_gemm_args *g);
axc_status axc_cublaslt_bias_grad(int device, void *stream, axc_dtype dt, const void *dY,
                                  int64_t M, int64_t N, int64_t ld, void *db, int accumulate);
/* The bias gradient at small token counts (csrc/device/bias_grad_cuda.c): one kernel launch,
 * for M <= AXC_BIAS_GRAD_KERNEL_MAX_ROWS, on the current device; the cuBLASLt GEMV otherwise
 * and where the kernel is not available (a build without nvcc, the CUDA mocks,
 * AXONN_C_BIAS_GRAD_KERNEL not 1). axc_bias_grad_kernel_ready: 1 loaded, 0 not available, -1
 * not tried yet; may_load 0 does not try (a capturing stream: loading a library is no stream
 * operation and could invalidate the capture). */
enum { AXC_BIAS_GRAD_KERNEL_MAX_ROWS = 1024 };
int axc_bias_grad_kernel_ready(int may_load);
axc_status axc_bias_grad_kernel(void *stream, axc_dtype dt, const void *dY, int64_t M, int64_t N,
                                int64_t ld, void *db, int accumulate);
/* The cuBLASLt plan cache: plans cached now; *capacity (if not NULL) gets its bound (0 in a
 * build without cuBLASLt). */
int axc_cublaslt_cached_plans(int *capacity);
/* Destroys every cached plan (one in use by a GEMM on another thread when that GEMM returns);
 * later GEMMs build them again. Called by axc_gemm_release (teardown) and tests. */
axc_status axc_cublaslt_release(void);

#ifdef __cplusplus
}
#endif
#endif
