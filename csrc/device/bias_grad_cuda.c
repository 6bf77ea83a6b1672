/* Launches the small-M bias-gradient kernel (bias_grad_kernels.cu). setup.py embeds its fatbin
 * when nvcc is present (AXC_HAVE_BIAS_GRAD_FATBIN); it is loaded once through the CUDA runtime's
 * library API. Without it (no nvcc at build time, the CUDA mocks, a runtime older than 12) the
 * caller keeps the cuBLASLt GEMV (axc_cublaslt_bias_grad). Opt-in (AXONN_C_BIAS_GRAD_KERNEL=1)
 * until the GPU suite has run it on a GPU: it was written in a session without one. */
#include <pthread.h>
#include <string.h>

#include "axc/cuda_rt.h"
#include "axc/env.h"
#include "axc/gemm.h"

#ifdef AXC_HAVE_BIAS_GRAD_FATBIN
extern const unsigned char axc_bias_grad_fatbin[];
extern const size_t axc_bias_grad_fatbin_size;
#endif

static pthread_once_t once_ = PTHREAD_ONCE_INIT;
static const axc_cuda_api *cu_;
static void *kernel_; /* NULL: not available */

static void load_kernel(void)
{
#ifdef AXC_HAVE_BIAS_GRAD_FATBIN
    const char *on = axc_env_str("AXONN_C_BIAS_GRAD_KERNEL");
    if (!on || strcmp(on, "1") != 0) /* (opt-in until a GPU run has validated it) */
        return;
    static const char *const names[] = {"axc_bias_grad_kernel"};
    const axc_cuda_api *api = NULL;
    void *k = NULL;
    if (axc_cuda_load_kernels(axc_bias_grad_fatbin, axc_bias_grad_fatbin_size,
                              "the bias-gradient kernel", names, &k, 1, &api) != AXC_OK) {
        /* (the GEMV serves: nothing is lost but the host time) */
        axc_log(2, "AXONN_C_BIAS_GRAD_KERNEL=1: %s: the bias gradient stays a cuBLASLt GEMV",
                axc_last_error());
        return;
    }
    cu_ = api;
    kernel_ = k;
#endif
}

/* -1: not tried yet, 0: not available, 1: loaded */
static _Atomic int state_ = -1;

int axc_bias_grad_kernel_ready(int may_load)
{
    int s = state_;
    if (s >= 0 || !may_load)
        return s;
    pthread_once(&once_, load_kernel);
    state_ = s = kernel_ != NULL;
    return s;
}

axc_status axc_bias_grad_kernel(void *stream, axc_dtype dt, const void *dY, int64_t M, int64_t N,
                                int64_t ld, void *db, int accumulate)
{
    if (axc_bias_grad_kernel_ready(1) != 1)
        return axc_fail(AXC_ERR_UNAVAILABLE, "axc_bias_grad: the bias-gradient kernel is not "
                                             "loaded");
    if (dt != AXC_DT_F32 && dt != AXC_DT_BF16 && dt != AXC_DT_F16)
        return axc_fail(AXC_ERR_INVALID, "axc_bias_grad: the kernel takes float32, bfloat16 or "
                                         "float16, got dtype %d",
                        (int)dt);
    long long m = M, n = N, l = ld;
    int d = (int)dt;
    if ((N + 31) / 32 > 0x7fffffff)
        return axc_fail(AXC_ERR_INVALID, "axc_bias_grad: N=%lld is too large", (long long)N);
    void *args[] = {(void *)&dY, &db, &m, &n, &l, &d, &accumulate};
    struct axc_cuda_dim3 grid = {(unsigned)((N + 31) / 32), 1, 1}, block = {32, 32, 1};
    return axc_cuda_check(cu_->LaunchKernel(kernel_, grid, block, args, 0, stream),
                          "axc_bias_grad (cudaLaunchKernel)");
}
