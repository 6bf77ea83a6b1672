/* Host reductions: blocked so the fp32/int64 accumulator stays in L1 and loops vectorise. */
#include "axc/reduce.h"

#include <string.h>

float axc_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t axc_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float axc_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t axc_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000u, absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (absu >= 0x477ff000u)               /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (absu < 0x38800000u) { /* result is subnormal or zero */
        if (absu < 0x33000000u)
            return (uint16_t)sign;
        uint32_t exp = absu >> 23, man = (absu & 0x7fffffu) | 0x800000u;
        int shift = (int)(126 - 14 + 1 - exp) + 13; /* bits to drop */
        uint32_t half = 1u << (shift - 1), rest = man & ((1u << shift) - 1u), v = man >> shift;
        if (rest > half || (rest == half && (v & 1u)))
            v++;
        return (uint16_t)(sign | v);
    }
    uint32_t v = absu - ((uint32_t)(127 - 15) << 23);
    uint32_t rest = v & 0x1fffu;
    v >>= 13;
    if (rest > 0x1000u || (rest == 0x1000u && (v & 1u)))
        v++;
    return (uint16_t)(sign | v);
}

enum { BLOCK = 2048 };

#define LOOP_FLOAT(T, LOAD, STORE, ACC)                                                   \
    do {                                                                                  \
        ACC acc[BLOCK];                                                                   \
        for (size_t base = 0; base < n; base += BLOCK) {                                  \
            size_t m = n - base < BLOCK ? n - base : BLOCK;                               \
            const T *s0 = (const T *)srcs[0] + base;                                      \
            for (size_t x = 0; x < m; x++)                                                \
                acc[x] = LOAD(s0[x]);                                                     \
            for (int k = 1; k < nsrc; k++) {                                              \
                const T *sk = (const T *)srcs[k] + base;                                  \
                if (op == AXC_RED_MAX) {                                                  \
                    for (size_t x = 0; x < m; x++) {                                      \
                        ACC v = LOAD(sk[x]);                                              \
                        acc[x] = (v > acc[x] || v != v) ? v : acc[x];                     \
                    }                                                                     \
                } else {                                                                  \
                    for (size_t x = 0; x < m; x++)                                        \
                        acc[x] += LOAD(sk[x]);                                            \
                }                                                                         \
            }                                                                             \
            T *d = (T *)dst + base;                                                       \
            if (op == AXC_RED_AVG) {                                                      \
                for (size_t x = 0; x < m; x++)                                            \
                    d[x] = STORE(acc[x] / (ACC)avg_div);                                  \
            } else {                                                                      \
                for (size_t x = 0; x < m; x++)                                            \
                    d[x] = STORE(acc[x]);                                                 \
            }                                                                             \
        }                                                                                 \
    } while (0)

#define ID(x) (x)

/* Integers: wrap-around sums computed on uint64 (well defined), max/avg on int64. */
#define LOOP_INT(T, UT)                                                                   \
    do {                                                                                  \
        int64_t acc[BLOCK];                                                               \
        for (size_t base = 0; base < n; base += BLOCK) {                                  \
            size_t m = n - base < BLOCK ? n - base : BLOCK;                               \
            const T *s0 = (const T *)srcs[0] + base;                                      \
            for (size_t x = 0; x < m; x++)                                                \
                acc[x] = (int64_t)s0[x];                                                  \
            for (int k = 1; k < nsrc; k++) {                                              \
                const T *sk = (const T *)srcs[k] + base;                                  \
                if (op == AXC_RED_MAX) {                                                  \
                    for (size_t x = 0; x < m; x++)                                        \
                        acc[x] = (int64_t)sk[x] > acc[x] ? (int64_t)sk[x] : acc[x];       \
                } else {                                                                  \
                    for (size_t x = 0; x < m; x++)                                        \
                        acc[x] = (int64_t)((uint64_t)acc[x] + (uint64_t)(int64_t)sk[x]);  \
                }                                                                         \
            }                                                                             \
            T *d = (T *)dst + base;                                                       \
            for (size_t x = 0; x < m; x++) {                                              \
                if (op == AXC_RED_AVG)                                                    \
                    d[x] = (T)(acc[x] / avg_div);                                         \
                else                                                                      \
                    memcpy(&d[x], &(UT){(UT)(uint64_t)acc[x]}, sizeof(T));                \
            }                                                                             \
        }                                                                                 \
    } while (0)

void axc_reduce(axc_dtype dt, axc_redop op, void *dst, const void *const *srcs, int nsrc,
                size_t n, int avg_div)
{
    switch (dt) {
    case AXC_DT_F32: LOOP_FLOAT(float, ID, ID, float); break;
    case AXC_DT_F64: LOOP_FLOAT(double, ID, ID, double); break;
    case AXC_DT_BF16: LOOP_FLOAT(uint16_t, axc_bf16_to_f32, axc_f32_to_bf16, float); break;
    case AXC_DT_F16: LOOP_FLOAT(uint16_t, axc_f16_to_f32, axc_f32_to_f16, float); break;
    case AXC_DT_I8: LOOP_INT(int8_t, uint8_t); break;
    case AXC_DT_U8: LOOP_INT(uint8_t, uint8_t); break;
    case AXC_DT_I32: LOOP_INT(int32_t, uint32_t); break;
    case AXC_DT_I64: LOOP_INT(int64_t, uint64_t); break;
    case AXC_DT_COUNT: break;
    }
}
