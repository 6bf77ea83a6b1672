/* The benchmark-only AXONN_C_BENCH_SKIP knob and the tests-only AXONN_C_TEST_FAULT (see
 * axc/bench_skip.h). */
#include <pthread.h>
#include <string.h>

#include "axc/bench_skip.h"
#include "axc/env.h"

static int skip_env_set;
static pthread_once_t skip_env_once = PTHREAD_ONCE_INIT;

static void skip_env_read(void) { skip_env_set = axc_env_str("AXONN_C_BENCH_SKIP") != NULL; }

int axc_bench_skips(const char *what)
{
    pthread_once(&skip_env_once, skip_env_read);
    if (!skip_env_set)
        return 0;
    const char *v = axc_env_str("AXONN_C_BENCH_SKIP");
    return v && strcmp(v, what) == 0;
}

static int fault_env_set;
static pthread_once_t fault_env_once = PTHREAD_ONCE_INIT;

static void fault_env_read(void) { fault_env_set = axc_env_str("AXONN_C_TEST_FAULT") != NULL; }

int axc_test_fault(const char *what)
{
    pthread_once(&fault_env_once, fault_env_read);
    if (!fault_env_set)
        return 0;
    const char *v = axc_env_str("AXONN_C_TEST_FAULT");
    return v && strcmp(v, what) == 0;
}
