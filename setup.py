"""Build of axonn_c._C: a plain C extension (no pybind11, no torch headers).

CUDA/NCCL support is compiled in when their headers are found (CUDA toolkit, or the
nvidia-* pip wheels); the libraries themselves are bound at run time, so the same build runs
on CPU-only machines. Set AXONN_C_CPU_ONLY=1 to skip CUDA, AXONN_C_CUDA_INCLUDE to add dirs.
"""
import glob
import os
import shutil
import site
import subprocess
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _site_dirs():
    dirs = []
    for getter in (site.getsitepackages, lambda: [site.getusersitepackages()]):
        try:
            dirs += list(getter())
        except Exception:  # noqa: BLE001 - site may be partial inside build isolation
            pass
    for key in ("purelib", "platlib"):
        dirs.append(sysconfig.get_paths()[key])
        # the base interpreter's site-packages, also when pip isolates the build
        dirs.append(sysconfig.get_paths(vars={"base": sysconfig.get_config_var("installed_base") or ""})[key])
    return [d for d in dict.fromkeys(dirs) if d and os.path.isdir(d)]


def _cuda_include_candidates():
    cands = [p for p in os.environ.get("AXONN_C_CUDA_INCLUDE", "").split(os.pathsep) if p]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "include"))
    cands.append("/usr/local/cuda/include")
    for sp in _site_dirs():
        cands += glob.glob(os.path.join(sp, "nvidia", "*", "include"))
    return [c for c in dict.fromkeys(cands) if os.path.isdir(c)]


def _compiles(header, include_dirs):
    """True when a C file including `header` compiles with these include dirs (a wheel can ship
    cuda_runtime_api.h without the crt/ headers it needs)."""
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-std=c11", "-fsyntax-only", "-x", "c", "-"] + [f"-I{d}" for d in include_dirs]
    try:
        r = subprocess.run(cmd, input=f"#include <{header}>\n", capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _find_header(name, dirs, extra=()):
    """The first dir holding `name` in which it also compiles (with the dirs in `extra`)."""
    for d in dirs:
        if os.path.isfile(os.path.join(d, name)) and _compiles(name, [d, *extra, *dirs]):
            return d
    return None


def _nvcc():
    nvcc = shutil.which("nvcc")
    if not nvcc:
        for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
                nvcc = os.path.join(home, "bin", "nvcc")
                break
    return nvcc


def _configure():
    """Returns (define_macros, include_dirs, summary) for the CUDA-dependent parts."""
    if os.environ.get("AXONN_C_CPU_ONLY") == "1":
        return [], [], "CPU-only (AXONN_C_CPU_ONLY=1)"
    dirs = _cuda_include_candidates()
    found = {"cuda_runtime_api.h": _find_header("cuda_runtime_api.h", dirs)}
    base = [found["cuda_runtime_api.h"]] if found["cuda_runtime_api.h"] else []
    for h in ("nccl.h", "cublasLt.h"):
        found[h] = _find_header(h, dirs, base) if base else None
    macros, incs, parts = [], [], []
    if found["cuda_runtime_api.h"]:
        macros.append(("AXC_HAVE_CUDA_HEADERS", "1"))
        incs.append(found["cuda_runtime_api.h"])
        parts.append("CUDA runtime")
        if found["nccl.h"]:
            macros.append(("AXC_HAVE_NCCL_HEADERS", "1"))
            incs.append(found["nccl.h"])
            parts.append("NCCL")
        if found["cublasLt.h"]:
            macros.append(("AXC_HAVE_CUBLASLT_HEADERS", "1"))
            incs.append(found["cublasLt.h"])
            parts.append("cuBLASLt")
    nvcc = _nvcc()
    if nvcc:
        macros.append(("AXC_HAVE_NVCC", "1"))
        parts.append("nvcc")
    if not parts or not found["cuda_runtime_api.h"]:
        return macros, [], ("CPU-only (no usable CUDA headers found; install the CUDA toolkit, or "
                            "nvidia-cuda-runtime nvidia-cuda-crt nvidia-nccl-cu13 nvidia-cublas)")
    return macros, list(dict.fromkeys(incs)), "CUDA parts compiled: " + ", ".join(parts)


# the CUDA kernels: each .cu a fatbin for these GPUs plus PTX for newer ones, embedded as bytes
# (axc_<name>_fatbin) and loaded through the CUDA runtime (no CUDA library is linked); the macro
# tells its launcher the fatbin is there
CUDA_ARCHS = os.environ.get("AXONN_C_CUDA_ARCHS", "80,90").split(",")
KERNELS = (("codec", "csrc/compress/codec_kernels.cu", "AXC_HAVE_CODEC_FATBIN"),
           ("bias_grad", "csrc/device/bias_grad_kernels.cu", "AXC_HAVE_BIAS_GRAD_FATBIN"))


def _embed_kernels(nvcc, build_temp, name, cu):
    """Compiles the .cu into a fatbin and writes a C file holding it; returns that file."""
    os.makedirs(build_temp, exist_ok=True)
    fatbin = os.path.join(build_temp, f"{name}_kernels.fatbin")
    cmd = [nvcc, "-std=c++17", "-O3", "-fatbin", "-Icsrc/include", "-o", fatbin, cu]
    for a in CUDA_ARCHS:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd += ["-gencode", f"arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed on {cu} ({' '.join(cmd)}):\n{r.stderr}")
    data = open(fatbin, "rb").read()
    src = os.path.join(build_temp, f"{name}_fatbin.c")
    rows = ",\n".join(",".join(str(b) for b in data[i:i + 32]) for i in range(0, len(data), 32))
    with open(src, "w") as f:
        f.write(f"/* generated by setup.py from {cu} */\n"
                "#include <stddef.h>\n"
                f"const unsigned char axc_{name}_fatbin[] = {{\n{rows}\n}};\n"
                f"const size_t axc_{name}_fatbin_size = {len(data)};\n")
    return src


class BuildExt(build_ext):
    def run(self):
        print(f"axonn_c: {BUILD_SUMMARY}")
        super().run()

    def build_extensions(self):
        nvcc = _nvcc() if ("AXC_HAVE_NVCC", "1") in MACROS else None
        if nvcc and CUDA_INCS:
            for name, cu, macro in KERNELS:
                src = _embed_kernels(nvcc, self.build_temp, name, cu)
                for e in self.extensions:
                    e.sources.append(src)
                    e.define_macros.append((macro, "1"))
        super().build_extensions()


MACROS, CUDA_INCS, BUILD_SUMMARY = _configure()
if os.environ.get("AXONN_C_PRINT_CFLAGS") == "1":
    # the Makefile's C tests compile the core with the same CUDA/NCCL/cuBLASLt headers
    print(" ".join([f"-D{k}={v}" for k, v in MACROS if k.endswith("_HEADERS")]
                   + [f"-I{d}" for d in CUDA_INCS]))
    raise SystemExit(0)
SOURCES = sorted(
    p for p in glob.glob("csrc/**/*.c", recursive=True) if not p.startswith("csrc/tests/")
)
# every header: build_ext rebuilds when one changes (it only compares sources otherwise)
HEADERS = sorted(glob.glob("csrc/**/*.h", recursive=True))
MACROS.append(("AXC_BUILD_SUMMARY", '"' + BUILD_SUMMARY.replace('"', "'") + '"'))

# AXONN_C_SANITIZE=address: an AddressSanitizer build of the extension, for the multi-rank
# workers run with libasan preloaded (tests/run_asan_workers.sh); never for a release
SANITIZE = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"] \
    if os.environ.get("AXONN_C_SANITIZE") == "address" else []

ext = Extension(
    "axonn_c._C",
    sources=SOURCES,
    depends=HEADERS,
    include_dirs=["csrc/include"] + CUDA_INCS,
    define_macros=MACROS + [("_GNU_SOURCE", "1")],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
                        "-Wno-missing-field-initializers"] + SANITIZE,
    extra_link_args=SANITIZE[:1],
    libraries=["dl", "pthread", "rt", "m"],
    language="c",
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
