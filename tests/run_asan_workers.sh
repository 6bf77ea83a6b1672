#!/usr/bin/env bash
# The multi-rank workers whose collectives write into torch tensors asynchronously (held
# results, deferred dW GEMMs, gradient buckets, concurrent micro-batches) and the compressed
# collectives (scratch buffers, error-feedback residuals), with the extension built under
# AddressSanitizer and libasan preloaded into Python: a collective that writes into
# a tensor torch has already freed is reported as heap-use-after-free (and fails the run) instead
# of corrupting memory at random. Only our C code is instrumented; torch's allocations are seen
# through the intercepted malloc/free. Usage: bash tests/run_asan_workers.sh [python]
set -euo pipefail
PY="${1:-python3}"
cd "$(dirname "$0")/.."
OUT=build/asan
rm -rf "$OUT" && mkdir -p "$OUT"
cp -r axonn_c "$OUT/" && rm -f "$OUT"/axonn_c/_C*.so
AXONN_C_SANITIZE=address "$PY" setup.py -q build_ext --build-lib "$OUT" --build-temp "$OUT/tmp" \
    > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
# libstdc++ before anything else: torch's C++ exceptions (checkpoint's early stop) go through
# ASan's __cxa_throw interceptor, which needs the real one already loaded
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0
export PYTHONPATH="$PWD/$OUT" OMP_NUM_THREADS=1
cd tests/workers
run() {  # expected-line nproc worker [args]
  local expect=$1 n=$2; shift 2
  echo "== $* ($n ranks, ASan)"
  local log="../../$OUT/$1.$n.log"
  if ! timeout 1200 "$PY" -m torch.distributed.run --nproc_per_node "$n" \
      --master_addr 127.0.0.1 --master_port $((29700 + RANDOM % 200)) "$@" > "$log" 2>&1 \
      || ! grep -q "$expect" "$log"; then
    grep -A30 "ERROR: AddressSanitizer" "$log" | head -60 || true
    tail -30 "$log"
    echo "FAILED under ASan: $*"
    exit 1
  fi
}
AXONN_C_SIM_US=1500 run "pipeline checks pass" 2 pipeline_worker.py
AXONN_C_SIM_US=300 run "scheduler checks pass" 2 sched_worker.py
run "concurrent micro-batch checks pass" 2 concurrent_worker.py
run "shard swap checks pass" 2 shard_swap_worker.py
run "identical on every rank" 3 compress_worker.py --sizes 1,7,1000 --codecs int4,fp8
echo "ASan workers: clean"
