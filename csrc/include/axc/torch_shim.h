/* The few functions of torch's C ABI (the AOTI shim in libtorch_cpu) the core calls, resolved at
 * run time with dlsym. No torch header is included (they are C++); the prototypes below are
 * declared from the ABI: opaque tensor handles, int32 error codes (0 = success), plain scalars. */
#ifndef AXC_TORCH_SHIM_H
#define AXC_TORCH_SHIM_H

#include <stdint.h>

#include "axc/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* AtenTensorHandle: an owning handle to an at::Tensor (delete with delete_tensor_object). */
typedef struct axc_aten_tensor_opaque *axc_aten_tensor;

typedef struct axc_torch_api {
    /* Non-owning tensor over `data` (sizes/strides in elements, copied by torch). */
    int32_t (*create_tensor_from_blob)(void *data, int64_t ndim, const int64_t *sizes,
                                       const int64_t *strides, int64_t storage_offset,
                                       int32_t dtype, int32_t device_type, int32_t device_index,
                                       axc_aten_tensor *ret);
    int32_t (*delete_tensor_object)(axc_aten_tensor t);
    /* out = beta*self + alpha*(mat1 @ mat2); self broadcast to out's shape. CPU kernel, no
     * dispatcher, no autograd. */
    int32_t (*cpu_addmm_out)(axc_aten_tensor out, axc_aten_tensor self, axc_aten_tensor mat1,
                             axc_aten_tensor mat2, double beta, double alpha);
    /* out = self @ mat2 */
    int32_t (*cpu_mm_out)(axc_aten_tensor out, axc_aten_tensor self, axc_aten_tensor mat2);
    /* Optional (torch >= 2.13; NULL before): the message of this thread's last torch error. */
    const char *(*exception_what)(void);
    /* Codes torch uses for these dtypes / the CPU device (read once at load). */
    int32_t dtype_f32, dtype_bf16, dtype_f16, device_cpu;
} axc_torch_api;

/* Loads the API once (thread-safe): the libtorch_cpu.so that `import torch` loaded
 * (RTLD_NOLOAD), else the library named by the environment variable AXONN_C_TORCH_LIB (C unit
 * tests). AXC_ERR_UNAVAILABLE with the reason when neither works; the outcome is replayed to
 * every later caller. */
axc_status axc_torch_load(const axc_torch_api **api);

/* Turns a torch shim error code into AXC_ERR_BACKEND naming `what` (with torch's message when
 * this torch exports it). */
axc_status axc_torch_check(int32_t err, const char *what);

#ifdef __cplusplus
}
#endif
#endif
