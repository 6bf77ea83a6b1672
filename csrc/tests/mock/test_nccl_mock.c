/* The nccl backend's failure path on the CPU mocks: a collective that never finishes makes the
 * watchdog abort within the timeout; the unwaited work fails with AXC_ERR_TIMEOUT naming the op,
 * group and the collective's number on that group, a start overtaken by the abort (enqueued
 * before it, booked after) fails the same way instead of passing for finished, and every later
 * start fails with the same error; then axc_comm_abort fails a new communicator's starts with
 * its message. Before that, CUDA-graph capture: a
 * collective on a capturing stream is refused with a clear error, and event queries refused
 * because another thread captures do not fail the job. The buffers are the mock's device memory,
 * so its stream-order checker sees every collective's accesses: the fork from the caller's
 * stream, the join into it, and a collective started after another group's (follow_after) must
 * leave no violation, also after a work already waited on another stream. Run by
 * run_mock_test.sh. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "axc/comm.h"
#include "axc/cuda_rt.h"
#include "axc/grid.h"
#include "../ctest.h"
#include "mock_order_check.h"

static order_checker g_oc;

/* The stream waits logged by the mock from number `from` on: `by_caller` waits by the caller's
 * stream `caller`, `follows` waits of a comm stream on an event recorded on a comm stream (not
 * a fork from the caller's stream). */
static void count_waits(void *(*log)[2], int from, int to, const void *caller, int *by_caller,
                        int *follows)
{
    *by_caller = *follows = 0;
    CHECK(to <= 64); /* (the mock logs the first 64 waits: past them nothing would be counted) */
    for (int i = from; i < to && i < 64; i++) {
        if (log[i][0] == caller)
            (*by_caller)++;
        else if (log[i][1] != caller)
            (*follows)++;
    }
}

/* axc_comm_start_after over NCCL: the later group's comm stream waits on the earlier works'
 * `done` events; the caller's stream and the host wait for nothing (a caller's stream joined to
 * a depth reduce-scatter before a data-parallel bucket's sum would stall the GEMMs queued after
 * it). With device buffers `bucket`, `sum` and `other` (of c.count elements): GEMMs on the
 * caller's stream write the bucket, the depth collective rs sums it in place, the data sum ar
 * reads it after rs (into `sum`), a later depth collective too (into `other`); the caller's
 * stream reads the results after the joins. Returns the number of collectives issued. */
static int check_follow_after(axc_comm *comm, axc_coll c, void *bucket, void *sum, void *other)
{
    int *calls = dlsym(RTLD_DEFAULT, "g_calls");
    int *waits = dlsym(RTLD_DEFAULT, "mock_waits");
    void *(*log)[2] = dlsym(RTLD_DEFAULT, "mock_wait_log");
    int *query_err = dlsym(RTLD_DEFAULT, "g_query_err");
    CHECK(calls && waits && log && query_err);
    if (!calls || !waits || !log || !query_err)
        return 0;
    /* the GPU is busy: no event query (the watchdog's, reap()'s) sees a collective finish, so
     * only the stream waits order them and the checker sees every missing one */
    *query_err = 600; /* cudaErrorNotReady */
    static char caller_stream; /* a fake stream: the mock never dereferences one */
    c.stream = &caller_stream;
    g_oc.name_stream(&caller_stream, "the caller's stream");
    int calls0 = *calls, by_caller, follows;
    axc_work *rs = NULL, *ar = NULL, *same = NULL, *later = NULL;
    g_oc.access(bucket, &caller_stream, 1); /* the GEMMs that wrote the gradients */
    c.send = c.recv = bucket;
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &rs));
    int mark = *waits;
    c.recv = sum;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DATA, &c, &rs, 1, &ar));
    CHECK(*waits <= 64);
    count_waits(log, mark, *waits, &caller_stream, &by_caller, &follows);
    printf("data sum after a depth work: %d wait(s) of the caller's stream, %d comm stream "
           "wait(s) on another group's event, depth work waited: %d\n", by_caller, follows,
           rs ? rs->waited : -1);
    CHECK(by_caller == 0 && follows == 1 && rs && !rs->waited);
    /* two pending works of one group: its stream finishes them in order, one wait covers both */
    axc_work *rs2 = NULL, *ar2 = NULL;
    c.send = c.recv = other;
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &rs2));
    axc_work *both[] = {rs, rs2};
    mark = *waits;
    c.send = bucket;
    c.recv = sum;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DATA, &c, both, 2, &ar2));
    count_waits(log, mark, *waits, &caller_stream, &by_caller, &follows);
    CHECK(by_caller == 0 && follows == 1);
    /* the same group's stream is in order already: no wait */
    mark = *waits;
    c.recv = other;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DEPTH, &c, &rs, 1, &same));
    count_waits(log, mark, *waits, &caller_stream, &by_caller, &follows);
    CHECK(by_caller == 0 && follows == 0 && !rs->waited);
    /* a work already waited for ordered the caller's stream, and so the fork */
    CHECK_OK(axc_work_wait(rs));
    mark = *waits;
    c.recv = sum;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DATA, &c, &rs, 1, &later));
    count_waits(log, mark, *waits, &caller_stream, &by_caller, &follows);
    CHECK(by_caller == 0 && follows == 0);
    axc_work *works[] = {ar, ar2, same, later, rs, rs2};
    for (int i = 0; i < 6; i++) {
        CHECK_OK(axc_work_wait(works[i]));
        axc_work_free(works[i]);
    }
    g_oc.access(sum, &caller_stream, 0); /* what reads the results, after the joins */
    g_oc.access(other, &caller_stream, 0);
    *query_err = 0;
    return *calls - calls0;
}

/* An `after` work already waited was joined into the stream it was started on; a collective
 * issued after it on another stream must still be ordered after it (follow_after marks the
 * join on the first stream and makes the comm stream wait there). Before that fix nothing
 * ordered the new collective's comm stream after the earlier work on a GPU still busy with it
 * (no in-tree caller does this: the scheduler's `after` works are never waited before).
 * Returns the number of collectives issued. */
static int check_waited_on_another_stream(axc_comm *comm, axc_coll c)
{
    int *query_err = dlsym(RTLD_DEFAULT, "g_query_err");
    const axc_cuda_api *cu = NULL;
    void *bucket = NULL, *sum = NULL; /* buffers of its own: nothing else orders them */
    if (!query_err || axc_cuda_load(&cu) != AXC_OK || cu->Malloc(&bucket, 16 * sizeof(float)) ||
        cu->Malloc(&sum, 16 * sizeof(float)))
        return 0;
    static char stream_a, stream_b;
    g_oc.name_stream(&stream_a, "stream A");
    g_oc.name_stream(&stream_b, "stream B");
    CHECK(order_violations(&g_oc, "test_nccl_mock (before the probe)") == 0);
    *query_err = 600; /* the GPU is busy: no query sees the depth collective finish */
    int *calls = dlsym(RTLD_DEFAULT, "g_calls");
    int calls0 = calls ? *calls : 0;
    axc_work *rs = NULL, *ar = NULL;
    c.send = c.recv = bucket;
    c.stream = &stream_a;
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &rs));
    CHECK_OK(axc_work_wait(rs)); /* stream A waits for it */
    c.recv = sum;
    c.stream = &stream_b;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DATA, &c, &rs, 1, &ar));
    CHECK_OK(axc_work_wait(ar));
    *query_err = 0;
    axc_work_free(ar);
    axc_work_free(rs);
    cu->Free(bucket);
    cu->Free(sum);
    CHECK(order_violations(&g_oc, "test_nccl_mock (a data sum on stream B after a depth "
                                  "collective waited on stream A)") == 0);
    g_oc.reset();
    return calls ? *calls - calls0 : 2;
}

static int g_abort_failures; /* the backend's "ncclCommAbort call(s) failed" warnings */
static void on_log(int level, const char *msg)
{
    (void)level;
    if (strstr(msg, "ncclCommAbort call(s) failed"))
        g_abort_failures++;
}

/* A compressed collective over NCCL on a group of one rank: an exact stream-ordered copy (no
 * codec kernel, nothing on the wire: the multi-rank path needs a GPU); refused calls first. */
static void check_compressed_one_rank(axc_comm *comm, axc_coll c, float *src, float *dst)
{
    for (int i = 0; i < 16; i++)
        src[i] = (float)i * 0.37f - 2.0f;
    c.send = src;
    c.recv = dst;
    c.codec = AXC_CODEC_INT4;
    axc_work *w = NULL;
    c.op = AXC_RED_MAX;
    CHECK(axc_comm_start(comm, AXC_GROUP_DATA, &c, &w) == AXC_ERR_INVALID && !w);
    c.op = AXC_RED_SUM;
    axc_comm_reset_counters(comm);
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_DATA, &c, &w));
    if (w) {
        CHECK_OK(axc_work_wait(w));
        axc_work_free(w);
    }
    CHECK(memcmp(src, dst, 16 * sizeof(float)) == 0);
    axc_counters ctr;
    axc_comm_counters(comm, AXC_GROUP_DATA, &ctr);
    CHECK(ctr.compressed_calls == 1 && ctr.bytes_sent == 0 && ctr.logical_bytes_sent == 0);
}

int main(void)
{
    axc_set_log_hook(on_log);
    /* bind to the mocks, as a torch process would to the real libraries */
    const char *libs[] = {getenv("AXC_TEST_CUDART"), getenv("AXC_TEST_NCCL_LIB")};
    for (int i = 0; i < 2; i++)
        CHECK(libs[i] && dlopen(libs[i], RTLD_NOW | RTLD_GLOBAL));
    /* device buffers from the mock: [0] the main flow's, [1..3] check_follow_after's */
    const axc_cuda_api *cu = NULL;
    CHECK_OK(axc_cuda_load(&cu));
    int have_oc = order_checker_find(&g_oc);
    CHECK(have_oc);
    if (!cu || !have_oc)
        return ctest_summary("test_nccl_mock");
    float *dbuf[4] = {NULL};
    for (int i = 0; i < 4; i++)
        CHECK(cu->Malloc((void **)&dbuf[i], 16 * sizeof(float)) == 0 && dbuf[i]);
    axc_grid grid;
    CHECK_OK(axc_grid_make(&grid, 1, 1, 1, 1, 1, 1));
    axc_comm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.grid = grid;
    cfg.local_world_size = 1;
    cfg.cuda_device = 0;
    cfg.backend = "nccl";
    cfg.job_id = "mockjob";
    cfg.timeout_s = 0.5;
    axc_coll c;
    memset(&c, 0, sizeof c);
    c.kind = AXC_COLL_ALL_REDUCE;
    c.send = dbuf[0];
    c.recv = dbuf[0];
    c.count = 16;
    c.dtype = AXC_DT_F32;
    c.device = 0;
    /* channels for concurrent micro-batches (host tensors only) open no NCCL communicators, and
     * a CUDA collective from such a channel is refused by name */
    int *live = dlsym(RTLD_DEFAULT, "g_live");
    CHECK(live != NULL);
    if (!live)
        return ctest_summary("test_nccl_mock");
    axc_comm *comm = NULL;
    CHECK_OK(axc_comm_create(&comm, &cfg));
    int live_one = *live;
    axc_comm_destroy(comm);
    cfg.channels = 4;
    comm = NULL;
    CHECK_OK(axc_comm_create(&comm, &cfg));
    printf("NCCL communicators: %d with one channel, %d with four\n", live_one, *live);
    CHECK(live_one > 0 && *live == live_one);
    axc_work *wc = NULL;
    CHECK_OK(axc_comm_set_thread_channel(comm, 2));
    axc_status chs = axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &wc);
    printf("CUDA collective on channel 2: %s: %s\n", axc_status_name(chs), axc_last_error());
    CHECK(chs == AXC_ERR_INVALID && wc == NULL && strstr(axc_last_error(), "channel 2"));
    CHECK_OK(axc_comm_set_thread_channel(comm, 0));
    axc_comm_destroy(comm);
    cfg.channels = 1;
    /* before the MOCK_HANG_AT count starts: the hang moves back by the collectives issued here.
     * On a communicator with a long timeout: these checks keep event queries "not ready", and a
     * loaded machine must not make the watchdog abort them */
    int *hang_at = dlsym(RTLD_DEFAULT, "g_hang_at");
    CHECK(hang_at != NULL);
    if (!hang_at)
        return ctest_summary("test_nccl_mock");
    *hang_at = 0; /* no hang */
    cfg.timeout_s = 120;
    comm = NULL;
    CHECK_OK(axc_comm_create(&comm, &cfg));
    if (!comm)
        return ctest_summary("test_nccl_mock");
    int issued = check_follow_after(comm, c, dbuf[1], dbuf[2], dbuf[3]);
    issued += check_waited_on_another_stream(comm, c);
    check_compressed_one_rank(comm, c, dbuf[1], dbuf[2]);
    axc_comm_destroy(comm);
    cfg.timeout_s = 0.5;
    comm = NULL;
    CHECK_OK(axc_comm_create(&comm, &cfg));
    if (!comm)
        return ctest_summary("test_nccl_mock");
    const char *hang_env = getenv("MOCK_HANG_AT");
    int hang = hang_env ? atoi(hang_env) : 0;
    *hang_at = hang > 0 ? hang + issued : 0;
    int *capturing = dlsym(RTLD_DEFAULT, "g_capturing");
    int *query_err = dlsym(RTLD_DEFAULT, "g_query_err");
    int *exchanges = dlsym(RTLD_DEFAULT, "g_mode_exchanges");
    CHECK(capturing && query_err && exchanges);
    if (!capturing || !query_err || !exchanges)
        return ctest_summary("test_nccl_mock");
    axc_work *w0 = NULL;
    *capturing = 1; /* cudaStreamCaptureStatusActive */
    axc_status cst = axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &w0);
    printf("start while capturing: %s: %s\n", axc_status_name(cst), axc_last_error());
    CHECK(cst == AXC_ERR_INVALID && w0 == NULL);
    CHECK(strstr(axc_last_error(), "CUDA graph") && strstr(axc_last_error(), "all_reduce"));
    *capturing = 0;
    /* another thread captures (global mode): the watchdog's queries are refused for a while */
    *query_err = 906; /* cudaErrorStreamCaptureImplicit */
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &w0)); /* (collective 1) */
    struct timespec poll = {0, 150000000}; /* two watchdog rounds, well under the 0.5 s timeout */
    nanosleep(&poll, NULL);
    *query_err = 0;
    CHECK_OK(axc_work_wait(w0));
    axc_work_free(w0);
    CHECK(*exchanges >= 1); /* the watchdog put itself in the relaxed capture mode */
    axc_work *w1 = NULL, *w2 = NULL; /* MOCK_HANG_AT=3: the third collective hangs */
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_ROW, &c, &w1));
    CHECK_OK(axc_work_wait(w1));
    axc_work_free(w1);
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_ROW, &c, &w2)); /* the row group's second */
    CHECK(axc_work_done(w2) == 0);
    /* a collective whose start is overtaken by the abort: enqueued before it (its kernel is
     * aborted), booked after fail_all went through the in-flight list. Its `done` record (the
     * start's second cudaEventRecord) blocks until the watchdog has aborted w2's hang; the work
     * must come out failed, not finished */
    int *record_block_at = dlsym(RTLD_DEFAULT, "g_record_block_at");
    int *aborts = dlsym(RTLD_DEFAULT, "g_aborts");
    CHECK(record_block_at && aborts);
    if (record_block_at && aborts) {
        axc_work *wr = NULL;
        axc_coll cr = c;
        cr.send = cr.recv = dbuf[1]; /* not w2's buffer, which is still in flight */
        *record_block_at = 2;
        axc_status rs = axc_comm_start(comm, AXC_GROUP_COL, &cr, &wr);
        CHECK(*aborts > 0); /* the abort did come in between */
        if (*record_block_at != 0) { /* this thread stalled past the timeout before the start */
            printf("note: the abort came before the start: the race was not exercised\n");
            *record_block_at = 0;
        }
        if (rs == AXC_OK) {
            rs = axc_work_wait(wr);
            axc_work_free(wr);
        }
        printf("a start overtaken by the abort: %s: %s\n", axc_status_name(rs),
               rs != AXC_OK ? axc_last_error() : "");
        CHECK(rs == AXC_ERR_TIMEOUT);
        CHECK(strstr(axc_last_error(), "its collective #2") != NULL); /* w2's timeout */
    }
    struct timespec ts = {1, 200000000};
    nanosleep(&ts, NULL); /* > timeout: the watchdog aborts */
    CHECK(axc_work_done(w2) == 1);
    axc_status st = axc_work_wait(w2);
    printf("wait after the hang: %s: %s\n", axc_status_name(st), axc_last_error());
    CHECK(st == AXC_ERR_TIMEOUT);
    CHECK(strstr(axc_last_error(), "all_reduce (sum)") && strstr(axc_last_error(), "row"));
    /* numbered per group (the depth group's collective before does not count) */
    CHECK(strstr(axc_last_error(), "on the row group (its collective #2)") != NULL);
    axc_work_free(w2);
    axc_work *w3 = NULL;
    st = axc_comm_start(comm, AXC_GROUP_COL, &c, &w3);
    printf("start after the abort: %s: %s\n", axc_status_name(st), axc_last_error());
    CHECK(st == AXC_ERR_TIMEOUT);
    CHECK(w3 == NULL);
    c.kind = AXC_COLL_BARRIER;
    CHECK(axc_comm_start(comm, AXC_GROUP_WORLD, &c, &w3) == AXC_ERR_TIMEOUT);
    axc_comm_destroy(comm);
    /* axc_comm_abort: this rank's communicators aborted, every later start fails with its
     * message, and the communicator still closes */
    comm = NULL;
    CHECK_OK(axc_comm_create(&comm, &cfg));
    /* (the cause's kind, out of memory, goes to the caller; later starts fail with a
     * communication error, as on shm, not a MemoryError) */
    CHECK(axc_comm_abort(comm, AXC_ERR_NOMEM, "rank 0 stops here") == AXC_ERR_NOMEM);
    axc_work *wa = NULL;
    axc_status as = axc_comm_start(comm, AXC_GROUP_WORLD, &c, &wa);
    printf("start after axc_comm_abort: %s: %s\n", axc_status_name(as), axc_last_error());
    CHECK(as == AXC_ERR_PEER && wa == NULL && strstr(axc_last_error(), "rank 0 stops here"));
    /* a second abort changes nothing: the first message stays */
    CHECK(axc_comm_abort(comm, AXC_ERR_PEER, "again") == AXC_ERR_PEER);
    as = axc_comm_start(comm, AXC_GROUP_WORLD, &c, &wa);
    CHECK(as == AXC_ERR_PEER && strstr(axc_last_error(), "rank 0 stops here") &&
          !strstr(axc_last_error(), "again"));
    axc_comm_destroy(comm);
    /* the watchdog aborted every communicator at once (the mock's aborts wait for each other) */
    CHECK(g_abort_failures == 0);
    for (int i = 0; i < 4; i++)
        cu->Free(dbuf[i]);
    CHECK(order_violations(&g_oc, "test_nccl_mock") == 0);
    return ctest_summary("test_nccl_mock");
}
