/* CUDA kernels of the codecs: the same bytes as the CPU reference (codec.c), since both use the
 * element routines of codec_elem.h with explicitly rounded fp32 operations. Compiled by setup.py
 * with nvcc into a fatbin embedded in the extension and loaded at run time through the CUDA
 * runtime (cudaLibraryLoadData), so the extension links against no CUDA library
 * (codec_cuda.c launches them). Kernels take plain C types; names are extern "C".
 *
 * encode: one thread block per codec block (blockDim.x threads): the block's absmax and
 * non-finite flags are reduced in shared memory (max and or: exact in any order), then each
 * thread writes its elements. decode: one thread per element (per byte for int4).
 *
 * The *_warp_ kernels (AXONN_C_CODEC_KERNELS=warp, codec_cuda.c) do the same per codec block
 * with a thread block sized to it (a multiple of 32 threads, at most AXC_THREADS: not 256
 * threads for int4's 64 elements) and reduce by warp shuffles and one step across the warps
 * instead of log2(256) shared-memory rounds; the same bytes, max and or being exact in any
 * order. */
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

/* The payload of the codec block [lo, lo + len), this thread's share of it (int4: each thread a
 * pair of elements, one byte; blocks are even but for the last); fs: the block's scale (0 when
 * it is not finite). */
__device__ static void encode_payload(int codec, const float *in, const float *residual,
                                      size_t lo, size_t len, float fs, unsigned char *payload)
{
    int t = threadIdx.x;
    if (codec == K_INT4) {
        for (size_t j = t; 2 * j < len; j += blockDim.x) {
            size_t i = lo + 2 * j;
            unsigned v = (unsigned)axc_ce_quant(contribution(in, residual, i), fs, 7) & 0xfu;
            if (2 * j + 1 < len)
                v |= ((unsigned)axc_ce_quant(contribution(in, residual, i + 1), fs, 7) & 0xfu)
                     << 4;
            payload[i / 2] = (unsigned char)v;
        }
        return;
    }
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

/* Whether a value this thread decodes from the codec block's payload is not finite. */
__device__ static unsigned decoded_bad(int codec, const unsigned char *payload, size_t lo,
                                       size_t len, float s)
{
    unsigned bad = 0;
    for (size_t k = threadIdx.x; k < len; k += blockDim.x)
        bad |= !axc_ce_finite(decoded(codec, payload, lo + k, s));
    return bad;
}

/* residual = what the encoding lost (contribution - decoded), this thread's elements. */
__device__ static void keep_lost(int codec, const float *in, float *residual,
                                 const unsigned char *payload, size_t lo, size_t len, float s)
{
    for (size_t k = threadIdx.x; k < len; k += blockDim.x)
        residual[lo + k] = AXC_FSUB(contribution(in, residual, lo + k),
                                    decoded(codec, payload, lo + k, s));
}

#define AXC_FULL_WARP 0xffffffffu

/* The scan of every thread of the block, for every thread: a shared-memory tree over s_amax and
 * s_flags (blockDim.x entries each), or (WARP: blockDim.x a multiple of 32) shuffles within each
 * warp and one step across the warps through their first blockDim.x / 32 entries. Called by
 * all of the block's threads. */
template <bool WARP>
__device__ static axc_ce_scan block_scan(axc_ce_scan v, float *s_amax, unsigned *s_flags)
{
    int t = threadIdx.x;
    if constexpr (!WARP) {
        s_amax[t] = v.absmax;
        s_flags[t] = v.flags;
        __syncthreads();
        for (int w = blockDim.x / 2; w > 0; w /= 2) {
            if (t < w) {
                s_amax[t] = s_amax[t + w] > s_amax[t] ? s_amax[t + w] : s_amax[t];
                s_flags[t] |= s_flags[t + w];
            }
            __syncthreads();
        }
        return axc_ce_scan{s_amax[0], s_flags[0]};
    } else {
        for (int o = 16; o > 0; o /= 2) {
            float a = __shfl_xor_sync(AXC_FULL_WARP, v.absmax, o);
            v.absmax = a > v.absmax ? a : v.absmax;
            v.flags |= __shfl_xor_sync(AXC_FULL_WARP, v.flags, o);
        }
        int nw = (int)blockDim.x / 32;
        if (nw == 1)
            return v;
        if ((t & 31) == 0) {
            s_amax[t / 32] = v.absmax;
            s_flags[t / 32] = v.flags;
        }
        __syncthreads();
        v.absmax = s_amax[0];
        v.flags = s_flags[0];
        for (int w = 1; w < nw; w++) {
            v.absmax = s_amax[w] > v.absmax ? s_amax[w] : v.absmax;
            v.flags |= s_flags[w];
        }
        return v;
    }
}

/* Whether any thread of the block has `v` set, for every thread, through `s` (as block_or; WARP:
 * a warp vote and one step across the warps). Called by all of the block's threads. */
template <bool WARP> __device__ static unsigned block_any(unsigned *s, unsigned v)
{
    if constexpr (!WARP) {
        return block_or(s, v) != 0u;
    } else {
        unsigned any = __any_sync(AXC_FULL_WARP, v != 0u) ? 1u : 0u;
        int nw = (int)blockDim.x / 32;
        if (nw == 1)
            return any;
        if ((threadIdx.x & 31u) == 0)
            s[threadIdx.x / 32] = any;
        __syncthreads();
        any = 0u;
        for (int w = 0; w < nw; w++)
            any |= s[w];
        return any;
    }
}

/* encode of codec block blockIdx.x (see the top; WARP: the *_warp_ kernel's reductions) */
template <bool WARP>
__device__ static void encode_block(int codec, int block, const float *in, float *residual,
                                    unsigned long long n, unsigned char *out)
{
    __shared__ float s_amax[AXC_THREADS];
    __shared__ unsigned s_flags[AXC_THREADS];
    size_t b = blockIdx.x, nb = (n + (size_t)block - 1) / (size_t)block;
    size_t lo = b * (size_t)block, len = n - lo < (size_t)block ? n - lo : (size_t)block;
    axc_ce_scan scan = {0.0f, 0u};
    for (size_t i = threadIdx.x; i < len; i += blockDim.x)
        axc_ce_scan_add(&scan, contribution(in, residual, lo + i));
    scan = block_scan<WARP>(scan, s_amax, s_flags);
    int finite = scan.flags == 0;
    float s = 0.0f;
    unsigned char *payload = out + scales_bytes(codec, nb);
    if (codec != K_NONE && codec != K_BF16) {
        s = axc_ce_scale(scan, qmax_of(codec));
        if (threadIdx.x == 0)
            memcpy(out + 4 * b, &s, 4);
    }
    encode_payload(codec, in, residual, lo, len, axc_ce_finite(s) ? s : 0.0f, payload);
    if (!residual || !finite)
        return; /* (uniform over the thread block: `finite` is the block's) */
    /* what the encoding lost, unless a decoded value is not finite (bf16 rounds values near
     * FLT_MAX to inf): then, as for a non-finite input, the residual stays as it was */
    __syncthreads(); /* (the payload is written: int4's bytes by other threads than the reads
                      * below; and every thread has read s_flags) */
    if (!block_any<WARP>(s_flags, decoded_bad(codec, payload, lo, len, s)))
        keep_lost(codec, in, residual, payload, lo, len, s);
}

extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_encode_kernel(int codec, int block, const float *in, float *residual,
                            unsigned long long n, unsigned char *out)
{
    encode_block<false>(codec, block, in, residual, n, out);
}

extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_encode_warp_kernel(int codec, int block, const float *in, float *residual,
                                 unsigned long long n, unsigned char *out)
{
    encode_block<true>(codec, block, in, residual, n, out);
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
 * block per codec block; the CPU's axc_codec_feedback; WARP: the *_warp_ kernel's reduction) */
template <bool WARP>
__device__ static void feedback_block(int block, const float *x, const float *decoded,
                                      unsigned long long n, float mult, float *residual)
{
    __shared__ unsigned s_bad[AXC_THREADS];
    size_t lo = blockIdx.x * (size_t)block, len = n - lo < (size_t)block ? n - lo : (size_t)block;
    unsigned bad = 0;
    for (size_t i = threadIdx.x; i < len; i += blockDim.x)
        bad |= !axc_ce_finite(x[lo + i]) | !axc_ce_finite(decoded[lo + i]);
    if (block_any<WARP>(s_bad, bad))
        return;
    for (size_t i = threadIdx.x; i < len; i += blockDim.x)
        residual[lo + i] = axc_ce_add(residual[lo + i],
                                      AXC_FMUL(AXC_FSUB(x[lo + i], decoded[lo + i]), mult));
}

extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_feedback_kernel(int block, const float *x, const float *decoded,
                              unsigned long long n, float mult, float *residual)
{
    feedback_block<false>(block, x, decoded, n, mult, residual);
}

extern "C" __global__ void __launch_bounds__(AXC_THREADS)
    axc_codec_feedback_warp_kernel(int block, const float *x, const float *decoded,
                                   unsigned long long n, float mult, float *residual)
{
    feedback_block<true>(block, x, decoded, n, mult, residual);
}
