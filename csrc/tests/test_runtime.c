/* The runtime (csrc/runtime/runtime.c): open/close of the communicator and scheduler (twice,
 * refusing a second open, also one or a close while an open waits for the ranks), the
 * blocking hooks around every wait, the buckets and keep-alives that outlive a close, and the
 * start of due bucket sums: at 2 data-parallel ranks a bucket's sum reaches every rank, a
 * re-entrant start returns at once, a sum one rank cannot start fails the other's at once, and
 * due sums without an open communicator fail with a message; what a gradient hook decides from (axc_runtime_grad_needs_work: pending work,
 * marks, the micro-batch thread, sums on, the overlap knob and a parameter's own, group sizes
 * of the open grid). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/runtime.h"
#include "ctest.h"
#include "fork_ranks.h"
#include "rank_tally.h"

typedef struct counts {
    int allocs, releases, begins, ends, kept_released;
} counts;
static counts g_counts;
/* set by a test: the next blocking_begin calls axc_runtime_start_due_sums on it (a re-entry
 * while a start is under way), recording whether that started anything */
static axc_runtime *g_reenter;
static int g_reentry_started = -1;
/* set by a test: the next blocking_begin opens and closes it again (a second init, or a
 * finalize, while an open waits for the ranks), recording what they returned */
static axc_runtime *g_reopen;
static const axc_comm_config *g_reopen_cfg;
static axc_status g_reopen_st = AXC_OK, g_reclose_st = AXC_OK;
static char g_reopen_msg[256], g_reclose_msg[256];

static axc_status fake_alloc(void *ctx, const axc_bucket_key *key, size_t elems, void *arg,
                             void **data, void **owner)
{
    (void)arg;
    (void)ctx;
    g_counts.allocs++;
    *data = calloc(elems, axc_dtype_size(key->dtype));
    *owner = *data;
    return *data ? AXC_OK : axc_fail(AXC_ERR_NOMEM, "fake allocator: out of memory");
}

static void fake_release(void *ctx, void *owner)
{
    (void)ctx;
    g_counts.releases++;
    free(owner);
}

static void kept_release(void *ctx, void *owner)
{
    (void)ctx;
    (void)owner;
    g_counts.kept_released++;
}

static void *begin(void *ctx)
{
    (void)ctx;
    g_counts.begins++;
    if (g_reenter) {
        axc_runtime *rt = g_reenter;
        g_reenter = NULL;
        int before = g_counts.begins;
        axc_status st = axc_runtime_start_due_sums(rt);
        g_reentry_started = st != AXC_OK || g_counts.begins != before;
    }
    if (g_reopen) {
        axc_runtime *rt = g_reopen;
        g_reopen = NULL;
        g_reopen_st = axc_runtime_open(rt, g_reopen_cfg);
        snprintf(g_reopen_msg, sizeof g_reopen_msg, "%s", axc_last_error());
        g_reclose_st = axc_runtime_close(rt);
        snprintf(g_reclose_msg, sizeof g_reclose_msg, "%s", axc_last_error());
    }
    return &g_counts; /* handed back to end */
}

static void end(void *ctx, void *state)
{
    (void)ctx;
    g_counts.ends += state == &g_counts;
}

static axc_runtime_ops ops_of(void)
{
    axc_runtime_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.buckets = (axc_bucket_ops){fake_alloc, fake_release, NULL, NULL};
    ops.release_kept = kept_release;
    ops.hooks = (axc_runtime_hooks){begin, end, NULL};
    ops.bucket_bytes = 16 * sizeof(float);
    return ops;
}

/* 2 data-parallel ranks: a bucket of this rank's values, summed through the scheduler */
/* at G_data=2, idle: a gradient needs work only when its sum would start now */
static void needs_work_data2(axc_runtime *rt)
{
    axc_groups data = {.n = 1, .g = {AXC_GROUP_DATA}};
    axc_groups depth_data = {.n = 2, .g = {AXC_GROUP_DEPTH, AXC_GROUP_DATA}};
    axc_groups depth = {.n = 1, .g = {AXC_GROUP_DEPTH}};
    CHECK(axc_runtime_grad_sync(rt) && !axc_runtime_overlap_data(rt)); /* the defaults */
    /* gradient names: from 1, never repeated */
    unsigned long long id1 = axc_runtime_new_grad_ident(rt), id2 = axc_runtime_new_grad_ident(rt);
    CHECK(id1 == 1 && id2 == 2);
    CHECK(axc_runtime_process_token(rt) != 0);
    CHECK(axc_runtime_grads_idle(rt));
    CHECK(!axc_runtime_grad_needs_work(rt, 0, -1, &data)); /* overlap off */
    CHECK(axc_runtime_grad_needs_work(rt, 0, 1, &data));   /* a layer's own knob on */
    axc_runtime_set_overlap_data(rt, 1);
    CHECK(axc_runtime_grad_needs_work(rt, 0, -1, &data) &&
          axc_runtime_grad_needs_work(rt, 0, -1, &depth_data));
    CHECK(!axc_runtime_grad_needs_work(rt, 0, 0, &data));   /* its own knob off */
    CHECK(!axc_runtime_grad_needs_work(rt, 0, -1, &depth)); /* one rank in depth */
    CHECK(!axc_runtime_grad_needs_work(rt, 0, -1, NULL));
    axc_runtime_set_grad_sync(rt, 0); /* no_grad_sync */
    CHECK(!axc_runtime_grad_needs_work(rt, 0, -1, &data) && !axc_runtime_grad_sync(rt));
    axc_set_microbatch_thread(1); /* a micro-batch thread's gradient is always checked */
    CHECK(axc_runtime_grad_needs_work(rt, 0, -1, &depth) && axc_microbatch_thread());
    axc_set_microbatch_thread(0);
    axc_runtime_set_grad_sync(rt, 1);
    /* a parameter with a mark (its .grad summed or synced) needs it; another one does not */
    static int stamp;
    int before = g_counts.kept_released;
    CHECK_OK(axc_records_mark_synced(axc_runtime_records(rt), 7, &stamp, &depth, 0.5, 0));
    CHECK(axc_runtime_grad_needs_work(rt, 7, -1, NULL) &&
          !axc_runtime_grad_needs_work(rt, 8, -1, NULL));
    CHECK_OK(axc_records_mark(axc_runtime_records(rt), 7, NULL, NULL));
    CHECK(!axc_runtime_grad_needs_work(rt, 7, -1, NULL));
    g_counts.kept_released = before; /* (the stamp's release) */
    axc_runtime_set_overlap_data(rt, 0);
}

static void data2_main(int rank, int world, const int dims[4], double timeout)
{
    rank_begin(rank);
    memset(&g_counts, 0, sizeof g_counts);
    axc_runtime_ops ops = ops_of();
    axc_runtime *rt = NULL, *other = NULL;
    CHECK_OK(axc_runtime_create(&rt, &ops));
    CHECK_OK(axc_runtime_create(&other, &ops));
    /* the trace: each runtime's own, recording before init (spans recorded then are kept) */
    axc_timeline *tl = axc_runtime_timeline(rt), *tl_other = axc_runtime_timeline(other);
    CHECK(tl && tl_other && tl != tl_other);
    CHECK_OK(axc_timeline_enable_checked(tl, 1));
    CHECK_OK(axc_timeline_enable_checked(tl_other, 1));
    axc_timeline_record(tl, AXC_SPAN_COMPUTE, "before_init", -1, 1, 2, 0);
    axc_comm_config cfg;
    CHECK_OK(fork_ranks_config(&cfg, rank, world, dims, "runtime2", timeout));
    cfg.timeline = tl_other; /* (the runtime opens its communicator with its own instead) */
    CHECK_OK(axc_runtime_open(rt, &cfg));
    CHECK(axc_comm_timeline(axc_runtime_comm(rt)) == tl);
    CHECK_MSG(g_counts.begins >= 1 && g_counts.begins == g_counts.ends, "%d begins, %d ends",
              g_counts.begins, g_counts.ends);
    CHECK(axc_runtime_is_open(rt) && axc_runtime_comm(rt) && axc_runtime_sched(rt));
    needs_work_data2(rt);
    axc_bucket_key key = {.dtype = AXC_DT_F32, .device = -1, .ngroups = 1};
    key.groups[0] = AXC_GROUP_DATA;
    /* two full buckets of 16 floats: two sums due */
    float *data[2];
    for (int k = 0; k < 2; k++) {
        int id;
        size_t off;
        void *owner;
        CHECK_OK(axc_buckets_take(axc_runtime_buckets(rt), &key, 16, 0, NULL, 0, &id, &off, &owner));
        data[k] = (float *)owner + off;
        /* a bucket still taking gradients: every gradient needs the gradient code */
        axc_groups none = {.n = 0};
        CHECK(!axc_runtime_grads_idle(rt) && axc_runtime_grad_needs_work(rt, 0, 0, &none));
        for (int i = 0; i < 16; i++)
            data[k][i] = (float)(rank + 1) * (float)(i + 1 + 100 * k);
        CHECK_OK(axc_buckets_written(axc_runtime_buckets(rt), id));
    }
    int before = g_counts.begins;
    g_reenter = rt; /* the first start's wait re-enters: it must start nothing */
    CHECK_OK(axc_runtime_start_due_sums(rt));
    CHECK_MSG(g_reentry_started == 0, "a re-entrant start started sums (%d)", g_reentry_started);
    CHECK_MSG(g_counts.begins == before + 2 && g_counts.begins == g_counts.ends,
              "each sum's start lets go of the caller's lock once: %d -> %d begins, %d ends",
              before, g_counts.begins, g_counts.ends);
    CHECK_OK(axc_sched_finish(axc_runtime_sched(rt)));
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 16; i++)
            CHECK_MSG(data[k][i] == 3.0f * (float)(i + 1 + 100 * k), "bucket %d element %d: %g",
                      k, i, (double)data[k][i]);
    CHECK_OK(axc_runtime_start_due_sums(rt)); /* nothing due: nothing started */
    CHECK(g_counts.begins == before + 2);
    axc_buckets_reset(axc_runtime_buckets(rt));
    CHECK_OK(axc_runtime_close(rt));
    /* the two sums' collectives were recorded into this runtime's timeline, none into the
     * other's; the spans outlive the communicator */
    int comm_spans = 0, before_init = 0;
    for (size_t i = 0; i < axc_timeline_count(tl); i++) {
        axc_span s;
        CHECK_OK(axc_timeline_get(tl, i, &s));
        comm_spans += s.kind == AXC_SPAN_COMM && s.group == AXC_GROUP_DATA &&
                      strcmp(s.name, "all_reduce") == 0 && s.bytes > 0;
        before_init += s.kind == AXC_SPAN_COMPUTE && strcmp(s.name, "before_init") == 0;
    }
    CHECK_MSG(comm_spans == 2 && before_init == 1, "%d comm spans, %d before init (of %zu)",
              comm_spans, before_init, axc_timeline_count(tl));
    CHECK_MSG(axc_timeline_count(tl_other) == 0, "the other runtime's timeline has %zu spans",
              axc_timeline_count(tl_other));
    axc_runtime_destroy(other);
    axc_runtime_destroy(rt);
    CHECK_MSG(g_counts.allocs == g_counts.releases, "%d buffers made, %d released",
              g_counts.allocs, g_counts.releases);
    rank_end(rank);
}

/* Takes `elems` float32 of a data-group bucket: its id (-1 when the take failed), and the
 * values' address at *values. */
static int take_data_bucket(axc_runtime *rt, size_t elems, float **values)
{
    axc_bucket_key key = {.dtype = AXC_DT_F32, .device = -1, .ngroups = 1};
    key.groups[0] = AXC_GROUP_DATA;
    int id = -1;
    size_t off = 0;
    void *owner = NULL;
    CHECK_OK(axc_buckets_take(axc_runtime_buckets(rt), &key, elems, 0, NULL, 0, &id, &off,
                              &owner));
    *values = owner ? (float *)owner + off : NULL;
    return id;
}

/* set by a test: the residual allocator fails (this rank cannot start its compressed sums) */
static int g_residual_fails;

static axc_status fake_residual(void *ctx, void *bucket_owner, int device, size_t elems,
                                void **data, void **owner)
{
    (void)ctx;
    (void)bucket_owner;
    (void)device;
    if (g_residual_fails)
        return axc_fail(AXC_ERR_NOMEM, "fake residual allocator: out of memory");
    g_counts.allocs++;
    *data = *owner = calloc(elems, sizeof(float));
    return *data ? AXC_OK : axc_fail(AXC_ERR_NOMEM, "fake residual allocator: out of memory");
}

/* 2 data-parallel ranks, int8 sums with error feedback: rank 0 cannot make the residual of its
 * first sum, rank 1 starts it. Rank 0's start fails and aborts the job's collectives, so rank
 * 1's sum fails at once (not at the timeout) naming rank 0's error. */
static void unstarted_main(int rank, int world, const int dims[4], double timeout)
{
    rank_begin(rank);
    memset(&g_counts, 0, sizeof g_counts);
    g_residual_fails = rank == 0;
    axc_runtime_ops ops = ops_of();
    ops.buckets.alloc_residual = fake_residual;
    axc_runtime *rt = NULL;
    CHECK_OK(axc_runtime_create(&rt, &ops));
    axc_comm_config cfg;
    CHECK_OK(fork_ranks_config(&cfg, rank, world, dims, "unstarted", timeout));
    CHECK_OK(axc_runtime_open(rt, &cfg));
    axc_bucket_codec int8 = {.codec = AXC_CODEC_INT8, .error_feedback = 1};
    CHECK_OK(axc_buckets_set_codec(axc_runtime_buckets(rt), AXC_GROUP_DATA, &int8));
    float *values;
    int id = take_data_bucket(rt, 16, &values);
    for (int i = 0; values && i < 16; i++)
        values[i] = (float)i;
    CHECK_OK(axc_buckets_written(axc_runtime_buckets(rt), id));
    int64_t t0 = axc_now_ns();
    axc_status st = axc_runtime_start_due_sums(rt);
    if (rank == 1) {
        CHECK_OK(st);
        st = axc_sched_finish(axc_runtime_sched(rt));
    }
    double waited = (double)(axc_now_ns() - t0) * 1e-9;
    const char *msg = axc_last_error();
    CHECK_MSG(st == (rank == 0 ? AXC_ERR_NOMEM : AXC_ERR_PEER), "status %d: %s", (int)st, msg);
    CHECK_MSG(strstr(msg, "rank 0 could not start a gradient sum over the data group: fake "
                          "residual allocator: out of memory") != NULL, "%s", msg);
    CHECK_MSG(waited < timeout / 2, "waited %.1f s of the %.0f s timeout", waited, timeout);
    axc_buckets_reset(axc_runtime_buckets(rt));
    if (rank == 0) { /* a later sum: the aborted job's error, not a second abort around it */
        g_residual_fails = 0;
        id = take_data_bucket(rt, 16, &values);
        CHECK_OK(axc_buckets_written(axc_runtime_buckets(rt), id));
        st = axc_runtime_start_due_sums(rt);
        if (st == AXC_OK) /* (started: it fails in its wait) */
            st = axc_sched_finish(axc_runtime_sched(rt));
        msg = axc_last_error();
        const char *once = strstr(msg, "could not start a gradient sum");
        CHECK_MSG(st == AXC_ERR_PEER && once && !strstr(once + 1, "could not start"),
                  "a later sum: %d: %s", (int)st, msg);
        axc_buckets_reset(axc_runtime_buckets(rt));
    }
    (void)axc_runtime_close(rt);
    axc_runtime_destroy(rt);
    rank_end(rank);
}

static void one_rank(void)
{
    memset(&g_counts, 0, sizeof g_counts);
    axc_runtime_ops ops = ops_of();
    axc_runtime *rt = NULL;
    CHECK(axc_runtime_create(NULL, &ops) == AXC_ERR_INVALID);
    CHECK_OK(axc_runtime_create(&rt, &ops));
    if (!rt)
        return;
    /* closed: no communicator or scheduler; the buckets and keep-alives exist */
    CHECK(!axc_runtime_is_open(rt) && !axc_runtime_comm(rt) && !axc_runtime_sched(rt));
    CHECK(axc_runtime_buckets(rt) && axc_runtime_keeps(rt));
    /* arrivals: counted once per backward pass (pass 0 is one: nothing counted yet), each time
     * where the pass is unknown */
    unsigned long long a0 = axc_runtime_grad_arrivals(rt);
    CHECK(!axc_runtime_grad_pass_counted(rt, 0) && !axc_runtime_grad_pass_counted(rt, -1));
    axc_runtime_grad_arrived(rt, 0);
    CHECK(axc_runtime_grad_pass_counted(rt, 0) && !axc_runtime_grad_pass_counted(rt, 1));
    axc_runtime_grad_arrived(rt, -1);
    axc_runtime_grad_arrived(rt, -1);
    CHECK(axc_runtime_grad_arrivals(rt) == a0 + 3 && !axc_runtime_grad_pass_counted(rt, -1));
    CHECK_OK(axc_runtime_close(rt)); /* closing what is closed is fine */
    /* closed: no gradient needs work unless something is pending or marked */
    axc_groups world = {.n = 1, .g = {AXC_GROUP_WORLD}};
    axc_runtime_set_overlap_data(rt, 1);
    CHECK(axc_runtime_grads_idle(rt) && !axc_runtime_grad_needs_work(rt, 0, 1, &world));
    /* a sum that comes due with nothing open fails, naming init */
    float *values;
    int id = take_data_bucket(rt, 4, &values);
    CHECK_OK(axc_buckets_written(axc_runtime_buckets(rt), id));
    axc_buckets_close_all(axc_runtime_buckets(rt));
    CHECK(axc_runtime_start_due_sums(rt) == AXC_ERR_STATE &&
          strstr(axc_last_error(), "axonn_c.init"));
    axc_buckets_reset(axc_runtime_buckets(rt));
    /* open twice in turn; a second open while open is refused */
    static const int one[4] = {1, 1, 1, 1};
    for (int round = 0; round < 2; round++) {
        axc_comm_config cfg;
        atomic_store(&g_kv->ready, 0);
        CHECK_OK(fork_ranks_config(&cfg, 0, 1, one, round ? "runtime1b" : "runtime1a", 10.0));
        cfg.channels = round == 0 ? 2 : 1;
        if (round == 0) { /* while it waits: a second open and a close are refused */
            g_reopen = rt;
            g_reopen_cfg = &cfg;
        }
        CHECK_OK(axc_runtime_open(rt, &cfg));
        CHECK(axc_runtime_is_open(rt));
        if (round == 0) {
            CHECK_MSG(g_reopen_st == AXC_ERR_STATE && strstr(g_reopen_msg, "already running"),
                      "open during an open: %d %s", g_reopen_st, g_reopen_msg);
            CHECK_MSG(g_reclose_st == AXC_ERR_STATE && strstr(g_reclose_msg, "init() is running"),
                      "close during an open: %d %s", g_reclose_st, g_reclose_msg);
        }
        CHECK(axc_runtime_open(rt, &cfg) == AXC_ERR_STATE &&
              strstr(axc_last_error(), "already initialised"));
        if (round == 0) { /* this thread on channel 1, which the next communicator lacks */
            CHECK_OK(axc_comm_set_thread_channel(axc_runtime_comm(rt), 1));
        } else { /* a sum refused as a usage error (every rank alike) aborts nothing */
            id = take_data_bucket(rt, 4, &values);
            CHECK_OK(axc_buckets_written(axc_runtime_buckets(rt), id));
            axc_buckets_close_all(axc_runtime_buckets(rt));
            axc_status us = axc_runtime_start_due_sums(rt);
            CHECK_MSG(us == AXC_ERR_STATE && strstr(axc_last_error(), "uses channel 1") &&
                      !strstr(axc_last_error(), "could not start"),
                      "a sum on a channel too many: %d: %s", (int)us, axc_last_error());
            axc_buckets_reset(axc_runtime_buckets(rt));
            CHECK_OK(axc_comm_set_thread_channel(axc_runtime_comm(rt), 0));
        }
        CHECK_OK(axc_runtime_close(rt));
        CHECK(!axc_runtime_is_open(rt) && !axc_runtime_sched(rt));
    }
    /* the layers' last shards: a layer's next shard releases its previous one, forget
     * releases it (once), a bad id releases what it was given, close releases the rest */
    static int sa, sb, sc, sd;
    int before = g_counts.kept_released;
    CHECK_OK(axc_runtime_keep_shard(rt, 3, &sa));
    CHECK(g_counts.kept_released == before);
    CHECK_OK(axc_runtime_keep_shard(rt, 3, &sb));
    CHECK(g_counts.kept_released == before + 1);
    CHECK_OK(axc_runtime_keep_shard(rt, 40, &sc)); /* (past the first table) */
    axc_runtime_forget_shard(rt, 3);
    axc_runtime_forget_shard(rt, 3);
    axc_runtime_forget_shard(rt, 1000);
    CHECK(g_counts.kept_released == before + 2);
    CHECK(axc_runtime_keep_shard(rt, -1, &sd) == AXC_ERR_INVALID);
    CHECK(g_counts.kept_released == before + 3);
    CHECK_OK(axc_runtime_close(rt));
    CHECK(g_counts.kept_released == before + 4);
    g_counts.kept_released = before;
    /* what is kept, and what the gradient records and marks hold, is released when the
     * runtime goes */
    static int obj, param, dw, stamp;
    CHECK_OK(axc_keeps_add(axc_runtime_keeps(rt), AXC_KEEP_TASK, 1, &obj));
    axc_grad_records *recs = axc_runtime_records(rt);
    CHECK(recs != NULL);
    CHECK_OK(axc_records_add(recs, &(axc_grad_record){.key = 1, .param = &param, .dw = &dw}));
    axc_groups data = {.n = 1, .g = {AXC_GROUP_DATA}};
    CHECK_OK(axc_records_mark(recs, 1, &stamp, &data));
    CHECK(axc_runtime_grad_needs_work(rt, 0, 0, NULL)); /* a record */
    axc_runtime_destroy(rt);
    CHECK(g_counts.kept_released == 4);
    CHECK_MSG(g_counts.begins == g_counts.ends, "%d begins, %d ends", g_counts.begins,
              g_counts.ends);
    axc_runtime_destroy(NULL);
}

int main(void)
{
    if (!rank_tally_init())
        return 1;
    one_rank();
    static const int data2[4] = {2, 1, 1, 1};
    spawn_and_tally("G_data=2", 2, data2_main, data2);
    spawn_and_tally("G_data=2, a sum rank 0 cannot start", 2, unstarted_main, data2);
    return ctest_summary("test_runtime");
}
