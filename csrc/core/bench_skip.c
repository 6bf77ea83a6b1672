/* The benchmark-only AXONN_C_BENCH_SKIP knob and the tests-only AXONN_C_TEST_FAULT (see
 * axc/bench_skip.h). */
#include <stdatomic.h>
#include <string.h>

#include "axc/bench_skip.h"
#include "axc/env.h"

/* A switch read from the environment: whether the variable exists is looked up once (two threads
 * racing to look agree); only when it does is its value read at every call. */
typedef struct env_switch {
    const char *name;
    _Atomic int state; /* 0: not looked up yet, 1: unset, 2: set */
} env_switch;

static int switch_is(env_switch *sw, const char *what)
{
    int state = atomic_load_explicit(&sw->state, memory_order_acquire);
    if (state == 0) {
        state = axc_env_str(sw->name) ? 2 : 1;
        atomic_store_explicit(&sw->state, state, memory_order_release);
    }
    if (state == 1)
        return 0;
    const char *v = axc_env_str(sw->name);
    return v && strcmp(v, what) == 0;
}

static env_switch bench_skip = {"AXONN_C_BENCH_SKIP", 0};
static env_switch test_fault = {"AXONN_C_TEST_FAULT", 0};

int axc_bench_skips(const char *what) { return switch_is(&bench_skip, what); }

int axc_test_fault(const char *what) { return switch_is(&test_fault, what); }
