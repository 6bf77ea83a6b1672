/* The nccl backend's failure path on the CPU mocks: a collective that never finishes makes the
 * watchdog abort within the timeout; the unwaited work fails with AXC_ERR_TIMEOUT naming the op and
 * group, and every later start fails with the same error. Before that, CUDA-graph capture: a
 * collective on a capturing stream is refused with a clear error, and event queries refused
 * because another thread captures do not fail the job. Run by run_mock_test.sh. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "axc/comm.h"
#include "axc/cuda_rt.h"
#include "axc/grid.h"
#include "../ctest.h"

/* The stream waits logged by the mock from number `from` on: `by_caller` waits by the caller's
 * stream `caller`, `follows` waits of a comm stream on an event recorded on a comm stream (not
 * a fork from the caller's stream). */
static void count_waits(void *(*log)[2], int from, int to, const void *caller, int *by_caller,
                        int *follows)
{
    *by_caller = *follows = 0;
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
 * it). Returns the number of collectives issued. */
static int check_follow_after(axc_comm *comm, axc_coll c)
{
    int *calls = dlsym(RTLD_DEFAULT, "g_calls");
    int *waits = dlsym(RTLD_DEFAULT, "mock_waits");
    void *(*log)[2] = dlsym(RTLD_DEFAULT, "mock_wait_log");
    CHECK(calls && waits && log);
    if (!calls || !waits || !log)
        return 0;
    static char caller_stream; /* a fake stream: the mock never dereferences one */
    c.stream = &caller_stream;
    int calls0 = *calls, by_caller, follows;
    axc_work *rs = NULL, *ar = NULL, *same = NULL, *later = NULL;
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &rs));
    int mark = *waits;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DATA, &c, &rs, 1, &ar));
    CHECK(*waits <= 64);
    count_waits(log, mark, *waits, &caller_stream, &by_caller, &follows);
    printf("data sum after a depth work: %d wait(s) of the caller's stream, %d comm stream "
           "wait(s) on another group's event, depth work waited: %d\n", by_caller, follows,
           rs ? rs->waited : -1);
    CHECK(by_caller == 0 && follows == 1 && rs && !rs->waited);
    /* the same group's stream is in order already: no wait */
    mark = *waits;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DEPTH, &c, &rs, 1, &same));
    count_waits(log, mark, *waits, &caller_stream, &by_caller, &follows);
    CHECK(by_caller == 0 && follows == 0 && !rs->waited);
    /* a work already waited for ordered the caller's stream, and so the fork */
    CHECK_OK(axc_work_wait(rs));
    mark = *waits;
    CHECK_OK(axc_comm_start_after(comm, AXC_GROUP_DATA, &c, &rs, 1, &later));
    count_waits(log, mark, *waits, &caller_stream, &by_caller, &follows);
    CHECK(by_caller == 0 && follows == 0);
    axc_work *works[] = {ar, same, later, rs};
    for (int i = 0; i < 4; i++) {
        CHECK_OK(axc_work_wait(works[i]));
        axc_work_free(works[i]);
    }
    return *calls - calls0;
}

static int g_abort_failures; /* the backend's "ncclCommAbort call(s) failed" warnings */
static void on_log(int level, const char *msg)
{
    (void)level;
    if (strstr(msg, "ncclCommAbort call(s) failed"))
        g_abort_failures++;
}

int main(void)
{
    axc_set_log_hook(on_log);
    /* bind to the mocks, as a torch process would to the real libraries */
    const char *libs[] = {getenv("AXC_TEST_CUDART"), getenv("AXC_TEST_NCCL_LIB")};
    for (int i = 0; i < 2; i++)
        CHECK(libs[i] && dlopen(libs[i], RTLD_NOW | RTLD_GLOBAL));
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
    float buf[16] = {0};
    axc_coll c;
    memset(&c, 0, sizeof c);
    c.kind = AXC_COLL_ALL_REDUCE;
    c.send = buf;
    c.recv = buf;
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
    comm = NULL;
    CHECK_OK(axc_comm_create(&comm, &cfg));
    if (!comm)
        return ctest_summary("test_nccl_mock");
    /* before the MOCK_HANG_AT count starts: the hang moves back by the collectives issued here */
    int *hang_at = dlsym(RTLD_DEFAULT, "g_hang_at");
    CHECK(hang_at != NULL);
    if (!hang_at)
        return ctest_summary("test_nccl_mock");
    *hang_at = 0; /* no hang */
    int issued = check_follow_after(comm, c);
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
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_DEPTH, &c, &w1));
    CHECK_OK(axc_work_wait(w1));
    axc_work_free(w1);
    CHECK_OK(axc_comm_start(comm, AXC_GROUP_ROW, &c, &w2));
    CHECK(axc_work_done(w2) == 0);
    struct timespec ts = {1, 200000000};
    nanosleep(&ts, NULL); /* > timeout: the watchdog aborts */
    CHECK(axc_work_done(w2) == 1);
    axc_status st = axc_work_wait(w2);
    printf("wait after the hang: %s: %s\n", axc_status_name(st), axc_last_error());
    CHECK(st == AXC_ERR_TIMEOUT);
    CHECK(strstr(axc_last_error(), "all_reduce") && strstr(axc_last_error(), "row"));
    axc_work_free(w2);
    axc_work *w3 = NULL;
    st = axc_comm_start(comm, AXC_GROUP_COL, &c, &w3);
    printf("start after the abort: %s: %s\n", axc_status_name(st), axc_last_error());
    CHECK(st == AXC_ERR_TIMEOUT);
    CHECK(w3 == NULL);
    c.kind = AXC_COLL_BARRIER;
    CHECK(axc_comm_start(comm, AXC_GROUP_WORLD, &c, &w3) == AXC_ERR_TIMEOUT);
    axc_comm_destroy(comm);
    /* the watchdog aborted every communicator at once (the mock's aborts wait for each other) */
    CHECK(g_abort_failures == 0);
    return ctest_summary("test_nccl_mock");
}
