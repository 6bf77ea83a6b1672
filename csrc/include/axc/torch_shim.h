/* The few functions of torch's C ABI (the AOTI shim in libtorch_cpu) the core calls, resolved at
 * run time with dlsym. No torch header is included (they are C++); the prototypes below are
 * declared from the ABI: opaque tensor handles, int32 error codes (0 = success), plain scalars. */
#ifndef AXC_TORCH_SHIM_H
#define AXC_TORCH_SHIM_H

#include <stddef.h>
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

/* torch's CUDA caching allocator (the CUDA part of the shim, in libtorch_cuda; torch >= 2.10).
 * Memory from it is what torch.cuda.memory_allocated() counts and what torch's cached free
 * blocks can serve, so near the memory limit our buffers and torch's tensors share one pool.
 * A block belongs to the stream it was allocated on: once freed, torch hands it to the next
 * allocation on that stream at once, so every use on another stream must be waited for before
 * the free (as with torch's record_stream). */
typedef struct axc_torch_stream_guard_opaque *axc_torch_stream_guard;

typedef struct axc_torch_cuda_api {
    /* makes `stream` (on `device`) torch's current stream until the guard is deleted */
    int32_t (*create_stream_guard)(void *stream, int32_t device, axc_torch_stream_guard *ret);
    int32_t (*delete_stream_guard)(axc_torch_stream_guard guard);
    /* a block of torch's caching allocator on the current stream; freed by raw_delete */
    int32_t (*raw_alloc)(uint64_t nbytes, void **ret);
    int32_t (*raw_delete)(void *ptr);
    /* Optional (NULL where this torch lacks it): torch's current stream of `device` (the
     * cudaStream_t torch.cuda.current_stream(device).cuda_stream names), without Python. */
    int32_t (*get_current_stream)(int32_t device, void **ret);
} axc_torch_cuda_api;

/* Loads it once (thread-safe): the libtorch_cuda.so that `import torch` loaded (RTLD_NOLOAD),
 * else the library named by AXONN_C_TORCH_CUDA_LIB (the CPU mock tests). AXC_ERR_UNAVAILABLE
 * with the reason when there is none (CPU-only torch, no Python, a torch older than 2.10): the
 * caller then allocates on its own. */
axc_status axc_torch_cuda_load(const axc_torch_cuda_api **api);

/* `bytes` from torch's caching allocator, on `stream` of `device` (the block is that stream's). */
axc_status axc_torch_cuda_alloc(const axc_torch_cuda_api *api, size_t bytes, int device,
                                void *stream, void **out);

/* torch's current CUDA stream of `device` into *stream: AXC_ERR_UNAVAILABLE when torch's CUDA
 * library or its getter is not there (the caller passes the stream itself then). */
axc_status axc_torch_cuda_current_stream(int device, void **stream);

#ifdef __cplusplus
}
#endif
#endif
