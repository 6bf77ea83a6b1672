/* Benchmark-only knob AXONN_C_BENCH_SKIP: lets benchmarks/bench_overlap.py time a training step's
 * compute alone ("comm": collectives complete at once, csrc/comm/comm.c) or its communication
 * alone ("compute": GEMMs return at once, csrc/device/gemm.c). Results are garbage then. */
#ifndef AXC_BENCH_SKIP_H
#define AXC_BENCH_SKIP_H

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when AXONN_C_BENCH_SKIP equals `what`. The variable is looked up once: when it is unset
 * (every real job) it is never read again; when it is set (a benchmark) its value is re-read at
 * each call, so a benchmark can switch modes between steps. */
int axc_bench_skips(const char *what);

/* Tests only: 1 when AXONN_C_TEST_FAULT equals `what` (a failure the tests inject). Looked up the
 * same way: a job that starts without the variable never reads it again. */
int axc_test_fault(const char *what);

#ifdef __cplusplus
}
#endif
#endif
