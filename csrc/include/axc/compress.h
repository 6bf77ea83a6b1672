/* Gradient codecs: lossy fp32 -> bytes encodings for compressed collectives.
 *
 * Formats (n elements, block size B, nb = ceil(n / B) blocks):
 *   none  n fp32 values as they are (4n bytes)
 *   bf16  n bfloat16 values, round to nearest even (2n bytes; B is ignored)
 *   fp8   nb fp32 scales, then n e4m3 bytes (OCP "fn": max 448, no inf): x ~ s * e4m3
 *   int8  nb fp32 scales, then n int8 in [-127, 127]: x ~ s * q, s = absmax / 127
 *   int4  nb fp32 scales, then ceil(n/2) bytes of int4 in [-7, 7], element i in the low nibble
 *         of byte i/2 when i is even, the high one when odd: x ~ s * q, s = absmax / 7
 * The last block may be short. A block holding inf/nan gets a non-finite scale (+inf, -inf
 * when all its non-finite values are that infinity, else nan) and decodes to that value in every
 * element, so a non-finite gradient reaches the caller. An all-zero block has scale 0 and
 * decodes to exact zeros. Encoding is deterministic and uses only correctly rounded fp32
 * operations (division, multiplication, rintf), so the CUDA kernels produce the same bytes.
 *
 * Error bounds per element (a = the block's absmax, s its scale):
 *   int8/int4  |x - x^| <= s/2 (plus a few fp32 ulps of a)
 *   fp8        |x - x^| <= 2^-4 |x| + s * 2^-10 (normal / subnormal e4m3 range, plus ulps)
 *   bf16       |x - x^| <= 2^-8 |x| (normal range; values above bf16's max round to inf) */
#ifndef AXC_COMPRESS_H
#define AXC_COMPRESS_H

#include <stddef.h>
#include <stdint.h>

#include "axc/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum axc_codec {
    AXC_CODEC_NONE = 0,
    AXC_CODEC_BF16 = 1,
    AXC_CODEC_FP8 = 2,
    AXC_CODEC_INT8 = 3,
    AXC_CODEC_INT4 = 4,
    AXC_CODEC_COUNT = 5
} axc_codec;

/* Block sizes: powers of two in [AXC_CODEC_MIN_BLOCK, AXC_CODEC_MAX_BLOCK]; 0 = the codec's
 * default. */
#define AXC_CODEC_MIN_BLOCK 32
#define AXC_CODEC_MAX_BLOCK 4096
/* block = 0 selects these, chosen by measurement (docs/compression.md): 256 for the 8-bit
 * codecs (scales cost 1.6% of the bytes), 64 for int4 (scales 11% of its bytes: 7.11x fewer
 * than fp32; the demo GPT's final loss within the 3% bound, where 128 missed it) */
#define AXC_CODEC_DEFAULT_BLOCK 256
#define AXC_CODEC_DEFAULT_BLOCK_INT4 64
int axc_codec_default_block(axc_codec codec);

const char *axc_codec_name(axc_codec codec);
/* "none", "bf16", "fp8", "int8", "int4"; an unknown name fails naming the valid ones. */
axc_status axc_codec_from_name(const char *name, axc_codec *codec);
/* Checks codec and block; *block_out gets the block in effect (0 -> default). */
axc_status axc_codec_check(axc_codec codec, int block, int *block_out);

/* Bytes of the encoding of n elements. */
axc_status axc_codec_encoded_bytes(axc_codec codec, size_t n, int block, size_t *bytes);

/* Encodes n fp32 values into `out` (axc_codec_encoded_bytes bytes). */
axc_status axc_codec_encode(axc_codec codec, int block, const float *in, size_t n, void *out);
/* Error feedback: encodes c = in + residual, then sets residual = c - decode(encode(c)). A block
 * whose c, or its decoded value, is non-finite (an overflow step; bf16 rounding a value near
 * FLT_MAX to inf) leaves its residual unchanged. `residual` has n
 * values; it may not alias `in`. */
axc_status axc_codec_encode_ef(axc_codec codec, int block, const float *in, float *residual,
                               size_t n, void *out);
/* Decodes n values: out = x^ (accumulate = 0) or out += x^ (accumulate = 1, one fp32 add per
 * element, so a fixed order of decode-accumulate calls gives a fixed sum). */
axc_status axc_codec_decode(axc_codec codec, int block, const void *in, size_t n, float *out,
                            int accumulate);

/* Error feedback of a value encoded after a reduction (the owner's sum in a compressed
 * all_reduce): residual += mult * (x - decoded), for the blocks where x and decoded are
 * finite. */
void axc_codec_feedback(axc_codec codec, int block, const float *x, const float *decoded,
                        size_t n, float mult, float *residual);

/* x[i] = x[i] / d (the average of a compressed sum; a nan becomes the codecs' one nan) */
void axc_codec_div(float *x, size_t n, float d);

/* The CUDA kernels (codec_kernels.cu) on device buffers, ordered on `stream` (no host
 * synchronisation): the same bytes as the functions above. AXC_ERR_UNAVAILABLE when the build
 * has no kernels (nvcc was not found) or there is no CUDA runtime (>= 12) or device. */
int axc_codec_cuda_compiled(void);
axc_status axc_codec_cuda_encode(axc_codec codec, int block, const float *in, float *residual,
                                 size_t n, void *out, void *stream);
axc_status axc_codec_cuda_decode(axc_codec codec, int block, const void *in, size_t n,
                                 float *out, int accumulate, void *stream);
axc_status axc_codec_cuda_feedback(axc_codec codec, int block, const float *x,
                                   const float *decoded, size_t n, float mult, float *residual,
                                   void *stream);
/* x[i] = x[i] / d (the average of a compressed sum) */
axc_status axc_codec_cuda_div(float *x, size_t n, float d, void *stream);

#ifdef __cplusplus
}
#endif
#endif
