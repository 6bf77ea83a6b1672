/* Shared by the C tests that fork the ranks of one job on this machine: a one-key bootstrap store
 * in shared anonymous memory (enough to publish the shm segment name), the communicator config
 * of a grid, an EXPECT that counts a rank's failures, and the fork/wait loop. */
#ifndef AXC_TESTS_FORK_RANKS_H
#define AXC_TESTS_FORK_RANKS_H

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "axc/comm.h"
#include "axc/futex.h"

/* A one-key store in shared anonymous memory, enough to publish the segment name. */
typedef struct kv {
    _Atomic uint32_t ready;
    char key[128], value[256];
    size_t len;
} kv;
static kv *g_kv;

static inline axc_status kv_set(void *ctx, const char *key, const void *value, size_t len)
{
    (void)ctx;
    snprintf(g_kv->key, sizeof g_kv->key, "%s", key);
    memcpy(g_kv->value, value, len);
    g_kv->len = len;
    atomic_store(&g_kv->ready, 1);
    axc_futex_wake_all(&g_kv->ready, 1);
    return AXC_OK;
}

static inline axc_status kv_get(void *ctx, const char *key, void *value, size_t cap, size_t *len,
                                double timeout_s)
{
    (void)ctx;
    int64_t deadline = axc_now_ns() + (int64_t)(timeout_s * 1e9);
    while (!atomic_load(&g_kv->ready)) {
        if (axc_now_ns() > deadline)
            return axc_fail(AXC_ERR_TIMEOUT, "key %s never set", key);
        axc_futex_wait(&g_kv->ready, 0, 10000000, 1);
    }
    if (strcmp(key, g_kv->key) != 0 || g_kv->len > cap)
        return axc_fail(AXC_ERR_INVALID, "unexpected key %s", key);
    memcpy(value, g_kv->value, g_kv->len);
    *len = g_kv->len;
    return AXC_OK;
}

/* Maps the store; main() calls it once, before the first spawn. */
static inline void fork_ranks_init(void)
{
    g_kv = mmap(NULL, sizeof *g_kv, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
}

/* The failures of this rank (a forked child); its exit status. */
static int fails;
#define EXPECT(cond)                                                                        \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "rank %d: %s:%d: %s\n", rank, __FILE__, __LINE__, #cond);       \
            fails++;                                                                        \
        }                                                                                   \
    } while (0)

/* The shm communicator config of `rank` on the grid dims = {G_data, G_r, G_c, G_d}, all ranks
 * on this machine and bootstrapped through the store. Returns axc_grid_make's status. */
static inline axc_status fork_ranks_config(axc_comm_config *cfg, int rank, int world,
                                           const int dims[4], const char *job_id, double timeout)
{
    memset(cfg, 0, sizeof *cfg);
    axc_status st = axc_grid_make(&cfg->grid, world, dims[0], dims[1], dims[2], dims[3], 1);
    cfg->rank = rank;
    cfg->local_world_size = world;
    cfg->cuda_device = -1;
    cfg->backend = "shm";
    cfg->job_id = job_id;
    cfg->timeout_s = timeout;
    cfg->bootstrap = (axc_bootstrap){NULL, kv_set, kv_get};
    return st;
}

typedef void (*fork_rank_fn)(int rank, int world, const int dims[4], double timeout);

/* Forks `world` (<= 16) ranks running `fn`; returns the number of ranks that failed (nonzero
 * `fails`, a signal, or a nonzero exit status). exit_handlers = 0: a rank ends with _exit();
 * 1: with exit(), which runs the exit handlers, among them LeakSanitizer's leak check (whose
 * findings make the exit status nonzero). */
static inline int fork_ranks_spawn(int world, fork_rank_fn fn, const int dims[4], double timeout,
                                   int exit_handlers)
{
    atomic_store(&g_kv->ready, 0);
    fflush(NULL); /* nothing buffered before the fork may be written twice */
    pid_t pids[16];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            fails = 0;
            fn(r, world, dims, timeout);
            if (exit_handlers)
                exit(fails ? 1 : 0);
            _exit(fails ? 1 : 0);
        }
    }
    int bad = 0;
    for (int r = 0; r < world; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        bad += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    return bad;
}

#endif
