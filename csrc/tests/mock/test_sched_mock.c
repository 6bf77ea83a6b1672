/* The scheduler's CUDA branch (csrc/sched/sched.c) on the CPU mock of libcudart, two forked
 * ranks over the shm backend (G_d = 2, which stages "device" buffers through host memory, so the
 * depth all-gather really moves data between the ranks). Layers on device 0, two fake streams
 * S1 and S2 the mock watches. Checked in each rank:
 *   a. a miss gathers into a cudaMallocAsync buffer on the visit's stream, release frees it
 *      with cudaFreeAsync on that stream, without waiting for it on the host;
 *   b. readers on another stream: the old one is waited for once, the free goes to the new one;
 *   c. a prefetch (allocated on the stream of the visit that issued it) used on another stream:
 *      the same wait, right values, a hit or a wait, and the free on the new stream;
 *   d. cudaMallocAsync failing on both ranks: acquire names it, nothing is alive, and the next
 *      acquire works (no rank issued the gather, so they are still in step);
 *   e. a cached buffer released on another stream moves to it (its later free follows those
 *      readers); destroy with buffers alive frees every one of them;
 *   f. over a slow link (each gather 150 ms): a prefetch dropped while its gather is in flight
 *      (step_abort), then a new gather on the same stream at once: the drop waits for the
 *      gather before freeing (with torch's allocator the next allocation on that stream gets
 *      the block at once: a free ahead of the gather is a violation of the checker there);
 *   g. a finish on a thread of its own (axc_sched_finish_start) started on device 1 makes
 *      device 1 its thread's current one before it waits (a new thread starts on device 0).
 * With AXONN_C_TORCH_CUDA_LIB naming the mock of torch's CUDA shim (mock_torch_cuda.c), the
 * same checks run on the path a job with torch takes: gathered weights are blocks of torch's
 * caching allocator (counted in place of the cudaMallocAsync ones), which belong to the stream
 * they were allocated on and go back to it at once when freed; so a buffer that moved to
 * another stream is waited for on the host once more before its free (b, c), and the checker
 * sees every reuse of a freed block as a write on its stream (a free ahead of a reader on the
 * other stream is a violation at the next allocation that reuses it).
 * Between acquire and release, each visit's GEMMs "read" the gathered weight on its streams (the
 * acquire's and the release's, registered with the mock's stream-order checker), and at the end
 * of each rank the checker must have found no violation: every cudaFreeAsync of a gathered
 * buffer after its gather and its readers on every stream, no reader ahead of the gather.
 * Run by run_mock_test.sh (plain and ASan+UBSan; the ranks end with exit(), so LeakSanitizer
 * runs in each). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/cuda_rt.h"
#include "axc/sched.h"
#include "axc/torch_shim.h"
#include "../ctest.h"
#include "../fork_ranks.h"
#include "../rank_tally.h"
#include "mock_order_check.h"

#define N 513 /* elements of a layer's depth shard */

/* the mock's counters (exported by the library, found with dlsym) */
static struct mock {
    int torch; /* gathered weights come from (the mock of) torch's caching allocator */
    int *mallocs, *frees, *live, *malloc_err, *watch_syncs, *reuses, *guards_live;
    int *set_device_calls; /* [2]: cudaSetDevice calls per device */
    void **last_malloc_stream, **last_free_stream, **watch;
} g_mock;

/* the allocation calls as the messages name them */
#define ALLOC (g_mock.torch ? "torch raw_alloc" : "cudaMallocAsync")
#define FREE (g_mock.torch ? "torch raw_delete" : "cudaFreeAsync")

/* cudaFreeAsync goes to the stream that owns the buffer; torch's blocks have no free stream */
static int freed_on(const void *stream)
{
    return g_mock.torch || *g_mock.last_free_stream == stream;
}

/* the fake compute streams: any distinct non-NULL handles (the mock never dereferences them) */
static char s1_, s2_;
#define S1 ((void *)&s1_)
#define S2 ((void *)&s2_)

static order_checker g_oc;

/* The visit's GEMMs reading the gathered weight: on the stream of its acquire (where the layer
 * computes) and, when the test releases it on another one, there too (readers on two streams). */
static void gemm_reads(const void *full, void *acquired_on, void *released_on)
{
    if (!full)
        return;
    g_oc.access(full, acquired_on, 0);
    if (released_on != acquired_on)
        g_oc.access(full, released_on, 0);
}

/* what the mock has counted since a snapshot */
typedef struct counts {
    int mallocs, frees, live, sync1, sync2;
} counts;

static counts snap(void)
{
    return (counts){__atomic_load_n(g_mock.mallocs, __ATOMIC_SEQ_CST),
                    __atomic_load_n(g_mock.frees, __ATOMIC_SEQ_CST),
                    __atomic_load_n(g_mock.live, __ATOMIC_SEQ_CST),
                    __atomic_load_n(&g_mock.watch_syncs[0], __ATOMIC_SEQ_CST),
                    __atomic_load_n(&g_mock.watch_syncs[1], __ATOMIC_SEQ_CST)};
}

static counts since(counts t0)
{
    counts t = snap();
    return (counts){t.mallocs - t0.mallocs, t.frees - t0.frees, t.live - t0.live,
                    t.sync1 - t0.sync1, t.sync2 - t0.sync2};
}

static const char *stream_name(const void *s)
{
    return s == S1 ? "S1" : s == S2 ? "S2" : s == NULL ? "NULL" : "another stream";
}

typedef struct rank_ctx {
    int rank;
    axc_comm *comm;
} rank_ctx;

/* A test layer on device 0: its scheduler id and its shard's values (distinct per layer). */
typedef struct tlayer {
    int id, tag;
    float shard[N];
} tlayer;

static float val(int tag, int rank, int i) { return (float)(tag * 10000 + rank * 1000 + i); }

static void layer_init(const rank_ctx *c, axc_sched *s, tlayer *L, int tag)
{
    L->id = -1;
    L->tag = tag;
    CHECK_OK(axc_sched_layer_new(s, &L->id));
    for (int i = 0; i < N; i++)
        L->shard[i] = val(tag, c->rank, i);
}

static axc_sched_weight weight_of(const tlayer *L, void *stream)
{
    axc_sched_weight w = {0};
    w.layer = L->id;
    w.phase = AXC_PHASE_FWD;
    w.shard = L->shard;
    w.shard_elems = N;
    w.dtype = AXC_DT_F32;
    w.device = 0;
    w.stream = stream;
    w.prefetch_ok = 1;
    return w;
}

/* 1 when `full` is rank 0's shard of L followed by rank 1's */
static int full_ok(const tlayer *L, const void *got)
{
    const float *full = got;
    if (!full || (const void *)full == (const void *)L->shard) {
        fprintf(stderr, "rank %d: layer %d: acquire returned %s\n", g_rank, L->id,
                full ? "the shard itself" : "no buffer");
        return 0;
    }
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < N; i++)
            if (full[(size_t)r * N + (size_t)i] != val(L->tag, r, i)) {
                fprintf(stderr, "rank %d: layer %d: rank %d's piece wrong at %d: %g, expected %g\n",
                        g_rank, L->id, r, i, (double)full[(size_t)r * N + (size_t)i],
                        (double)val(L->tag, r, i));
                return 0;
            }
    return 1;
}

static axc_sched *sched_new(const rank_ctx *c)
{
    axc_sched *s = NULL;
    CHECK_OK(axc_sched_create(&s, c->comm));
    return s;
}

static int alive_buffers(axc_sched *s)
{
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    return st.alive_buffers;
}

/* ------------------------------------------------------------------ a. a miss on one stream */

static void test_miss(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer X;
    layer_init(c, s, &X, 1);
    counts t0 = snap();
    axc_sched_weight w = weight_of(&X, S1);
    const void *full = NULL;
    CHECK_OK(axc_sched_acquire(s, &w, &full));
    CHECK_MSG(full_ok(&X, full),
              "a miss: acquire on S1 did not gather rank 0's and rank 1's shard");
    counts d = since(t0);
    CHECK_MSG(d.mallocs == 1 && d.live == 1 && *g_mock.last_malloc_stream == S1,
              "a miss: %d %s (%d alive), the last on %s; expected 1 on S1", d.mallocs, ALLOC,
              d.live, stream_name(*g_mock.last_malloc_stream));
    CHECK_MSG(alive_buffers(s) == 1, "a miss: %d buffers alive after acquire", alive_buffers(s));
    gemm_reads(full, S1, S1);
    CHECK_OK(axc_sched_release(s, X.id, S1));
    d = since(t0);
    CHECK_MSG(d.frees == 1 && d.live == 0 && freed_on(S1),
              "a miss: release on S1: %d %s (%d alive), the last on %s; expected 1 on S1",
              d.frees, FREE, d.live, stream_name(*g_mock.last_free_stream));
    CHECK_MSG(d.sync1 == 0 && d.sync2 == 0,
              "a miss: one stream, yet %d host waits for S1 and %d for S2", d.sync1, d.sync2);
    CHECK_MSG(alive_buffers(s) == 0, "a miss: %d buffers alive after release", alive_buffers(s));
    CHECK_OK(axc_sched_step_end(s));
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ b. readers on two streams */

static void test_two_streams(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer X;
    layer_init(c, s, &X, 2);
    counts t0 = snap();
    axc_sched_weight w = weight_of(&X, S1);
    const void *full = NULL;
    CHECK_OK(axc_sched_acquire(s, &w, &full));
    CHECK(full_ok(&X, full));
    /* readers were queued on S2 (and S1): the free must not run ahead of the gather on S1 */
    gemm_reads(full, S1, S2);
    CHECK_OK(axc_sched_release(s, X.id, S2));
    counts d = since(t0);
    /* torch: the block goes back to S1 at once, so S2's readers are waited for too */
    int want2 = g_mock.torch ? 1 : 0;
    CHECK_MSG(d.sync1 == 1 && d.sync2 == want2,
              "b. release on S2 of a buffer of S1: %d host waits for S1 and %d for S2; expected "
              "1 and %d",
              d.sync1, d.sync2, want2);
    CHECK_MSG(d.mallocs == 1 && d.frees == 1 && d.live == 0 && freed_on(S2),
              "b. %d %s, %d %s (%d alive), the last free on %s; expected 1, 1, on S2", d.mallocs,
              ALLOC, d.frees, FREE, d.live, stream_name(*g_mock.last_free_stream));
    CHECK_MSG(alive_buffers(s) == 0, "b. %d buffers alive after release", alive_buffers(s));
    CHECK_OK(axc_sched_step_end(s));
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ c. a prefetch moves stream */

static void visit_on(axc_sched *s, const tlayer *L, void *stream)
{
    axc_sched_weight w = weight_of(L, stream);
    const void *full = NULL;
    CHECK_OK(axc_sched_acquire(s, &w, &full));
    CHECK(full_ok(L, full));
    gemm_reads(full, stream, stream);
    CHECK_OK(axc_sched_release(s, L->id, stream));
}

static void test_prefetch_moves(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer A, B;
    layer_init(c, s, &A, 3);
    layer_init(c, s, &B, 4);
    /* step 1 learns A, B (both on S1) */
    visit_on(s, &A, S1);
    visit_on(s, &B, S1);
    CHECK_OK(axc_sched_step_end(s));
    axc_sched_stats_reset(s);
    counts t0 = snap();
    /* step 2: A's visit on S1 issues B's gather, ordered on S1 */
    axc_sched_weight wa = weight_of(&A, S1);
    const void *full = NULL;
    CHECK_OK(axc_sched_acquire(s, &wa, &full));
    CHECK(full_ok(&A, full));
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    counts d = since(t0);
    CHECK_MSG(st.prefetches == 1 && st.misses == 1,
              "c. acquire A: %llu prefetches, %llu misses; expected 1 and 1",
              (unsigned long long)st.prefetches, (unsigned long long)st.misses);
    CHECK_MSG(d.mallocs == 2 && *g_mock.last_malloc_stream == S1,
              "c. acquire A: %d %s, the last (B's prefetch) on %s; expected 2, S1", d.mallocs,
              ALLOC, stream_name(*g_mock.last_malloc_stream));
    gemm_reads(full, S1, S1);
    CHECK_OK(axc_sched_release(s, A.id, S1));
    /* B's visit runs on S2: it waits for S1 (B's gather) once, then B belongs to S2 */
    counts t1 = snap();
    axc_sched_weight wb = weight_of(&B, S2);
    full = NULL;
    CHECK_OK(axc_sched_acquire(s, &wb, &full));
    CHECK_MSG(full_ok(&B, full), "c. the prefetched B, used on S2, has wrong values");
    axc_sched_stats_get(s, &st);
    d = since(t1);
    CHECK_MSG(st.misses == 1 && st.hits + st.waits == 1,
              "c. acquire B on S2: misses %llu hits %llu waits %llu (B was prefetched)",
              (unsigned long long)st.misses, (unsigned long long)st.hits,
              (unsigned long long)st.waits);
    CHECK_MSG(d.mallocs == 0, "c. acquire B on S2 allocated %d buffers (a second gather?)",
              d.mallocs);
    CHECK_MSG(d.sync1 == 1 && d.sync2 == 0,
              "c. acquire B on S2 (prefetched on S1): %d host waits for S1 and %d for S2; "
              "expected 1 and 0",
              d.sync1, d.sync2);
    gemm_reads(full, S2, S2);
    CHECK_OK(axc_sched_release(s, B.id, S2));
    d = since(t1);
    int want2 = g_mock.torch ? 1 : 0; /* torch: B's block goes back to S1, after S2's readers */
    CHECK_MSG(d.sync1 == 1 && d.sync2 == want2,
              "c. release B on S2: %d host waits for S1 and %d for S2 in all; expected 1 and %d",
              d.sync1, d.sync2, want2);
    CHECK_MSG(d.frees == 1 && freed_on(S2),
              "c. release B on S2: %d %s, the last on %s; expected 1 on S2", d.frees, FREE,
              stream_name(*g_mock.last_free_stream));
    d = since(t0);
    CHECK_MSG(d.live == 0 && alive_buffers(s) == 0,
              "c. after the step's visits: %d allocations live, %d buffers alive", d.live,
              alive_buffers(s));
    CHECK_OK(axc_sched_step_end(s));
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ d. cudaMallocAsync fails */

static void test_malloc_fails(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer X;
    layer_init(c, s, &X, 5);
    counts t0 = snap();
    /* on both ranks: the allocation comes before the gather, so neither starts it */
    *g_mock.malloc_err = 2; /* cudaErrorMemoryAllocation */
    axc_sched_weight w = weight_of(&X, S1);
    const void *full = NULL;
    axc_status st = axc_sched_acquire(s, &w, &full);
    *g_mock.malloc_err = 0;
    const char *named = g_mock.torch ? "torch's CUDA caching allocator" : "cudaMallocAsync";
    CHECK_MSG(st != AXC_OK && strstr(axc_last_error(), named) != NULL,
              "d. acquire with %s failing: %s: %s", ALLOC, axc_status_name(st),
              st != AXC_OK ? axc_last_error() : "");
    counts d = since(t0);
    CHECK_MSG(d.live == 0 && d.frees == 0 && alive_buffers(s) == 0,
              "d. after the failed acquire: %d allocations live, %d freed, %d buffers alive",
              d.live, d.frees, alive_buffers(s));
    /* the ranks are still in step: the next acquire gathers */
    full = NULL;
    CHECK_OK(axc_sched_acquire(s, &w, &full));
    CHECK_MSG(full_ok(&X, full), "d. the acquire after the failure gathered wrong values");
    gemm_reads(full, S1, S1);
    CHECK_OK(axc_sched_release(s, X.id, S1));
    d = since(t0);
    CHECK_MSG(d.mallocs == 1 && d.frees == 1 && d.live == 0 && alive_buffers(s) == 0,
              "d. after the retry: %d %s, %d %s, %d live, %d alive", d.mallocs, ALLOC, d.frees,
              FREE, d.live, alive_buffers(s));
    CHECK_OK(axc_sched_step_end(s));
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ e. destroy frees */

static void test_destroy(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    axc_sched_config cfg;
    axc_sched_get_config(s, &cfg);
    cfg.cache = 1; /* released buffers stay until the step ends, or destroy */
    CHECK_OK(axc_sched_configure(s, &cfg));
    tlayer A, B;
    layer_init(c, s, &A, 6);
    layer_init(c, s, &B, 7);
    visit_on(s, &A, S1);
    visit_on(s, &B, S2);
    CHECK_OK(axc_sched_step_end(s));
    counts t0 = snap();
    /* A kept by the cache, B's prefetch (issued by A's visit) perhaps still in flight */
    axc_sched_weight w = weight_of(&A, S1);
    const void *full = NULL;
    CHECK_OK(axc_sched_acquire(s, &w, &full));
    CHECK(full_ok(&A, full));
    gemm_reads(full, S1, S2);
    CHECK_OK(axc_sched_release(s, A.id, S2));
    counts d = since(t0);
    /* kept, with readers on S2: its later free must follow them, so S2 owns it now */
    CHECK_MSG(d.sync1 == 1 && d.sync2 == 0,
              "e. a cached buffer of S1 released on S2: %d host waits for S1 and %d for S2; "
              "expected 1 and 0",
              d.sync1, d.sync2);
    CHECK_MSG(d.live == 2 && alive_buffers(s) == 2,
              "e. before destroy: %d allocations live, %d buffers alive; expected 2 and 2",
              d.live, alive_buffers(s));
    axc_sched_destroy(s);
    d = since(t0);
    CHECK_MSG(d.live == 0 && d.frees == d.mallocs,
              "e. after destroy: %d allocations live (%d made, %d freed)", d.live, d.mallocs,
              d.frees);
}

/* ------------------------------------------------------------------ f. drop in flight */

static void test_drop_in_flight(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    tlayer A, B, X;
    layer_init(c, s, &A, 8);
    layer_init(c, s, &B, 9);
    layer_init(c, s, &X, 10);
    visit_on(s, &A, S1); /* step 1 learns A, B */
    visit_on(s, &B, S1);
    CHECK_OK(axc_sched_step_end(s));
    /* step 2: A's visit issues B's prefetch on S1, which the link keeps in flight */
    axc_sched_weight wa = weight_of(&A, S1);
    const void *full = NULL;
    CHECK_OK(axc_sched_acquire(s, &wa, &full));
    CHECK(full_ok(&A, full));
    gemm_reads(full, S1, S1);
    CHECK_OK(axc_sched_release(s, A.id, S1));
    axc_sched_stats st;
    axc_sched_stats_get(s, &st);
    CHECK_MSG(st.alive_buffers == 1, "f. %d buffers alive after A (B's prefetch expected)",
              st.alive_buffers);
    /* the step is dropped with B's gather in flight; a new layer gathers on S1 right away (its
     * allocation may get B's memory) */
    CHECK_OK(axc_sched_step_abort(s));
    axc_sched_weight wx = weight_of(&X, S1);
    full = NULL;
    CHECK_OK(axc_sched_acquire(s, &wx, &full));
    CHECK_MSG(full_ok(&X, full), "f. the gather after the dropped prefetch has wrong values");
    gemm_reads(full, S1, S1);
    CHECK_OK(axc_sched_release(s, X.id, S1));
    CHECK_MSG(alive_buffers(s) == 0, "f. %d buffers alive at the end", alive_buffers(s));
    CHECK_OK(axc_sched_step_end(s));
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ g. finish thread's device */

static void test_finish_device(const rank_ctx *c)
{
    axc_sched *s = sched_new(c);
    if (!s)
        return;
    const axc_cuda_api *cu = NULL;
    CHECK_OK(axc_cuda_load(&cu));
    if (cu && cu->device_count >= 2) {
        CHECK(cu->SetDevice(1) == 0);
        int before = g_mock.set_device_calls[1];
        axc_sched_finishing *f = NULL;
        CHECK_OK(axc_sched_finish_start(s, &f));
        axc_status st = AXC_OK;
        while (f && !axc_sched_finish_wait(f, 1000, &st))
            ;
        CHECK_OK(st);
        CHECK_MSG(g_mock.set_device_calls[1] == before + 1,
                  "g. the finish thread made device 1 current %d time(s), expected once",
                  g_mock.set_device_calls[1] - before);
        CHECK(cu->SetDevice(0) == 0);
    } else {
        CHECK_MSG(0, "g. the mock runtime has %d device(s), expected 2", cu ? cu->device_count : 0);
    }
    axc_sched_destroy(s);
}

/* ------------------------------------------------------------------ ranks */

/* A rank: sections a-e on a plain communicator, or (slow) f over one whose simulated link makes
 * each collective take 150 ms; no gathered weight may be left, nor any ordering violation. */
static void rank_run(int rank, int world, const int dims[4], double timeout, int slow)
{
    rank_begin(rank);
    rank_ctx c = {rank, NULL};
    axc_comm_config cfg;
    if (slow)
        setenv("AXONN_C_SIM_US", "150000", 1);
    CHECK_OK(fork_ranks_config(&cfg, rank, world, dims, slow ? "schedmockslow" : "schedmock",
                               timeout));
    CHECK_OK(axc_comm_create(&c.comm, &cfg));
    if (c.comm) {
        counts t0 = snap();
        if (slow) {
            test_drop_in_flight(&c);
        } else {
            test_miss(&c);
            test_two_streams(&c);
            test_prefetch_moves(&c);
            test_malloc_fails(&c);
            test_destroy(&c);
            test_finish_device(&c);
        }
        counts d = since(t0);
        CHECK_MSG(d.live == 0, "%d gathered-weight allocations never freed", d.live);
        if (g_mock.torch && !slow) {
            /* freed blocks came back (so the checker saw reuses after moved readers), and
             * every stream guard was undone */
            CHECK_MSG(*g_mock.reuses > 0, "torch mode: no freed block was ever reused");
            CHECK_MSG(*g_mock.guards_live == 0, "torch mode: %d stream guard(s) left",
                      *g_mock.guards_live);
        }
        axc_comm_destroy(c.comm);
    }
    char who[64];
    snprintf(who, sizeof who, "test_sched_mock%s rank %d", slow ? " (slow link)" : "", rank);
    int v = order_violations(&g_oc, who);
    CHECK_MSG(v == 0, "the stream-order checker found %d violation(s) (above)", v);
    rank_end(rank);
}

static void rank_main(int rank, int world, const int dims[4], double timeout)
{
    rank_run(rank, world, dims, timeout, 0);
}

static void rank_main_slow(int rank, int world, const int dims[4], double timeout)
{
    rank_run(rank, world, dims, timeout, 1);
}

static int find_mock(void)
{
    /* bind to the mock before the core loads the runtime, as torch would to the real one */
    const char *rt = getenv("AXC_TEST_CUDART");
    void *h = rt ? dlopen(rt, RTLD_NOW | RTLD_GLOBAL) : NULL;
    if (!h) {
        fprintf(stderr, "AXC_TEST_CUDART=%s could not be loaded: %s\n", rt ? rt : "(unset)",
                rt ? dlerror() : "set it to the mock libcudart.so.13");
        return 0;
    }
    g_mock.mallocs = dlsym(RTLD_DEFAULT, "mock_async_mallocs");
    g_mock.frees = dlsym(RTLD_DEFAULT, "mock_async_frees");
    g_mock.live = dlsym(RTLD_DEFAULT, "mock_async_live");
    g_mock.malloc_err = dlsym(RTLD_DEFAULT, "mock_malloc_async_err");
    g_mock.watch_syncs = dlsym(RTLD_DEFAULT, "mock_watch_syncs");
    g_mock.last_malloc_stream = dlsym(RTLD_DEFAULT, "mock_last_malloc_stream");
    g_mock.last_free_stream = dlsym(RTLD_DEFAULT, "mock_last_free_stream");
    g_mock.watch = dlsym(RTLD_DEFAULT, "mock_watch");
    g_mock.set_device_calls = dlsym(RTLD_DEFAULT, "mock_set_device_calls");
    if (!g_mock.mallocs || !g_mock.frees || !g_mock.live || !g_mock.malloc_err ||
        !g_mock.watch_syncs || !g_mock.last_malloc_stream || !g_mock.last_free_stream ||
        !g_mock.watch || !g_mock.set_device_calls) {
        fprintf(stderr, "the CUDA runtime at %s is not the mock with stream-ordered "
                        "allocation counters\n", rt);
        return 0;
    }
    const char *tc = getenv("AXONN_C_TORCH_CUDA_LIB");
    if (tc && tc[0]) { /* the core opens the same library: its counters replace cudart's */
        void *th = dlopen(tc, RTLD_NOW | RTLD_GLOBAL);
        if (!th) {
            fprintf(stderr, "AXONN_C_TORCH_CUDA_LIB=%s could not be loaded: %s\n", tc,
                    dlerror());
            return 0;
        }
        g_mock.torch = 1;
        g_mock.mallocs = dlsym(th, "mock_torch_allocs");
        g_mock.frees = dlsym(th, "mock_torch_deletes");
        g_mock.live = dlsym(th, "mock_torch_live");
        g_mock.malloc_err = dlsym(th, "mock_torch_alloc_err");
        g_mock.last_malloc_stream = dlsym(th, "mock_torch_last_alloc_stream");
        g_mock.reuses = dlsym(th, "mock_torch_reuses");
        g_mock.guards_live = dlsym(th, "mock_torch_guards_live");
        if (!g_mock.mallocs || !g_mock.frees || !g_mock.live || !g_mock.malloc_err ||
            !g_mock.last_malloc_stream || !g_mock.reuses || !g_mock.guards_live) {
            fprintf(stderr, "%s is not the mock of torch's CUDA shim\n", tc);
            return 0;
        }
    }
    printf("test_sched_mock: gathered weights from %s\n",
           g_mock.torch ? "torch's caching allocator (mock)" : "cudaMallocAsync");
    if (!order_checker_find(&g_oc)) {
        fprintf(stderr, "the mock CUDA runtime at %s has no stream-order checker\n", rt);
        return 0;
    }
    g_mock.watch[0] = S1;
    g_mock.watch[1] = S2;
    g_oc.name_stream(S1, "S1"); /* before the fork: every rank's checker knows the names */
    g_oc.name_stream(S2, "S2");
    return 1;
}

int main(void)
{
    int found = find_mock();
    CHECK(found);
    if (!found)
        return ctest_summary("test_sched_mock");
    if (!rank_tally_init())
        return 1;
    static const int depth2[4] = {1, 1, 1, 2};
    spawn_and_tally("G_d=2", 2, rank_main, depth2);
    spawn_and_tally("G_d=2, slow link", 2, rank_main_slow, depth2);
    if (g_mock.torch) { /* torch's current stream, read through the shim (LinearCall's path) */
        const axc_torch_cuda_api *api = NULL;
        CHECK(axc_torch_cuda_load(&api) == AXC_OK && api && api->get_current_stream);
        void *s = (void *)1;
        CHECK(axc_torch_cuda_current_stream(0, &s) == AXC_OK && s == NULL); /* the default */
        axc_torch_stream_guard guard = NULL;
        CHECK(api && api->create_stream_guard(S2, 0, &guard) == 0);
        CHECK(axc_torch_cuda_current_stream(0, &s) == AXC_OK && s == S2);
        CHECK(api && api->delete_stream_guard(guard) == 0);
        CHECK(axc_torch_cuda_current_stream(0, &s) == AXC_OK && s == NULL);
    }
    return ctest_summary("test_sched_mock");
}
