/* CUDA kernels of the codecs: the same bytes as the CPU reference (codec.c), since both use the
 * element routines of codec_elem.h with explicitly rounded fp32 operations. Compiled by setup.py
 * with nvcc into a fatbin embedded in the extension and loaded at run time through the CUDA
 * runtime (cudaLibraryLoadData), so the extension links against no CUDA library
 * (codec_cuda.c launches them). Kernels take plain C types; names are extern "C".
 *
 * encode: one thread block per codec block (blockDim.x threads): the block's absmax and
 * non-finite flags are reduced in shared memory (max and or: exact in any order), then each
 * thread writes its elements. decode: one thread per element (per byte for int4). */
#include <stdint.h>

#include "codec_elem.h"

#define AXC_THREADS 256

enum { K_NONE = 0, K_BF16 = 1, K_FP8 = 2, K_INT8 = 3, K_INT4 = 4 };

__device__ static float qmax_of(int codec)
{
    return codec == K_FP8 ? AXC_E4M3_MAX : codec == K_INT8 ? 127.0f : 7.0f;
}

__device__ static float contribution(const float *in, const float *residual, size_t i)
{
    return residual ? axc_ce_add(in[i], residual[i]) : in[i];
}

/* the payload starts after nb scales for block-scaled codecs */
__device__ static size_t scales_bytes(int codec, size_t nb)
{
    return (codec == K_NONE || codec == K_BF16) ? 0 : 4 * nb;
}

__device__ static float decoded(int codec, const unsigned char *payload, size_t i, float s)
{
    switch (codec) {
    case K_NONE: {
        float v;
        memcpy(&v, payload + 4 * i, 4);
        return v;
    }
    case K_BF16: {
        uint16_t h;
        memcpy(&h, payload + 2 * i, 2);
        return axc_ce_bf16_to_f32(h);
    }
    case K_INT8: return axc_ce_dequant((int8_t)payload[i], s);
    case K_FP8: return axc_ce_defp8(payload[i], s);
    default: return axc_ce_dequant(axc_ce_int4(payload[i / 2], i), s);
    }
}

/* The OR of every thread's `v` over the thread block, through `s` (a shared array of blockDim.x
 * entries that no thread still reads), for every thread; called by all of the block's threads. */
__device__ static unsigned block_or(unsigned *s, unsigned v)
{
    int t = threadIdx.x;
    s[t] = v;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (t < w)
            s[t] |= s[t + w];
        __syncthreads();
    }
    return s[0];
}

extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_encode_kernel(int codec, int block, const float *in, float *residual,
                            unsigned long long n, unsigned char *out)
{
    __shared__ float s_amax[AXC_THREADS];
    __shared__ unsigned s_flags[AXC_THREADS];
    size_t b = blockIdx.x, nb = (n + (size_t)block - 1) / (size_t)block;
    size_t lo = b * (size_t)block, len = n - lo < (size_t)block ? n - lo : (size_t)block;
    int t = threadIdx.x;
    axc_ce_scan scan = {0.0f, 0u};
    for (size_t i = t; i < len; i += blockDim.x)
        axc_ce_scan_add(&scan, contribution(in, residual, lo + i));
    s_amax[t] = scan.absmax;
    s_flags[t] = scan.flags;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (t < w) {
            s_amax[t] = s_amax[t + w] > s_amax[t] ? s_amax[t + w] : s_amax[t];
            s_flags[t] |= s_flags[t + w];
        }
        __syncthreads();
    }
    scan.absmax = s_amax[0];
    scan.flags = s_flags[0];
    int finite = scan.flags == 0;
    float s = 0.0f;
    unsigned char *payload = out + scales_bytes(codec, nb);
    if (codec != K_NONE && codec != K_BF16) {
        s = axc_ce_scale(scan, qmax_of(codec));
        if (t == 0)
            memcpy(out + 4 * b, &s, 4);
    }
    float fs = axc_ce_finite(s) ? s : 0.0f;
    /* the payload (int4: each thread a pair of elements, one byte; blocks are even but for the
     * last) */
    if (codec == K_INT4) {
        for (size_t j = t; 2 * j < len; j += blockDim.x) {
            size_t i = lo + 2 * j;
            unsigned v = (unsigned)axc_ce_quant(contribution(in, residual, i), fs, 7) & 0xfu;
            if (2 * j + 1 < len)
                v |= ((unsigned)axc_ce_quant(contribution(in, residual, i + 1), fs, 7) & 0xfu)
                     << 4;
            payload[i / 2] = (unsigned char)v;
        }
    } else {
        for (size_t k = t; k < len; k += blockDim.x) {
            size_t i = lo + k;
            float c = contribution(in, residual, i);
            switch (codec) {
            case K_NONE: {
                float v = axc_ce_canon(c);
                memcpy(payload + 4 * i, &v, 4);
                break;
            }
            case K_BF16: {
                uint16_t h = axc_ce_bf16(c);
                memcpy(payload + 2 * i, &h, 2);
                break;
            }
            case K_INT8: payload[i] = (unsigned char)(int8_t)axc_ce_quant(c, fs, 127); break;
            default: payload[i] = axc_ce_fp8(c, fs); break;
            }
        }
    }
    if (!residual || !finite)
        return; /* (uniform over the thread block: `finite` is the block's) */
    /* what the encoding lost, unless a decoded value is not finite (bf16 rounds values near
     * FLT_MAX to inf): then, as for a non-finite input, the residual stays as it was */
    __syncthreads(); /* (the payload is written: int4's bytes by other threads than the reads
                      * below; and every thread has read s_flags[0]) */
    unsigned bad = 0;
    for (size_t k = t; k < len; k += blockDim.x)
        bad |= !axc_ce_finite(decoded(codec, payload, lo + k, s));
    if (block_or(s_flags, bad))
        return;
    for (size_t k = t; k < len; k += blockDim.x)
        residual[lo + k] = AXC_FSUB(contribution(in, residual, lo + k),
                                    decoded(codec, payload, lo + k, s));
}

extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_decode_kernel(int codec, int block, const unsigned char *in, unsigned long long n,
                            float *out, int accumulate)
{
    size_t nb = (n + (size_t)block - 1) / (size_t)block;
    const unsigned char *payload = in + scales_bytes(codec, nb);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        if (codec != K_NONE && codec != K_BF16)
            memcpy(&s, in + 4 * (i / (size_t)block), 4);
        float v = decoded(codec, payload, i, s);
        out[i] = accumulate ? axc_ce_add(out[i], v) : v;
    }
}

/* x /= d, element-wise (the average of a compressed sum) */
extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_div_kernel(float *x, unsigned long long n, float d)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = axc_ce_canon(AXC_FDIV(x[i], d));
}

/* residual += mult * (x - decoded) on the codec blocks where x and decoded are finite (one thread
 * block per codec block; the CPU's axc_codec_feedback) */
extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_feedback_kernel(int block, const float *x, const float *decoded,
                              unsigned long long n, float mult, float *residual)
{
    __shared__ unsigned s_bad[AXC_THREADS];
    size_t lo = blockIdx.x * (size_t)block, len = n - lo < (size_t)block ? n - lo : (size_t)block;
    int t = threadIdx.x;
    unsigned bad = 0;
    for (size_t i = t; i < len; i += blockDim.x)
        bad |= !axc_ce_finite(x[lo + i]) | !axc_ce_finite(decoded[lo + i]);
    if (block_or(s_bad, bad))
        return;
    for (size_t i = t; i < len; i += blockDim.x)
        residual[lo + i] = axc_ce_add(residual[lo + i],
                                      AXC_FMUL(AXC_FSUB(x[lo + i], decoded[lo + i]), mult));
}
