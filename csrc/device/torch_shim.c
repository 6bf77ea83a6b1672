/* torch's C ABI bound at run time: see axc/torch_shim.h.
 *
 * The package never links against torch: by the time the core needs a torch kernel, `import
 * torch` has loaded libtorch_cpu.so, so a RTLD_NOLOAD dlopen finds it (and shares its thread pool
 * and BLAS). C unit tests, which run without Python, name the library in AXONN_C_TORCH_LIB. */
#include "axc/torch_shim.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/dynlib.h"

static pthread_once_t load_once_ = PTHREAD_ONCE_INIT;
static axc_torch_api api_;
static axc_status load_status_ = AXC_ERR_UNAVAILABLE;
static char load_msg_[1024];
static char lib_name_[512];

static void load_torch(void)
{
    static const char *const names[] = {"libtorch_cpu.so"};
    static const axc_dynlib_spec spec = {
        "torch's C library", names, 1, "AXONN_C_TORCH_LIB", 0,
        "`import torch` before using axonn_c, or set AXONN_C_TORCH_LIB to the path of "
        "libtorch_cpu.so"};
    void *h = axc_dynlib_open(&spec, lib_name_, sizeof lib_name_, load_msg_, sizeof load_msg_);
    if (!h)
        return;
    axc_torch_api api;
    memset(&api, 0, sizeof api);
    int32_t (*dt_f32)(void) = NULL, (*dt_bf16)(void) = NULL, (*dt_f16)(void) = NULL,
            (*dev_cpu)(void) = NULL;
    const axc_dynlib_sym syms[] = {
        {"aoti_torch_create_tensor_from_blob", &api.create_tensor_from_blob, 1},
        {"aoti_torch_delete_tensor_object", &api.delete_tensor_object, 1},
        {"aoti_torch_cpu_addmm_out", &api.cpu_addmm_out, 1},
        {"aoti_torch_cpu_mm_out", &api.cpu_mm_out, 1},
        {"aoti_torch_dtype_float32", &dt_f32, 1},
        {"aoti_torch_dtype_bfloat16", &dt_bf16, 1},
        {"aoti_torch_dtype_float16", &dt_f16, 1},
        {"aoti_torch_device_type_cpu", &dev_cpu, 1},
        {"torch_exception_get_what_without_backtrace", &api.exception_what, 0},
    };
    if (!axc_dynlib_resolve(h, "torch's", lib_name_, syms, sizeof syms / sizeof syms[0],
                            "this torch is too old or too new for axonn_c", load_msg_,
                            sizeof load_msg_))
        return;
    api.dtype_f32 = dt_f32();
    api.dtype_bf16 = dt_bf16();
    api.dtype_f16 = dt_f16();
    api.device_cpu = dev_cpu();
    api_ = api;
    load_status_ = AXC_OK;
    load_msg_[0] = '\0';
}

axc_status axc_torch_load(const axc_torch_api **api)
{
    if (api)
        *api = NULL;
    if (pthread_once(&load_once_, load_torch) != 0)
        return axc_fail(AXC_ERR_SYSTEM, "pthread_once failed while loading torch's C library");
    if (load_status_ != AXC_OK)
        return axc_fail(load_status_, "%s", load_msg_);
    if (api)
        *api = &api_;
    return AXC_OK;
}

axc_status axc_torch_check(int32_t err, const char *what)
{
    if (err == 0)
        return AXC_OK;
    const char *msg = NULL;
    if (load_status_ == AXC_OK && api_.exception_what)
        msg = api_.exception_what();
    return axc_fail(AXC_ERR_BACKEND, "%s failed (torch error %d)%s%s", what ? what : "torch call",
                    (int)err, msg && msg[0] ? ": " : "", msg && msg[0] ? msg : "");
}

/* ---------------------------------------------------------------- torch's CUDA allocator */

static pthread_once_t cuda_once_ = PTHREAD_ONCE_INIT;
static axc_torch_cuda_api cuda_api_;
static axc_status cuda_status_ = AXC_ERR_UNAVAILABLE;
static char cuda_msg_[768];

static void load_torch_cuda(void)
{
    static const char *const names[] = {"libtorch_cuda.so"};
    static const axc_dynlib_spec spec = {"torch's CUDA library", names, 1,
                                         "AXONN_C_TORCH_CUDA_LIB", 0,
                                         "a CUDA build of torch loads it on import"};
    char name[512];
    void *h = axc_dynlib_open(&spec, name, sizeof name, cuda_msg_, sizeof cuda_msg_);
    if (!h)
        return;
    axc_torch_cuda_api api = {0};
    /* optional as a whole: without them the caller falls back (torch older than 2.10) */
    const axc_dynlib_sym syms[] = {
        {"aoti_torch_create_cuda_stream_guard", &api.create_stream_guard, 1},
        {"aoti_torch_delete_cuda_stream_guard", &api.delete_stream_guard, 1},
        {"aoti_torch_cuda_caching_allocator_raw_alloc", &api.raw_alloc, 1},
        {"aoti_torch_cuda_caching_allocator_raw_delete", &api.raw_delete, 1},
        {"aoti_torch_get_current_cuda_stream", &api.get_current_stream, 0},
    };
    if (!axc_dynlib_resolve(h, "torch's CUDA library", name, syms, sizeof syms / sizeof syms[0],
                            "torch older than 2.10", cuda_msg_, sizeof cuda_msg_))
        return;
    cuda_api_ = api;
    cuda_status_ = AXC_OK;
}

axc_status axc_torch_cuda_load(const axc_torch_cuda_api **api)
{
    if (api)
        *api = NULL;
    if (pthread_once(&cuda_once_, load_torch_cuda) != 0)
        return axc_fail(AXC_ERR_SYSTEM, "pthread_once failed while loading torch's CUDA library");
    if (cuda_status_ != AXC_OK)
        return axc_fail(cuda_status_, "%s", cuda_msg_);
    if (api)
        *api = &cuda_api_;
    return AXC_OK;
}

axc_status axc_torch_cuda_current_stream(int device, void **stream)
{
    *stream = NULL;
    const axc_torch_cuda_api *api;
    AXC_TRY(axc_torch_cuda_load(&api));
    if (!api->get_current_stream)
        return axc_fail(AXC_ERR_UNAVAILABLE,
                        "torch's CUDA library has no aoti_torch_get_current_cuda_stream");
    char what[96];
    snprintf(what, sizeof what, "asking torch for the current stream of cuda:%d", device);
    return axc_torch_check(api->get_current_stream(device, stream), what);
}

axc_status axc_torch_cuda_alloc(const axc_torch_cuda_api *api, size_t bytes, int device,
                                void *stream, void **out)
{
    *out = NULL;
    char what[160];
    snprintf(what, sizeof what, "making stream %p of cuda:%d torch's current stream", stream,
             device);
    axc_torch_stream_guard guard = NULL;
    AXC_TRY(axc_torch_check(api->create_stream_guard(stream, device, &guard), what));
    snprintf(what, sizeof what, "torch's CUDA caching allocator (%zu bytes on cuda:%d)", bytes,
             device);
    axc_status st = axc_torch_check(api->raw_alloc((uint64_t)bytes, out), what);
    axc_status gs = axc_torch_check(api->delete_stream_guard(guard),
                                    "restoring torch's current CUDA stream");
    if (st == AXC_OK && gs != AXC_OK) { /* keep nothing when the guard could not be undone */
        api->raw_delete(*out);
        *out = NULL;
        st = gs;
    }
    return st;
}
