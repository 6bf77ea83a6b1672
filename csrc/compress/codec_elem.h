/* Per-element and per-block routines of the codecs, shared by the CPU reference (codec.c) and
 * the CUDA kernels (codec_kernels.cu) so both produce the same bytes: every fp32 operation is
 * an explicitly rounded one (no contraction into FMA, no fast-math), rounding to integers is
 * round to nearest even (axc_ce_rint) and the e4m3 conversion is integer arithmetic. */
#ifndef AXC_CODEC_ELEM_H
#define AXC_CODEC_ELEM_H

#include <stdint.h>
#include <string.h>
#ifndef __CUDACC__
#include <math.h>
#endif

#ifdef __CUDACC__
#define AXC_HD __host__ __device__ static inline
#else
#define AXC_HD static inline
#endif

#ifdef __CUDA_ARCH__
#define AXC_FDIV(a, b) __fdiv_rn((a), (b))
#define AXC_FMUL(a, b) __fmul_rn((a), (b))
#define AXC_FADD(a, b) __fadd_rn((a), (b))
#define AXC_FSUB(a, b) __fsub_rn((a), (b))
#else
/* C11 without -ffast-math: each operator rounds once (ISO mode keeps -ffp-contract=off) */
#define AXC_FDIV(a, b) ((a) / (b))
#define AXC_FMUL(a, b) ((a) * (b))
#define AXC_FADD(a, b) ((a) + (b))
#define AXC_FSUB(a, b) ((a) - (b))
#endif

#define AXC_E4M3_MAX 448.0f

AXC_HD uint32_t axc_ce_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

AXC_HD float axc_ce_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

AXC_HD int axc_ce_finite(float f) { return (axc_ce_bits(f) & 0x7f800000u) != 0x7f800000u; }

/* NaN payloads differ between x86 (the operand's, or 0xffc00000) and CUDA (0x7fffffff): every
 * NaN an operation of the codecs can produce is replaced by this one, so bytes stay equal. */
#define AXC_CE_NAN 0x7fc00000u

AXC_HD float axc_ce_canon(float f) { return f != f ? axc_ce_float(AXC_CE_NAN) : f; }

AXC_HD float axc_ce_add(float a, float b) { return axc_ce_canon(AXC_FADD(a, b)); }

/* bfloat16, round to nearest even; nan becomes the canonical nan, inf stays inf */
AXC_HD uint16_t axc_ce_bf16(float f)
{
    uint32_t u = axc_ce_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)(AXC_CE_NAN >> 16);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

AXC_HD float axc_ce_bf16_to_f32(uint16_t h) { return axc_ce_float((uint32_t)h << 16); }

/* What the scan of a block found: the absmax of its finite values and which non-finite kinds. */
typedef struct axc_ce_scan {
    float absmax;
    unsigned flags; /* 1: nan, 2: +inf, 4: -inf */
} axc_ce_scan;

AXC_HD void axc_ce_scan_add(axc_ce_scan *s, float x)
{
    uint32_t u = axc_ce_bits(x), a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        s->flags |= 1u;
    else if (a == 0x7f800000u)
        s->flags |= (u >> 31) ? 4u : 2u;
    else if (axc_ce_float(a) > s->absmax)
        s->absmax = axc_ce_float(a);
}

/* The block's scale: absmax / qmax, or the non-finite marker (see axc/compress.h). */
AXC_HD float axc_ce_scale(axc_ce_scan s, float qmax)
{
    if (s.flags == 2u)
        return axc_ce_float(0x7f800000u);
    if (s.flags == 4u)
        return axc_ce_float(0xff800000u);
    if (s.flags)
        return axc_ce_float(AXC_CE_NAN);
    float scale = AXC_FDIV(s.absmax, qmax);
    /* near FLT_MAX, qmax * scale can round to inf: a smaller scale keeps every decoded value
     * finite (the largest ones then clamp to qmax, within a few ulps) */
    while (!axc_ce_finite(AXC_FMUL(scale, qmax)))
        scale = axc_ce_float(axc_ce_bits(scale) - 1u);
    return scale;
}

/* rintf (round to nearest even, the default mode). On the host, the classic add-and-subtract
 * of 1.5 * 2^23 for |v| < 2^22 (exact there: the sum's ulp is 1, so the addition rounds v to an
 * integer, ties to even, and the subtraction is exact), with v's sign for a zero result as
 * rintf gives it: x86-64's baseline has no rounding instruction, so rintf is a libm call per
 * element, several times slower than the codec around it. */
AXC_HD float axc_ce_rint(float v)
{
#ifdef __CUDA_ARCH__
    return rintf(v);
#else
    if (!(fabsf(v) < 4194304.0f))
        return rintf(v);
    float r = AXC_FSUB(AXC_FADD(v, 12582912.0f), 12582912.0f);
    return copysignf(r, v);
#endif
}

/* Symmetric integer quantization of x with a finite scale s: rint(x / s) clamped to +-qmax
 * (0 when s is 0: an all-zero block, or an absmax so small that s underflowed). */
AXC_HD int axc_ce_quant(float x, float s, int qmax)
{
    if (s == 0.0f)
        return 0;
    float q = axc_ce_rint(AXC_FDIV(x, s));
    if (q > (float)qmax)
        q = (float)qmax;
    if (q < (float)-qmax)
        q = (float)-qmax;
    return (int)q;
}

/* e4m3 ("fn": bias 7, no inf, max 448) of y, |y| <= 448 finite, round to nearest even. */
AXC_HD uint8_t axc_ce_e4m3(float y)
{
    uint32_t u = axc_ce_bits(y), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    uint32_t code;
    if (a < 0x3c800000u) { /* |y| < 2^-6: subnormal steps of 2^-9 (exact scaling, then rint) */
        code = (uint32_t)axc_ce_rint(AXC_FMUL(axc_ce_float(a), 512.0f)); /* 8 carries into 2^-6 */
    } else {
        /* rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits */
        uint32_t m = a - (120u << 23);
        uint32_t rem = m & 0xfffffu;
        code = m >> 20;
        if (rem > 0x80000u || (rem == 0x80000u && (code & 1u)))
            code++;
        if (code > 0x7eu)
            code = 0x7eu; /* saturate at 448 (0x7f is nan) */
    }
    return (uint8_t)(sign | code);
}

AXC_HD float axc_ce_e4m3_to_f32(uint8_t c)
{
    uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    float v;
    if (e == 0)
        v = AXC_FMUL((float)m, 0.001953125f); /* m * 2^-9, exact */
    else
        v = axc_ce_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -v : v;
}

/* The e4m3 code of x in a block of finite scale s (0 for a zero scale). */
AXC_HD uint8_t axc_ce_fp8(float x, float s)
{
    if (s == 0.0f)
        return 0;
    float y = AXC_FDIV(x, s);
    if (y > AXC_E4M3_MAX)
        y = AXC_E4M3_MAX;
    if (y < -AXC_E4M3_MAX)
        y = -AXC_E4M3_MAX;
    return axc_ce_e4m3(y);
}

/* Decoded values: a non-finite scale decodes to itself in every element of the block. */
AXC_HD float axc_ce_dequant(int q, float s)
{
    return axc_ce_finite(s) ? AXC_FMUL((float)q, s) : s;
}

AXC_HD float axc_ce_defp8(uint8_t c, float s)
{
    return axc_ce_finite(s) ? AXC_FMUL(axc_ce_e4m3_to_f32(c), s) : s;
}

AXC_HD int axc_ce_int4(uint8_t byte, size_t i)
{
    int v = (i & 1) ? (byte >> 4) : (byte & 0xf);
    return v >= 8 ? v - 16 : v;
}

#endif
