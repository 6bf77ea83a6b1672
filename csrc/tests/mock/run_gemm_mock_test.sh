#!/usr/bin/env bash
# Runs the cuBLASLt path of the GEMM layer against CPU mocks of libcudart and libcublasLt (no GPU
# needed), plain and under ASan+UBSan+LeakSanitizer. Needs the CUDA runtime and cuBLASLt headers
# (CUDA_INC, CUBLAS_INC: the toolkit, or the nvidia-cuda-runtime / nvidia-cublas wheels).
# The mock libcudart carries the stream-order checker (mock_stream_order.c; libcublasLt's copy
# binds to libcudart's, loaded first), so the test also checks the GEMM layer's stream ordering,
# and the per-API call counts (mock_api_count.c): test_linear_mock checks that a warmed-up
# Linear forward + backward makes no host synchronisation, allocation, cuBLASLt descriptor
# creation or heuristic query.
# --table: builds the mocks and the plain test_linear_mock only, and prints its table of calls
# per API for one Linear forward + backward (benchmarks/cuda_call_counts.sh); the exit status
# says whether its checks passed.
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODES="plain san"
TESTS="test_gemm_mock test_linear_mock"
ARGS=()
if [ "${1:-}" = --table ]; then
    MODES=plain
    TESTS=test_linear_mock
    ARGS=(--table)
fi
OUT=build/mock_gemm
mkdir -p "$OUT"
CUDA_INC="${CUDA_INC:-/usr/local/cuda/include}"
CUBLAS_INC="${CUBLAS_INC:-$("${PYTHON:-python3}" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "include"))')}"
INC="-I$CUDA_INC -I$CUBLAS_INC"
# shellcheck disable=SC2086
gcc -shared -fPIC -O1 -Wall -Wextra -DMOCK_CUDART_EXTRA $INC -Wl,-soname,libcudart.so.13 \
    -o "$OUT/libcudart.so.13" csrc/tests/mock/mock_cuda_nccl.c csrc/tests/mock/mock_cublaslt.c \
    csrc/tests/mock/mock_stream_order.c csrc/tests/mock/mock_api_count.c -lpthread
# shellcheck disable=SC2086
gcc -shared -fPIC -O1 -std=c11 -Wall -Wextra -Werror $INC -Wl,-soname,libcublasLt.so.13 \
    -o "$OUT/libcublasLt.so.13" csrc/tests/mock/mock_cublaslt.c csrc/tests/mock/mock_stream_order.c \
    csrc/tests/mock/mock_api_count.c -lpthread
CORE="$(ls csrc/*/*.c | grep -v -e '^csrc/python/' -e '^csrc/tests/')"
for mode in $MODES; do
    FLAGS="-O1 -g"
    [ "$mode" = san ] && FLAGS="$FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    for t in $TESTS; do
        bin="$OUT/${t}_$mode"
        # shellcheck disable=SC2086
        gcc -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-missing-field-initializers $FLAGS \
            -DAXC_HAVE_CUDA_HEADERS=1 -DAXC_HAVE_CUBLASLT_HEADERS=1 -Icsrc/include $INC \
            -o "$bin" "csrc/tests/mock/$t.c" $CORE -ldl -lpthread -lrt -lm
        [ ${#ARGS[@]} -eq 0 ] && echo "== $bin"
        AXC_TEST_CUDART="$PWD/$OUT/libcudart.so.13" AXC_TEST_CUBLASLT="$PWD/$OUT/libcublasLt.so.13" \
            ASAN_OPTIONS=detect_leaks=1 "$bin" "${ARGS[@]}"
    done
done
