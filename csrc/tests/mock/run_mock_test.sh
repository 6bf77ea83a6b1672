#!/usr/bin/env bash
# Runs the nccl backend against CPU mocks of libcudart/libnccl (no GPU needed), plain and under
# ASan+UBSan: the one-rank flow of test_cuda_rt, the watchdog/abort path of test_nccl_mock, the
# scheduler's CUDA branch (stream-ordered gathered weights) in test_sched_mock (two forked ranks
# over the shm backend, which stages the mock's "device" buffers through host memory), and
# test_order_mock, the stream-order checker's own test. test_sched_mock runs twice: gathered
# weights from cudaMallocAsync, then from a mock of torch's caching allocator
# (mock_torch_cuda.c). The mock libcudart carries the stream-order checker
# (mock_stream_order.c): every test also checks that the core orders its GPU work right across
# streams (libnccl's copy of it, and the torch mock, bind to libcudart's, loaded first).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=build/mock
mkdir -p "$OUT"
NCCL_INC="${NCCL_INC:-$("${PYTHON:-python3}" -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "include"))')}"
CUDA_INC="${CUDA_INC:-/usr/local/cuda/include}"
MOCK_SRC="csrc/tests/mock/mock_cuda_nccl.c csrc/tests/mock/mock_stream_order.c csrc/tests/mock/mock_api_count.c"
for lib in libcudart.so.13 libnccl.so.2; do
    # shellcheck disable=SC2086
    gcc -shared -fPIC -O1 -Wall -Wextra -Wl,-soname,$lib -o "$OUT/$lib" $MOCK_SRC -lpthread
done
# torch's CUDA shim (stream guard, caching allocator); its memory comes from libcudart's checker
gcc -shared -fPIC -O1 -Wall -Wextra -Werror -Wl,-soname,libtorch_cuda.so \
    -o "$OUT/libtorch_cuda.so" csrc/tests/mock/mock_torch_cuda.c -lpthread
CORE="$(ls csrc/*/*.c | grep -v -e '^csrc/python/' -e '^csrc/tests/')"
for mode in plain san; do
    FLAGS="-O1 -g"
    [ "$mode" = san ] && FLAGS="$FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    for t in csrc/tests/test_cuda_rt.c csrc/tests/mock/test_nccl_mock.c \
        csrc/tests/mock/test_sched_mock.c csrc/tests/mock/test_order_mock.c; do
        bin="$OUT/$(basename "$t" .c)_$mode"
        # shellcheck disable=SC2086
        gcc -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-missing-field-initializers $FLAGS \
            -DAXC_HAVE_CUDA_HEADERS=1 -DAXC_HAVE_NCCL_HEADERS=1 -Icsrc/include -I"$CUDA_INC" \
            -I"$NCCL_INC" -o "$bin" "$t" $CORE -ldl -lpthread -lrt -lm
        echo "== $bin"
        hang=0 together=0
        case "$t" in *test_nccl_mock.c) hang=3 together=1 ;; esac
        AXC_TEST_CUDART="$PWD/$OUT/libcudart.so.13" AXC_TEST_NCCL_LIB="$PWD/$OUT/libnccl.so.2" \
            MOCK_HANG_AT=$hang MOCK_ABORTS_TOGETHER=$together ASAN_OPTIONS=detect_leaks=1 "$bin"
        case "$t" in *test_sched_mock.c) # again, gathered weights from torch's allocator
            echo "== $bin (torch's caching allocator)"
            AXC_TEST_CUDART="$PWD/$OUT/libcudart.so.13" \
                AXONN_C_TORCH_CUDA_LIB="$PWD/$OUT/libtorch_cuda.so" \
                ASAN_OPTIONS=detect_leaks=1 "$bin" ;;
        esac
    done
done
