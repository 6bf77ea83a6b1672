/* CPU stand-ins for libcudart.so.13 and libnccl.so.2 (one rank), so the nccl backend's control
 * flow (non-blocking polling, fork/join events, pooling, watchdog timeout, abort) runs on a machine
 * without a GPU. Device memory is host memory; every "kernel" runs at once on the host.
 * MOCK_HANG_AT=k: the k-th collective "hangs": events recorded after it stay pending until a
 * communicator is aborted. MOCK_ABORTS_TOGETHER=1: an abort returns only once every live
 * communicator's abort has begun, as a real abort waits for kernels that may wait on another
 * communicator's; made one after the other, the first fails after 2 s (ncclSystemError).
 * Every call that orders or touches device memory also reports to the stream-order checker
 * (mock_stream_order.c), which tells whether the work would be ordered right on a real GPU,
 * and every entry point counts its calls (MOCK_API(), mock_api_count.c).
 * Build: see csrc/tests/mock/run_mock_test.sh. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mock_api_count.h"
#include "mock_stream_order.h"

typedef struct ev { int pending; void *stream; } ev; /* stream: of its last record */
/* exported, so both mock libraries share one copy (ELF interposition, libcudart loaded first) */
int g_hung, g_calls, g_hang_at = -1, g_polls;

static int hang_at(void)
{
    if (g_hang_at == -1) {
        const char *e = getenv("MOCK_HANG_AT");
        g_hang_at = e ? atoi(e) : 0;
    }
    return g_hang_at;
}

/* ---- cudart ---- */
/* two devices, the current one per thread (a new thread starts on 0, as with the real one);
 * mock_set_device_calls counts cudaSetDevice per device */
#define MOCK_DEVICES 2
int mock_set_device_calls[MOCK_DEVICES];
static _Thread_local int current_device_;
int cudaGetDeviceCount(int *c) { MOCK_API(); *c = MOCK_DEVICES; return 0; }
int cudaGetDevice(int *d) { MOCK_API(); *d = current_device_; return 0; }
int cudaSetDevice(int d)
{
    MOCK_API();
    if (d < 0 || d >= MOCK_DEVICES)
        return 101; /* cudaErrorInvalidDevice */
    __atomic_add_fetch(&mock_set_device_calls[d], 1, __ATOMIC_RELAXED);
    current_device_ = d;
    return 0;
}
int cudaRuntimeGetVersion(int *v) { MOCK_API(); *v = 13000; return 0; }
int cudaMemcpyAsync(void *d, const void *s, size_t n, int k, void *st)
{
    MOCK_API();
    (void)k;
    mock_order_rw("cudaMemcpyAsync", st, s, n, d, n);
    memmove(d, s, n);
    return 0;
}
int cudaStreamCreateWithFlags(void **s, unsigned f)
{
    MOCK_API();
    (void)f;
    *s = malloc(1);
    mock_order_stream_created(*s);
    return 0;
}
int cudaStreamCreateWithPriority(void **s, unsigned f, int p)
{
    MOCK_API();
    (void)p;
    return cudaStreamCreateWithFlags(s, f);
}
int cudaDeviceGetStreamPriorityRange(int *l, int *g) { MOCK_API(); *l = 0; *g = -5; return 0; }
int cudaStreamDestroy(void *s) { MOCK_API(); mock_order_stream_destroyed(s); free(s); return 0; }
/* as CUDA does: not permitted on a stream being captured (cudaErrorStreamCaptureUnsupported,
 * 900), which invalidates the capture; counted so a test can assert none happened */
int mock_capture_invalidations;
extern int g_capturing;
extern void *mock_capturing_stream;
int cudaStreamGetId(void *s, unsigned long long *id)
{
    MOCK_API();
    if (g_capturing || (s && s == mock_capturing_stream)) {
        mock_capture_invalidations++;
        return 900;
    }
    *id = mock_order_stream_id(s);
    return 0;
}
/* streams a test watches (test_sched_mock: the fake compute streams) and their host waits;
 * others (the shm backend's staging streams, synchronised on its lane threads) go uncounted */
void *mock_watch[2];
int mock_watch_syncs[2];
int cudaStreamSynchronize(void *s)
{
    MOCK_API();
    for (int i = 0; i < 2; i++)
        if (s && s == mock_watch[i])
            __atomic_add_fetch(&mock_watch_syncs[i], 1, __ATOMIC_SEQ_CST);
    mock_order_host_waits_stream(s);
    return 0;
}
/* stream waits (read by test_nccl_mock): [i][0] the waiting stream, [i][1] the stream the
 * awaited event was last recorded on; mock_waits counts every wait, the first 64 are logged */
void *mock_wait_log[64][2];
int mock_waits;
int cudaStreamWaitEvent(void *s, void *e, unsigned f)
{
    MOCK_API();
    (void)f;
    int i = __atomic_fetch_add(&mock_waits, 1, __ATOMIC_SEQ_CST);
    if (i < 64) {
        mock_wait_log[i][0] = s;
        mock_wait_log[i][1] = ((ev *)e)->stream;
    }
    mock_order_stream_waits(s, e);
    return 0;
}
int cudaEventCreateWithFlags(void **e, unsigned f)
{
    MOCK_API();
    (void)f;
    *e = calloc(1, sizeof(ev));
    return 0;
}
int cudaEventDestroy(void *e) { MOCK_API(); mock_order_event_destroyed(e); free(e); return 0; }
/* set by test_nccl_mock: the g_record_block_at-th cudaEventRecord from now blocks until a
 * communicator was aborted (at most 5 s), so a collective's start runs into the watchdog's
 * abort between its enqueue and its bookkeeping (the race fail_all must not miss) */
int g_record_block_at, g_aborts;
int cudaEventRecord(void *e, void *s)
{
    MOCK_API();
    if (__atomic_load_n(&g_record_block_at, __ATOMIC_SEQ_CST) > 0 &&
        __atomic_sub_fetch(&g_record_block_at, 1, __ATOMIC_SEQ_CST) == 0) {
        struct timespec ms = {0, 1000000};
        for (int i = 0; i < 5000 && !__atomic_load_n(&g_aborts, __ATOMIC_SEQ_CST); i++)
            nanosleep(&ms, NULL);
    }
    ((ev *)e)->pending = g_hung;
    ((ev *)e)->stream = s;
    mock_order_event_record(e, s);
    return 0;
}
/* set by test_nccl_mock: every stream is being captured into a CUDA graph; every event query
 * fails with this code (another thread captures: cudaErrorStreamCaptureImplicit = 906). Set
 * by test_gemm_mock: this one stream is being captured. */
int g_capturing, g_query_err, g_mode_exchanges;
void *mock_capturing_stream;
int cudaEventQuery(void *e)
{
    MOCK_API();
    if (g_query_err)
        return g_query_err;
    if (((ev *)e)->pending && g_hung)
        return 600; /* cudaErrorNotReady */
    mock_order_host_waits_event(e); /* the host saw it fire */
    return 0;
}
int cudaStreamIsCapturing(void *s, int *status)
{
    MOCK_API();
    *status = g_capturing || (s && s == mock_capturing_stream); /* 1: ...StatusActive */
    return 0;
}
int cudaThreadExchangeStreamCaptureMode(int *mode)
{
    MOCK_API();
    g_mode_exchanges++;
    *mode = 0;
    return 0;
}
/* not called by the core today; here so that a use would be counted (and found) */
int cudaDeviceSynchronize(void)
{
    MOCK_API();
    mock_order_host_waits_all();
    return 0;
}
int cudaEventSynchronize(void *e) { MOCK_API(); mock_order_host_waits_event(e); return 0; }
int cudaMallocHost(void **p, size_t n) { MOCK_API(); *p = malloc(n ? n : 1); return 0; }
int cudaFreeHost(void *p) { MOCK_API(); free(p); return 0; }
int mock_cuda_mallocs; /* read by test_gemm_mock */
/* device memory belongs to the checker (which keeps freed blocks a while, see there) */
int cudaMalloc(void **p, size_t n)
{
    MOCK_API();
    mock_cuda_mallocs++;
    *p = mock_order_malloc(n);
    return *p ? 0 : 2;
}
int cudaFree(void *p) { MOCK_API(); mock_order_free(p); return 0; }
/* stream-ordered allocations (read by test_sched_mock): calls, those not yet freed, the stream
 * of the last of each; while mock_malloc_async_err is nonzero cudaMallocAsync fails with it
 * (2: cudaErrorMemoryAllocation) */
int mock_async_mallocs, mock_async_frees, mock_async_live, mock_malloc_async_err;
void *mock_last_malloc_stream, *mock_last_free_stream;
int cudaMallocAsync(void **p, size_t n, void *st)
{
    MOCK_API();
    if (mock_malloc_async_err)
        return mock_malloc_async_err;
    *p = mock_order_malloc_async(n, st);
    if (!*p)
        return 2;
    __atomic_add_fetch(&mock_async_mallocs, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&mock_async_live, 1, __ATOMIC_SEQ_CST);
    mock_last_malloc_stream = st;
    return 0;
}
int cudaFreeAsync(void *p, void *st)
{
    MOCK_API();
    if (p) {
        __atomic_add_fetch(&mock_async_frees, 1, __ATOMIC_SEQ_CST);
        __atomic_sub_fetch(&mock_async_live, 1, __ATOMIC_SEQ_CST);
    }
    mock_last_free_stream = st;
    mock_order_free_async(p, st);
    return 0;
}
const char *cudaGetErrorString(int e) { return e ? "mock cuda error" : "no error"; }

/* ---- nccl (one rank) ---- */
typedef struct comm { int polls_left; const void *pending_send; } comm;
typedef struct uid { char internal[128]; } uid;
static const size_t dsz[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
int ncclGetVersion(int *v) { MOCK_API(); *v = 22809; return 0; }
int ncclGetUniqueId(void *id) { MOCK_API(); memset(id, 7, 128); return 0; }
/* communicators created and not destroyed (read by test_nccl_mock); aborts entered */
int g_live;
static int g_aborts_begun;
int ncclCommInitRankConfig(void **c, int n, uid id, int r, void *cfg)
{
    MOCK_API();
    (void)id, (void)cfg;
    if (n != 1 || r != 0) return 4;
    __atomic_add_fetch(&g_live, 1, __ATOMIC_SEQ_CST);
    comm *m = calloc(1, sizeof *m);
    m->polls_left = 2; /* two polls see ncclInProgress */
    *c = m;
    return 7;
}
int ncclCommSplit(void *p, int color, int key, void **c, void *cfg)
{
    MOCK_API();
    (void)p, (void)color, (void)key, (void)cfg;
    __atomic_add_fetch(&g_live, 1, __ATOMIC_SEQ_CST);
    comm *m = calloc(1, sizeof *m);
    m->polls_left = 1;
    *c = m;
    return 7;
}
int ncclCommGetAsyncError(void *c, int *st)
{
    MOCK_API();
    comm *m = c;
    g_polls++;
    if (m->polls_left > 0) { m->polls_left--; *st = 7; } else *st = 0;
    return 0;
}
int ncclCommAbort(void *c)
{
    MOCK_API();
    int result = 0;
    const char *together = getenv("MOCK_ABORTS_TOGETHER");
    if (together && *together == '1') {
        __atomic_add_fetch(&g_aborts_begun, 1, __ATOMIC_SEQ_CST);
        struct timespec ms = {0, 1000000};
        int waited = 0;
        while (__atomic_load_n(&g_aborts_begun, __ATOMIC_SEQ_CST) <
                   __atomic_load_n(&g_live, __ATOMIC_SEQ_CST) && waited < 2000) {
            nanosleep(&ms, NULL);
            waited++;
        }
        if (waited == 2000)
            result = 2; /* ncclSystemError */
    }
    free(c);
    g_hung = 0;
    __atomic_add_fetch(&g_aborts, 1, __ATOMIC_SEQ_CST);
    return result;
}
int ncclCommFinalize(void *c) { MOCK_API(); ((comm *)c)->polls_left = 1; return 7; }
int ncclCommDestroy(void *c)
{
    MOCK_API();
    __atomic_sub_fetch(&g_live, 1, __ATOMIC_SEQ_CST);
    free(c);
    return 0;
}
const char *ncclGetErrorString(int r) { return r ? "mock nccl error" : "no error"; }
const char *ncclGetLastError(void *c) { (void)c; return ""; }
static int op_done(void *c)
{
    if (++g_calls == hang_at()) g_hung = 1;
    ((comm *)c)->polls_left = g_calls % 3 == 0; /* some enqueues report ncclInProgress */
    return ((comm *)c)->polls_left ? 7 : 0;
}
/* one rank: every collective copies send to recv, reading and writing them on stream st */
static int coll(const char *name, const void *s, void *r, size_t n, int dt, void *c, void *st)
{
    mock_order_rw(name, st, s, n * dsz[dt], r, n * dsz[dt]);
    memmove(r, s, n * dsz[dt]);
    return op_done(c);
}
int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *c, void *st)
{ MOCK_API(); (void)op; return coll("ncclAllReduce", s, r, n, dt, c, st); }
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *c, void *st)
{ MOCK_API(); return coll("ncclAllGather", s, r, n, dt, c, st); }
int ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, void *c, void *st)
{ MOCK_API(); (void)op; return coll("ncclReduceScatter", s, r, n, dt, c, st); }
int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, void *c, void *st)
{ MOCK_API(); (void)root; return coll("ncclBroadcast", s, r, n, dt, c, st); }
int ncclSend(const void *s, size_t n, int dt, int peer, void *c, void *st)
{
    MOCK_API();
    (void)peer;
    mock_order_rw("ncclSend", st, s, n * dsz[dt], NULL, 0);
    ((comm *)c)->pending_send = s;
    return 0;
}
int ncclRecv(void *r, size_t n, int dt, int peer, void *c, void *st)
{
    MOCK_API();
    (void)peer;
    mock_order_rw("ncclRecv", st, NULL, 0, r, n * dsz[dt]);
    memmove(r, ((comm *)c)->pending_send, n * dsz[dt]);
    return 0;
}
int ncclGroupStart(void) { MOCK_API(); return 0; }
int ncclGroupEnd(void) { MOCK_API(); return 0; }
