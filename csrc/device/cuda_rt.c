/* The CUDA runtime, bound at run time to the libcudart that torch already loaded.
 *
 * One build serves CPU-only and GPU machines: nothing here links against CUDA. The first
 * axc_cuda_load() looks for an already-loaded libcudart (RTLD_NOLOAD, CUDA 13 then 12), falls back
 * to a normal dlopen, resolves every entry point of axc_cuda_api and asks for the device count.
 * The outcome (success, or the reason CUDA is unavailable) is computed once and replayed to every
 * later caller. When the real CUDA headers are present at build time the declared pointer types
 * are checked against the runtime's prototypes, so a header change cannot silently break the ABI.
 */
#include "axc/cuda_rt.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "axc/dynlib.h"

#if defined(AXC_HAVE_CUDA_HEADERS)
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
#error "axonn_c binds the legacy-default-stream entry points; do not define CUDA_API_PER_THREAD_DEFAULT_STREAM"
#endif
#include <cuda_runtime_api.h>

/* ---- compile-time ABI checks against the real headers ----
 * 1. Each runtime function has exactly the prototype written here (compatible-type match through
 *    _Generic: no casts, any difference in a parameter or the return type fails the build).
 * 2. The types axc_cuda_api uses instead are ABI-identical: cudaError_t and enum cudaMemcpyKind
 *    are 4-byte integers, cudaStream_t/cudaEvent_t are object pointers. */
#define AXC_PROTO_IS(fn, type)                                                                   \
    _Static_assert(_Generic(&fn, type : 1, default : 0),                                         \
                   #fn " no longer has the prototype axc_cuda_api assumes (cuda_rt.c)")

AXC_PROTO_IS(cudaGetDeviceCount, cudaError_t (*)(int *));
AXC_PROTO_IS(cudaGetDevice, cudaError_t (*)(int *));
AXC_PROTO_IS(cudaSetDevice, cudaError_t (*)(int));
AXC_PROTO_IS(cudaMemcpyAsync,
             cudaError_t (*)(void *, const void *, size_t, enum cudaMemcpyKind, cudaStream_t));
AXC_PROTO_IS(cudaStreamCreateWithFlags, cudaError_t (*)(cudaStream_t *, unsigned int));
AXC_PROTO_IS(cudaStreamDestroy, cudaError_t (*)(cudaStream_t));
AXC_PROTO_IS(cudaStreamSynchronize, cudaError_t (*)(cudaStream_t));
AXC_PROTO_IS(cudaStreamWaitEvent, cudaError_t (*)(cudaStream_t, cudaEvent_t, unsigned int));
AXC_PROTO_IS(cudaEventCreateWithFlags, cudaError_t (*)(cudaEvent_t *, unsigned int));
AXC_PROTO_IS(cudaEventDestroy, cudaError_t (*)(cudaEvent_t));
AXC_PROTO_IS(cudaEventRecord, cudaError_t (*)(cudaEvent_t, cudaStream_t));
AXC_PROTO_IS(cudaEventQuery, cudaError_t (*)(cudaEvent_t));
AXC_PROTO_IS(cudaEventSynchronize, cudaError_t (*)(cudaEvent_t));
AXC_PROTO_IS(cudaMallocHost, cudaError_t (*)(void **, size_t));
AXC_PROTO_IS(cudaFreeHost, cudaError_t (*)(void *));
AXC_PROTO_IS(cudaGetErrorString, const char *(*)(cudaError_t));
AXC_PROTO_IS(cudaMalloc, cudaError_t (*)(void **, size_t));
AXC_PROTO_IS(cudaFree, cudaError_t (*)(void *));
AXC_PROTO_IS(cudaStreamCreateWithPriority, cudaError_t (*)(cudaStream_t *, unsigned int, int));
AXC_PROTO_IS(cudaDeviceGetStreamPriorityRange, cudaError_t (*)(int *, int *));
AXC_PROTO_IS(cudaRuntimeGetVersion, cudaError_t (*)(int *));
AXC_PROTO_IS(cudaMemcpy2DAsync, cudaError_t (*)(void *, size_t, const void *, size_t, size_t,
                                                size_t, enum cudaMemcpyKind, cudaStream_t));
AXC_PROTO_IS(cudaMemsetAsync, cudaError_t (*)(void *, int, size_t, cudaStream_t));
AXC_PROTO_IS(cudaMallocAsync, cudaError_t (*)(void **, size_t, cudaStream_t));
AXC_PROTO_IS(cudaFreeAsync, cudaError_t (*)(void *, cudaStream_t));
AXC_PROTO_IS(cudaStreamIsCapturing, cudaError_t (*)(cudaStream_t, enum cudaStreamCaptureStatus *));
AXC_PROTO_IS(cudaThreadExchangeStreamCaptureMode, cudaError_t (*)(enum cudaStreamCaptureMode *));
#if CUDART_VERSION >= 12000
AXC_PROTO_IS(cudaStreamGetId, cudaError_t (*)(cudaStream_t, unsigned long long *));
AXC_PROTO_IS(cudaLibraryGetKernel, cudaError_t (*)(cudaKernel_t *, cudaLibrary_t, const char *));
AXC_PROTO_IS(cudaLibraryLoadData,
             cudaError_t (*)(cudaLibrary_t *, const void *, enum cudaJitOption *, void **,
                             unsigned int, enum cudaLibraryOption *, void **, unsigned int));
AXC_PROTO_IS(cudaLaunchKernel,
             cudaError_t (*)(const void *, dim3, dim3, void **, size_t, cudaStream_t));
_Static_assert(sizeof(cudaLibrary_t) == sizeof(void *) && sizeof(cudaKernel_t) == sizeof(void *),
               "cudaLibrary_t/cudaKernel_t are not pointers");
_Static_assert(sizeof(dim3) == sizeof(struct axc_cuda_dim3) && offsetof(dim3, z) == 8,
               "dim3 no longer has the layout of axc_cuda_dim3");
#endif

_Static_assert(sizeof(cudaError_t) == sizeof(int), "cudaError_t is not int-sized");
_Static_assert(sizeof(enum cudaMemcpyKind) == sizeof(int), "cudaMemcpyKind is not int-sized");
_Static_assert(sizeof(cudaStream_t) == sizeof(void *), "cudaStream_t is not a pointer");
_Static_assert(sizeof(cudaEvent_t) == sizeof(void *), "cudaEvent_t is not a pointer");
_Static_assert(sizeof(enum cudaStreamCaptureStatus) == sizeof(int),
               "cudaStreamCaptureStatus is not int-sized");
_Static_assert((int)cudaStreamCaptureStatusNone == AXC_CUDA_CAPTURE_NONE,
               "cudaStreamCaptureStatusNone changed");
_Static_assert((int)cudaSuccess == AXC_CUDA_SUCCESS, "cudaSuccess changed");
_Static_assert((int)cudaErrorNotReady == AXC_CUDA_ERROR_NOT_READY, "cudaErrorNotReady changed");
_Static_assert((int)cudaErrorStreamCaptureUnsupported == AXC_CUDA_ERROR_CAPTURE_UNSUPPORTED,
               "cudaErrorStreamCaptureUnsupported changed");
_Static_assert((int)cudaErrorStreamCaptureImplicit == AXC_CUDA_ERROR_CAPTURE_IMPLICIT,
               "cudaErrorStreamCaptureImplicit changed");
_Static_assert((int)cudaErrorCapturedEvent == AXC_CUDA_ERROR_CAPTURED_EVENT,
               "cudaErrorCapturedEvent changed");
_Static_assert(sizeof(enum cudaStreamCaptureMode) == sizeof(int),
               "cudaStreamCaptureMode is not int-sized");
_Static_assert((int)cudaStreamCaptureModeRelaxed == AXC_CUDA_CAPTURE_MODE_RELAXED,
               "cudaStreamCaptureModeRelaxed changed");
_Static_assert(cudaStreamNonBlocking == AXC_CUDA_STREAM_NON_BLOCKING, "cudaStreamNonBlocking");
_Static_assert(cudaEventDisableTiming == AXC_CUDA_EVENT_DISABLE_TIMING, "cudaEventDisableTiming");
_Static_assert((int)cudaMemcpyHostToDevice == AXC_CUDA_MEMCPY_H2D, "cudaMemcpyHostToDevice changed");
_Static_assert((int)cudaMemcpyDeviceToHost == AXC_CUDA_MEMCPY_D2H, "cudaMemcpyDeviceToHost changed");
_Static_assert((int)cudaMemcpyDeviceToDevice == AXC_CUDA_MEMCPY_D2D, "cudaMemcpyDeviceToDevice");
_Static_assert((int)cudaMemcpyDefault == AXC_CUDA_MEMCPY_DEFAULT, "cudaMemcpyDefault changed");

int axc_cuda_compiled(void) { return 1; }
int axc_cuda_header_version(void) { return CUDART_VERSION; }
#else
int axc_cuda_compiled(void) { return 0; }
int axc_cuda_header_version(void) { return 0; }
#endif

static pthread_once_t load_once_ = PTHREAD_ONCE_INIT;
static axc_cuda_api api_;
static axc_status load_status_ = AXC_ERR_UNAVAILABLE;
static char load_msg_[768];
/* set once the runtime is loaded and has a device: read without loading it */
static atomic_int usable_;
static char lib_name_[64];

static void set_unavailable(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_unavailable(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(load_msg_, sizeof load_msg_, fmt, ap);
    va_end(ap);
    load_status_ = AXC_ERR_UNAVAILABLE;
}

/* Whether the CUDA driver library is in this process or loadable. */
static int driver_present(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_LAZY);
    if (h)
        dlclose(h);
    return h != NULL;
}

static void load_runtime(void)
{
    static const char *const names[] = {"libcudart.so.13", "libcudart.so.12"};
    static const axc_dynlib_spec spec = {"the CUDA runtime", names, 2, NULL, 1,
                                         "a CUDA build of torch loads it on import"};
    void *h = axc_dynlib_open(&spec, lib_name_, sizeof lib_name_, load_msg_, sizeof load_msg_);
    if (!h)
        return;
    axc_cuda_api api;
    memset(&api, 0, sizeof api);
    int (*runtime_version)(int *) = NULL;
    const axc_dynlib_sym syms[] = {
        {"cudaGetDeviceCount", &api.GetDeviceCount, 1},
        {"cudaGetDevice", &api.GetDevice, 1},
        {"cudaSetDevice", &api.SetDevice, 1},
        {"cudaMemcpyAsync", &api.MemcpyAsync, 1},
        {"cudaStreamCreateWithFlags", &api.StreamCreateWithFlags, 1},
        {"cudaStreamDestroy", &api.StreamDestroy, 1},
        {"cudaStreamSynchronize", &api.StreamSynchronize, 1},
        {"cudaStreamWaitEvent", &api.StreamWaitEvent, 1},
        {"cudaEventCreateWithFlags", &api.EventCreateWithFlags, 1},
        {"cudaEventDestroy", &api.EventDestroy, 1},
        {"cudaEventRecord", &api.EventRecord, 1},
        {"cudaEventQuery", &api.EventQuery, 1},
        {"cudaEventSynchronize", &api.EventSynchronize, 1},
        {"cudaMallocHost", &api.MallocHost, 1},
        {"cudaFreeHost", &api.FreeHost, 1},
        {"cudaGetErrorString", &api.GetErrorString, 1},
        {"cudaMalloc", &api.Malloc, 1},
        {"cudaFree", &api.Free, 1},
        {"cudaStreamCreateWithPriority", &api.StreamCreateWithPriority, 1},
        {"cudaDeviceGetStreamPriorityRange", &api.DeviceGetStreamPriorityRange, 1},
        {"cudaRuntimeGetVersion", &runtime_version, 1},
        /* optional entry points (NULL when absent; their users check) */
        {"cudaMemcpy2DAsync", &api.Memcpy2DAsync, 0},
        {"cudaMemsetAsync", &api.MemsetAsync, 0},
        {"cudaMallocAsync", &api.MallocAsync, 0},
        {"cudaFreeAsync", &api.FreeAsync, 0},
        {"cudaStreamIsCapturing", &api.StreamIsCapturing, 0},
        {"cudaThreadExchangeStreamCaptureMode", &api.ThreadExchangeStreamCaptureMode, 0},
        {"cudaStreamGetId", &api.StreamGetId, 0},
        {"cudaLibraryLoadData", &api.LibraryLoadData, 0},
        {"cudaLibraryGetKernel", &api.LibraryGetKernel, 0},
        {"cudaLaunchKernel", &api.LaunchKernel, 0},
    };
    if (!axc_dynlib_resolve(h, "the CUDA runtime", lib_name_, syms, sizeof syms / sizeof syms[0],
                            NULL, load_msg_, sizeof load_msg_))
        return;

    int version = 0;
    if (runtime_version(&version) != AXC_CUDA_SUCCESS)
        version = 0;
    api.runtime_version = version;

    int count = 0;
    int err = api.GetDeviceCount(&count);
    if (err == 35 /* cudaErrorInsufficientDriver */ && !driver_present()) {
        /* the runtime's text ("driver version is insufficient") misleads where there is none */
        set_unavailable("no CUDA driver (CPU-only machine): cudaGetDeviceCount in %s found no "
                        "libcuda.so.1",
                        lib_name_);
        return;
    }
    if (err != AXC_CUDA_SUCCESS) {
        const char *what = api.GetErrorString(err);
        set_unavailable("no usable CUDA device: cudaGetDeviceCount failed in %s: %s (cudaError %d)",
                        lib_name_, what ? what : "unknown error", err);
        return;
    }
    if (count <= 0) {
        set_unavailable("no CUDA device is visible to this process (%s reports 0 devices; "
                        "check CUDA_VISIBLE_DEVICES)",
                        lib_name_);
        return;
    }
    api.device_count = count;
    api_ = api;
    load_status_ = AXC_OK;
    load_msg_[0] = '\0';
    atomic_store(&usable_, 1);
}

axc_status axc_cuda_load(const axc_cuda_api **api)
{
    if (api)
        *api = NULL;
    if (pthread_once(&load_once_, load_runtime) != 0)
        return axc_fail(AXC_ERR_SYSTEM, "pthread_once failed while loading the CUDA runtime");
    if (load_status_ != AXC_OK)
        return axc_fail(load_status_, "%s", load_msg_);
    if (api)
        *api = &api_;
    return AXC_OK;
}

axc_status axc_cuda_load_kernels(const void *fatbin, size_t size, const char *what,
                                 const char *const *names, void **kernels, int n,
                                 const axc_cuda_api **api)
{
    AXC_TRY(axc_cuda_load(api));
    const axc_cuda_api *cu = *api;
    *api = NULL;
    if (!cu->LibraryLoadData || !cu->LibraryGetKernel || !cu->LaunchKernel)
        return axc_fail(AXC_ERR_UNAVAILABLE, "the CUDA runtime (version %d) has no "
                                             "cudaLibraryLoadData/cudaLaunchKernel: %s need CUDA "
                                             ">= 12", cu->runtime_version, what);
    void *lib = NULL;
    int err = cu->LibraryLoadData(&lib, fatbin, NULL, NULL, 0, NULL, NULL, 0);
    for (int i = 0; err == AXC_CUDA_SUCCESS && i < n; i++)
        err = cu->LibraryGetKernel(&kernels[i], lib, names[i]);
    if (err != AXC_CUDA_SUCCESS)
        return axc_fail(AXC_ERR_UNAVAILABLE, "loading %s (%zu-byte fatbin) failed: %s "
                                             "(cudaError %d)", what, size,
                        cu->GetErrorString ? cu->GetErrorString(err) : "?", err);
    *api = cu;
    return AXC_OK;
}

axc_status axc_cuda_check(int err, const char *what)
{
    if (err == AXC_CUDA_SUCCESS)
        return AXC_OK;
    const char *desc = NULL;
    if (load_status_ == AXC_OK && api_.GetErrorString)
        desc = api_.GetErrorString(err);
    return axc_fail(AXC_ERR_BACKEND, "%s failed: %s (cudaError %d)", what ? what : "CUDA call",
                    desc ? desc : "unknown error", err);
}

int axc_cuda_current_device(void)
{
    int d = -1;
    if (!atomic_load(&usable_) || api_.GetDevice(&d) != AXC_CUDA_SUCCESS)
        return -1;
    return d;
}

axc_status axc_cuda_device_enter(int device, const axc_cuda_api **api, int *prev, const char *what)
{
    AXC_TRY(axc_cuda_load(api));
    if (device < 0 || device >= (*api)->device_count)
        return axc_fail(AXC_ERR_INVALID, "%s: CUDA device %d does not exist (%d visible)",
                        what ? what : "CUDA call", device, (*api)->device_count);
    AXC_TRY(axc_cuda_check((*api)->GetDevice(prev), "cudaGetDevice"));
    if (*prev != device)
        AXC_TRY(axc_cuda_check((*api)->SetDevice(device), "cudaSetDevice"));
    return AXC_OK;
}

axc_status axc_cuda_device_leave(const axc_cuda_api *api, int device, int prev, axc_status st)
{
    if (prev != device) {
        char saved[512];
        snprintf(saved, sizeof saved, "%s", axc_last_error());
        axc_status s2 = axc_cuda_check(api->SetDevice(prev), "cudaSetDevice (restoring the device)");
        if (st == AXC_OK)
            return s2;
        axc_set_last_error(saved); /* keep the first failure's message */
    }
    return st;
}
