/* CPU reference of the codecs (formats and bounds in axc/compress.h). The CUDA kernels in
 * codec_kernels.cu share the element routines of codec_elem.h and produce the same bytes. */
#include "axc/compress.h"

#include <math.h>
#include <string.h>

#include "codec_elem.h"

static const char *const codec_names[AXC_CODEC_COUNT] = {"none", "bf16", "fp8", "int8", "int4"};

const char *axc_codec_name(axc_codec codec)
{
    return ((int)codec >= 0 && codec < AXC_CODEC_COUNT) ? codec_names[codec] : "?";
}

axc_status axc_codec_from_name(const char *name, axc_codec *codec)
{
    for (int i = 0; i < AXC_CODEC_COUNT; i++) {
        if (name && strcmp(name, codec_names[i]) == 0) {
            *codec = (axc_codec)i;
            return AXC_OK;
        }
    }
    return axc_fail(AXC_ERR_INVALID,
                    "unknown compression codec '%s', expected one of 'none', 'bf16', 'fp8', "
                    "'int8', 'int4'",
                    name ? name : "(null)");
}

int axc_codec_default_block(axc_codec codec)
{
    return codec == AXC_CODEC_INT4 ? AXC_CODEC_DEFAULT_BLOCK_INT4 : AXC_CODEC_DEFAULT_BLOCK;
}

axc_status axc_codec_check(axc_codec codec, int block, int *block_out)
{
    if ((int)codec < 0 || codec >= AXC_CODEC_COUNT)
        return axc_fail(AXC_ERR_INVALID, "unknown codec %d, expected 0..%d", (int)codec,
                        AXC_CODEC_COUNT - 1);
    if (block == 0)
        block = axc_codec_default_block(codec);
    if (block < AXC_CODEC_MIN_BLOCK || block > AXC_CODEC_MAX_BLOCK || (block & (block - 1)))
        return axc_fail(AXC_ERR_INVALID,
                        "compression block %d is not supported: expected a power of two from "
                        "%d to %d (or 0 for the codec's default, %d for %s)",
                        block, AXC_CODEC_MIN_BLOCK, AXC_CODEC_MAX_BLOCK,
                        axc_codec_default_block(codec), axc_codec_name(codec));
    if (block_out)
        *block_out = block;
    return AXC_OK;
}

static size_t n_blocks(size_t n, int block) { return (n + (size_t)block - 1) / (size_t)block; }

axc_status axc_codec_encoded_bytes(axc_codec codec, size_t n, int block, size_t *bytes)
{
    AXC_TRY(axc_codec_check(codec, block, &block));
    size_t scales = 4 * n_blocks(n, block);
    switch (codec) {
    case AXC_CODEC_NONE: *bytes = 4 * n; break;
    case AXC_CODEC_BF16: *bytes = 2 * n; break;
    case AXC_CODEC_FP8:
    case AXC_CODEC_INT8: *bytes = scales + n; break;
    case AXC_CODEC_INT4: *bytes = scales + (n + 1) / 2; break;
    case AXC_CODEC_COUNT: break;
    }
    return AXC_OK;
}

static float qmax_of(axc_codec codec)
{
    return codec == AXC_CODEC_FP8 ? AXC_E4M3_MAX : codec == AXC_CODEC_INT8 ? 127.0f : 7.0f;
}

/* One block [lo, hi) of a block-scaled codec: scale and payload. `x` is the whole input. */
static float encode_block(axc_codec codec, const float *x, size_t lo, size_t hi,
                          unsigned char *payload)
{
    axc_ce_scan scan = {0.0f, 0u};
    for (size_t i = lo; i < hi; i++)
        axc_ce_scan_add(&scan, x[i]);
    float s = axc_ce_scale(scan, qmax_of(codec));
    float fs = axc_ce_finite(s) ? s : 0.0f; /* a marked block's payload is zeros */
    if (codec == AXC_CODEC_INT8) {
        for (size_t i = lo; i < hi; i++)
            payload[i] = (unsigned char)(int8_t)axc_ce_quant(x[i], fs, 127);
    } else if (codec == AXC_CODEC_FP8) {
        for (size_t i = lo; i < hi; i++)
            payload[i] = axc_ce_fp8(x[i], fs);
    } else {
        /* blocks hold an even number of elements but the last, so a byte never spans two */
        for (size_t i = lo; i < hi; i += 2) {
            unsigned v = (unsigned)axc_ce_quant(x[i], fs, 7) & 0xfu;
            if (i + 1 < hi)
                v |= ((unsigned)axc_ce_quant(x[i + 1], fs, 7) & 0xfu) << 4;
            payload[i / 2] = (unsigned char)v;
        }
    }
    return s;
}

/* Decodes elements [lo, hi) of one block of scale s into out[lo, hi) (added to it with
 * `accumulate`): one loop per codec, the choice made once per block, not per element. */
static void decode_block(axc_codec codec, const unsigned char *payload, float s, size_t lo,
                         size_t hi, float *out, int accumulate)
{
    float tmp[AXC_CODEC_MAX_BLOCK];
    float *v = accumulate ? tmp : out + lo; /* v[i - lo] is element i */
    size_t n = hi - lo;
    if (!axc_ce_finite(s)) {
        for (size_t j = 0; j < n; j++)
            v[j] = s;
    } else if (codec == AXC_CODEC_INT8) {
        for (size_t j = 0; j < n; j++)
            v[j] = axc_ce_dequant((int8_t)payload[lo + j], s);
    } else if (codec == AXC_CODEC_FP8) {
        for (size_t j = 0; j < n; j++)
            v[j] = axc_ce_defp8(payload[lo + j], s);
    } else {
        for (size_t j = 0; j < n; j++)
            v[j] = axc_ce_dequant(axc_ce_int4(payload[(lo + j) / 2], lo + j), s);
    }
    if (accumulate)
        for (size_t j = 0; j < n; j++)
            out[lo + j] = axc_ce_add(out[lo + j], v[j]);
}

static void decode_range(axc_codec codec, const float *scales, const unsigned char *payload,
                         int block, size_t lo, size_t hi, float *out, int accumulate)
{
    for (size_t b0 = lo; b0 < hi; b0 += (size_t)block) {
        size_t b1 = hi - b0 < (size_t)block ? hi : b0 + (size_t)block;
        decode_block(codec, payload, scales[b0 / (size_t)block], b0, b1, out, accumulate);
    }
}

axc_status axc_codec_encode(axc_codec codec, int block, const float *in, size_t n, void *out)
{
    AXC_TRY(axc_codec_check(codec, block, &block));
    if (n && (!in || !out))
        return axc_fail(AXC_ERR_INVALID, "codec encode: NULL buffer for %zu elements", n);
    unsigned char *o = out;
    if (codec == AXC_CODEC_NONE) {
        for (size_t i = 0; i < n; i++) {
            float v = axc_ce_canon(in[i]);
            memcpy(o + 4 * i, &v, 4);
        }
        return AXC_OK;
    }
    if (codec == AXC_CODEC_BF16) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h = axc_ce_bf16(in[i]);
            memcpy(o + 2 * i, &h, 2);
        }
        return AXC_OK;
    }
    size_t nb = n_blocks(n, block);
    unsigned char *payload = o + 4 * nb;
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * (size_t)block, hi = lo + (size_t)block < n ? lo + (size_t)block : n;
        float s = encode_block(codec, in, lo, hi, payload);
        memcpy(o + 4 * b, &s, 4);
    }
    return AXC_OK;
}

axc_status axc_codec_decode(axc_codec codec, int block, const void *in, size_t n, float *out,
                            int accumulate)
{
    AXC_TRY(axc_codec_check(codec, block, &block));
    if (n && (!in || !out))
        return axc_fail(AXC_ERR_INVALID, "codec decode: NULL buffer for %zu elements", n);
    const unsigned char *p = in;
    if (codec == AXC_CODEC_NONE || codec == AXC_CODEC_BF16) {
        if (codec == AXC_CODEC_NONE && !accumulate) {
            if (n)
                memmove(out, p, 4 * n); /* (in place allowed, as the element loop was) */
            return AXC_OK;
        }
        for (size_t i = 0; i < n; i++) {
            float v;
            if (codec == AXC_CODEC_NONE) {
                memcpy(&v, p + 4 * i, 4);
            } else {
                uint16_t h;
                memcpy(&h, p + 2 * i, 2);
                v = axc_ce_bf16_to_f32(h);
            }
            out[i] = accumulate ? axc_ce_add(out[i], v) : v;
        }
        return AXC_OK;
    }
    size_t nb = n_blocks(n, block);
    float scales[256];
    /* scales are read through a small aligned copy: the encoded buffer may be unaligned */
    for (size_t b0 = 0; b0 < nb; b0 += 256) {
        size_t k = nb - b0 < 256 ? nb - b0 : 256;
        memcpy(scales, p + 4 * b0, 4 * k);
        size_t lo = b0 * (size_t)block, hi = (b0 + k) * (size_t)block;
        if (hi > n)
            hi = n;
        decode_range(codec, scales - b0, p + 4 * nb, block, lo, hi, out, accumulate);
    }
    return AXC_OK;
}

axc_status axc_codec_encode_ef(axc_codec codec, int block, const float *in, float *residual,
                               size_t n, void *out)
{
    AXC_TRY(axc_codec_check(codec, block, &block));
    if (n && (!in || !out || !residual))
        return axc_fail(AXC_ERR_INVALID, "codec encode: NULL buffer for %zu elements", n);
    /* a block at a time: contribution, encoding, then what the encoding lost */
    float c[AXC_CODEC_MAX_BLOCK], d[AXC_CODEC_MAX_BLOCK];
    size_t nb = n_blocks(n, block), bytes_per_block = 0;
    unsigned char *o = out;
    if (codec == AXC_CODEC_NONE || codec == AXC_CODEC_BF16)
        bytes_per_block = (codec == AXC_CODEC_NONE ? 4 : 2) * (size_t)block;
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * (size_t)block, len = n - lo < (size_t)block ? n - lo : (size_t)block;
        int finite = 1;
        for (size_t i = 0; i < len; i++) {
            c[i] = axc_ce_add(in[lo + i], residual[lo + i]);
            finite &= axc_ce_finite(c[i]);
        }
        if (bytes_per_block) {
            unsigned char *dst = o + b * bytes_per_block;
            AXC_TRY(axc_codec_encode(codec, block, c, len, dst));
            AXC_TRY(axc_codec_decode(codec, block, dst, len, d, 0));
        } else {
            /* block-scaled: scale b at o + 4b, payload from o + 4nb (int4: 2 per byte) */
            unsigned char *payload = o + 4 * nb;
            size_t off = codec == AXC_CODEC_INT4 ? lo / 2 : lo;
            float s = encode_block(codec, c, 0, len, payload + off);
            memcpy(o + 4 * b, &s, 4);
            decode_block(codec, payload + off, s, 0, len, d, 0);
        }
        /* a decoded value that is not finite (bf16 rounds values near FLT_MAX to inf) leaves
         * the residual as a non-finite input does: c - inf would poison it for good */
        for (size_t i = 0; i < len; i++)
            finite &= axc_ce_finite(d[i]);
        if (finite)
            for (size_t i = 0; i < len; i++)
                residual[lo + i] = AXC_FSUB(c[i], d[i]);
    }
    return AXC_OK;
}

void axc_codec_div(float *x, size_t n, float d)
{
    for (size_t i = 0; i < n; i++)
        x[i] = axc_ce_canon(AXC_FDIV(x[i], d));
}

void axc_codec_feedback(axc_codec codec, int block, const float *x, const float *decoded,
                        size_t n, float mult, float *residual)
{
    if (axc_codec_check(codec, block, &block) != AXC_OK)
        return;
    for (size_t lo = 0; lo < n; lo += (size_t)block) {
        size_t hi = n - lo < (size_t)block ? n : lo + (size_t)block;
        int finite = 1;
        for (size_t i = lo; i < hi; i++)
            finite &= axc_ce_finite(x[i]) & axc_ce_finite(decoded[i]);
        if (finite)
            for (size_t i = lo; i < hi; i++)
                residual[i] = axc_ce_add(residual[i], AXC_FMUL(AXC_FSUB(x[i], decoded[i]), mult));
    }
}
