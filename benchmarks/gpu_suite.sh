#!/usr/bin/env bash
# GPU suite: build axonn_c on the GPU machine (offline), then run what needs a GPU.
#
#   bash benchmarks/gpu_suite.sh [STAGE ...]        (no STAGE: all of them, in this order)
#
#   build      pip install --no-build-isolation --no-deps . and build_info() (always runs first)
#   ctest      the C test of the CUDA loader + a one-rank nccl communicator, built with the
#              CUDA/NCCL headers
#   gpu        pytest -m gpu tests/test_gpu.py (nccl at world size 1; shm with CUDA tensors), and
#              the bias gradient on CUDA (tests/test_gemm.py -k "bias_grad and cuda"), also with
#              AXONN_C_BIAS_GRAD_KERNEL=1 (and test_linear_gpu.py with it); the codec tests with
#              AXONN_C_CODEC_KERNELS=warp
#   linear     the GEMM and Linear on CUDA (cuBLASLt; CUDA-graph capture), bench_linear on cuda
#   multirank  the multi-process suite with CUDA tensors (torchrun, 2/3/4 ranks sharing the GPU,
#              shm backend), and init(overlap=True) training steps with CUDA tensors at 2 and 4
#   bench      bench_overlap (shm, simulated link)
#   capture    why cuBLASLt fails inside a CUDA-graph capture: gpu_capture_probe.py, one probe per
#              way of issuing a GEMM (torch, cuBLASLt through ctypes, axonn_c), with cuBLASLt's log
#   train      bf16 GPT training throughput and MFU at a world of one: axonn_c against plain
#              PyTorch eager and torch.compile (bench_train_gpu.py; TRAIN_PRESET, TRAIN_VARIANTS)
#   codec      the CUDA codec kernels' bandwidth against the device's copy (bench_codec_cuda.py),
#              also with AXONN_C_CODEC_KERNELS=warp
#   host       host cost of one Linear forward + backward on CUDA against nn.Linear, alone (also
#              with AXONN_C_BIAS_GRAD_KERNEL=1) and per layer of a stack of 8 (bench_host.py);
#              clip_grad_norm_ against torch's (bench_clip.py)
#   profile    a sampling profile (py-spy --native, from .whl/py_spy-*.whl when it is not installed)
#              of bench_host.py --spin on CUDA, one process per loop (profile_host.sh): axonn_c.Linear
#              (overlap off, on) and nn.Linear, summarised by profile_summary.py into
#              host_profile.txt (the raw stacks in the logs)
#   nccl       per-call cost of a one-rank NCCL all-reduce, axonn_c against torch.distributed
#              (bench_nccl_world1.py)
#
# SUITE_BUDGET_S (seconds, default none) caps the whole call: every step's timeout is cut to what
# is left, so the suite ends, and bundles its logs, inside a limit such as the device tool's 10
# minutes a command (there: SUITE_BUDGET_S=540, and split the stages over two or three calls).
# Results go to $OUT (default ./gpu_out): summary.txt (PASS/FAIL per step), logs.tar.gz (every
# step's log, env, junit xml) and the benchmarks' json/csv files -- at most 8 files, which is what
# the device tool brings back. Exits non-zero when any step failed.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
FAILED=0
ALL_STAGES="ctest gpu linear multirank bench capture train codec host profile nccl"
STAGES="${*:-$ALL_STAGES}"
for st in $STAGES; do
    case " build $ALL_STAGES " in
        *" $st "*) ;;
        *) echo "gpu_suite: unknown stage '$st' (stages: build $ALL_STAGES)" >&2; exit 2 ;;
    esac
done
want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
BUDGET="${SUITE_BUDGET_S:-}"
START=$SECONDS

note() { echo "== $*" | tee -a "$LOGS/suite.log"; }

# logs.tar.gz holds the logs; whatever happens, the suite leaves few files in $OUT
bundle() {
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null && rm -rf "$LOGS"
}
trap bundle EXIT

# the timeout of a step: its own limit, cut to what is left of SUITE_BUDGET_S (with 20 s for the
# bundle); 0 when nothing is left
limit_for() {
    local limit="$1"
    if [ -n "$BUDGET" ]; then
        local left=$((BUDGET - (SECONDS - START) - 20))
        [ "$left" -lt "$limit" ] && limit=$left
        [ "$limit" -lt 0 ] && limit=0
    fi
    echo "$limit"
}

# step NAME TIMEOUT_S CMD...: runs CMD, logs to $LOGS/NAME.log, records PASS/FAIL with the time.
step() {
    local name="$1" limit
    limit="$(limit_for "$2")"
    shift 2
    if [ "$limit" -le 0 ]; then
        echo "SKIP $name (SUITE_BUDGET_S=$BUDGET spent)" | tee -a "$SUMMARY"
        FAILED=1
        return 124
    fi
    note "$name (timeout ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    local dt=$((SECONDS - t0))
    tail -n 40 "$LOGS/$name.log"
    if [ "$rc" -eq 0 ]; then
        echo "PASS $name (${dt}s)" | tee -a "$SUMMARY"
    else
        [ "$rc" -eq 124 ] && echo "   (timed out after ${limit}s)" | tee -a "$SUMMARY"
        echo "FAIL $name (rc=$rc, ${dt}s, log: logs/$name.log in logs.tar.gz)" | tee -a "$SUMMARY"
        FAILED=1
    fi
    return "$rc"
}

cd "$REPO" || exit 2
note "axonn_c GPU suite in $REPO, stages: build $STAGES, results in $OUT, $(date -u +%FT%TZ)"
echo "stages: build $STAGES; $(date -u +%FT%TZ)" > "$SUMMARY"
{
    echo "git: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
    uname -a
    "$PY" --version
    nvidia-smi 2>&1 || echo "nvidia-smi not available"
    df -h /dev/shm 2>&1  # the shm backend's segments live there; a small one ends in SIGBUS
    "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
    print("nccl", torch.cuda.nccl.version())
EOF
} > "$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

# build (every call: a device machine starts bare)
step build 900 "$PY" -m pip install --no-build-isolation --no-deps -v "$REPO"
BUILD_RC=$?
grep -E "axonn_c: " "$LOGS/build.log" | head -3 | tee -a "$SUMMARY"

# run Python from $OUT so the installed package (with _C) is imported, not the source tree
cd "$OUT" || exit 2
if [ "$BUILD_RC" -eq 0 ]; then
    # build facts
    step build_info 120 "$PY" -c "import json, axonn_c; print(json.dumps(axonn_c.build_info(), indent=1))"
    cat "$LOGS/build_info.log" >> "$SUMMARY"
    # a build that found no CUDA headers is a CPU-only build: every GPU step would fail for that
    step build_has_cuda 60 "$PY" -c "import axonn_c, sys; i = axonn_c.build_info(); \
sys.exit(0 if i['cuda_compiled'] and i['nccl_compiled'] else 'CPU-only build: ' + i['summary'])" \
        || BUILD_RC=1
fi

# the C test with the real headers (the Makefile's C tests build without them)
read -r -d '' FIND_PATHS <<'EOF'
import glob, os, site, sys
import torch  # noqa: F401  (loads libcudart / libnccl)
def loaded(name):
    for line in open("/proc/self/maps"):
        p = line.split()[-1]
        if "/" in p and os.path.basename(p).startswith(name):
            return p
    return ""
incs = []
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    incs += glob.glob(os.path.join(sp, "nvidia", "*", "include"))
for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
    if d and os.path.isdir(os.path.join(d, "include")):
        incs.insert(0, os.path.join(d, "include"))
print(" ".join("-I" + i for i in dict.fromkeys(incs)))
print(loaded("libcudart.so"))
print(loaded("libnccl.so"))
EOF
if ! want ctest; then
    :
elif "$PY" -c "$FIND_PATHS" > "$LOGS/paths.txt" 2> "$LOGS/paths.err"; then
    INCS="$(sed -n 1p "$LOGS/paths.txt")"
    CUDART="$(sed -n 2p "$LOGS/paths.txt")"
    NCCLLIB="$(sed -n 3p "$LOGS/paths.txt")"
    echo "include dirs: $INCS" >> "$LOGS/suite.log"
    echo "libcudart: ${CUDART:-not loaded by torch}; libnccl: ${NCCLLIB:-not loaded by torch}" | tee -a "$SUMMARY"
    CORE_SRC="$(ls "$REPO"/csrc/*/*.c | grep -v -e '/csrc/python/' -e '/csrc/tests/')"
    # shellcheck disable=SC2086  (word splitting of the include and source lists is intended)
    if step ctest_build 300 ${CC:-gcc} -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror \
        -Wno-missing-field-initializers -g -O1 -DAXC_HAVE_CUDA_HEADERS=1 \
        -DAXC_HAVE_NCCL_HEADERS=1 -I"$REPO/csrc/include" $INCS -o "$LOGS/test_cuda_rt" \
        "$REPO/csrc/tests/test_cuda_rt.c" $CORE_SRC -ldl -lpthread -lrt -lm; then
        step ctest_cuda_rt 300 env AXC_TEST_CUDART="$CUDART" AXC_TEST_NCCL_LIB="$NCCLLIB" \
            "$LOGS/test_cuda_rt"
        rm -f "$LOGS/test_cuda_rt"
    fi
else
    cat "$LOGS/paths.err"
    echo "FAIL ctest (could not locate the CUDA/NCCL paths)" | tee -a "$SUMMARY"
    FAILED=1
fi

if [ "$BUILD_RC" -ne 0 ]; then
    echo "FAIL (skipped the Python steps: the build failed, see logs/build.log)" | tee -a "$SUMMARY"
    exit 1
fi

# the measurements first (a call that runs out of time keeps them), then the tests
if want capture; then
    step capture_probe 240 "$PY" "$REPO/benchmarks/gpu_capture_probe.py" --out "$OUT"
fi
if want train; then
    step train_gpt_bf16 420 "$PY" "$REPO/benchmarks/bench_train_gpu.py" --preset "${TRAIN_PRESET:-350m}" --variants "${TRAIN_VARIANTS:-torch,axonn_c,torch_compile}" \
        --json "$OUT/gpt_train.json"
fi
if want codec; then
    step codec_cuda 120 "$PY" "$REPO/benchmarks/bench_codec_cuda.py" --json "$OUT/codec_cuda.json"
    # the warp-reduced encode and feedback kernels (AXONN_C_CODEC_KERNELS=warp), for the A/B
    # (their bytes against the CPU's: the gpu stage)
    step codec_cuda_warp 120 env AXONN_C_CODEC_KERNELS=warp "$PY" \
        "$REPO/benchmarks/bench_codec_cuda.py" --json "$OUT/codec_cuda_warp.json"
fi
if want host; then
    step host_cuda 240 "$PY" "$REPO/benchmarks/bench_host.py" --device cuda --json "$OUT/host_cuda.json"
    # the same with the bias gradient's small-M kernel (AXONN_C_BIAS_GRAD_KERNEL=1), for the A/B
    step host_cuda_bias_kernel 240 env AXONN_C_BIAS_GRAD_KERNEL=1 "$PY" \
        "$REPO/benchmarks/bench_host.py" --device cuda --json "$OUT/host_cuda_bias_kernel.json"
    # clip_grad_norm_ on 144 CUDA gradients against torch's (foreach kernels both)
    step clip_cuda 60 "$PY" "$REPO/benchmarks/bench_clip.py" --device cuda --json "$OUT/clip_cuda.json"
    # per layer of a stack of 8 (a step's fixed work shared, as in a model; HOST_STACK=0 skips)
    [ "${HOST_STACK:-1}" = 0 ] || step host_cuda_stack 180 "$PY" "$REPO/benchmarks/bench_host.py" --device cuda --layers 8 \
        --rounds 30 --json "$OUT/host_cuda_stack.json"
fi
if want profile; then
    PYSPY="$(command -v py-spy || true)"
    if [ -z "$PYSPY" ] && ls "$REPO"/.whl/py_spy-*.whl > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyspy \
            "$REPO"/.whl/py_spy-*.whl > "$LOGS/pyspy_install.log" 2>&1 && PYSPY=/tmp/pyspy/bin/py-spy
    fi
    if [ -n "$PYSPY" ]; then
        # one process per loop, every thread, py-spy attached after the start-up
        for loop in axonn_c_off axonn_c_on nn_linear; do
            step "host_profile_$loop" 150 env PY="$PY" PYSPY="$PYSPY" bash \
                "$REPO/benchmarks/profile_host.sh" "$loop" "$LOGS/host_profile_$loop.txt" 6 \
                --device cuda
        done
        step host_profile_summary 60 sh -c "'$PY' '$REPO/benchmarks/profile_summary.py' \
            '$LOGS'/host_profile_*.txt --top 60 > '$OUT/host_profile.txt'"
    else
        echo "FAIL host_profile (no py-spy: carry .whl with py_spy-*.whl)" | tee -a "$SUMMARY"
        FAILED=1
    fi
fi
if want nccl; then
    step nccl_world1 300 "$PY" "$REPO/benchmarks/bench_nccl_world1.py" --csv "$OUT/bench_nccl_world1.csv"
fi

if want gpu; then
    # the bias gradient on CUDA against float64 sums: the cuBLASLt GEMV, and with
    # AXONN_C_BIAS_GRAD_KERNEL=1 the small-M kernel (opt-in until these steps have passed on a
    # GPU), also through the Linear tests; first, as they are short
    step pytest_bias_grad_cuda 300 "$PY" -m pytest -q -rs -p no:cacheprovider \
        "$REPO/tests/test_gemm.py" -k "bias_grad and cuda"
    step pytest_bias_grad_kernel_cuda 300 env AXONN_C_BIAS_GRAD_KERNEL=1 "$PY" -m pytest -q -rs \
        -p no:cacheprovider "$REPO/tests/test_gemm.py" -k "bias_grad and cuda"
    step pytest_linear_gpu_bias_kernel 600 env AXONN_C_BIAS_GRAD_KERNEL=1 "$PY" -m pytest -q -rs \
        -m gpu -p no:cacheprovider "$REPO/tests/test_linear_gpu.py"
    # the codec kernels' bytes against the CPU reference's with AXONN_C_CODEC_KERNELS=warp (opt-in
    # until this has passed on a GPU; the default kernels' run in pytest_gpu)
    step pytest_codec_warp_cuda 300 env AXONN_C_CODEC_KERNELS=warp "$PY" -m pytest -q -rs -m gpu \
        -p no:cacheprovider "$REPO/tests/test_gpu.py" -k "codec or compressed"
    # pytest GPU tests (nccl world size 1 + shm multi-rank with CUDA tensors)
    step pytest_gpu 1500 "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider \
        --junitxml="$LOGS/pytest_gpu.xml" "$REPO/tests/test_gpu.py" "$REPO/tests/test_linear_gpu.py"
fi

if want linear; then
    # the GEMM layer and the Linear layer on CUDA (cuBLASLt, CUDA-graph capture), and
    # bench_linear against nn.Linear
    step pytest_gemm_cuda 900 "$PY" -m pytest -q -rs -p no:cacheprovider "$REPO/tests/test_gemm.py" \
        "$REPO/tests/test_linear_gpu.py"
    step bench_linear_cuda 1200 "$PY" "$REPO/benchmarks/bench_linear.py" --device cuda \
        --json "$OUT/linear_cuda.json"
fi

if want multirank; then
    # multi-process suite with CUDA tensors (shm backend stages through host memory)
    for n in 2 3 4; do
        step "multirank_cuda_shm_np$n" 900 "$PY" -m torch.distributed.run --standalone \
            --nproc_per_node "$n" "$REPO/tests/workers/gpu_shm_worker.py" --backend shm \
            --sizes 1,7,1000,65539
    done

    # init(overlap=True) with CUDA tensors, 2 and 4 ranks sharing the GPU: prefetch buffers
    #     from torch's caching allocator, deferred reduce-scatters, buckets, hooks, against
    #     serial PyTorch
    for n in 2 4; do
        step "overlap_cuda_shm_np$n" 900 "$PY" -m torch.distributed.run --standalone \
            --nproc_per_node "$n" "$REPO/tests/workers/gpu_overlap_worker.py"
    done
fi

if want bench; then
    # the overlap benchmark (shm, simulated link) with the whole package built for CUDA, on a
    # machine with a spare core per rank and progress thread
    step bench_overlap 900 "$PY" "$REPO/benchmarks/bench_overlap.py" \
        --micro-batches 2 --json "$OUT/overlap_cpu.json" --trace "$OUT/overlap_trace.json"

fi

note "summary"
cat "$SUMMARY"
if [ "$FAILED" -ne 0 ]; then
    echo "gpu_suite: FAILED (see $SUMMARY and the logs in $OUT)"
    exit 1
fi
echo "gpu_suite: all steps passed"
exit 0
