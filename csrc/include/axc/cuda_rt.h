/* The CUDA runtime, resolved at run time (dlopen of the libcudart torch loaded), so one build
 * serves CPU-only and GPU machines. Plain ints/void* stand in for the runtime's types. */
#ifndef AXC_CUDA_RT_H
#define AXC_CUDA_RT_H

#include <stddef.h>

#include "axc/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    AXC_CUDA_MEMCPY_H2D = 1,
    AXC_CUDA_MEMCPY_D2H = 2,
    AXC_CUDA_MEMCPY_D2D = 3,
    AXC_CUDA_MEMCPY_DEFAULT = 4 /* cudaMemcpyDefault: direction from the pointers (UVA) */
};

enum { AXC_CUDA_CAPTURE_NONE = 0 /* cudaStreamCaptureStatusNone */ };
enum { AXC_CUDA_CAPTURE_MODE_RELAXED = 2 /* cudaStreamCaptureModeRelaxed */ };

struct axc_cuda_dim3 {
    unsigned x, y, z;
};

typedef struct axc_cuda_api {
    int runtime_version; /* e.g. 13000 */
    int (*GetDeviceCount)(int *count);
    int (*GetDevice)(int *device);
    int (*SetDevice)(int device);
    int (*MemcpyAsync)(void *dst, const void *src, size_t bytes, int kind, void *stream);
    int (*StreamCreateWithFlags)(void **stream, unsigned flags);
    int (*StreamDestroy)(void *stream);
    int (*StreamSynchronize)(void *stream);
    int (*StreamWaitEvent)(void *stream, void *event, unsigned flags);
    int (*EventCreateWithFlags)(void **event, unsigned flags);
    int (*EventDestroy)(void *event);
    int (*EventRecord)(void *event, void *stream);
    int (*EventQuery)(void *event);
    int (*EventSynchronize)(void *event);
    int (*MallocHost)(void **ptr, size_t bytes);
    int (*FreeHost)(void *ptr);
    const char *(*GetErrorString)(int err);
    /* used by the nccl backend (small persistent buffers and high-priority comm streams) */
    int (*Malloc)(void **ptr, size_t bytes);
    int (*Free)(void *ptr);
    int (*StreamCreateWithPriority)(void **stream, unsigned flags, int priority);
    int (*DeviceGetStreamPriorityRange)(int *least, int *greatest);
    int device_count; /* devices visible to this process (> 0 once loaded) */
    /* used by gemm.c (axc_copy2d, axc_zero); resolved optionally: NULL when the runtime lacks
     * them (a real libcudart always has them; the CPU mocks of the tests do not) */
    int (*Memcpy2DAsync)(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                         size_t height, int kind, void *stream);
    int (*MemsetAsync)(void *dst, int value, size_t bytes, void *stream);
    /* used by the scheduler for gathered weights (stream-ordered, no device synchronisation) */
    int (*MallocAsync)(void **ptr, size_t bytes, void *stream);
    int (*FreeAsync)(void *ptr, void *stream);
    /* optional too: *status is AXC_CUDA_CAPTURE_NONE unless `stream` is being captured into a
     * CUDA graph (where cudaMalloc and stream synchronisation are not allowed) */
    int (*StreamIsCapturing)(void *stream, int *status);
    /* optional: sets the calling thread's capture interaction mode, *mode gets the old one (a
     * helper thread in AXC_CUDA_CAPTURE_MODE_RELAXED may query events while another thread
     * captures in cudaStreamCaptureModeGlobal, torch's default) */
    int (*ThreadExchangeStreamCaptureMode)(int *mode);
    /* optional (CUDA >= 12): a stream's id, unique for the process's lifetime (a stream handle
     * may be reused once cudaStreamDestroy returned) */
    int (*StreamGetId)(void *stream, unsigned long long *id);
    /* optional (CUDA >= 12): kernels of an embedded fatbin (axc_cuda_load_kernels):
     * cudaLibraryLoadData without options, cudaLibraryGetKernel, and cudaLaunchKernel taking
     * that kernel handle (dim3 by value: axc_cuda_dim3 has its layout) */
    int (*LibraryLoadData)(void **library, const void *code, void *jit_options,
                           void **jit_values, unsigned n_jit, void *lib_options,
                           void **lib_values, unsigned n_lib);
    int (*LibraryGetKernel)(void **kernel, void *library, const char *name);
    int (*LaunchKernel)(const void *func, struct axc_cuda_dim3 grid, struct axc_cuda_dim3 block,
                        void **args, size_t shared_mem, void *stream);
} axc_cuda_api;

/* Runtime constants the core relies on (checked against the real headers in cuda_rt.c). */
enum {
    AXC_CUDA_SUCCESS = 0,
    AXC_CUDA_ERROR_NOT_READY = 600,     /* cudaErrorNotReady: EventQuery of a pending event */
    /* a call refused because some stream is being captured into a CUDA graph: nothing is wrong
     * with the work queried (cudaErrorStreamCaptureUnsupported, ...Implicit); an event recorded
     * inside a capture can never be queried (cudaErrorCapturedEvent) */
    AXC_CUDA_ERROR_CAPTURE_UNSUPPORTED = 900,
    AXC_CUDA_ERROR_CAPTURE_IMPLICIT = 906,
    AXC_CUDA_ERROR_CAPTURED_EVENT = 907,
    AXC_CUDA_STREAM_NON_BLOCKING = 1,   /* cudaStreamNonBlocking */
    AXC_CUDA_EVENT_DISABLE_TIMING = 2   /* cudaEventDisableTiming */
};

/* Loads the runtime once (thread-safe). AXC_ERR_UNAVAILABLE with the reason when there is none. */
axc_status axc_cuda_load(const axc_cuda_api **api);

/* Loads the kernels `names[0 .. n)` of an embedded fatbin (`what` names it in messages: "the
 * codec kernels") through the runtime's library API, once per caller: kernels[i] gets each
 * handle to launch with (*api)->LaunchKernel. AXC_ERR_UNAVAILABLE with the reason when there is
 * no runtime, it is older than CUDA 12 (no cudaLibraryLoadData), or a load fails. */
axc_status axc_cuda_load_kernels(const void *fatbin, size_t size, const char *what,
                                 const char *const *names, void **kernels, int n,
                                 const axc_cuda_api **api);

/* Turns a runtime error code into an AXC_ERR_BACKEND status naming the call. */
axc_status axc_cuda_check(int err, const char *what);

/* The calling thread's current device, or -1 where the runtime was never loaded (or has no
 * device): a CPU-only job does not load it for this. */
int axc_cuda_current_device(void);

/* Makes `device` the calling thread's current device (loading the runtime, checking the index);
 * *prev receives the device to hand back to axc_cuda_device_leave, which restores it and returns
 * `st` (or the restore's failure when `st` is AXC_OK). `what` names the caller in messages. */
axc_status axc_cuda_device_enter(int device, const axc_cuda_api **api, int *prev, const char *what);
axc_status axc_cuda_device_leave(const axc_cuda_api *api, int device, int prev, axc_status st);

/* Build facts for build_info(): 1 when compiled against real CUDA headers, and their version. */
int axc_cuda_compiled(void);
int axc_cuda_header_version(void);

#ifdef __cplusplus
}
#endif
#endif
