/* The bias gradient of a Linear at small token counts: db[j] (+)= sum over the M rows of dY[i, j]
 * in fp32. One cudaLaunchKernel costs the host a fraction of the cuBLASLt GEMV it replaces
 * (bias_grad_cuda.c picks it for M <= AXC_BIAS_GRAD_KERNEL_MAX_ROWS). Compiled by setup.py into
 * a fatbin embedded in the extension, loaded at run time (no CUDA library is linked).
 *
 * A thread block of 32 x 32 threads covers 32 columns: thread (x, y) sums rows y, y + 32, ... of
 * column x, the 32 partial sums of a column are then added in a fixed order (deterministic). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 }; /* axc_dtype's codes */

__device__ static float load(const void *p, long long i, int dt)
{
    if (dt == DT_BF16)
        return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    if (dt == DT_F16)
        return __half2float(((const __half *)p)[i]);
    return ((const float *)p)[i];
}

__device__ static void store(void *p, long long i, float v, int dt)
{
    if (dt == DT_BF16)
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16(v);
    else if (dt == DT_F16)
        ((__half *)p)[i] = __float2half(v);
    else
        ((float *)p)[i] = v;
}

extern "C" __global__ void __launch_bounds__(1024)
    axc_bias_grad_kernel(const void *dy, void *db, long long M, long long N, long long ld, int dt,
                         int accumulate)
{
    __shared__ float part[32][33];
    long long j = (long long)blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (j < N)
        for (long long i = threadIdx.y; i < M; i += 32)
            s += load(dy, i * ld + j, dt);
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < N) {
        float t = 0.0f;
        for (int r = 0; r < 32; ++r)
            t += part[r][threadIdx.x];
        if (accumulate)
            t += load(db, j, dt);
        store(db, j, t, dt);
    }
}
