/* For the C tests whose forked ranks run CHECKs (test_sched, mock/test_sched_mock): each rank's
 * pass/fail counts go to shared memory and are added to the parent's, CHECK_MSG names the rank,
 * and a hang alarm bounds every rank. Include after ctest.h and fork_ranks.h. */
#ifndef AXC_TESTS_RANK_TALLY_H
#define AXC_TESTS_RANK_TALLY_H

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* The children's CHECK counts, per rank in shared memory, added to the parent's. */
typedef struct tally {
    int passed, failed, done;
} tally;
static tally *g_tally;
static int g_rank = -1;

/* CHECK with the rank and a formatted explanation on failure (one write, so that the ranks'
 * messages do not interleave). */
#define CHECK_MSG(cond, ...)                                                                  \
    do {                                                                                      \
        if (cond) {                                                                           \
            ctest_passed_++;                                                                  \
        } else {                                                                              \
            char ctest_m_[512];                                                               \
            ctest_failed_++;                                                                  \
            snprintf(ctest_m_, sizeof ctest_m_, __VA_ARGS__);                                 \
            fprintf(stderr, "%s:%d: rank %d: CHECK failed: %s: %s\n", __FILE__, __LINE__,     \
                    g_rank, #cond, ctest_m_);                                                 \
        }                                                                                     \
    } while (0)

/* Maps the store and the tally; main() calls it once, before the first spawn. 0 on failure. */
static inline int rank_tally_init(void)
{
    fork_ranks_init();
    g_tally = mmap(NULL, sizeof(tally) * 16, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    if (g_kv == MAP_FAILED || g_tally == MAP_FAILED) {
        perror("mmap");
        return 0;
    }
    return 1;
}

static inline void rank_begin(int rank)
{
    g_rank = rank;
    ctest_passed_ = ctest_failed_ = 0; /* counts inherited from the parent */
    alarm(20);                         /* a hang kills the rank, which fails the test */
}

static inline void rank_end(int rank)
{
    g_tally[rank] = (tally){ctest_passed_, ctest_failed_, 1};
    fails += ctest_failed_;
}

/* Forks `world` ranks running fn (which brackets its checks with rank_begin/rank_end) and adds
 * their counts to this process's; a rank that failed in any way is one more failed check. */
static inline void spawn_and_tally(const char *what, int world, fork_rank_fn fn,
                                   const int dims[4])
{
    memset(g_tally, 0, sizeof(tally) * 16);
    int bad = fork_ranks_spawn(world, fn, dims, 10.0, 1);
    for (int r = 0; r < world; r++) {
        if (!g_tally[r].done)
            fprintf(stderr, "%s: rank %d did not finish\n", what, r);
        ctest_passed_ += g_tally[r].passed;
        ctest_failed_ += g_tally[r].failed;
    }
    if (bad)
        fprintf(stderr,
                "%s: %d of %d ranks failed (failed checks, a signal such as the hang alarm, or "
                "a LeakSanitizer report: see above)\n",
                what, bad, world);
    CHECK(bad == 0);
}

#endif
