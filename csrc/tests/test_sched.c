/* The cross-layer scheduler (axc/sched.h) on forked ranks over the shm backend, float32 host
 * buffers: layer ids, the depth all-gather acquire returns, order learning and the prefetches it
 * issues, re-learning, stale gathered weights (values, buffer, depth codec), the memory budget, deferred collectives, config
 * validation, deferred tasks (order, failures, before an after-collective, dropped by destroy),
 * and destroy with work outstanding (leaks: LeakSanitizer runs in every rank of
 * the ASan build, since the ranks end with exit()). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "axc/comm.h"
#include "axc/sched.h"
#include "ctest.h"
#include "fork_ranks.h"
#include "rank_tally.h"

#define N 777       /* elements of a layer's depth shard */
#define M 1001      /* elements of a deferred collective's piece */
#define SLEEP_MS 5  /* between acquire and release: lets the prefetches issued by acquire land */

typedef struct rank_ctx {
    int rank, G_d;
    int members[16]; /* the depth group, in group order */
    axc_comm *comm;
} rank_ctx;

/* A test layer: its scheduler id, the shard it passes and the values the shard holds. */
typedef struct tlayer {
    int id;
    int tag;         /* which values (distinct per layer) */
    int gen;         /* generation of the values, bumped when the test "steps the optimizer" */
    int64_t version; /* what the visit reports as the shard's version */
    float *shard;    /* points at own[] or at another buffer */
    float own[N];
} tlayer;

static float val(int tag, int gen, int rank, int i)
{
    return (float)(gen * 100000 + tag * 10000 + rank * 1000 + i); /* exact in float32 */
}

static void fill(const rank_ctx *c, tlayer *L, float *buf, int gen)
{
    for (int i = 0; i < N; i++)
        buf[i] = val(L->tag, gen, c->rank, i);
    L->shard = buf;
    L->gen = gen;
}

static void layer_init(const rank_ctx *c, axc_sched *s, tlayer *L, int tag)
{
    memset(L, 0, sizeof *L);
    L->id = -1;
    L->tag = tag;
    CHECK_OK(axc_sched_layer_new(s, &L->id));
    fill(c, L, L->own, 0);
}

/* 1 when `full` is the depth all-gather of L's current values (every rank's shard, in group
 * order); otherwise says where it differs. */
static int full_ok(const rank_ctx *c, const tlayer *L, const float *full)
{
    if (!full) {
        fprintf(stderr, "rank %d: layer %d: acquire returned no buffer\n", c->rank, L->id);
        return 0;
    }
    for (int m = 0; m < c->G_d; m++)
        for (int i = 0; i < N; i++) {
            float e = val(L->tag, L->gen, c->members[m], i);
            if (full[(size_t)m * N + (size_t)i] != e) {
                fprintf(stderr,
                        "rank %d: layer %d: gathered weight wrong in rank %d's piece at %d: %g, "
                        "expected %g (generation %d)\n",
                        c->rank, L->id, c->members[m], i, (double)full[(size_t)m * N + (size_t)i],
                        (double)e, L->gen);
                return 0;
            }
        }
    return 1;
}

static void nap_ms(int ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

static axc_sched_weight weight_of(const tlayer *L, int phase)
{
    axc_sched_weight w = {0};
    w.layer = L->id;
    w.phase = phase;
    w.shard = L->shard;
    w.shard_elems = N;
    w.version = L->version;
    w.dtype = AXC_DT_F32;
    w.device = -1;
    w.stream = NULL;
    w.prefetch_ok = 1;
    return w;
}

/* One layer call: acquire (checking the gathered values), nap, release. */
static void visit(const rank_ctx *c, axc_sched *s, const tlayer *L, int phase, int sleep_ms)
{
    axc_sched_weight w = weight_of(L, phase);
    const void *full = NULL;
    CHECK_OK(axc_sched_acquire(s, &w, &full));
    CHECK(full_ok(c, L, full));
    if (sleep_ms)
        nap_ms(sleep_ms);
    CHECK_OK(axc_sched_release(s, L->id, NULL));
}

typedef struct step_visit {
    int layer; /* index into the test's layer array */
    int phase;
} step_visit;

static void run_step(const rank_ctx *c, axc_sched *s, const tlayer *layers,
                     const step_visit *seq, int n, int sleep_ms)
{
    for (int i = 0; i < n; i++)
        visit(c, s, &layers[seq[i].layer], seq[i].phase, sleep_ms);
    CHECK_OK(axc_sched_step_end(s));
}

static const char *ev_name(int kind)
{
    static const char *names[] = {"hit", "wait", "miss", "prefetch"};
    return kind >= 0 && kind < 4 ? names[kind] : "?";
}

/* with_kind = 0: a learned order, whose events carry no kind */
static void print_events(const char *what, const axc_sched_event *ev, size_t n, int with_kind)
{
    char line[2048];
    size_t len = (size_t)snprintf(line, sizeof line, "rank %d: %s: %zu events (layer, phase):",
                                  g_rank, what, n);
    for (size_t i = 0; i < n && len < sizeof line; i++)
        len += (size_t)snprintf(line + len, sizeof line - len, " %s(%d,%s)",
                                with_kind ? ev_name(ev[i].kind) : "", ev[i].layer,
                                ev[i].phase == AXC_PHASE_FWD ? "fwd" : "bwd");
    fprintf(stderr, "%s\n", line);
}

/* Takes the event log and checks that its prefetches are exactly `want` (layer ids), in order. */
static void check_prefetches(axc_sched *s, const char *what, const step_visit *want, int nwant,
                             const tlayer *layers)
{
    axc_sched_event ev[256];
    size_t n = axc_sched_log_take(s, ev, 256);
    int k = 0, ok = 1;
    for (size_t i = 0; i < n; i++) {
        if (ev[i].kind != AXC_EV_PREFETCH)
            continue;
        if (k >= nwant || ev[i].layer != layers[want[k].layer].id || ev[i].phase != want[k].phase)
            ok = 0;
        k++;
    }
    ok = ok && k == nwant;
    CHECK_MSG(ok, "%s: the prefetches issued differ from the %d expected (log below)", what, nwant);
    if (!ok)
        print_events(what, ev, n, 1);
}

/* The learned order must be `seq`. */
static void check_order(axc_sched *s, const char *what, const step_visit *seq, int n,
                        const tlayer *layers)
{
    axc_sched_event ev[64];
    int64_t len = axc_sched_order(s, ev, 64);
    int ok = len == n;
    for (int i = 0; ok && i < n; i++)
        ok = ev[i].layer == layers[seq[i].layer].id && ev[i].phase == seq[i].phase;
    CHECK_MSG(ok, "%s: the learned order is not the last step's visits", what);
    if (!ok)
        print_events("learned order", ev, len < 0 ? 0 : (size_t)(len < 64 ? len : 64), 0);
}

static axc_sched *sched_new(const rank_ctx *c)
{
    axc_sched *s = NULL;
    CHECK_OK(axc_sched_create(&s, c->comm));
    return s;
}

/* a scheduler that prefetches one layer ahead and caches gathers, without a memory budget */
static axc_sched *sched_cached(const rank_ctx *c, axc_sched_config *cfg)
{
    axc_sched *s = sched_new(c);
    *cfg = (axc_sched_config){.prefetch = 1, .budget_bytes = 0, .cache = 1};
    if (s)
        CHECK_OK(axc_sched_configure(s, cfg));
    return s;
}

/* ------------------------------------------------------------------ 1. layer ids */

static void test_ids(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    int a = -1, b = -1, d = -1, again = -1;
    CHECK_OK(axc_sched_layer_new(s, &a));
    CHECK_OK(axc_sched_layer_new(s, &b));
    CHECK_OK(axc_sched_layer_new(s, &d));
    CHECK_MSG(a >= 0 && b >= 0 && d >= 0 && a != b && b != d && a != d,
              "layer ids %d, %d, %d are not distinct", a, b, d);
    axc_sched_forget(s, b);
    /* a forgotten id is unknown until it is handed out again (fails before any collective) */
    tlayer X = {0};
    X.id = b;
    X.shard = X.own;
    axc_sched_weight w = weight_of(&X, AXC_PHASE_FWD);
    const void *full = NULL;
    CHECK(axc_sched_acquire(s, &w, &full) == AXC_ERR_INVALID);
    CHECK_OK(axc_sched_layer_new(s, &again));
    CHECK_MSG(again == b, "forgot id %d, the next layer got %d", b, again);
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ 2. acquire gathers */

static void test_gather(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer X;
    layer_init(c, s, &X, 1);
    axc_sched_weight w = weight_of(&X, AXC_PHASE_FWD);
    const void *got = NULL;
    CHECK_OK(axc_sched_acquire(s, &w, &got));
    const float *full = got;
    int ok = full != NULL && (const void *)full != (const void *)X.shard;
    /* rank 0's shard, then rank 1's */
    for (int r = 0; ok && r < 2; r++)
        for (int i = 0; ok && i < N; i++)
            ok = full[(size_t)r * N + (size_t)i] == val(X.tag, 0, r, i);
    CHECK_MSG(ok, "acquire did not return rank 0's shard followed by rank 1's");
    for (int i = 0; i < N; i++)
        ok = ok && X.own[i] == val(X.tag, 0, c->rank, i);
    CHECK_MSG(ok, "the shard changed");
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.visits == 1 && st.misses == 1 && st.alive_buffers == 1 &&
                  st.alive_bytes == 2 * N * sizeof(float),
              "visits %llu misses %llu alive %d buffers %llu bytes", (unsigned long long)st.visits,
              (unsigned long long)st.misses, st.alive_buffers, (unsigned long long)st.alive_bytes);
    /* a reset zeroes the counters and restarts the peaks from what is alive now */
    axc_sched_stats_reset(s);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.visits == 0 && st.misses == 0 && st.alive_buffers == 1 &&
                  st.peak_buffers == 1 && st.peak_bytes == 2 * N * sizeof(float),
              "after a reset: visits %llu misses %llu alive %d, peak %d buffers %llu bytes",
              (unsigned long long)st.visits, (unsigned long long)st.misses, st.alive_buffers,
              st.peak_buffers, (unsigned long long)st.peak_bytes);
    CHECK_OK(axc_sched_release(s, X.id, NULL));
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.alive_buffers == 0 && st.alive_bytes == 0,
              "no order learned yet, but release kept %d buffers", st.alive_buffers);
    CHECK_OK(axc_sched_step_end(s));
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ 3-4. order, re-learning */

enum { A = 0, B = 1, C = 2 };
#define F AXC_PHASE_FWD
#define W AXC_PHASE_BWD /* backWard */

static const step_visit order1[6] = {{C, F}, {A, F}, {B, F}, {B, W}, {A, W}, {C, W}};
/* the same start, diverging at the 5th visit */
static const step_visit order2[6] = {{C, F}, {A, F}, {B, F}, {B, W}, {C, W}, {A, W}};

static void test_order(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer L[3];
    for (int i = 0; i < 3; i++)
        layer_init(c, s, &L[i], i + 1);
    axc_sched_stats st;

    /* step 1: nothing learned yet, every visit gathers synchronously */
    run_step(c, s, L, order1, 6, 0);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.visits == 6 && st.misses == 6 && st.hits + st.waits == 0 && st.prefetches == 0,
              "step 1: visits %llu misses %llu hits %llu waits %llu prefetches %llu",
              (unsigned long long)st.visits, (unsigned long long)st.misses,
              (unsigned long long)st.hits, (unsigned long long)st.waits,
              (unsigned long long)st.prefetches);
    CHECK_MSG(st.relearned == 1 && st.order_len == 6, "step 1: relearned %llu order_len %lld",
              (unsigned long long)st.relearned, (long long)st.order_len);
    CHECK_MSG(st.alive_buffers == 0, "step 1 ended with %d gathered buffers", st.alive_buffers);
    check_order(s, "step 1", order1, 6, L);
    (void)axc_sched_log_take(s, NULL, 0);
    axc_sched_stats_reset(s);

    /* step 2: the learned order; each visit prefetches the next one of another layer */
    run_step(c, s, L, order1, 6, SLEEP_MS);
    static const step_visit want2[4] = {{A, F}, {B, F}, {A, W}, {C, W}};
    check_prefetches(s, "step 2", want2, 4, L);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.misses == 1 && st.hits + st.waits == 5 && st.prefetches == 4,
              "step 2: misses %llu hits %llu waits %llu prefetches %llu",
              (unsigned long long)st.misses, (unsigned long long)st.hits,
              (unsigned long long)st.waits, (unsigned long long)st.prefetches);
    /* a prefetch overlaps the visit that issued it, never more (prefetch = 1) */
    CHECK_MSG(st.peak_buffers <= 2, "step 2: peak %d gathered buffers", st.peak_buffers);
    CHECK_MSG(st.peak_buffers >= 2, "step 2: peak %d gathered buffers: no prefetch overlapped",
              st.peak_buffers);
    CHECK_MSG(st.alive_buffers == 0 && st.alive_bytes == 0,
              "step 2 ended with %d gathered buffers (%llu bytes)", st.alive_buffers,
              (unsigned long long)st.alive_bytes);
    CHECK_MSG(st.order_len == 6 && st.relearned == 0 && st.off_order == 0 && st.stale == 0,
              "step 2: order_len %lld relearned %llu off_order %llu stale %llu",
              (long long)st.order_len, (unsigned long long)st.relearned,
              (unsigned long long)st.off_order, (unsigned long long)st.stale);
    axc_sched_stats_reset(s);

    /* step 3: a different order (the last two backward visits swapped) */
    run_step(c, s, L, order2, 6, SLEEP_MS);
    (void)axc_sched_log_take(s, NULL, 0);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.off_order >= 1, "step 3 left the learned order, off_order %llu",
              (unsigned long long)st.off_order);
    CHECK_MSG(st.relearned == 1, "step 3 ran a new order, relearned %llu",
              (unsigned long long)st.relearned);
    /* the first diverging visit cannot have been prefetched */
    CHECK_MSG(st.misses >= 2 && st.misses + st.hits + st.waits == 6,
              "step 3: misses %llu hits %llu waits %llu", (unsigned long long)st.misses,
              (unsigned long long)st.hits, (unsigned long long)st.waits);
    CHECK_MSG(st.alive_buffers == 0, "step 3 ended with %d gathered buffers", st.alive_buffers);
    check_order(s, "step 3", order2, 6, L);
    axc_sched_stats_reset(s);

    /* step 4: the new order is followed and prefetched */
    run_step(c, s, L, order2, 6, SLEEP_MS);
    static const step_visit want4[4] = {{A, F}, {B, F}, {C, W}, {A, W}};
    check_prefetches(s, "step 4", want4, 4, L);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.misses == 1 && st.hits + st.waits == 5 && st.off_order == 0 &&
                  st.relearned == 0,
              "step 4: misses %llu hits %llu waits %llu off_order %llu relearned %llu",
              (unsigned long long)st.misses, (unsigned long long)st.hits,
              (unsigned long long)st.waits, (unsigned long long)st.off_order,
              (unsigned long long)st.relearned);
    CHECK_MSG(st.alive_buffers == 0, "step 4 ended with %d gathered buffers", st.alive_buffers);
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ 5. staleness */

static void expect_stale_misses(axc_sched *s, const char *what, uint64_t stale, uint64_t misses,
                                uint64_t hits)
{
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.stale == stale && st.misses == misses && st.hits + st.waits == hits &&
                  st.alive_buffers == 0,
              "%s: stale %llu (expected %llu), misses %llu (expected %llu), hits+waits %llu "
              "(expected %llu), %d buffers alive after the step",
              what, (unsigned long long)st.stale, (unsigned long long)stale,
              (unsigned long long)st.misses, (unsigned long long)misses,
              (unsigned long long)(st.hits + st.waits), (unsigned long long)hits,
              st.alive_buffers);
    axc_sched_stats_reset(s);
}

static int alive_buffers(axc_sched *s)
{
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    return st.alive_buffers;
}

static void test_stale(const rank_ctx *c)
{
    axc_sched_config cfg;
    axc_sched *s = sched_cached(c, &cfg);
    if (!s)
        return;
    tlayer X;
    layer_init(c, s, &X, 4);
    float *other = malloc(sizeof(float) * N);

    /* control: unchanged shard, the cached forward gather serves the backward */
    visit(c, s, &X, F, 0);
    CHECK_MSG(alive_buffers(s) == 1, "cache = 1 did not keep the forward gather");
    visit(c, s, &X, W, 0);
    CHECK_OK(axc_sched_step_end(s));
    expect_stale_misses(s, "unchanged shard", 0, 1, 1);

    /* new values and version between forward and backward: gathered again */
    visit(c, s, &X, F, 0);
    fill(c, &X, X.own, 1);
    X.version++;
    visit(c, s, &X, W, 0);
    CHECK_OK(axc_sched_step_end(s));
    expect_stale_misses(s, "version changed", 1, 2, 0);

    /* another shard buffer (same version): gathered again from it */
    visit(c, s, &X, F, 0);
    fill(c, &X, other, 2);
    visit(c, s, &X, W, 0);
    CHECK_OK(axc_sched_step_end(s));
    expect_stale_misses(s, "shard pointer changed", 1, 2, 0);

    /* the layer's depth codec changed between forward and backward (its own, then the
     * communicator's policy): the gather made with the old one is not used */
    for (int how = 0; how < 2; how++) {
        visit(c, s, &X, F, 0);
        axc_sched_weight w = weight_of(&X, W);
        if (how == 0) {
            w.own_codec = 1;
            w.codec = AXC_CODEC_BF16;
        } else {
            CHECK_OK(axc_comm_set_layer_codec(c->comm, AXC_GROUP_DEPTH, AXC_CODEC_BF16, 0, 0));
        }
        const void *full = NULL;
        CHECK_OK(axc_sched_acquire(s, &w, &full));
        CHECK_OK(axc_sched_release(s, X.id, NULL));
        CHECK_OK(axc_comm_set_layer_codec(c->comm, AXC_GROUP_DEPTH, AXC_CODEC_NONE, 0, 0));
        CHECK_OK(axc_sched_step_end(s));
        expect_stale_misses(s, how ? "communicator's depth codec changed"
                                   : "layer's depth codec changed", 1, 2, 0);
    }

    /* no cache: kept because the layer's backward is the next visit, then stepped */
    cfg.cache = 0;
    CHECK_OK(axc_sched_configure(s, &cfg));
    fill(c, &X, X.own, 3);
    X.version++;
    visit(c, s, &X, F, 0);
    CHECK_MSG(alive_buffers(s) == 1, "the gather needed by the next visit was not kept");
    fill(c, &X, X.own, 4);
    X.version++;
    visit(c, s, &X, W, 0);
    CHECK_OK(axc_sched_step_end(s));
    expect_stale_misses(s, "version changed, kept buffer", 1, 2, 0);
    axc_sched_destroy(s);
    free(other);
}

/* The next visit passes another shard (a per-call cast, a swapped weight): the gather of the
 * old one, a prefetch possibly still in flight, is settled before the caller frees it. */
static void test_shard_passing(const rank_ctx *c)
{
    axc_sched_config cfg;
    axc_sched *s = sched_cached(c, &cfg);
    if (!s)
        return;
    tlayer X, Y;
    layer_init(c, s, &X, 6);
    layer_init(c, s, &Y, 7);
    CHECK_OK(axc_sched_shard_passing(s, 1000, X.own)); /* an unknown id: nothing to settle */
    /* the same shard: the cached gather stays */
    visit(c, s, &X, F, 0);
    CHECK_OK(axc_sched_shard_passing(s, X.id, X.own));
    CHECK_MSG(alive_buffers(s) == 1, "passing the same shard dropped its gather");
    /* Y's shards live in heap blocks of their own, each freed once the scheduler let go of it */
    float *old = malloc(sizeof(float) * N);
    CHECK(old != NULL);
    if (old)
        fill(c, &Y, old, 1);
    visit(c, s, &Y, F, 0);
    CHECK_OK(axc_sched_step_end(s)); /* learned: X, Y */
    for (int step = 2; old && step < 5; step++) {
        float *next = malloc(sizeof(float) * N);
        CHECK(next != NULL);
        if (!next)
            break;
        visit(c, s, &X, F, 0); /* prefetches Y's gather, from `old` */
        CHECK_OK(axc_sched_shard_passing(s, Y.id, next));
        CHECK_MSG(alive_buffers(s) == 1, "step %d: the gather of the replaced shard survived",
                  step);
        memset(old, 0xff, sizeof(float) * N); /* (NaNs: a gather still reading would show) */
        free(old);
        fill(c, &Y, next, step);
        visit(c, s, &Y, F, 0);
        CHECK_OK(axc_sched_step_end(s));
        old = next;
    }
    free(old);
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ 6. budget */

static void test_budget(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    const int64_t gathered = (int64_t)(sizeof(float) * N) * c->G_d;
    axc_sched_config cfg = {.prefetch = 2, .budget_bytes = gathered - 1, .cache = 0};
    CHECK_OK(axc_sched_configure(s, &cfg));
    tlayer L[3];
    for (int i = 0; i < 3; i++)
        layer_init(c, s, &L[i], i + 1);
    axc_sched_stats st;
    run_step(c, s, L, order1, 6, 0);
    axc_sched_stats_reset(s);
    run_step(c, s, L, order1, 6, 0);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.prefetches == 0 && st.budget_skips > 0 && st.waits == 0,
              "budget below one gathered weight: prefetches %llu budget_skips %llu waits %llu",
              (unsigned long long)st.prefetches, (unsigned long long)st.budget_skips,
              (unsigned long long)st.waits);
    CHECK_MSG(st.peak_buffers == 1, "budget below one gathered weight: peak %d buffers",
              st.peak_buffers);
    CHECK_MSG(st.misses + st.hits == 6, "misses %llu hits %llu", (unsigned long long)st.misses,
              (unsigned long long)st.hits);

    /* control: room for two gathered weights, so prefetches happen within it */
    cfg.budget_bytes = 2 * gathered;
    CHECK_OK(axc_sched_configure(s, &cfg));
    axc_sched_stats_reset(s);
    run_step(c, s, L, order1, 6, 0);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.prefetches > 0 && st.peak_bytes <= (uint64_t)cfg.budget_bytes,
              "budget of two gathered weights: prefetches %llu, peak %llu bytes of %lld",
              (unsigned long long)st.prefetches, (unsigned long long)st.peak_bytes,
              (long long)cfg.budget_bytes);
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ 8. config validation */

static void test_config(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    axc_sched_config good = {.prefetch = 3, .budget_bytes = 1000, .cache = 1}, got;
    CHECK_OK(axc_sched_configure(s, &good));
    static const axc_sched_config bad[] = {{.prefetch = -1}, {.prefetch = 65},
                                           {.prefetch = 1, .budget_bytes = -1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        axc_status r = axc_sched_configure(s, &bad[i]);
        CHECK_MSG(r == AXC_ERR_INVALID, "prefetch %d budget %lld: status %d, expected INVALID",
                  bad[i].prefetch, (long long)bad[i].budget_bytes, (int)r);
        axc_sched_get_config(s, &got);
        CHECK_MSG(got.prefetch == 3 && got.budget_bytes == 1000 && got.cache == 1,
                  "a rejected config changed the config to prefetch %d budget %lld cache %d",
                  got.prefetch, (long long)got.budget_bytes, got.cache);
    }
    static const axc_sched_config edges[] = {{.prefetch = 0}, {.prefetch = 64}};
    for (size_t i = 0; i < 2; i++) {
        CHECK_OK(axc_sched_configure(s, &edges[i]));
        axc_sched_get_config(s, &got);
        CHECK(got.prefetch == edges[i].prefetch && got.budget_bytes == 0 && got.cache == 0);
    }
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ 7. deferred collectives */

static float contrib(int rank, size_t j) { return (float)((rank + 1) * 100 + (int)(j % 53)); }

static void test_deferred(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    const axc_grid *g = axc_comm_grid(c->comm);
    int p = axc_grid_group_rank(g, AXC_GROUP_DEPTH, c->rank);
    float *in = malloc(sizeof(float) * M * (size_t)c->G_d), *out = malloc(sizeof(float) * M);
    for (size_t j = 0; j < (size_t)M * (size_t)c->G_d; j++)
        in[j] = contrib(c->rank, j);
    for (size_t i = 0; i < M; i++)
        out[i] = -1.0f; /* an all-reduce run before the reduce-scatter would leave -2 */
    axc_coll rs = {.kind = AXC_COLL_REDUCE_SCATTER, .send = in, .recv = out, .count = M,
                   .dtype = AXC_DT_F32, .op = AXC_RED_SUM, .device = -1};
    axc_work *w = NULL;
    CHECK_OK(axc_comm_start(c->comm, AXC_GROUP_DEPTH, &rs, &w));
    CHECK_OK(axc_sched_defer(s, w));
    axc_coll ar = {.kind = AXC_COLL_ALL_REDUCE, .send = out, .recv = out, .count = M,
                   .dtype = AXC_DT_F32, .op = AXC_RED_SUM, .device = -1};
    CHECK_OK(axc_sched_start_after_deferred(s, AXC_GROUP_DATA, &ar, NULL));
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.deferred == 2 && st.pending == 2, "before finish: deferred %llu pending %lld",
              (unsigned long long)st.deferred, (long long)st.pending);
    /* finished on a thread of its own, waited for in slices (as run_concurrent's reducer) */
    axc_sched_finishing *f = NULL;
    CHECK_OK(axc_sched_finish_start(s, &f));
    axc_status fs = AXC_ERR_STATE;
    while (f && !axc_sched_finish_wait(f, 20, &fs))
        ;
    CHECK_OK(fs);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.deferred == 2 && st.pending == 0, "after finish: deferred %llu pending %lld",
              (unsigned long long)st.deferred, (long long)st.pending);
    /* piece p summed over the depth group, then over the data group: every rank's piece p,
     * sum over r = 0..3 of (r + 1) * 100 + j % 53 */
    int ok = 1;
    for (size_t i = 0; i < M && ok; i++) {
        size_t j = (size_t)p * M + i;
        float e = (float)(1000 + 4 * (int)(j % 53));
        ok = out[i] == e;
        if (!ok)
            fprintf(stderr, "rank %d: deferred result [%zu] = %g, expected %g\n", c->rank, i,
                    (double)out[i], (double)e);
    }
    CHECK_MSG(ok, "reduce-scatter (depth) then all-reduce (data) gave wrong sums");
    axc_sched_destroy(s);
    free(in);
    free(out);
}

/* ------------------------------------------------------------------ 8b. deferred tasks */

typedef struct task_probe {
    int id;
    int *log, *nlog; /* run order */
    int *drops;
    float *buf;      /* a task fills it (with rank + 1): what the after-collective sums */
    int rank, fail;
} task_probe;

static axc_status probe_run(void *arg)
{
    task_probe *t = arg;
    t->log[(*t->nlog)++] = t->id;
    if (t->buf)
        for (int i = 0; i < M; i++)
            t->buf[i] = (float)(t->rank + 1);
    return t->fail ? axc_fail(AXC_ERR_INVALID, "task %d failed on purpose", t->id) : AXC_OK;
}

static void probe_drop(void *arg) { (*((task_probe *)arg)->drops)++; }

static void test_tasks(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    int log[16], nlog = 0, drops = 0;
    float *buf = malloc(sizeof(float) * M);
    for (int i = 0; i < M; i++)
        buf[i] = -100.0f;
    task_probe t[6];
    for (int i = 0; i < 6; i++)
        t[i] = (task_probe){i, log, &nlog, &drops, NULL, c->rank, 0};
    t[2].buf = buf;
    t[1].fail = 1;
    uint64_t num[6];
    for (int i = 0; i < 3; i++)
        CHECK_OK(axc_sched_add_task(s, (axc_sched_task){probe_run, probe_drop, &t[i]}, &num[i]));
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.tasks == 3 && st.tasks_run == 0 && nlog == 0 && num[0] == 1 && num[2] == 3,
              "queued: tasks %llu run %llu, %d ran, numbers %llu %llu",
              (unsigned long long)st.tasks, (unsigned long long)st.tasks_run, nlog,
              (unsigned long long)num[0], (unsigned long long)num[2]);
    /* a collective after the deferred work reads what the tasks wrote: they run first; a
     * failing task is reported, and the collective starts anyway (peers would wait for it) */
    axc_coll ar = {.kind = AXC_COLL_ALL_REDUCE, .send = buf, .recv = buf, .count = M,
                   .dtype = AXC_DT_F32, .op = AXC_RED_SUM, .device = -1};
    int started = 0;
    axc_status rs = axc_sched_start_after_deferred(s, AXC_GROUP_DEPTH, &ar, &started);
    CHECK_MSG(rs == AXC_ERR_INVALID && strstr(axc_last_error(), "task 1") != NULL && started,
              "a failing task: status %d (%s), started %d", (int)rs, axc_last_error(), started);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.pending == 1, "the all-reduce did not start after the failed task (%lld "
              "pending)", (long long)st.pending);
    /* all three ran, in order, despite the failure of the second; all dropped once */
    CHECK_MSG(nlog == 3 && log[0] == 0 && log[1] == 1 && log[2] == 2 && drops == 3,
              "ran %d (%d %d %d), dropped %d", nlog, log[0], log[1], log[2], drops);
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.tasks == 3 && st.tasks_run == 3, "after: tasks %llu run %llu",
              (unsigned long long)st.tasks, (unsigned long long)st.tasks_run);
    CHECK_OK(axc_sched_finish(s));
    float e = 0;
    for (int m = 0; m < c->G_d; m++)
        e += (float)(c->members[m] + 1);
    CHECK_MSG(buf[0] == e && buf[M - 1] == e, "after-collective read %g, expected %g",
              (double)buf[0], (double)e);
    /* finish runs what is queued; numbers keep counting after a stats reset */
    axc_sched_stats_reset(s);
    CHECK_OK(axc_sched_add_task(s, (axc_sched_task){probe_run, probe_drop, &t[3]}, &num[3]));
    CHECK_OK(axc_sched_run_tasks(s));
    CHECK_OK(axc_sched_add_task(s, (axc_sched_task){probe_run, probe_drop, &t[4]}, &num[4]));
    CHECK_OK(axc_sched_finish(s));
    axc_sched_stats_get(s, &st);
    CHECK_MSG(nlog == 5 && log[3] == 3 && log[4] == 4 && num[4] == 5 && st.tasks_run == 5,
              "run_tasks/finish: ran %d, number %llu, tasks_run %llu", nlog,
              (unsigned long long)num[4], (unsigned long long)st.tasks_run);
    /* destroy drops a queued task without running it */
    CHECK_OK(axc_sched_add_task(s, (axc_sched_task){probe_run, probe_drop, &t[5]}, &num[5]));
    axc_sched_destroy(s);
    CHECK_MSG(nlog == 5 && drops == 6, "destroy: ran %d (expected 5), dropped %d (expected 6)",
              nlog, drops);
    free(buf);
}

/* ------------------------------------------------------------------ 8b. held results */

/* Starts a sum all-reduce of buf[M] (each rank adds rank + 1 + k) over depth and holds it. */
static void hold_sum(const rank_ctx *c, axc_sched *s, float *buf, int k, uint64_t *number)
{
    for (int i = 0; i < M; i++)
        buf[i] = (float)(c->rank + 1 + k);
    axc_coll ar = {.kind = AXC_COLL_ALL_REDUCE, .send = buf, .recv = buf, .count = M,
                   .dtype = AXC_DT_F32, .op = AXC_RED_SUM, .device = -1};
    axc_work *w = NULL;
    CHECK_OK(axc_comm_start(c->comm, AXC_GROUP_DEPTH, &ar, &w));
    CHECK_OK(axc_sched_hold_result(s, buf, sizeof(float) * M, w, number));
}

static float held_sum(const rank_ctx *c, int k)
{
    float e = 0;
    for (int m = 0; m < c->G_d; m++)
        e += (float)(c->members[m] + 1 + k);
    return e;
}

static void test_held(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    float *buf = malloc(sizeof(float) * M * 5);
    uint64_t num[5] = {0};
    for (int k = 0; k < 3; k++)
        hold_sum(c, s, buf + k * M, k, &num[k]);
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.results_held == 3 && st.results_done == 0 && num[0] == 1 && num[2] == 3,
              "held %llu done %llu numbers %llu %llu", (unsigned long long)st.results_held,
              (unsigned long long)st.results_done, (unsigned long long)num[0],
              (unsigned long long)num[2]);
    /* memory nobody holds: nothing to wait for */
    float other[4];
    CHECK_OK(axc_sched_await_result(s, other, sizeof other));
    CHECK_OK(axc_sched_hold_result(s, other, sizeof other, NULL, NULL)); /* no work: no-op */
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.results_held == 3 && st.results_done == 0, "unrelated await: done %llu",
              (unsigned long long)st.results_done);
    /* the last element of the second: the first two complete (FIFO), in that order */
    CHECK_OK(axc_sched_await_result(s, buf + 2 * M - 1, sizeof(float)));
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.results_done == 2, "await of the second: done %llu, expected 2",
              (unsigned long long)st.results_done);
    for (int k = 0; k < 2; k++)
        CHECK_MSG(buf[k * M] == held_sum(c, k) && buf[k * M + M - 1] == held_sum(c, k),
                  "result %d: %g, expected %g", k, (double)buf[k * M], (double)held_sum(c, k));
    /* by number: up to the third (the one left), and a number already done is a no-op */
    CHECK_OK(axc_sched_await_number(s, 1));
    CHECK_OK(axc_sched_await_number(s, num[2]));
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.results_done == 3 && buf[2 * M] == held_sum(c, 2),
              "await_number: done %llu, value %g", (unsigned long long)st.results_done,
              (double)buf[2 * M]);
    /* finish awaits the rest; numbers go on */
    hold_sum(c, s, buf + 3 * M, 3, &num[3]);
    CHECK_OK(axc_sched_finish(s));
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.results_done == 4 && num[3] == 4, "finish: done %llu, number %llu",
              (unsigned long long)st.results_done, (unsigned long long)num[3]);
    CHECK_MSG(buf[3 * M] == held_sum(c, 3) && buf[3 * M + M - 1] == held_sum(c, 3),
              "after finish: %g %g", (double)buf[3 * M], (double)buf[3 * M + M - 1]);
    /* destroy completes a held result (no leak, no write after it returns) */
    hold_sum(c, s, buf + 4 * M, 4, &num[4]);
    axc_sched_destroy(s);
    CHECK_MSG(buf[4 * M] == held_sum(c, 4), "destroy: %g, expected %g", (double)buf[4 * M],
              (double)held_sum(c, 4));
    free(buf);
}

/* ------------------------------------------------------------------ 9. destroy with work out */

static void test_destroy(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer L[2];
    layer_init(c, s, &L[0], 5);
    layer_init(c, s, &L[1], 6);
    static const step_visit seq[2] = {{0, F}, {1, F}};
    run_step(c, s, L, seq, 2, 0);
    /* the first visit prefetches the second, which never comes */
    visit(c, s, &L[0], F, 0);
    float x[M];
    for (int i = 0; i < M; i++)
        x[i] = (float)(c->rank + 1);
    axc_coll ar = {.kind = AXC_COLL_ALL_REDUCE, .send = x, .recv = x, .count = M,
                   .dtype = AXC_DT_F32, .op = AXC_RED_SUM, .device = -1};
    axc_work *w = NULL;
    CHECK_OK(axc_comm_start(c->comm, AXC_GROUP_DEPTH, &ar, &w));
    CHECK_OK(axc_sched_defer(s, w));
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.prefetches == 1 && st.alive_buffers == 1 && st.pending == 1,
              "setup: prefetches %llu, %d buffers alive, %lld pending (expected 1, 1, 1)",
              (unsigned long long)st.prefetches, st.alive_buffers, (long long)st.pending);
    axc_sched_destroy(s); /* must wait for both, free both, and return */
    float e = 0;
    for (int m = 0; m < c->G_d; m++)
        e += (float)(c->members[m] + 1);
    int ok = 1;
    for (int i = 0; i < M; i++)
        ok = ok && x[i] == e;
    CHECK_MSG(ok, "destroy did not complete the deferred all-reduce: x[0] = %g, expected %g",
              (double)x[0], (double)e);
    /* the ranks are still in step on the communicator */
    float y = 1;
    axc_coll one = {.kind = AXC_COLL_ALL_REDUCE, .send = &y, .recv = &y, .count = 1,
                    .dtype = AXC_DT_F32, .op = AXC_RED_SUM, .device = -1};
    w = NULL;
    CHECK_OK(axc_comm_start(c->comm, AXC_GROUP_WORLD, &one, &w));
    if (w) {
        CHECK_OK(axc_work_wait(w));
        axc_work_free(w);
    }
    CHECK(y == (float)axc_comm_grid(c->comm)->world_size);
}

/* ------------------------------------------------------------------ ranks */

static int ctx_open(rank_ctx *c, int rank, int world, const int dims[4], const char *job,
                    double timeout)
{
    memset(c, 0, sizeof *c);
    c->rank = rank;
    axc_comm_config cfg;
    CHECK_OK(fork_ranks_config(&cfg, rank, world, dims, job, timeout));
    c->G_d = axc_grid_group_size(&cfg.grid, AXC_GROUP_DEPTH);
    axc_grid_group_members(&cfg.grid, AXC_GROUP_DEPTH, rank, c->members);
    axc_status st = axc_comm_create(&c->comm, &cfg);
    CHECK_OK(st);
    return st == AXC_OK;
}

/* G_d = 2: everything but the deferred collectives */
static void depth2_main(int rank, int world, const int dims[4], double timeout)
{
    rank_begin(rank);
    rank_ctx c;
    if (ctx_open(&c, rank, world, dims, "sched2", timeout)) {
        test_ids(&c);
        test_gather(&c);
        test_order(&c);
        test_stale(&c);
        test_shard_passing(&c);
        test_budget(&c);
        test_config(&c);
        test_tasks(&c);
        test_held(&c);
        test_destroy(&c);
        axc_comm_destroy(c.comm);
    }
    rank_end(rank);
}

/* G_data = 2, G_d = 2: the deferred collectives */
static void data2_main(int rank, int world, const int dims[4], double timeout)
{
    rank_begin(rank);
    rank_ctx c;
    if (ctx_open(&c, rank, world, dims, "sched4", timeout)) {
        test_deferred(&c);
        axc_comm_destroy(c.comm);
    }
    rank_end(rank);
}

int main(void)
{
    if (!rank_tally_init())
        return 1;
    int64_t t0 = axc_now_ns();
    static const int depth2[4] = {1, 1, 1, 2}, data2[4] = {2, 1, 1, 2};
    spawn_and_tally("G_d=2", 2, depth2_main, depth2);
    spawn_and_tally("G_data=2,G_d=2", 4, data2_main, data2);
    double secs = (double)(axc_now_ns() - t0) * 1e-9;
    CHECK_MSG(secs < 5.0, "took %.1f s", secs);
    return ctest_summary("test_sched");
}
