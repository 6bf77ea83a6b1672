/* The AXONN_C_* settings: see axc/env.h. The entries are written as docs/ARCHITECTURE.md shows
 * them (Markdown): tests/test_docs.py reads this table and compares it with the docs' one. */
#include "axc/env.h"

#include <stdlib.h>
#include <string.h>

#include "axc/status.h"

static const axc_env_setting settings[] = {
    {"AXONN_C_TIMEOUT", "`axonn_c/validate.py`", "300",
     "seconds any wait for a peer may take before `CommTimeoutError` (`init(timeout=...)` "
     "overrides)"},
    {"AXONN_C_MACHINE", "`axonn_c/plan.py`", "`perlmutter`",
     "the machine profile of `init(plan=\"auto\")` and the planner when none is given: a built-in "
     "name or a JSON profile path"},
    {"AXONN_C_SHM_SLOT_KB", "`csrc/comm/shm.c`", "2048 (min 64)",
     "the shm data slot per rank and lane, in KiB; lower it when `/dev/shm` is small"},
    {"AXONN_C_SHM_TAG", "`csrc/comm/shm.c`", "none",
     "a job tag (≤ 64 letters, digits, `_`, `-`) that ends the shm segment name, so leak checks "
     "see only their own job's segments (the tests and `.ci/run` set it)"},
    {"AXONN_C_SIM_GBPS", "`csrc/comm/shm.c`", "0 (off)",
     "a simulated link's bandwidth: each shm collective takes at least `US µs + bytes / GBPS "
     "GB/s`, asleep (benchmarks of overlap without a network)"},
    {"AXONN_C_SIM_US", "`csrc/comm/shm.c`", "0 (off)",
     "a simulated link's latency, the `US` of `AXONN_C_SIM_GBPS`"},
    {"AXONN_C_TORCH_LIB", "`csrc/device/torch_shim.c`",
     "the `libtorch_cpu.so` `import torch` loaded",
     "where torch's C library is when no torch is loaded (the C unit tests)"},
    {"AXONN_C_TORCH_CUDA_LIB", "`csrc/device/torch_shim.c`", "the loaded `libtorch_cuda.so`",
     "the same for torch's CUDA library (the mock tests)"},
    {"AXONN_C_BENCH_SKIP", "`csrc/core/bench_skip.c`", "unset",
     "benchmarks only: `comm` makes collectives complete at once, `compute` makes GEMMs return "
     "at once (results are garbage)"},
    {"AXONN_C_BIAS_GRAD_KERNEL", "`csrc/device/bias_grad_cuda.c`", "unset",
     "`1`: the CUDA bias gradient of up to 1024 rows is one kernel launch "
     "(`csrc/device/bias_grad_kernels.cu`) instead of the cuBLASLt GEMV, less host time per "
     "Linear backward; off until `benchmarks/gpu_suite.sh` has run it on a GPU (read once, at "
     "the first CUDA bias gradient of up to 1024 rows outside a graph capture)"},
    {"AXONN_C_CODEC_KERNELS", "`csrc/compress/codec_cuda.c`", "`block`",
     "`warp`: the CUDA codec encode and error-feedback kernels reduce each codec block by warp "
     "shuffles in a thread block sized to it (`csrc/compress/codec_kernels.cu`), the same bytes; "
     "off until `benchmarks/gpu_suite.sh` has run it on a GPU (read once, at the first CUDA "
     "codec kernel; another value makes the kernels unavailable, naming it)"},
    {"AXONN_C_CPU_ONLY", "`setup.py`", "unset", "`1`: build without the CUDA parts"},
    {"AXONN_C_CUDA_INCLUDE", "`setup.py`", "none",
     "extra directories (`:`-separated) to look for CUDA/NCCL/cuBLASLt headers in"},
    {"AXONN_C_CUDA_ARCHS", "`setup.py`", "`80,90`",
     "the GPU architectures the CUDA kernels (codecs, bias gradient) are compiled for (plus PTX "
     "for newer ones)"},
    {"AXONN_C_SANITIZE", "`setup.py`", "unset",
     "`address`: an AddressSanitizer build (`tests/run_asan_workers.sh`)"},
    {"AXONN_C_PRINT_CFLAGS", "`setup.py`", "unset",
     "`1`: print the header flags of the CUDA parts and exit (the Makefile's C tests use them)"},
    {"AXONN_C_TEST_FAULT", "`csrc/python/py_linear_call.c`", "unset",
     "tests only: `backward_keep` makes a deferred Linear backward fail (`MemoryError`) in the "
     "step after its work was queued (keeping what the work reads alive), as out of memory "
     "there would; switchable while the job runs only when set (to anything) at its start"},
    {"AXONN_C_TEST_DEVICE", "`tests/workers/gpu_overlap_worker.py`", "`cuda`",
     "`cpu` runs that GPU worker on CPU tensors (the CPU suite does)"},
};

const axc_env_setting *axc_env_settings(size_t *n)
{
    *n = sizeof settings / sizeof settings[0];
    return settings;
}

const axc_env_setting *axc_env_find(const char *name)
{
    for (size_t i = 0; name && i < sizeof settings / sizeof settings[0]; i++)
        if (strcmp(settings[i].name, name) == 0)
            return &settings[i];
    return NULL;
}

const char *axc_env_str(const char *name)
{
    if (!axc_env_find(name)) { /* a programming error: every setting is in the table */
        axc_log(2, "env: %s is not in the table of settings (csrc/core/env.c); read as unset",
                name ? name : "(null)");
        return NULL;
    }
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

double axc_env_double(const char *name, double dflt)
{
    const char *v = axc_env_str(name);
    if (!v)
        return dflt;
    char *end;
    double d = strtod(v, &end);
    return end != v ? d : dflt;
}
