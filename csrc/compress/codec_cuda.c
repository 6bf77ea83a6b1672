/* Launches the codec kernels (codec_kernels.cu). setup.py embeds their fatbin when nvcc is
 * present (AXC_HAVE_CODEC_FATBIN); it is loaded once through the CUDA runtime's library API,
 * so nothing here links against CUDA and builds without nvcc report the kernels unavailable.
 * AXONN_C_CODEC_KERNELS=warp (read once, at the load) launches the warp-reduced encode and
 * feedback kernels, each thread block sized to the codec block: opt-in until a GPU run of
 * benchmarks/gpu_suite.sh has checked their bytes against the CPU's. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "axc/compress.h"
#include "axc/cuda_rt.h"
#include "axc/env.h"
#include "axc/status.h"

#ifdef AXC_HAVE_CODEC_FATBIN
extern const unsigned char axc_codec_fatbin[];
extern const size_t axc_codec_fatbin_size;
int axc_codec_cuda_compiled(void) { return 1; }
#else
int axc_codec_cuda_compiled(void) { return 0; }
#endif

enum { THREADS = 256 };

static pthread_once_t once_ = PTHREAD_ONCE_INIT;
static axc_status load_status_ = AXC_ERR_UNAVAILABLE;
static char load_msg_[512] = "the codec kernels were not loaded";
static const axc_cuda_api *cu_;
static void *k_encode_, *k_decode_, *k_div_, *k_feedback_;
static int warp_; /* the warp-reduced encode and feedback kernels, thread blocks sized to fit */

static void load_kernels(void)
{
#ifndef AXC_HAVE_CODEC_FATBIN
    snprintf(load_msg_, sizeof load_msg_,
             "this build has no CUDA codec kernels (nvcc was not found when axonn_c was built)");
#else
    const char *which = axc_env_str("AXONN_C_CODEC_KERNELS");
    if (which && *which && strcmp(which, "warp") != 0 && strcmp(which, "block") != 0) {
        load_status_ = AXC_ERR_INVALID;
        snprintf(load_msg_, sizeof load_msg_,
                 "AXONN_C_CODEC_KERNELS=%.64s is not a codec kernel choice: expected `block` "
                 "(the default) or `warp`", which);
        return;
    }
    int warp = which && strcmp(which, "warp") == 0;
    static const char *const names[] = {"axc_codec_encode_kernel", "axc_codec_decode_kernel",
                                        "axc_codec_div_kernel", "axc_codec_feedback_kernel",
                                        "axc_codec_encode_warp_kernel",
                                        "axc_codec_feedback_warp_kernel"};
    void *k[6] = {NULL};
    if (axc_cuda_load_kernels(axc_codec_fatbin, axc_codec_fatbin_size, "the codec kernels", names,
                              k, 6, &cu_) != AXC_OK) {
        snprintf(load_msg_, sizeof load_msg_, "%s", axc_last_error());
        return;
    }
    k_encode_ = warp ? k[4] : k[0];
    k_decode_ = k[1];
    k_div_ = k[2];
    k_feedback_ = warp ? k[5] : k[3];
    warp_ = warp;
    load_status_ = AXC_OK;
#endif
}

static axc_status kernels(void)
{
    pthread_once(&once_, load_kernels);
    if (load_status_ != AXC_OK)
        return axc_fail(load_status_, "%s", load_msg_);
    return AXC_OK;
}

static axc_status launch(void *kernel, const char *what, size_t blocks, unsigned threads,
                         void **args, void *stream)
{
    if (blocks > 0x7fffffffu)
        return axc_fail(AXC_ERR_INVALID, "%s: %zu thread blocks are too many", what, blocks);
    struct axc_cuda_dim3 grid = {(unsigned)blocks, 1, 1}, block = {threads, 1, 1};
    return axc_cuda_check(cu_->LaunchKernel(kernel, grid, block, args, 0, stream), what);
}

/* threads of a kernel with one thread block per codec block: THREADS, or with the warp-reduced
 * kernels the codec block's size in whole warps, up to THREADS */
static unsigned per_block_threads(int block)
{
    if (!warp_ || block >= THREADS)
        return THREADS;
    return block < 32 ? 32u : (unsigned)block; /* (a power of two) */
}

/* thread blocks of an element-wise kernel (grid-stride loops cover the rest) */
static size_t elementwise_blocks(size_t n)
{
    size_t b = (n + THREADS - 1) / THREADS;
    return b < 65536 ? b : 65536;
}

axc_status axc_codec_cuda_encode(axc_codec codec, int block, const float *in, float *residual,
                                 size_t n, void *out, void *stream)
{
    AXC_TRY(axc_codec_check(codec, block, &block));
    AXC_TRY(kernels());
    if (!n)
        return AXC_OK;
    int c = (int)codec;
    unsigned long long nn = n;
    void *args[] = {&c, &block, &in, &residual, &nn, &out};
    return launch(k_encode_, "codec encode kernel", (n + (size_t)block - 1) / (size_t)block,
                  per_block_threads(block), args, stream);
}

axc_status axc_codec_cuda_decode(axc_codec codec, int block, const void *in, size_t n,
                                 float *out, int accumulate, void *stream)
{
    AXC_TRY(axc_codec_check(codec, block, &block));
    AXC_TRY(kernels());
    if (!n)
        return AXC_OK;
    int c = (int)codec;
    unsigned long long nn = n;
    void *args[] = {&c, &block, &in, &nn, &out, &accumulate};
    return launch(k_decode_, "codec decode kernel", elementwise_blocks(n), THREADS, args, stream);
}

axc_status axc_codec_cuda_div(float *x, size_t n, float d, void *stream)
{
    AXC_TRY(kernels());
    if (!n)
        return AXC_OK;
    unsigned long long nn = n;
    void *args[] = {&x, &nn, &d};
    return launch(k_div_, "codec div kernel", elementwise_blocks(n), THREADS, args, stream);
}

axc_status axc_codec_cuda_feedback(axc_codec codec, int block, const float *x,
                                   const float *decoded, size_t n, float mult, float *residual,
                                   void *stream)
{
    AXC_TRY(axc_codec_check(codec, block, &block));
    AXC_TRY(kernels());
    if (!n)
        return AXC_OK;
    unsigned long long nn = n;
    void *args[] = {&block, &x, &decoded, &nn, &mult, &residual};
    return launch(k_feedback_, "codec feedback kernel", (n + (size_t)block - 1) / (size_t)block,
                  per_block_threads(block), args, stream);
}
