/* The nccl backend's communicators: the unique id through the bootstrap store, the world
 * communicator, each group split from it with its comm stream, closing groups, and creating and
 * destroying the backend. */
#include "nccl_internal.h"

#if defined(AXC_HAVE_NCCL_HEADERS) && defined(AXC_HAVE_CUDA_HEADERS)

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void comm_config(ncclConfig_t *config, const char *name)
{
    ncclConfig_t init = NCCL_CONFIG_INITIALIZER;
    *config = init;
    config->blocking = 0; /* every call may return ncclInProgress: we poll with a deadline */
    config->commName = name;
}

/* Finalizes and destroys `comm` (issue_mu held). On failure or timeout it aborts it instead and
 * returns the error; `comm` is gone either way. */
static axc_status comm_release_locked(nccl_backend *be, ncclComm_t comm, const char *what)
{
    if (atomic_load(&be->failed)) {
        be->nc->CommAbort(comm);
        return AXC_OK;
    }
    ncclResult_t r = be->nc->CommFinalize(comm);
    if (r == ncclInProgress || r == ncclSuccess) {
        int aborted = 0;
        r = axc_nccl_poll_comm(be, comm, axc_nccl_deadline_after(be->timeout_s), &aborted);
        if (aborted) {
            be->nc->CommAbort(comm);
            return AXC_OK;
        }
    }
    if (r == ncclSuccess) {
        r = be->nc->CommDestroy(comm);
        if (r == ncclSuccess || r == ncclInProgress)
            return AXC_OK;
        return axc_nccl_fail(be, r, NULL, "ncclCommDestroy", what);
    }
    axc_status st;
    if (r == ncclInProgress)
        st = axc_fail(AXC_ERR_TIMEOUT,
                      "ncclCommFinalize of %s did not finish within %.1f s (job %s, rank %d): a "
                      "peer is missing; the communicator was aborted",
                      what, be->timeout_s, be->job, be->rank);
    else
        st = axc_nccl_fail(be, r, comm, "ncclCommFinalize", what);
    be->nc->CommAbort(comm);
    return st;
}

static axc_status init_world(nccl_backend *be, const axc_comm_config *cfg)
{
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    char key[256];
    snprintf(key, sizeof key, "%s/nccl/uid", be->job);
    ncclResult_t r;
    if (be->rank == 0 || be->world_size == 1) {
        r = be->nc->GetUniqueId(&id);
        if (r != ncclSuccess)
            return axc_nccl_fail(be, r, NULL, "ncclGetUniqueId", "the world communicator");
    }
    if (be->world_size > 1) {
        if (!cfg->bootstrap.set || !cfg->bootstrap.get)
            return axc_fail(AXC_ERR_INVALID,
                            "the nccl backend needs a bootstrap store to share its id among %d "
                            "ranks (job %s)",
                            be->world_size, be->job);
        if (be->rank == 0) {
            axc_status st = cfg->bootstrap.set(cfg->bootstrap.ctx, key, &id, sizeof id);
            if (st != AXC_OK)
                return axc_fail(st, "publishing the NCCL id under '%s' failed: %s", key,
                                axc_last_error());
        } else {
            size_t len = 0;
            axc_status st = cfg->bootstrap.get(cfg->bootstrap.ctx, key, &id, sizeof id, &len,
                                               be->timeout_s);
            if (st != AXC_OK)
                return axc_fail(st, "rank %d waited for rank 0's NCCL id under '%s' (job %s): %s",
                                be->rank, key, be->job, axc_last_error());
            if (len != sizeof id)
                return axc_fail(AXC_ERR_INVALID,
                                "the NCCL id under '%s' has %zu bytes, expected %zu (job %s): "
                                "another job or version wrote that key",
                                key, len, sizeof id, be->job);
        }
    }

    ncclConfig_t config;
    snprintf(be->world_name, sizeof be->world_name, "axonn_c:%s:world", be->job);
    comm_config(&config, be->world_name);
    ncclComm_t comm = NULL;
    int64_t deadline = axc_nccl_deadline_after(be->timeout_s);
    pthread_mutex_lock(&be->issue_mu);
    r = be->nc->CommInitRankConfig(&comm, be->world_size, id, be->rank, &config);
    if (r == ncclInProgress || (r == ncclSuccess && comm))
        r = axc_nccl_poll_comm(be, comm, deadline, NULL);
    if (r != ncclSuccess) {
        axc_status st;
        if (r == ncclInProgress)
            st = axc_fail(AXC_ERR_TIMEOUT,
                          "the NCCL world communicator of job %s was not ready within %.1f s "
                          "(rank %d of %d, cuda:%d): a peer did not arrive",
                          be->job, be->timeout_s, be->rank, be->world_size, be->device);
        else
            st = axc_fail(AXC_ERR_BACKEND,
                          "ncclCommInitRankConfig failed for job %s (rank %d of %d, cuda:%d): "
                          "%s: %s",
                          be->job, be->rank, be->world_size, be->device, axc_nccl_str(be->nc, r),
                          axc_nccl_last(be->nc, comm));
        if (comm)
            be->nc->CommAbort(comm);
        pthread_mutex_unlock(&be->issue_mu);
        return st;
    }
    be->world = comm;
    pthread_mutex_unlock(&be->issue_mu);
    return AXC_OK;
}

static void group_destroy_resources(nccl_backend *be, nccl_group *g)
{
    if (g->stream) {
        int e = be->cu->StreamDestroy(g->stream);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: cudaStreamDestroy of the %s group failed (cudaError %d)",
                    axc_group_name(g->kind), e);
    }
    if (g->barrier_buf) {
        int e = be->cu->Free(g->barrier_buf);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: cudaFree of the %s group's barrier buffer failed (cudaError %d)",
                    axc_group_name(g->kind), e);
    }
    if (g->cbuf) {
        int e = be->cu->Free(g->cbuf);
        if (e != AXC_CUDA_SUCCESS)
            axc_log(2, "nccl: cudaFree of the %s group's compression buffer failed (cudaError %d)",
                    axc_group_name(g->kind), e);
    }
    g->stream = g->barrier_buf = g->cbuf = NULL;
    g->cbuf_bytes = 0;
}

static axc_status nccl_group_open(axc_backend *base, const axc_group_info *info, void **out)
{
    nccl_backend *be = (nccl_backend *)base;
    *out = NULL;
    AXC_TRY(axc_nccl_failure_status(be));
    if (info->kind != AXC_GROUP_WORLD && info->color < 0)
        return axc_fail(AXC_ERR_INVALID, "nccl: negative colour %d for the %s group",
                        info->color, axc_group_name(info->kind));
    nccl_group *g = calloc(1, sizeof *g);
    if (!g)
        return axc_fail(AXC_ERR_NOMEM, "out of memory opening the %s group",
                        axc_group_name(info->kind));
    g->be = be;
    g->kind = info->kind;
    g->size = info->size;
    g->rank = info->rank;
    g->color = info->color;
    snprintf(g->name, sizeof g->name, "axonn_c:%s:%s:%d:ch%d", be->job,
             axc_group_name(info->kind), info->color, info->channel);
    dev_guard dg;
    axc_status st = axc_nccl_dev_enter(be, &dg);
    if (st != AXC_OK) {
        free(g);
        return st;
    }

    /* channel 0's world group is the world communicator; every other group (and every channel's
     * world copy, colour 0 for all) is a split of it, with its own stream */
    if (info->kind == AXC_GROUP_WORLD && info->channel == 0) {
        g->comm = be->world;
        g->owns_comm = 0;
    } else {
        ncclConfig_t config;
        comm_config(&config, g->name);
        ncclComm_t child = NULL;
        int64_t deadline = axc_nccl_deadline_after(be->timeout_s);
        pthread_mutex_lock(&be->issue_mu);
        if (!be->world) {
            st = axc_fail(AXC_ERR_STATE, "nccl: the world communicator is gone (job %s)", be->job);
        } else {
            ncclResult_t r =
                be->nc->CommSplit(be->world, info->color, info->rank, &child, &config);
            if (r == ncclInProgress || (r == ncclSuccess && child))
                r = axc_nccl_poll_comm(be, child, deadline, NULL);
            if (r == ncclSuccess) /* the parent takes part in the split too */
                r = axc_nccl_poll_comm(be, be->world, deadline, NULL);
            if (r == ncclSuccess && !child)
                st = axc_fail(AXC_ERR_BACKEND,
                              "ncclCommSplit returned no communicator for the %s group (colour "
                              "%d, job %s)",
                              axc_group_name(info->kind), info->color, be->job);
            else if (r == ncclInProgress)
                st = axc_fail(AXC_ERR_TIMEOUT,
                              "ncclCommSplit for the %s group (colour %d, rank %d of %d) did not "
                              "finish within %.1f s (job %s, global rank %d): a peer did not "
                              "arrive",
                              axc_group_name(info->kind), info->color, info->rank, info->size,
                              be->timeout_s, be->job, be->rank);
            else if (r != ncclSuccess)
                st = axc_fail(AXC_ERR_BACKEND,
                              "ncclCommSplit failed for the %s group (colour %d, rank %d of %d, "
                              "job %s): %s: %s",
                              axc_group_name(info->kind), info->color, info->rank, info->size,
                              be->job, axc_nccl_str(be->nc, r), axc_nccl_last(be->nc, child));
            if (st != AXC_OK && child)
                be->nc->CommAbort(child);
            else
                g->comm = child;
        }
        pthread_mutex_unlock(&be->issue_mu);
        if (st != AXC_OK) {
            if (st == AXC_ERR_TIMEOUT) { /* the world is stuck mid-split: nothing can recover */
                char msg[512];
                snprintf(msg, sizeof msg, "%s", axc_last_error());
                axc_nccl_fail_all(be, st, msg, 0);
                axc_fail(st, "%s", msg);
            }
            axc_nccl_dev_leave(be, &dg);
            free(g);
            return st;
        }
        g->owns_comm = 1;
    }

    st = axc_cuda_check(be->cu->StreamCreateWithPriority(&g->stream, AXC_CUDA_STREAM_NON_BLOCKING,
                                                         be->stream_priority),
                        "cudaStreamCreateWithPriority (nccl comm stream)");
    if (st == AXC_OK)
        st = axc_cuda_check(be->cu->Malloc(&g->barrier_buf, sizeof(int32_t)),
                            "cudaMalloc (nccl barrier word)");
    if (st == AXC_OK) { /* zero it on the comm stream, ordered before any barrier */
        static const int32_t zero = 0;
        st = axc_cuda_check(be->cu->MemcpyAsync(g->barrier_buf, &zero, sizeof zero,
                                                AXC_CUDA_MEMCPY_H2D, g->stream),
                            "cudaMemcpyAsync (nccl barrier word)");
        if (st == AXC_OK)
            st = axc_cuda_check(be->cu->StreamSynchronize(g->stream),
                                "cudaStreamSynchronize (nccl comm stream)");
    }
    if (st != AXC_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", axc_last_error());
        group_destroy_resources(be, g);
        if (g->owns_comm && g->comm) {
            pthread_mutex_lock(&be->issue_mu);
            if (g->comm)
                be->nc->CommAbort(g->comm);
            pthread_mutex_unlock(&be->issue_mu);
        }
        axc_nccl_dev_leave(be, &dg);
        free(g);
        return axc_fail(st, "%s", msg);
    }
    axc_nccl_dev_leave(be, &dg);

    pthread_mutex_lock(&be->mu);
    g->next = be->groups;
    be->groups = g;
    pthread_mutex_unlock(&be->mu);
    *out = g;
    return AXC_OK;
}

static void nccl_group_close(axc_backend *base, void *group)
{
    nccl_backend *be = (nccl_backend *)base;
    nccl_group *g = group;
    if (!g)
        return;
    dev_guard dg;
    int have_dev = axc_nccl_dev_enter(be, &dg) == AXC_OK;

    /* 1. let this group's in-flight collectives finish (bounded by the timeout) */
    int64_t deadline = axc_nccl_deadline_after(be->timeout_s);
    unsigned spins = 0;
    for (;;) {
        pthread_mutex_lock(&be->mu);
        int pending = 0;
        for (nccl_slot *s = be->head; s; s = s->next) {
            if (s->group != g || s->completed)
                continue;
            int q = be->cu->EventQuery(s->done);
            if (q == AXC_CUDA_SUCCESS || q != AXC_CUDA_ERROR_NOT_READY)
                s->completed = 1; /* an error here is the watchdog's to report */
            else
                pending++;
        }
        int failed = atomic_load(&be->failed);
        pthread_mutex_unlock(&be->mu);
        if (!pending || failed)
            break;
        if (axc_now_ns() >= deadline) {
            char msg[512];
            snprintf(msg, sizeof msg,
                     "closing the %s group: %d collective(s) still running after %.1f s (job %s, "
                     "rank %d); all NCCL communicators were aborted",
                     axc_group_name(g->kind), pending, be->timeout_s, be->job, be->rank);
            axc_nccl_fail_all(be, AXC_ERR_TIMEOUT, msg, 0);
            break;
        }
        axc_nccl_backoff(&spins);
    }

    /* 2. release the communicator */
    pthread_mutex_lock(&be->issue_mu);
    if (g->owns_comm && g->comm) {
        char what[96];
        snprintf(what, sizeof what, "the %s group", axc_group_name(g->kind));
        ncclComm_t c = g->comm;
        g->comm = NULL;
        axc_status st = comm_release_locked(be, c, what);
        if (st != AXC_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", axc_last_error());
            axc_nccl_fail_all(be, st, msg, 1);
        }
    }
    g->comm = NULL;
    pthread_mutex_unlock(&be->issue_mu);

    /* 3. forget it: slots keep running (watched) but no longer point at the group */
    pthread_mutex_lock(&be->mu);
    for (nccl_slot *s = be->head; s; s = s->next) {
        if (s->group == g)
            s->group = NULL;
    }
    g->inflight = 0;
    for (nccl_group **p = &be->groups; *p; p = &(*p)->next) {
        if (*p == g) {
            *p = g->next;
            break;
        }
    }
    pthread_mutex_unlock(&be->mu);

    group_destroy_resources(be, g);
    if (have_dev)
        axc_nccl_dev_leave(be, &dg);
    free(g);
}

/* axc_comm_abort: this rank's communicators aborted, its works failed with `msg`. As on shm, the
 * failure they and later starts report is a communication error (PEER; TIMEOUT for a timeout),
 * not the cause's kind (e.g. NOMEM: a MemoryError for every later collective); the cause goes
 * to axc_comm_abort's caller only. Once failed, a backend is not failed again. */
static void nccl_abort_job(axc_backend *base, axc_status status, const char *msg)
{
    axc_nccl_fail_all((nccl_backend *)base,
                      status == AXC_ERR_TIMEOUT ? AXC_ERR_TIMEOUT : AXC_ERR_PEER, msg, 0);
}

static void nccl_destroy(axc_backend *base)
{
    nccl_backend *be = (nccl_backend *)base;
    if (!be)
        return;
    if (be->watchdog_started) {
        pthread_mutex_lock(&be->mu);
        be->stop = 1;
        pthread_cond_broadcast(&be->cv);
        pthread_mutex_unlock(&be->mu);
        pthread_join(be->watchdog, NULL);
        be->watchdog_started = 0;
    }
    while (be->groups) /* normally closed by the generic layer already */
        nccl_group_close(base, be->groups);
    dev_guard dg;
    int have_dev = axc_nccl_dev_enter(be, &dg) == AXC_OK;
    axc_status wst = AXC_OK;
    pthread_mutex_lock(&be->issue_mu);
    if (be->world) {
        ncclComm_t w = be->world;
        be->world = NULL;
        wst = comm_release_locked(be, w, "the world communicator");
    }
    pthread_mutex_unlock(&be->issue_mu);
    if (wst != AXC_OK)
        axc_log(2, "nccl: %s", axc_last_error());
    /* slots: finished ones are idle; unfinished ones were aborted. EventDestroy of an event whose
     * work is pending is allowed (the runtime releases it when it completes). */
    while (be->head) {
        nccl_slot *s = be->head;
        axc_nccl_inflight_remove(be, s);
        axc_nccl_slot_free(be, s);
    }
    while (be->free_slots) {
        nccl_slot *s = be->free_slots;
        be->free_slots = s->next;
        axc_nccl_slot_free(be, s);
    }
    if (have_dev)
        axc_nccl_dev_leave(be, &dg);
    pthread_cond_destroy(&be->cv);
    pthread_mutex_destroy(&be->mu);
    pthread_mutex_destroy(&be->issue_mu);
    free(be);
}

axc_status axc_nccl_backend_create(axc_backend **out, const axc_comm_config *cfg)
{
    *out = NULL;
    const axc_cuda_api *cu;
    const nccl_api *nc;
    AXC_TRY(axc_cuda_load(&cu));
    AXC_TRY(axc_nccl_load(&nc));
    if (cfg->cuda_device < 0 || cfg->cuda_device >= cu->device_count)
        return axc_fail(AXC_ERR_INVALID,
                        "nccl: CUDA device %d does not exist (this process sees %d device(s))",
                        cfg->cuda_device, cu->device_count);
    if (cfg->grid.world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->grid.world_size)
        return axc_fail(AXC_ERR_INVALID, "nccl: rank %d is outside the world of %d ranks",
                        cfg->rank, cfg->grid.world_size);

    nccl_backend *be = calloc(1, sizeof *be);
    if (!be)
        return axc_fail(AXC_ERR_NOMEM, "out of memory creating the nccl backend");
    be->base.name = "nccl";
    be->base.group_open = nccl_group_open;
    be->base.group_close = nccl_group_close;
    be->base.start = axc_nccl_start;
    be->base.follows_after = 1; /* follow_after(): stream waits on the works' events */
    be->base.wait = axc_nccl_wait;
    be->base.query = axc_nccl_query;
    be->base.abort = nccl_abort_job;
    be->base.destroy = nccl_destroy;
    be->cu = cu;
    be->nc = nc;
    be->device = cfg->cuda_device;
    be->rank = cfg->rank;
    be->world_size = cfg->grid.world_size;
    be->timeout_s = cfg->timeout_s > 0 ? cfg->timeout_s : 300.0;
    snprintf(be->job, sizeof be->job, "%s",
             (cfg->job_id && *cfg->job_id) ? cfg->job_id : "axonn_c");
    atomic_store(&be->failed, 0);

    pthread_condattr_t ca;
    int e = pthread_mutex_init(&be->issue_mu, NULL);
    if (e == 0 && (e = pthread_mutex_init(&be->mu, NULL)) != 0)
        pthread_mutex_destroy(&be->issue_mu);
    if (e != 0) {
        free(be);
        return axc_fail(AXC_ERR_SYSTEM, "nccl: pthread_mutex_init failed: %s", strerror(e));
    }
    if ((e = pthread_condattr_init(&ca)) == 0) {
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        e = pthread_cond_init(&be->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (e != 0) {
        pthread_mutex_destroy(&be->mu);
        pthread_mutex_destroy(&be->issue_mu);
        free(be);
        return axc_fail(AXC_ERR_SYSTEM, "nccl: pthread_cond_init failed: %s", strerror(e));
    }

    dev_guard dg;
    axc_status st = axc_nccl_dev_enter(be, &dg);
    if (st != AXC_OK) {
        nccl_destroy(&be->base);
        return st;
    }
    int least = 0, greatest = 0;
    if (cu->DeviceGetStreamPriorityRange(&least, &greatest) == AXC_CUDA_SUCCESS)
        be->stream_priority = greatest; /* numerically lowest = highest priority */
    (void)least;

    st = init_world(be, cfg);
    if (st == AXC_OK) {
        e = pthread_create(&be->watchdog, NULL, axc_nccl_watchdog_main, be);
        if (e != 0)
            st = axc_fail(AXC_ERR_SYSTEM, "nccl: starting the watchdog thread failed: %s",
                          strerror(e));
        else
            be->watchdog_started = 1;
    }
    axc_nccl_dev_leave(be, &dg);
    if (st != AXC_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", axc_last_error());
        nccl_destroy(&be->base);
        axc_set_last_error(msg);
        return st;
    }
    int ma, mi, pa;
    axc_nccl_version_parts(nc->version, &ma, &mi, &pa);
    axc_log(1, "nccl: world communicator ready (job %s, rank %d of %d, cuda:%d, NCCL %d.%d.%d)",
            be->job, be->rank, be->world_size, be->device, ma, mi, pa);
    *out = &be->base;
    return AXC_OK;
}

#endif
