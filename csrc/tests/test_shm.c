/* shm backend across forked processes: every collective on every group of several grids, odd
 * lengths crossing the slot size, byte counters, groups progressing independently, works started
 * after other groups' works, channels matched independently, ranks out of step failing at once
 * with both calls named, a dead peer failing the others in time, and an init failing on one rank
 * failing on the others at once, and a rank's abort failing every rank's collectives at once. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "axc/comm.h"
#include "axc/futex.h"
#include "ctest.h"
#include "fork_ranks.h"

static float val(int rank, size_t i) { return (float)((rank + 1) * 1000 + (int)(i % 997)); }

static axc_status run(axc_comm *comm, axc_group_kind kind, axc_coll *c)
{
    axc_work *w;
    AXC_TRY(axc_comm_start(comm, kind, c, &w));
    axc_status st = axc_work_wait(w);
    axc_work_free(w);
    return st;
}

/* All collectives of one grid, checked against values each rank can compute for its peers. */
static void rank_main(int rank, int world, const int dims[4], double timeout)
{
    axc_comm_config cfg;
    if (fork_ranks_config(&cfg, rank, world, dims, "test", timeout) != AXC_OK) {
        fails++;
        return;
    }
    axc_comm *comm;
    if (axc_comm_create(&comm, &cfg) != AXC_OK) {
        fprintf(stderr, "rank %d: create: %s\n", rank, axc_last_error());
        fails++;
        return;
    }
    static const size_t lengths[] = {1, 7, 1000, 300001};
    for (int k = 0; k < AXC_GROUP_COUNT; k++) {
        axc_group_kind kind = (axc_group_kind)k;
        int G = axc_grid_group_size(&cfg.grid, kind), me = axc_grid_group_rank(&cfg.grid, kind, rank);
        int members[64];
        axc_grid_group_members(&cfg.grid, kind, rank, members);
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
            size_t n = lengths[li];
            float *in = malloc(sizeof(float) * n * (size_t)G), *out = malloc(sizeof(float) * n * (size_t)G);
            axc_coll c = {0};
            c.dtype = AXC_DT_F32;
            c.device = -1;
            /* all_reduce sum */
            for (size_t i = 0; i < n; i++)
                out[i] = val(rank, i);
            c.kind = AXC_COLL_ALL_REDUCE;
            c.send = out;
            c.recv = out;
            c.count = n;
            EXPECT(run(comm, kind, &c) == AXC_OK);
            for (size_t i = 0; i < n; i++) {
                float e = 0;
                for (int m = 0; m < G; m++)
                    e += val(members[m], i);
                if (out[i] != e) {
                    EXPECT(out[i] == e);
                    break;
                }
            }
            /* all_gather */
            for (size_t i = 0; i < n; i++)
                in[i] = val(rank, i);
            c.kind = AXC_COLL_ALL_GATHER;
            c.send = in;
            c.recv = out;
            EXPECT(run(comm, kind, &c) == AXC_OK);
            for (int m = 0; m < G; m++)
                for (size_t i = 0; i < n; i += 97)
                    EXPECT(out[(size_t)m * n + i] == val(members[m], i));
            /* reduce_scatter max and all_to_all: piece p of rank r holds val(r, p*n + i) */
            for (size_t i = 0; i < n * (size_t)G; i++)
                in[i] = val(rank, i);
            c.kind = AXC_COLL_REDUCE_SCATTER;
            c.op = AXC_RED_MAX;
            EXPECT(run(comm, kind, &c) == AXC_OK);
            for (size_t i = 0; i < n; i += 89) {
                float e = val(members[0], (size_t)me * n + i);
                for (int m = 1; m < G; m++)
                    e = val(members[m], (size_t)me * n + i) > e ? val(members[m], (size_t)me * n + i) : e;
                EXPECT(out[i] == e);
            }
            c.kind = AXC_COLL_ALL_TO_ALL;
            c.op = AXC_RED_SUM;
            EXPECT(run(comm, kind, &c) == AXC_OK);
            for (int m = 0; m < G; m++)
                for (size_t i = 0; i < n; i += 89)
                    EXPECT(out[(size_t)m * n + i] == val(members[m], (size_t)me * n + i));
            /* broadcast from the last group rank */
            for (size_t i = 0; i < n; i++)
                out[i] = val(rank, i);
            c.kind = AXC_COLL_BROADCAST;
            c.send = out;
            c.recv = out;
            c.root = G - 1;
            EXPECT(run(comm, kind, &c) == AXC_OK);
            for (size_t i = 0; i < n; i += 31)
                EXPECT(out[i] == val(members[G - 1], i));
            c.root = 0;
            free(in);
            free(out);
        }
        axc_coll b = {.kind = AXC_COLL_BARRIER, .device = -1};
        EXPECT(run(comm, kind, &b) == AXC_OK);
        /* counters: ring volumes of what ran on this group */
        axc_counters ctr;
        axc_comm_counters(comm, kind, &ctr);
        EXPECT(ctr.calls == 5 * (sizeof lengths / sizeof lengths[0]) + 1);
        uint64_t sent = 0, recv = 0;
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0] && G > 1; li++) {
            uint64_t n = lengths[li], g = (uint64_t)G;
            uint64_t piece = n / g + ((uint64_t)me < n % g ? 1 : 0);
            sent += 2 * (n - piece) * 4 + 3 * (g - 1) * n * 4; /* all_reduce, gather, rs, a2a */
            recv += 2 * (n - piece) * 4 + 3 * (g - 1) * n * 4;
            sent += me == G - 2 ? 0 : n * 4; /* broadcast chain from G-1 ends at G-2 */
            recv += me == G - 1 ? 0 : n * 4;
        }
        EXPECT(ctr.bytes_sent == sent);
        EXPECT(ctr.bytes_recv == recv);
    }
    axc_comm_destroy(comm);
}

static axc_comm *open_comm(int rank, int world, const int dims[4], const char *job, double timeout)
{
    axc_comm_config cfg;
    axc_comm *comm = NULL;
    if (fork_ranks_config(&cfg, rank, world, dims, job, timeout) != AXC_OK ||
        axc_comm_create(&comm, &cfg) != AXC_OK) {
        fprintf(stderr, "rank %d: create: %s\n", rank, axc_last_error());
        fails++;
        return NULL;
    }
    return comm;
}

/* Waits for the second work first, then checks both two-rank sums: a = 2 * {1,2,3}, b = 2 *
 * {10,20,30} (a collective paired with the wrong peer's mixes them, or times out). */
static void finish_pair(int rank, axc_work *w1, axc_work *w2, const float *a, const float *b)
{
    EXPECT(axc_work_wait(w2) == AXC_OK);
    EXPECT(axc_work_wait(w1) == AXC_OK);
    axc_work_free(w1);
    axc_work_free(w2);
    for (int i = 0; i < 3; i++) {
        EXPECT(a[i] == 2.0f * (float)(i + 1));
        EXPECT(b[i] == 20.0f * (float)(i + 1));
    }
}

/* Two ranks, grid 1x1x2x1: the col and world groups are both {0, 1}. Rank 0 starts col then
 * world, rank 1 world then col, each waiting for its second collective first. This completes
 * only when each group kind progresses on its own (one in-order queue per process would wait
 * for the peer's first collective forever, i.e. time out). */
static void independent_main(int rank, int world, const int dims[4], double timeout)
{
    axc_comm *comm = open_comm(rank, world, dims, "indep", timeout);
    if (!comm)
        return;
    float a[3] = {1, 2, 3}, b[3] = {10, 20, 30};
    axc_coll ca = {.kind = AXC_COLL_ALL_REDUCE, .send = a, .recv = a, .count = 3, .device = -1};
    axc_coll cb = {.kind = AXC_COLL_ALL_REDUCE, .send = b, .recv = b, .count = 3, .device = -1};
    axc_group_kind first = rank == 0 ? AXC_GROUP_COL : AXC_GROUP_WORLD;
    axc_group_kind second = rank == 0 ? AXC_GROUP_WORLD : AXC_GROUP_COL;
    axc_work *w1 = NULL, *w2 = NULL;
    EXPECT(axc_comm_start(comm, first, rank == 0 ? &ca : &cb, &w1) == AXC_OK);
    EXPECT(axc_comm_start(comm, second, rank == 0 ? &cb : &ca, &w2) == AXC_OK);
    finish_pair(rank, w1, w2, a, b);
    axc_comm_destroy(comm);
}

/* Four ranks, grid 2x1x1x2 (data 2, depth 2). The depth reduce-scatter's output feeds a data
 * all-reduce started with axc_comm_start_after; one depth peer joins late, so the all-reduce
 * would read the not-yet-written output if it did not follow. */
static void after_main(int rank, int world, const int dims[4], double timeout)
{
    axc_comm *comm = open_comm(rank, world, dims, "after", timeout);
    if (!comm)
        return;
    const axc_grid *grid = axc_comm_grid(comm);
    enum { N = 5000 };
    float *send = malloc(2 * N * sizeof(float)), *mid = calloc(N, sizeof(float));
    for (size_t i = 0; i < 2 * N; i++)
        send[i] = val(rank, i);
    if (axc_grid_coords(grid, rank).depth == 1)
        usleep(200000);
    axc_coll rs = {.kind = AXC_COLL_REDUCE_SCATTER, .send = send, .recv = mid, .count = N,
                   .device = -1};
    axc_coll ar = {.kind = AXC_COLL_ALL_REDUCE, .send = mid, .recv = mid, .count = N,
                   .device = -1};
    axc_work *w1 = NULL, *w2 = NULL;
    EXPECT(axc_comm_start(comm, AXC_GROUP_DEPTH, &rs, &w1) == AXC_OK);
    EXPECT(axc_comm_start_after(comm, AXC_GROUP_DATA, &ar, &w1, 1, &w2) == AXC_OK);
    EXPECT(axc_work_wait(w2) == AXC_OK);
    EXPECT(axc_work_wait(w1) == AXC_OK);
    axc_work_free(w2);
    axc_work_free(w1);
    /* every rank ends with the sum over all 4 ranks of the depth piece of its depth index */
    size_t off = (size_t)axc_grid_coords(grid, rank).depth * N;
    int bad = 0;
    for (size_t i = 0; i < N; i++) {
        float want = 0;
        for (int r = 0; r < world; r++)
            want += val(r, off + i);
        bad += mid[i] != want;
    }
    EXPECT(bad == 0);
    axc_comm_destroy(comm);
    free(send);
    free(mid);
}

/* Two ranks, grid 1x1x2x1, two channels: rank 0 starts a col all-reduce on channel 0 then one on
 * channel 1, rank 1 the other way round, each waiting for its second first. Channels are matched
 * independently, so this completes with each sum over its own channel's data (one lane per kind
 * would pair a with b, or time out). Then threads, one per channel, run many collectives at once,
 * and the per-kind counters add up both channels. */
typedef struct chan_arg {
    axc_comm *comm;
    int channel, rank, ok;
} chan_arg;

static void *chan_thread(void *p)
{
    chan_arg *a = p;
    a->ok = axc_comm_set_thread_channel(a->comm, a->channel) == AXC_OK;
    for (int it = 0; it < 50 && a->ok; it++) {
        float x[64];
        for (int i = 0; i < 64; i++)
            x[i] = (float)(a->channel * 1000 + it * 10 + a->rank + i);
        axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = x, .recv = x, .count = 64,
                      .device = -1};
        a->ok = run(a->comm, AXC_GROUP_COL, &c) == AXC_OK;
        for (int i = 0; i < 64 && a->ok; i++) /* ranks 0 and 1 */
            a->ok = x[i] == (float)(2 * (a->channel * 1000 + it * 10 + i) + 1);
    }
    return NULL;
}

static void channels_main(int rank, int world, const int dims[4], double timeout)
{
    axc_comm_config cfg;
    axc_comm *comm = NULL;
    if (fork_ranks_config(&cfg, rank, world, dims, "chan", timeout) != AXC_OK) {
        fails++;
        return;
    }
    cfg.channels = 2;
    if (axc_comm_create(&comm, &cfg) != AXC_OK) {
        fprintf(stderr, "rank %d: create: %s\n", rank, axc_last_error());
        fails++;
        return;
    }
    EXPECT(axc_comm_channels(comm) == 2);
    EXPECT(axc_comm_set_thread_channel(comm, 2) == AXC_ERR_INVALID);
    EXPECT(strstr(axc_last_error(), "channel 2") != NULL);
    float a[3] = {1, 2, 3}, b[3] = {10, 20, 30};
    axc_coll ca = {.kind = AXC_COLL_ALL_REDUCE, .send = a, .recv = a, .count = 3, .device = -1};
    axc_coll cb = {.kind = AXC_COLL_ALL_REDUCE, .send = b, .recv = b, .count = 3, .device = -1};
    int first = rank == 0 ? 0 : 1;
    axc_work *w1 = NULL, *w2 = NULL;
    EXPECT(axc_comm_set_thread_channel(comm, first) == AXC_OK);
    EXPECT(axc_comm_start(comm, AXC_GROUP_COL, first == 0 ? &ca : &cb, &w1) == AXC_OK);
    EXPECT(axc_comm_set_thread_channel(comm, 1 - first) == AXC_OK);
    EXPECT(axc_comm_start(comm, AXC_GROUP_COL, first == 0 ? &cb : &ca, &w2) == AXC_OK);
    finish_pair(rank, w1, w2, a, b);
    EXPECT(axc_comm_set_thread_channel(comm, 0) == AXC_OK);
    pthread_t th[2];
    chan_arg args[2] = {{comm, 0, rank, 0}, {comm, 1, rank, 0}};
    for (int t = 0; t < 2; t++)
        EXPECT(pthread_create(&th[t], NULL, chan_thread, &args[t]) == 0);
    for (int t = 0; t < 2; t++) {
        pthread_join(th[t], NULL);
        EXPECT(args[t].ok);
    }
    axc_counters ctr;
    axc_comm_counters(comm, AXC_GROUP_COL, &ctr);
    EXPECT(ctr.calls == 2 + 2 * 50);
    axc_comm_destroy(comm);
}

/* Rank world-1 dies before the collective; everyone else must fail with PEER, not hang. */
static void dead_peer_main(int rank, int world, const int dims[4], double timeout)
{
    axc_comm_config cfg;
    (void)fork_ranks_config(&cfg, rank, world, dims, "dead", timeout);
    axc_comm *comm;
    if (axc_comm_create(&comm, &cfg) != AXC_OK) {
        fails++;
        return;
    }
    if (rank == world - 1)
        _exit(0); /* dies without finalising */
    float x[4] = {1, 2, 3, 4};
    axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = x, .recv = x, .count = 4, .device = -1};
    int64_t t0 = axc_now_ns();
    axc_status st = run(comm, AXC_GROUP_WORLD, &c);
    double waited = (double)(axc_now_ns() - t0) * 1e-9;
    EXPECT(st == AXC_ERR_PEER || st == AXC_ERR_TIMEOUT);
    EXPECT(waited < timeout + 1.0);
    EXPECT(strstr(axc_last_error(), "rank") != NULL);
    /* the communicator stays failed, and destroying it does not hang */
    EXPECT(run(comm, AXC_GROUP_WORLD, &c) != AXC_OK);
    axc_comm_destroy(comm);
}

/* Ranks that run different collectives (a caller bug) fail at once on every rank with a message
 * naming both calls, instead of corrupting data or waiting for the timeout. Case `which`: rank
 * 1's call differs in length, kind, dtype, op; or rank 1 runs a barrier where rank 0 runs an
 * empty all-reduce (both meet only at the closing barrier). The first, matching, call passes. */
static int mismatch_case;
static void mismatch_main(int rank, int world, const int dims[4], double timeout)
{
    (void)world;
    axc_comm *comm = open_comm(rank, 2, dims, "mismatch", timeout);
    if (!comm)
        return;
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[16];
    axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = x, .recv = x, .count = 4, .device = -1};
    EXPECT(run(comm, AXC_GROUP_COL, &c) == AXC_OK);
    EXPECT(x[0] == 2.0f);
    const char *want = "all_reduce of 4 float32 (sum)";
    if (rank == 1) {
        switch (mismatch_case) {
        case 0: c.count = 8; want = "all_reduce of 8 float32"; break;
        case 1: c.kind = AXC_COLL_ALL_GATHER; c.recv = y; want = "all_gather of 4 float32"; break;
        case 2: c.dtype = AXC_DT_I32; want = "all_reduce of 4 int32"; break;
        case 3: c.op = AXC_RED_MAX; want = "all_reduce of 4 float32 (max)"; break;
        default: c.kind = AXC_COLL_BARRIER; want = "runs a barrier"; break;
        }
    }
    if (mismatch_case == 4) {
        c.count = 0;
        want = rank == 0 ? "all_reduce of 0 float32 (sum)" : want;
    }
    int64_t t0 = axc_now_ns();
    axc_status st = run(comm, AXC_GROUP_COL, &c);
    double waited = (double)(axc_now_ns() - t0) * 1e-9;
    EXPECT(st == AXC_ERR_PEER);
    EXPECT(waited < timeout / 2); /* not the timeout */
    const char *msg = axc_last_error();
    EXPECT(strstr(msg, "out of step") != NULL);
    if (rank == 1) /* (rank 0 may report rank 1's abort, which names rank 1's own call) */
        EXPECT(strstr(msg, want) != NULL);
    if (fails)
        fprintf(stderr, "rank %d, case %d: %s\n", rank, mismatch_case, msg);
    EXPECT(run(comm, AXC_GROUP_COL, &c) != AXC_OK); /* the communicator stays failed */
    axc_comm_destroy(comm);
}

/* Grid 1x1x2x1 (col and world both {0, 1}): rank 0 runs an all-reduce on the col group while
 * rank 1 runs one on the world group, each waiting for it. The calls meet on no lane, so
 * check_calls cannot compare them; each rank waits for the other. Both fail at once (not at the
 * timeout), naming both calls and both groups. (independent_main: started in crossed orders and
 * waited for afterwards, the same calls complete.) `by_abort`: rank 0 calls axc_comm_abort
 * instead, then runs rank 1's call; rank 1's wait fails at once with rank 0's message, and so
 * does rank 0's call. */
static int by_abort;
static void crossed_main(int rank, int world, const int dims[4], double timeout)
{
    (void)world;
    axc_comm *comm = open_comm(rank, 2, dims, by_abort ? "abort" : "crossed", timeout);
    if (!comm)
        return;
    float x[4] = {1, 2, 3, 4};
    axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = x, .recv = x, .count = 4, .device = -1};
    EXPECT(run(comm, AXC_GROUP_WORLD, &c) == AXC_OK); /* in step */
    int64_t t0 = axc_now_ns();
    if (by_abort && rank == 0) {
        struct timespec nap = {0, 200000000}; /* (rank 1 waits by now; sooner: fails at start) */
        nanosleep(&nap, NULL);
        EXPECT(axc_comm_abort(comm, AXC_ERR_PEER, "rank 0 stops here") == AXC_ERR_PEER);
        EXPECT(strstr(axc_last_error(), "rank 0 stops here") != NULL);
    }
    axc_status st = run(comm, rank == 0 && !by_abort ? AXC_GROUP_COL : AXC_GROUP_WORLD, &c);
    double waited = (double)(axc_now_ns() - t0) * 1e-9;
    const char *msg = axc_last_error();
    EXPECT(st == AXC_ERR_PEER);
    EXPECT(waited < timeout / 2); /* not the timeout */
    if (by_abort) {
        EXPECT(strstr(msg, "rank 0 aborted the job: rank 0 stops here") != NULL);
    } else {
        EXPECT(strstr(msg, "out of step on the") != NULL &&
               strstr(msg, "which have the same ranks") != NULL);
        EXPECT(strstr(msg, "all_reduce of 4 float32 (sum) as its collective 1 on the col group"));
        EXPECT(strstr(msg, "all_reduce of 4 float32 (sum) as its collective 2 on the world group"));
    }
    if (fails)
        fprintf(stderr, "rank %d: %s\n", rank, msg);
    axc_comm_destroy(comm);
}

/* AXONN_C_SHM_TAG ends the segment name (which the store publishes), so a leak check can tell
 * its own segments from those of other jobs; a tag that cannot be part of a name fails on every
 * rank, naming the variable. */
static int tag_bad;
static void tag_main(int rank, int world, const int dims[4], double timeout)
{
    if (tag_bad) {
        axc_comm_config cfg;
        axc_comm *comm = NULL;
        EXPECT(fork_ranks_config(&cfg, rank, world, dims, "tag", timeout) == AXC_OK);
        EXPECT(axc_comm_create(&comm, &cfg) == AXC_ERR_INVALID);
        EXPECT(strstr(axc_last_error(), "AXONN_C_SHM_TAG") != NULL);
        return;
    }
    axc_comm *comm = open_comm(rank, world, dims, "tag", timeout);
    if (!comm)
        return;
    const char *want = ".ctest-tag_1";
    EXPECT(g_kv->len > strlen(want) &&
           memcmp(g_kv->value + g_kv->len - strlen(want), want, strlen(want)) == 0);
    axc_comm_destroy(comm);
}

static int tagged_run(const char *tag, int bad)
{
    static const int grid[4] = {1, 1, 2, 1};
    const char *outer = getenv("AXONN_C_SHM_TAG");
    char saved[128];
    snprintf(saved, sizeof saved, "%s", outer ? outer : "");
    setenv("AXONN_C_SHM_TAG", tag, 1);
    tag_bad = bad;
    int failed = fork_ranks_spawn(2, tag_main, grid, 10.0, 0);
    if (outer)
        setenv("AXONN_C_SHM_TAG", saved, 1);
    else
        unsetenv("AXONN_C_SHM_TAG");
    return failed;
}

/* Issue 28 item 1: a timeout that is not a finite number in (0, AXC_MAX_TIMEOUT_S] is refused
 * before the store is touched; rank 0 waiting for a rank whose init failed (here rank 1 never
 * attaches and says so through peer_failed) fails at once, not at the timeout. */
static axc_status peer_says_failed(void *ctx)
{
    (void)ctx;
    return axc_fail(AXC_ERR_PEER, "init failed on another rank: rank 1: test");
}

static void init_failure_main(int rank, int world, const int dims[4], double timeout)
{
    axc_comm_config cfg;
    (void)fork_ranks_config(&cfg, rank, world, dims, "initfail", timeout);
    axc_comm *comm = NULL;
    const double bad[] = {0.0, -1.0, NAN, INFINITY, 1e300, AXC_MAX_TIMEOUT_S * 2};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cfg.timeout_s = bad[i];
        EXPECT(axc_comm_create(&comm, &cfg) == AXC_ERR_INVALID && comm == NULL);
    }
    if (rank == 1)
        return; /* never attaches: its init "failed" */
    cfg.timeout_s = timeout;
    cfg.bootstrap.peer_failed = peer_says_failed;
    int64_t t0 = axc_now_ns();
    EXPECT(axc_comm_create(&comm, &cfg) == AXC_ERR_PEER && comm == NULL);
    EXPECT(strstr(axc_last_error(), "rank 1: test") != NULL);
    EXPECT(axc_now_ns() - t0 < (int64_t)(timeout * 0.5e9));
}

int main(void)
{
    fork_ranks_init();
    setenv("AXONN_C_SHM_SLOT_KB", "256", 1); /* small slots: many rounds per collective */
    static const int grids[][4] = {{1, 1, 1, 1}, {2, 1, 1, 1}, {1, 1, 3, 1}, {1, 2, 2, 1},
                                   {2, 1, 1, 2}, {1, 2, 1, 2}, {1, 1, 2, 2}};
    for (size_t i = 0; i < sizeof grids / sizeof grids[0]; i++) {
        const int *d = grids[i];
        int world = d[0] * d[1] * d[2] * d[3];
        int bad = fork_ranks_spawn(world, rank_main, d, 30.0, 0);
        if (bad)
            fprintf(stderr, "grid %d,%d,%d,%d: %d ranks failed\n", d[0], d[1], d[2], d[3], bad);
        CHECK(bad == 0);
    }
    static const int indep_grid[4] = {1, 1, 2, 1}, after_grid[4] = {2, 1, 1, 2};
    CHECK(fork_ranks_spawn(2, independent_main, indep_grid, 10.0, 0) == 0);
    CHECK(fork_ranks_spawn(4, after_main, after_grid, 10.0, 0) == 0);
    CHECK(fork_ranks_spawn(2, channels_main, indep_grid, 10.0, 0) == 0);
    for (mismatch_case = 0; mismatch_case < 5; mismatch_case++)
        CHECK(fork_ranks_spawn(2, mismatch_main, indep_grid, 20.0, 0) == 0);
    for (by_abort = 0; by_abort < 2; by_abort++)
        CHECK(fork_ranks_spawn(2, crossed_main, indep_grid, 20.0, 0) == 0);
    CHECK(tagged_run("ctest-tag_1", 0) == 0);
    CHECK(tagged_run("../escape", 1) == 0);
    CHECK(tagged_run("a-tag-that-is-far-too-long-to-be-part-of-a-name-0123456789012345678", 1) == 0);
    CHECK(fork_ranks_spawn(2, init_failure_main, indep_grid, 60.0, 0) == 0);
    static const int dead_grid[4] = {1, 1, 3, 1};
    int64_t t0 = axc_now_ns();
    CHECK(fork_ranks_spawn(3, dead_peer_main, dead_grid, 5.0, 0) == 0);
    CHECK(axc_now_ns() - t0 < 6000000000LL);
    return ctest_summary("test_shm");
}
