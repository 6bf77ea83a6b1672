/* The benchmark-only AXONN_C_BENCH_SKIP knob (see axc/bench_skip.h). */
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
