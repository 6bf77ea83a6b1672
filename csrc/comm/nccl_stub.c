/* The nccl backend where axonn_c was built without the NCCL or CUDA headers: every entry point
 * says so. */
#include "axc/comm.h"

#if !(defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS))
axc_status axc_nccl_backend_create(axc_backend **out, const axc_comm_config *cfg)
{
    (void)cfg;
    *out = NULL;
    return axc_fail(AXC_ERR_UNAVAILABLE,
                    "the nccl backend is unavailable: axonn_c was built without NCCL headers "
                    "(install nvidia-nccl-cu13 and the CUDA headers, then reinstall axonn_c)");
}

int axc_nccl_header_version(void) { return 0; }

int axc_nccl_runtime_version(void)
{
    axc_fail(AXC_ERR_UNAVAILABLE,
             "the nccl backend is unavailable: axonn_c was built without NCCL headers");
    return 0;
}

#endif
