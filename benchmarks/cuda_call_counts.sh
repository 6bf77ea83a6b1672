#!/usr/bin/env bash
# The CUDA API calls of one axonn_c Linear forward + backward (grid 1x1x1, 4 tokens, 16 -> 16,
# float32, bias, expert layout as axonn_c.Linear takes it at that grid, after one warm-up step), counted on the CPU mocks of libcudart and
# libcublasLt: builds them and csrc/tests/mock/test_linear_mock.c, and prints
#   API: calls per Linear forward+backward (...)
#     <API name>   <calls>
#     total        <calls>
# No GPU needed: gcc, the CUDA runtime headers (CUDA_INC, default /usr/local/cuda/include) and
# cuBLASLt's (CUBLAS_INC, default: the nvidia-cublas wheel of the python3 on PATH). Exit status
# 0 when the step made no host synchronisation, allocation, cuBLASLt descriptor/layout/
# preference creation or heuristic query (those calls are also named on stderr), else nonzero.
set -euo pipefail
exec bash "$(dirname "$0")/../csrc/tests/mock/run_gemm_mock_test.sh" --table
