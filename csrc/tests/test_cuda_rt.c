/* CUDA runtime loader and nccl backend entry points.
 *
 * Everywhere: the loader gives a clean answer (AXC_OK with a usable table, or AXC_ERR_UNAVAILABLE
 * with a reason), replays it identically to every caller and thread, and the nccl constructor
 * fails cleanly without a GPU. Optional env, to exercise more paths:
 *   AXC_TEST_CUDART=/path/libcudart.so.13  preload it (as torch would) before the first load
 *   AXC_TEST_NCCL_LIB=/path/libnccl.so.2   preload it and check ncclGetVersion
 * On a GPU machine, when built with -DAXC_HAVE_CUDA_HEADERS -DAXC_HAVE_NCCL_HEADERS (as
 * benchmarks/gpu_suite.sh does), it also runs every collective on every group of a one-rank nccl
 * communicator and compares the results. Against the CPU mock runtime (run_mock_test.sh) that
 * flow runs too, and the mock's stream-order checker must find no violation in it: the
 * collectives' fork from and join into the caller's stream, the token-count buffer's order. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/cuda_rt.h"
#include "axc/grid.h"
#include "axc/linear.h"
#include "ctest.h"
#include "mock/mock_order_check.h"

static void *preload(const char *env)
{
    const char *path = getenv(env);
    if (!path || !*path)
        return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!h)
        fprintf(stderr, "%s=%s could not be loaded: %s\n", env, path, dlerror());
    CHECK(h != NULL);
    return h;
}

typedef struct load_result {
    axc_status st;
    const axc_cuda_api *api;
    char msg[1024];
} load_result;

static void *load_in_thread(void *arg)
{
    load_result *r = arg;
    r->st = axc_cuda_load(&r->api);
    snprintf(r->msg, sizeof r->msg, "%s", axc_last_error());
    return NULL;
}

static void test_loader(void)
{
    /* several threads race on the first load: all must see the same outcome */
    enum { N = 4 };
    pthread_t th[N];
    load_result res[N];
    memset(res, 0, sizeof res);
    for (int i = 0; i < N; i++)
        CHECK(pthread_create(&th[i], NULL, load_in_thread, &res[i]) == 0);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    for (int i = 1; i < N; i++) {
        CHECK(res[i].st == res[0].st);
        CHECK(res[i].api == res[0].api);
        CHECK(strcmp(res[i].msg, res[0].msg) == 0);
    }

    const axc_cuda_api *api = (const axc_cuda_api *)1;
    axc_status st = axc_cuda_load(&api);
    CHECK(st == res[0].st);
    if (st == AXC_OK) {
        printf("CUDA runtime %d, %d device(s)\n", api->runtime_version, api->device_count);
        CHECK(api != NULL);
        CHECK(api->device_count > 0);
        CHECK(api->runtime_version > 0);
        CHECK(api->GetDevice && api->SetDevice && api->EventRecord && api->StreamWaitEvent);
        CHECK(api->Malloc && api->Free && api->StreamCreateWithPriority);
        int dev = -1;
        CHECK_OK(axc_cuda_check(api->GetDevice(&dev), "cudaGetDevice"));
        CHECK(dev >= 0);
    } else {
        const char *msg = axc_last_error();
        printf("CUDA unavailable (expected without a GPU): %s\n", msg);
        CHECK(st == AXC_ERR_UNAVAILABLE);
        CHECK(api == NULL);
        CHECK(msg[0] != '\0');
        CHECK(strstr(msg, "CUDA") != NULL);
        CHECK(strcmp(msg, res[0].msg) == 0); /* replayed verbatim */
        if (getenv("AXC_TEST_CUDART") && *getenv("AXC_TEST_CUDART"))
            /* the runtime was there (preloaded): the reason must be the device query */
            CHECK(strstr(msg, "cudaGetDeviceCount") != NULL);
        /* a machine without a driver is named as such, not as a too-old driver */
        void *drv = dlopen("libcuda.so.1", RTLD_LAZY);
        if (drv)
            dlclose(drv);
        else if (strstr(msg, "cudaGetDeviceCount"))
            CHECK(strstr(msg, "no CUDA driver (CPU-only machine)") != NULL);
        CHECK(strstr(msg, "insufficient") == NULL || drv != NULL);
    }

    /* error codes become AXC_ERR_BACKEND naming the call */
    CHECK_OK(axc_cuda_check(0, "cudaNothing"));
    CHECK(axc_cuda_check(2, "cudaMalloc (test)") == AXC_ERR_BACKEND);
    CHECK(strstr(axc_last_error(), "cudaMalloc (test)") != NULL);
    CHECK(strstr(axc_last_error(), "cudaError 2") != NULL);

    /* build facts are consistent */
    CHECK(axc_cuda_compiled() == 0 || axc_cuda_compiled() == 1);
    if (axc_cuda_compiled())
        CHECK(axc_cuda_header_version() >= 11000);
    else
        CHECK(axc_cuda_header_version() == 0);
}

static void test_nccl_versions(void)
{
    int hv = axc_nccl_header_version();
    int rv = axc_nccl_runtime_version();
    printf("NCCL headers %d, runtime %d%s%s\n", hv, rv, rv ? "" : ": ", rv ? "" : axc_last_error());
    if (hv == 0) {
        CHECK(rv == 0);
        CHECK(strstr(axc_last_error(), "without NCCL headers") != NULL);
        return;
    }
    CHECK(hv >= 21800);
    if (getenv("AXC_TEST_NCCL_LIB") && *getenv("AXC_TEST_NCCL_LIB"))
        CHECK(rv >= 21800); /* preloaded: it must bind to it */
    if (rv == 0)
        CHECK(axc_last_error()[0] != '\0');
}

static axc_status no_set(void *ctx, const char *key, const void *value, size_t len)
{
    (void)ctx, (void)key, (void)value, (void)len;
    return axc_fail(AXC_ERR_STATE, "no store in this test");
}

static axc_status no_get(void *ctx, const char *key, void *value, size_t cap, size_t *len,
                         double timeout_s)
{
    (void)ctx, (void)key, (void)value, (void)cap, (void)len, (void)timeout_s;
    return axc_fail(AXC_ERR_STATE, "no store in this test");
}

static axc_comm_config one_rank_config(axc_grid grid)
{
    axc_comm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.grid = grid;
    cfg.rank = 0;
    cfg.local_rank = 0;
    cfg.local_world_size = 1;
    cfg.cuda_device = 0;
    cfg.backend = "nccl";
    cfg.job_id = "test_cuda_rt";
    cfg.timeout_s = 60;
    cfg.bootstrap.set = no_set;
    cfg.bootstrap.get = no_get;
    return cfg;
}

static void test_nccl_unavailable(void)
{
    const axc_cuda_api *api;
    if (axc_cuda_load(&api) == AXC_OK && axc_nccl_header_version() > 0)
        return; /* a GPU build on a GPU: covered by test_nccl_one_rank */
    axc_grid grid;
    CHECK_OK(axc_grid_make(&grid, 1, 1, 1, 1, 1, 1));
    axc_comm_config cfg = one_rank_config(grid);
    axc_backend *be = (axc_backend *)1;
    axc_status st = axc_nccl_backend_create(&be, &cfg);
    printf("nccl backend: %s: %s\n", axc_status_name(st), axc_last_error());
    CHECK(st == AXC_ERR_UNAVAILABLE);
    CHECK(be == NULL);
    CHECK(axc_last_error()[0] != '\0');
    /* and through the generic layer: backend="nccl" fails with the same clean status */
    axc_comm *comm = (axc_comm *)1;
    st = axc_comm_create(&comm, &cfg);
    CHECK(st == AXC_ERR_UNAVAILABLE);
    CHECK(comm == NULL);
}

/* ---- GPU only: one-rank nccl communicator, every collective on every group ---- */

static int run_coll(axc_comm *comm, const axc_cuda_api *cu, axc_group_kind g, axc_coll_kind k,
                    axc_redop op, size_t n, void *dsend, void *drecv, void *stream)
{
    /* input i -> i % 251 - 100 as float; with one rank every collective is a copy of it
     * (avg and max of one value included) */
    size_t in_n = n, out_n = n;
    float *h = malloc(sizeof(float) * n), *o = malloc(sizeof(float) * n);
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        h[i] = (float)((int)(i % 251) - 100);
        o[i] = -12345.0f;
    }
    CHECK_OK(axc_cuda_check(cu->MemcpyAsync(dsend, h, sizeof(float) * in_n, AXC_CUDA_MEMCPY_H2D,
                                            stream),
                            "H2D"));
    if (drecv != dsend) /* poison the output (not when in place: it holds the input) */
        CHECK_OK(axc_cuda_check(cu->MemcpyAsync(drecv, o, sizeof(float) * out_n,
                                                AXC_CUDA_MEMCPY_H2D, stream),
                                "H2D"));
    axc_coll c;
    memset(&c, 0, sizeof c);
    c.kind = k;
    c.send = dsend;
    c.recv = drecv;
    c.count = n;
    c.dtype = AXC_DT_F32;
    c.op = op;
    c.root = 0;
    c.device = 0;
    c.stream = stream;
    axc_work *w = NULL;
    axc_status st = axc_comm_start(comm, g, &c, &w);
    CHECK_OK(st);
    if (st != AXC_OK) {
        free(h), free(o);
        return 1;
    }
    (void)axc_work_done(w);
    CHECK_OK(axc_work_wait(w));
    CHECK(axc_work_done(w) == 1);
    axc_work_free(w);
    if (k != AXC_COLL_BARRIER) {
        CHECK_OK(axc_cuda_check(cu->MemcpyAsync(o, drecv, sizeof(float) * out_n,
                                                AXC_CUDA_MEMCPY_D2H, stream),
                                "D2H"));
        CHECK_OK(axc_cuda_check(cu->StreamSynchronize(stream), "cudaStreamSynchronize"));
        for (size_t i = 0; i < n; i++)
            bad += o[i] != h[i];
        if (bad)
            fprintf(stderr, "%s/%s: %d of %zu elements differ\n", axc_group_name(g),
                    axc_coll_name(k), bad, n);
        CHECK(bad == 0);
    } else {
        CHECK_OK(axc_cuda_check(cu->StreamSynchronize(stream), "cudaStreamSynchronize"));
    }
    free(h), free(o);
    return bad != 0;
}

static void test_nccl_one_rank(void)
{
    const axc_cuda_api *cu;
    if (axc_cuda_load(&cu) != AXC_OK || axc_nccl_header_version() == 0) {
        printf("one-rank nccl test skipped (needs a GPU and a build with NCCL headers)\n");
        return;
    }
    axc_grid grid;
    CHECK_OK(axc_grid_make(&grid, 1, 1, 1, 1, 1, 1));
    axc_comm_config cfg = one_rank_config(grid);
    CHECK_OK(cu->SetDevice(0) == 0 ? AXC_OK : AXC_ERR_BACKEND);
    for (int round = 0; round < 2; round++) { /* create/destroy twice */
        axc_comm *comm = NULL;
        axc_status st = axc_comm_create(&comm, &cfg);
        CHECK_OK(st);
        if (st != AXC_OK)
            return;
        CHECK(strstr(axc_comm_backends(comm), "nccl") != NULL);
        size_t n = 1000003;
        void *ds = NULL, *dr = NULL, *stream = NULL;
        CHECK_OK(axc_cuda_check(cu->Malloc(&ds, n * sizeof(float)), "cudaMalloc"));
        CHECK_OK(axc_cuda_check(cu->Malloc(&dr, n * sizeof(float)), "cudaMalloc"));
        CHECK_OK(axc_cuda_check(cu->StreamCreateWithFlags(&stream, 1), "cudaStreamCreate"));
        for (int g = 0; g < AXC_GROUP_COUNT; g++) {
            for (int k = 0; k < AXC_COLL_BARRIER + 1; k++) {
                size_t sizes[] = {1, 7, 1000, n};
                for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
                    axc_redop ops[] = {AXC_RED_SUM, AXC_RED_AVG, AXC_RED_MAX};
                    int nops = (k == AXC_COLL_ALL_REDUCE || k == AXC_COLL_REDUCE_SCATTER) ? 3 : 1;
                    for (int oi = 0; oi < nops; oi++)
                        run_coll(comm, cu, (axc_group_kind)g, (axc_coll_kind)k, ops[oi],
                                 sizes[si], ds, dr, stream);
                }
            }
            axc_counters cnt;
            axc_comm_counters(comm, (axc_group_kind)g, &cnt);
            CHECK(cnt.bytes_sent == 0 && cnt.bytes_recv == 0);
            CHECK(cnt.calls > 0);
        }
        /* in-place all-reduce on the legacy default stream */
        run_coll(comm, cu, AXC_GROUP_WORLD, AXC_COLL_ALL_REDUCE, AXC_RED_SUM, 4096, dr, dr, NULL);
        /* many in flight before any wait: the event pool grows and recycles (each into a buffer
         * of its own: on different groups' streams they run concurrently) */
        enum { INFLIGHT = 64 };
        axc_work *ws[INFLIGHT];
        void *recv[INFLIGHT] = {NULL};
        for (int i = 0; i < INFLIGHT; i++) {
            CHECK_OK(axc_cuda_check(cu->Malloc(&recv[i], 1024 * sizeof(float)), "cudaMalloc"));
            axc_coll c;
            memset(&c, 0, sizeof c);
            c.kind = AXC_COLL_ALL_REDUCE;
            c.send = ds;
            c.recv = recv[i];
            c.count = 1024;
            c.dtype = AXC_DT_F32;
            c.device = 0;
            c.stream = stream;
            CHECK_OK(axc_comm_start(comm, (axc_group_kind)(i % AXC_GROUP_COUNT), &c, &ws[i]));
        }
        for (int i = INFLIGHT - 1; i >= 0; i--)
            axc_work_free(ws[i]); /* waits */
        CHECK_OK(axc_cuda_check(cu->StreamSynchronize(stream), "cudaStreamSynchronize"));
        for (int i = 0; i < INFLIGHT; i++)
            cu->Free(recv[i]);
        /* host buffers are refused by nccl with a message naming the problem */
        {
            float hb[4] = {0};
            axc_coll c;
            memset(&c, 0, sizeof c);
            c.kind = AXC_COLL_ALL_REDUCE;
            c.send = hb;
            c.recv = hb;
            c.count = 4;
            c.dtype = AXC_DT_F32;
            c.device = -1;
            axc_work *w = NULL;
            CHECK(axc_comm_start(comm, AXC_GROUP_WORLD, &c, &w) != AXC_OK);
            CHECK(w == NULL);
        }
        /* the easy layout's token counts on a job without host collectives (nccl only): they
         * go through device memory with CUDA tensors, and are refused as host buffers without */
        {
            CHECK(axc_comm_host_collectives(comm) == 0);
            axc_linear_desc d;
            memset(&d, 0, sizeof d);
            d.in_features = 8;
            d.out_features = 4;
            d.layout = AXC_LAYOUT_EASY;
            d.dtype = AXC_DT_F32;
            int64_t t_max = -1;
            CHECK_OK(axc_linear_plane_tokens(comm, &d, 37, 0, stream, &t_max));
            CHECK(t_max == 37);
            CHECK(axc_linear_plane_tokens(comm, &d, 37, -1, NULL, &t_max) != AXC_OK);
        }
        /* a barrier as Python issues it (no tensor: no device, the legacy default stream) is
         * served by nccl when there is no shm backend */
        for (int g = 0; g < AXC_GROUP_COUNT; g++) {
            axc_coll b;
            memset(&b, 0, sizeof b);
            b.kind = AXC_COLL_BARRIER;
            b.device = -1;
            axc_work *w = NULL;
            axc_status bst = axc_comm_start(comm, (axc_group_kind)g, &b, &w);
            CHECK_OK(bst);
            if (bst == AXC_OK) {
                CHECK_OK(axc_work_wait(w));
                axc_work_free(w);
            }
        }
        cu->StreamDestroy(stream);
        cu->Free(ds);
        cu->Free(dr);
        axc_comm_destroy(comm);
    }
}

int main(void)
{
    preload("AXC_TEST_CUDART");
    preload("AXC_TEST_NCCL_LIB");
    test_loader();
    test_nccl_versions();
    test_nccl_unavailable();
    test_nccl_one_rank();
    order_checker oc;
    if (order_checker_find(&oc)) /* the mock runtime: was the GPU work ordered right? */
        CHECK(order_violations(&oc, "test_cuda_rt") == 0);
    return ctest_summary("test_cuda_rt");
}
