/* Host reductions and 16-bit float conversions. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "axc/reduce.h"
#include "ctest.h"

int main(void)
{
    /* bf16/f16 round trips of every 16-bit pattern that is not NaN */
    int bad_bf = 0, bad_h = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = axc_bf16_to_f32((uint16_t)h);
        if (f == f && axc_f32_to_bf16(f) != h)
            bad_bf++;
        float g = axc_f16_to_f32((uint16_t)h);
        if (g == g && axc_f32_to_f16(g) != h)
            bad_h++;
    }
    CHECK(bad_bf == 0);
    CHECK(bad_h == 0);
    CHECK(axc_f16_to_f32(0x3c00) == 1.0f);
    CHECK(axc_f16_to_f32(0x0001) == ldexpf(1.0f, -24));
    CHECK(axc_f32_to_f16(65520.0f) == 0x7c00);       /* rounds to inf */
    CHECK(axc_f32_to_f16(65504.0f) == 0x7bff);       /* max half */
    CHECK(axc_f32_to_bf16(1.0f + ldexpf(1, -8)) == 0x3f80); /* tie to even */
    CHECK(axc_f32_to_bf16(1.0f + 3 * ldexpf(1, -8)) == 0x3f82);

    /* float32: sum, avg, max in source order; dst may alias a source */
    float a[5] = {1, 2, 3, 4, -5}, b[5] = {10, 20, 30, 40, 50}, out[5];
    const void *srcs[2] = {a, b};
    axc_reduce(AXC_DT_F32, AXC_RED_SUM, out, srcs, 2, 5, 2);
    CHECK(out[0] == 11 && out[4] == 45);
    axc_reduce(AXC_DT_F32, AXC_RED_AVG, out, srcs, 2, 5, 2);
    CHECK(out[1] == 11 && out[4] == 22.5f);
    axc_reduce(AXC_DT_F32, AXC_RED_MAX, a, srcs, 2, 5, 2);
    CHECK(a[0] == 10 && a[4] == 50);

    /* int8: sums wrap, avg truncates toward zero, max is signed */
    int8_t x[3] = {100, -7, -128}, y[3] = {100, 2, -1}, z[3];
    const void *s8[2] = {x, y};
    axc_reduce(AXC_DT_I8, AXC_RED_SUM, z, s8, 2, 3, 2);
    CHECK(z[0] == (int8_t)-56 && z[1] == -5 && z[2] == 127);
    axc_reduce(AXC_DT_I8, AXC_RED_AVG, z, s8, 2, 3, 2);
    CHECK(z[0] == 100 && z[1] == -2 && z[2] == -64);
    axc_reduce(AXC_DT_I8, AXC_RED_MAX, z, s8, 2, 3, 2);
    CHECK(z[0] == 100 && z[1] == 2 && z[2] == -1);
    uint8_t u[2] = {200, 1}, v[2] = {100, 2}, w[2];
    const void *su[2] = {u, v};
    axc_reduce(AXC_DT_U8, AXC_RED_SUM, w, su, 2, 2, 2);
    CHECK(w[0] == 44 && w[1] == 3);
    axc_reduce(AXC_DT_U8, AXC_RED_MAX, w, su, 2, 2, 2);
    CHECK(w[0] == 200 && w[1] == 2);

    /* bf16 sum accumulates in fp32 and rounds once: 256 + 1 + 1 = 258 exactly */
    uint16_t p[1] = {axc_f32_to_bf16(256)}, q[1] = {axc_f32_to_bf16(1)}, r[1];
    const void *s16[3] = {p, q, q};
    axc_reduce(AXC_DT_BF16, AXC_RED_SUM, r, s16, 3, 1, 3);
    CHECK(axc_bf16_to_f32(r[0]) == 258.0f);

    /* long inputs cross the internal block size */
    enum { N = 5000 };
    static float big0[N], big1[N], bigo[N];
    for (int i = 0; i < N; i++) {
        big0[i] = (float)i;
        big1[i] = (float)(2 * i);
    }
    const void *sb[2] = {big0, big1};
    axc_reduce(AXC_DT_F32, AXC_RED_SUM, bigo, sb, 2, N, 2);
    int ok = 1;
    for (int i = 0; i < N; i++)
        ok &= bigo[i] == (float)(3 * i);
    CHECK(ok);
    return ctest_summary("test_reduce");
}
