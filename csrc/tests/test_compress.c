/* The codecs (axc/compress.h): error bounds per element and block, determinism, zero blocks,
 * non-finite values, odd and short lengths, every supported block size, error feedback. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../compress/codec_elem.h"
#include "axc/compress.h"
#include "ctest.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double uniform(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

/* Gradient-like values: log-uniform magnitudes over ~3 decades, random signs, rare outliers,
 * some exact zeros. */
static void fill(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double u = uniform();
        double mag = 1e-4 * pow(10.0, 3.0 * uniform());
        if (u < 0.001)
            mag *= 20;
        else if (u < 0.01)
            mag = 0;
        x[i] = (float)(uniform() < 0.5 ? -mag : mag);
    }
}

static float scale_of(const unsigned char *enc, size_t b)
{
    float s;
    memcpy(&s, enc + 4 * b, 4);
    return s;
}

static const axc_codec codecs[] = {AXC_CODEC_BF16, AXC_CODEC_FP8, AXC_CODEC_INT8, AXC_CODEC_INT4};

/* the stated bound of element x decoded as y in a block of absmax a and scale s */
static int within_bound(axc_codec codec, float x, float y, float a, float s)
{
    double err = fabs((double)x - (double)y), ulps = ldexp((double)a, -22) + ldexp(1.0, -149);
    switch (codec) {
    case AXC_CODEC_BF16: return err <= ldexp(fabs((double)x), -8) + ldexp(1.0, -134);
    case AXC_CODEC_FP8:
        return err <= ldexp(fabs((double)x), -4) + ldexp((double)s, -10) + ulps;
    case AXC_CODEC_INT8:
    case AXC_CODEC_INT4: return s == 0.0f ? err <= a : err <= (double)s / 2 + ulps;
    default: return err == 0;
    }
}

/* Round trip of n values: size, determinism (every byte written), bounds, decode-accumulate. */
static void check_round_trip(axc_codec codec, int block, const float *x, size_t n)
{
    size_t bytes = 0;
    CHECK_OK(axc_codec_encoded_bytes(codec, n, block, &bytes));
    size_t nb = (n + (size_t)block - 1) / (size_t)block;
    size_t want = codec == AXC_CODEC_BF16   ? 2 * n
                  : codec == AXC_CODEC_INT4 ? 4 * nb + (n + 1) / 2
                                            : 4 * nb + n;
    CHECK(bytes == want);
    unsigned char *e1 = malloc(bytes + 1), *e2 = malloc(bytes + 1);
    float *y = malloc((n + 1) * sizeof *y), *acc = malloc((n + 1) * sizeof *acc);
    memset(e1, 0xaa, bytes + 1);
    memset(e2, 0x55, bytes + 1);
    CHECK_OK(axc_codec_encode(codec, block, x, n, e1));
    CHECK_OK(axc_codec_encode(codec, block, x, n, e2));
    CHECK(memcmp(e1, e2, bytes) == 0);             /* deterministic, every byte written */
    CHECK(e1[bytes] == 0xaa && e2[bytes] == 0x55); /* nothing past the end */
    CHECK_OK(axc_codec_decode(codec, block, e1, n, y, 0));
    int bad = 0;
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * (size_t)block, hi = lo + (size_t)block < n ? lo + (size_t)block : n;
        float a = 0;
        for (size_t i = lo; i < hi; i++)
            a = fabsf(x[i]) > a ? fabsf(x[i]) : a;
        float s = codec == AXC_CODEC_BF16 ? 0 : scale_of(e1, b);
        if (codec != AXC_CODEC_BF16 && s != (codec == AXC_CODEC_FP8    ? a / 448.0f
                                             : codec == AXC_CODEC_INT8 ? a / 127.0f
                                                                       : a / 7.0f))
            bad++;
        for (size_t i = lo; i < hi; i++)
            if (!within_bound(codec, x[i], y[i], a, s)) {
                if (bad++ < 3)
                    fprintf(stderr, "%s block %d n %zu: x[%zu]=%g decoded %g (absmax %g)\n",
                            axc_codec_name(codec), block, n, i, (double)x[i], (double)y[i],
                            (double)a);
            }
    }
    CHECK(bad == 0);
    /* decode-accumulate adds the decoded value once per element */
    for (size_t i = 0; i < n; i++)
        acc[i] = (float)i;
    CHECK_OK(axc_codec_decode(codec, block, e1, n, acc, 1));
    int acc_bad = 0;
    for (size_t i = 0; i < n; i++)
        acc_bad += acc[i] != (float)i + y[i];
    CHECK(acc_bad == 0);
    free(e1);
    free(e2);
    free(y);
    free(acc);
}

static void test_bounds_all_blocks(void)
{
    float *x = malloc(20000 * sizeof *x);
    fill(x, 20000);
    for (int block = AXC_CODEC_MIN_BLOCK; block <= AXC_CODEC_MAX_BLOCK; block *= 2) {
        size_t lens[] = {0, 1, 2, 3, 5, 31, (size_t)block - 1, (size_t)block, (size_t)block + 1,
                         3 * (size_t)block + 7, 10007};
        for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++)
            for (size_t k = 0; k < sizeof lens / sizeof *lens; k++)
                check_round_trip(codecs[c], block, x, lens[k]);
    }
    free(x);
}

static void test_zero_blocks(void)
{
    float x[300] = {0}, y[300];
    x[299] = -0.0f;
    x[5] = 0; /* first block all zero; a later block has values */
    for (int i = 256; i < 299; i++)
        x[i] = (float)(i - 280) * 0.25f;
    x[257] = -31.75f; /* int8 scale 31.75 / 127 = 0.25: multiples of 0.25 come back exactly */
    unsigned char enc[2000];
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++) {
        CHECK_OK(axc_codec_encode(codecs[c], 256, x, 300, enc));
        CHECK_OK(axc_codec_decode(codecs[c], 256, enc, 300, y, 0));
        int nonzero = 0;
        for (int i = 0; i < 256; i++)
            nonzero += y[i] != 0.0f || isnan(y[i]);
        CHECK(nonzero == 0);
        if (codecs[c] != AXC_CODEC_BF16)
            CHECK(scale_of(enc, 0) == 0.0f);
        /* values that are multiples of the int8 scale come back exactly */
        if (codecs[c] == AXC_CODEC_INT8)
            CHECK(y[280] == 0.0f && y[281] == 0.25f);
    }
}

/* A block holding inf/nan decodes non-finite everywhere (sign kept for one kind of infinity),
 * the other blocks are unaffected. bf16 keeps each element's own value. */
static void test_non_finite(void)
{
    const int B = 64, n = 4 * B + 3;
    float x[4 * 64 + 3], y[4 * 64 + 3];
    unsigned char enc[4096];
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++) {
        axc_codec codec = codecs[c];
        fill(x, (size_t)n);
        x[3] = INFINITY;                         /* block 0: +inf */
        x[B + 7] = -INFINITY;                    /* block 1: -inf */
        x[2 * B + 1] = NAN;                      /* block 2: nan */
        x[4 * B + 1] = INFINITY;                 /* short last block: +inf and -inf */
        x[4 * B + 2] = -INFINITY;
        CHECK_OK(axc_codec_encode(codec, B, x, (size_t)n, enc));
        CHECK_OK(axc_codec_decode(codec, B, enc, (size_t)n, y, 0));
        if (codec == AXC_CODEC_BF16) {
            CHECK(y[3] == INFINITY && y[B + 7] == -INFINITY && isnan(y[2 * B + 1]));
            CHECK(isfinite(y[0]) && isfinite(y[B]));
            continue;
        }
        int ok = 1;
        for (int i = 0; i < B; i++) {
            ok &= y[i] == INFINITY;
            ok &= y[B + i] == -INFINITY;
            ok &= isnan(y[2 * B + i]) != 0;
            ok &= isfinite(y[3 * B + i]) != 0;
        }
        for (int i = 4 * B; i < n; i++)
            ok &= isnan(y[i]) != 0;
        CHECK(ok);
        CHECK(scale_of(enc, 0) == INFINITY && scale_of(enc, 1) == -INFINITY);
        CHECK(isnan(scale_of(enc, 2)) && isfinite(scale_of(enc, 3)) && isnan(scale_of(enc, 4)));
    }
}

/* e4m3: every finite code survives a round trip; ties round to even; saturation at 448. */
static void test_e4m3(void)
{
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f)
            continue;
        float v = axc_ce_e4m3_to_f32((uint8_t)c);
        if (axc_ce_e4m3(v) != (c == 0x80 ? 0x80 : c))
            bad++;
    }
    CHECK(bad == 0);
    CHECK(axc_ce_e4m3_to_f32(0x7e) == 448.0f && axc_ce_e4m3_to_f32(0x01) == ldexpf(1, -9));
    CHECK(axc_ce_e4m3_to_f32(0x08) == ldexpf(1, -6));
    CHECK(axc_ce_e4m3(1.0625f) == axc_ce_e4m3(1.0f));          /* tie to even (mantissa 0) */
    CHECK(axc_ce_e4m3(1.1875f) == (uint8_t)(axc_ce_e4m3(1.0f) + 2)); /* tie to even (2) */
    CHECK(axc_ce_e4m3(ldexpf(1.5f, -9)) == 2);                 /* subnormal tie to even */
    CHECK(axc_ce_e4m3(ldexpf(15.5f, -10)) == 8);               /* rounds up into min normal */
    CHECK(axc_ce_e4m3(448.0f) == 0x7e && axc_ce_e4m3(-448.0f) == 0xfe);
    CHECK(axc_ce_bf16(1.0f + ldexpf(1, -8)) == 0x3f80);
    CHECK(axc_ce_bf16(INFINITY) == 0x7f80 && (axc_ce_bf16(NAN) & 0x7fc0) == 0x7fc0);
}

/* Error feedback: the decoded sum over steps tracks the true sum up to the last residual. */
static void test_error_feedback(void)
{
    enum { N = 1000, T = 20 };
    static float x[N], r[N], r_plain[N], y[N], sum_true[N], sum_ef[N], sum_plain[N];
    unsigned char enc[N * 4], enc2[N * 4];
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++) {
        axc_codec codec = codecs[c];
        memset(r, 0, sizeof r);
        memset(sum_true, 0, sizeof sum_true);
        memset(sum_ef, 0, sizeof sum_ef);
        memset(sum_plain, 0, sizeof sum_plain);
        for (int t = 0; t < T; t++) {
            fill(x, N);
            if (t == 0) { /* a zero residual: the same bytes as plain encoding */
                CHECK_OK(axc_codec_encode(codec, 128, x, N, enc2));
                memcpy(r_plain, r, sizeof r);
            }
            CHECK_OK(axc_codec_encode_ef(codec, 128, x, r, N, enc));
            if (t == 0) { /* (bytes may differ in the sign of zeros: -0 + 0 = +0) */
                float d1[N], d2[N];
                int same = 1;
                CHECK_OK(axc_codec_decode(codec, 128, enc, N, d1, 0));
                CHECK_OK(axc_codec_decode(codec, 128, enc2, N, d2, 0));
                for (int i = 0; i < N; i++)
                    same &= d1[i] == d2[i];
                CHECK(same);
            }
            CHECK_OK(axc_codec_decode(codec, 128, enc, N, sum_ef, 1));
            CHECK_OK(axc_codec_encode(codec, 128, x, N, enc2));
            CHECK_OK(axc_codec_decode(codec, 128, enc2, N, sum_plain, 1));
            for (int i = 0; i < N; i++)
                sum_true[i] += x[i];
        }
        double e_ef = 0, e_plain = 0, e_res = 0;
        for (int i = 0; i < N; i++) {
            e_ef += fabs((double)sum_ef[i] - sum_true[i]);
            e_plain += fabs((double)sum_plain[i] - sum_true[i]);
            e_res += fabs((double)r[i]);
        }
        /* telescoping: sum of decoded = sum of inputs - final residual (up to fp32 sums) */
        CHECK(fabs(e_ef - e_res) <= 0.05 * e_res + 1e-3);
        if (codec != AXC_CODEC_BF16)
            CHECK(e_ef * 3 < e_plain);
        /* an overflow step leaves the residual of the non-finite block untouched */
        memcpy(r_plain, r, sizeof r);
        x[5] = INFINITY;
        CHECK_OK(axc_codec_encode_ef(codec, 128, x, r, N, enc));
        CHECK(memcmp(r, r_plain, 128 * sizeof(float)) == 0);
        CHECK_OK(axc_codec_decode(codec, 128, enc, N, y, 0));
        CHECK(isinf(y[5]));
    }
}

/* A finite value the codec rounds to inf (bf16 above 3.3962e38) leaves the residual as a
 * non-finite input does (was: c - inf = -inf, kept for good, so every later step of the block
 * was -inf); the block-scaled codecs decode FLT_MAX finite (was: int8's 127 * rn(FLT_MAX / 127)
 * rounded to inf). Plain and after-reduction feedback alike. */
static void test_error_feedback_decoded_overflow(void)
{
    enum { N = 4 };
    unsigned char enc[64];
    float x[N], r[N], y[N];
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++) {
        axc_codec codec = codecs[c];
        float big = codec == AXC_CODEC_BF16 ? 3.397e38f : FLT_MAX;
        for (int i = 0; i < N; i++)
            x[i] = i ? 1.0f : big, r[i] = 0.25f;
        CHECK_OK(axc_codec_encode(codec, 128, x, N, enc));
        CHECK_OK(axc_codec_decode(codec, 128, enc, N, y, 0));
        int inf_out = isinf(y[0]);
        CHECK(inf_out == (codec == AXC_CODEC_BF16)); /* (only bf16 cannot represent it) */
        CHECK_OK(axc_codec_encode_ef(codec, 128, x, r, N, enc));
        int kept = 1, finite = 1;
        for (int i = 0; i < N; i++)
            kept &= r[i] == 0.25f, finite &= isfinite(r[i]);
        CHECK(finite && kept == inf_out);
        for (int i = 0; i < N; i++) /* the next step recovers */
            x[i] = 1.0f;
        CHECK_OK(axc_codec_encode_ef(codec, 128, x, r, N, enc));
        CHECK_OK(axc_codec_decode(codec, 128, enc, N, y, 0));
        CHECK(isfinite(y[0]) && isfinite(r[0]));
        /* after a reduction: an owner's finite sum that decodes to inf */
        for (int i = 0; i < N; i++)
            x[i] = i ? 1.0f : big, y[i] = i ? 1.0f : INFINITY, r[i] = 0.25f;
        axc_codec_feedback(codec, 128, x, y, N, 1.0f, r);
        kept = 1;
        for (int i = 0; i < N; i++)
            kept &= r[i] == 0.25f;
        CHECK(kept);
    }
}

static void test_invalid(void)
{
    size_t bytes;
    axc_codec codec;
    CHECK(axc_codec_encoded_bytes(AXC_CODEC_INT8, 10, 48, &bytes) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "power of two") != NULL);
    CHECK(axc_codec_encoded_bytes(AXC_CODEC_INT8, 10, 16, &bytes) == AXC_ERR_INVALID);
    CHECK(axc_codec_encoded_bytes(AXC_CODEC_INT8, 10, 8192, &bytes) == AXC_ERR_INVALID);
    CHECK(axc_codec_encoded_bytes((axc_codec)9, 10, 0, &bytes) == AXC_ERR_INVALID);
    CHECK_OK(axc_codec_encoded_bytes(AXC_CODEC_INT4, 3, 0, &bytes));
    CHECK(bytes == 4 + 2);
    CHECK(axc_codec_from_name("int3", &codec) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "'int4'") != NULL);
    CHECK_OK(axc_codec_from_name("fp8", &codec));
    CHECK(codec == AXC_CODEC_FP8);
    float x = 1;
    CHECK(axc_codec_encode(AXC_CODEC_INT8, 0, &x, 1, NULL) == AXC_ERR_INVALID);
}

/* The host's add-and-subtract rounding is rintf, bit for bit (the CUDA kernels use rintf):
 * ties to even, both zeros, the 2^22 switch-over, large and non-finite values. */
static void test_rint(void)
{
    int bad = 0;
    const float fixed[] = {0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 0.49999997f, -0.3f, -0.0f, 0.0f,
                           4194303.5f, 4194304.0f, 4194304.5f, 8388607.5f, 1e30f, -1e30f,
                           INFINITY, -INFINITY, 1e-45f, -1e-45f, 127.5f, -127.5f, 7.5f, -6.5f};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        float a = axc_ce_rint(fixed[i]), b = rintf(fixed[i]);
        bad += memcmp(&a, &b, 4) != 0;
    }
    uint32_t u = 12345u;
    for (int i = 0; i < 200000; i++) { /* random bit patterns (finite), and halves near qmax */
        u = u * 1664525u + 1013904223u;
        float x;
        memcpy(&x, &u, 4);
        float h = (float)((int)(u % 600u) - 300) * 0.5f;
        float a = axc_ce_rint(h), b = rintf(h);
        bad += memcmp(&a, &b, 4) != 0;
        if (isfinite(x)) {
            a = axc_ce_rint(x), b = rintf(x);
            bad += memcmp(&a, &b, 4) != 0;
        }
    }
    CHECK(bad == 0);
}

int main(void)
{
    test_rint();
    test_bounds_all_blocks();
    test_zero_blocks();
    test_non_finite();
    test_e4m3();
    test_error_feedback();
    test_error_feedback_decoded_overflow();
    test_invalid();
    return ctest_summary("test_compress");
}
