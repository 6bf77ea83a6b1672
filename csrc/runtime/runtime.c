/* The runtime (axc/runtime.h): one session's communicator, scheduler, timeline, gradient
 * buckets, keep-alives and gradient records, and the start of due bucket sums. */
#include "axc/runtime.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "axc/gemm.h"
#include "axc/torch_shim.h"

struct axc_runtime {
    axc_comm *comm;   /* the current init's; NULL when closed */
    axc_sched *sched; /* over comm */
    axc_buckets *buckets;
    axc_keeps *keeps;
    axc_grad_records *records;
    axc_mb *mb; /* the running run_concurrent call, or NULL */
    const void *mb_owner; /* who opened it (axc_runtime_mb_end_owned) */
    axc_mb_memory *mbmem; /* what the calls learned (NULL without the ops) */
    axc_layer_residuals *layer_residuals; /* the linear layers' depth dW residuals */
    axc_timeline *timeline; /* the trace: kept across inits, each comm opened with it */
    /* the last shard each scheduled layer passed, by layer id (an owner each, or NULL): a
     * prefetch reads it (axc/sched.h) */
    void **shards;
    int nshards;
    void (*release_kept)(void *ctx, void *owner);
    void *kept_ctx;
    axc_runtime_hooks hooks;
    int starting; /* axc_runtime_start_due_sums is running (the caller's lock may be let go) */
    int opening;  /* axc_runtime_open is waiting for the ranks (the caller's lock is let go) */
    int grad_sync;    /* backward starts gradient sums (0 inside no_grad_sync) */
    int overlap_data; /* the data overlap knob in force */
    size_t grad_bucket_bytes; /* the bucket size of backward's sums (init(bucket_size=)) */
    /* gradients that reached a hook or a deferred Linear weight (any thread) */
    _Atomic unsigned long long grad_arrivals;
    _Atomic long long grad_arrivals_pass; /* the backward pass counted last (-1: none) */
    _Atomic unsigned long long grad_idents; /* the gradient names given so far */
    unsigned long long process_token; /* tells this process's names from a pickle's */
};

/* set by run_concurrent on its micro-batch threads */
static _Thread_local int t_microbatch;

static void *blocking_begin(const axc_runtime *rt)
{
    return rt->hooks.blocking_begin ? rt->hooks.blocking_begin(rt->hooks.ctx) : NULL;
}

static void blocking_end(const axc_runtime *rt, void *state)
{
    if (rt->hooks.blocking_end)
        rt->hooks.blocking_end(rt->hooks.ctx, state);
}

axc_status axc_runtime_create(axc_runtime **out, const axc_runtime_ops *ops)
{
    if (!out || !ops)
        return axc_fail(AXC_ERR_INVALID, "axc_runtime_create: NULL argument");
    *out = NULL;
    axc_runtime *rt = calloc(1, sizeof *rt);
    if (!rt)
        return axc_fail(AXC_ERR_NOMEM, "axc_runtime_create: out of memory");
    rt->hooks = ops->hooks;
    rt->release_kept = ops->release_kept;
    rt->kept_ctx = ops->kept_ctx;
    rt->grad_sync = 1;
    rt->grad_bucket_bytes = 4u << 20;
    rt->grad_arrivals_pass = -1;
    /* (splitmix64 of the time, the process id and the address: another process's differs) */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long z = (unsigned long long)ts.tv_nsec ^ ((unsigned long long)ts.tv_sec << 30) ^
                           ((unsigned long long)getpid() << 16) ^ (unsigned long long)(uintptr_t)rt;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    rt->process_token = (z ^ (z >> 31)) | 1; /* (never 0) */
    axc_status st = axc_timeline_create(&rt->timeline);
    if (st == AXC_OK)
        st = axc_buckets_create(&rt->buckets, &ops->buckets, ops->bucket_bytes);
    if (st == AXC_OK)
        st = axc_keeps_create(&rt->keeps, ops->release_kept, ops->kept_ctx);
    if (st == AXC_OK)
        st = axc_records_create(&rt->records, ops->release_kept, ops->kept_ctx);
    if (st == AXC_OK && ops->microbatch.alloc) {
        axc_mb_ops mo = ops->microbatch;
        mo.blocking_begin = ops->hooks.blocking_begin;
        mo.blocking_end = ops->hooks.blocking_end;
        st = axc_mb_memory_create(&rt->mbmem, &mo);
    }
    if (st == AXC_OK)
        st = axc_layer_residuals_create(&rt->layer_residuals, &ops->buckets);
    if (st != AXC_OK) {
        axc_runtime_destroy(rt);
        return st;
    }
    *out = rt;
    return AXC_OK;
}

void axc_runtime_destroy(axc_runtime *rt)
{
    if (!rt)
        return;
    axc_runtime_mb_end(rt); /* (its works use the communicator close destroys) */
    axc_runtime_close(rt);
    if (rt->opening || rt->comm) /* (an open still running uses all of it: leaked, not freed) */
        return;
    axc_mb_memory_destroy(rt->mbmem);
    axc_records_destroy(rt->records);
    axc_layer_residuals_destroy(rt->layer_residuals);
    free(rt->shards); /* (released by close) */
    axc_keeps_clear(rt->keeps);
    axc_keeps_destroy(rt->keeps);
    axc_buckets_destroy(rt->buckets);
    axc_timeline_destroy(rt->timeline); /* (after close: no communicator records into it) */
    free(rt);
}

axc_status axc_runtime_open(axc_runtime *rt, const axc_comm_config *cfg)
{
    if (rt->comm)
        return axc_fail(AXC_ERR_STATE, "axonn_c is already initialised: finalize() first");
    if (rt->opening)
        return axc_fail(AXC_ERR_STATE, "axonn_c.init() is already running (on another thread, "
                                       "or re-entered while it waits for the ranks): one init "
                                       "at a time");
    rt->opening = 1;
    axc_comm *comm = NULL;
    axc_comm_config c = *cfg;
    c.timeline = rt->timeline; /* (the collectives and the layers over them record into it) */
    void *b = blocking_begin(rt);
    axc_status st = axc_comm_create(&comm, &c); /* waits for every rank */
    blocking_end(rt, b);
    axc_sched *sched = NULL;
    if (st == AXC_OK)
        st = axc_sched_create(&sched, comm);
    if (st != AXC_OK && comm) {
        b = blocking_begin(rt);
        axc_comm_destroy(comm);
        blocking_end(rt, b);
    }
    rt->opening = 0;
    if (st != AXC_OK)
        return st;
    rt->comm = comm;
    rt->sched = sched;
    /* (a new grid: the layers' ids and shards differ; nothing is in flight) */
    axc_layer_residuals_clear(rt->layer_residuals);
    axc_layer_residuals_pass_done(rt->layer_residuals, AXC_LAYER_RESIDUALS_ALL);
    return AXC_OK;
}

axc_status axc_runtime_close(axc_runtime *rt)
{
    if (!rt)
        return AXC_OK;
    if (rt->opening) /* (its communicator would be installed after this close) */
        return axc_fail(AXC_ERR_STATE, "axonn_c.finalize() while init() is running (on another "
                                       "thread, or re-entered while it waits for the ranks)");
    if (rt->mb) /* (its collectives use the communicator: it must end first) */
        return axc_fail(AXC_ERR_STATE, "axonn_c.finalize() while run_concurrent runs (from fn, "
                                       "or on another thread): finalize after it returns");
    axc_comm *comm = rt->comm;
    axc_sched *sched = rt->sched;
    axc_mb_memory_clear(rt->mbmem); /* (the learned order holds the last call's weights) */
    rt->comm = NULL;
    rt->sched = NULL;
    void *b = blocking_begin(rt);
    axc_sched_destroy(sched); /* drains its work first; NULL is a no-op */
    if (comm)
        axc_comm_destroy(comm);
    axc_status st = axc_gemm_release(); /* the cuBLASLt plans (none on CPU) */
    blocking_end(rt, b);
    /* (the scheduler drained: nothing uses them any more) */
    axc_layer_residuals_clear(rt->layer_residuals);
    axc_layer_residuals_pass_done(rt->layer_residuals, AXC_LAYER_RESIDUALS_ALL);
    for (int i = 0; i < rt->nshards; i++)
        axc_runtime_forget_shard(rt, i);
    return st;
}

axc_status axc_runtime_keep_shard(axc_runtime *rt, int layer, void *owner)
{
    if (layer < 0) {
        if (rt->release_kept)
            rt->release_kept(rt->kept_ctx, owner);
        return axc_fail(AXC_ERR_INVALID, "keep_shard: layer id %d, expected >= 0", layer);
    }
    if (layer >= rt->nshards) {
        int n = rt->nshards ? rt->nshards : 16;
        while (n <= layer)
            n *= 2;
        void **v = realloc(rt->shards, (size_t)n * sizeof *v);
        if (!v) {
            if (rt->release_kept)
                rt->release_kept(rt->kept_ctx, owner);
            return axc_fail(AXC_ERR_NOMEM, "keep_shard: out of memory");
        }
        memset(v + rt->nshards, 0, (size_t)(n - rt->nshards) * sizeof *v);
        rt->shards = v;
        rt->nshards = n;
    }
    void *old = rt->shards[layer];
    rt->shards[layer] = owner;
    if (old && rt->release_kept) /* (after the new one is in: a release may re-enter) */
        rt->release_kept(rt->kept_ctx, old);
    return AXC_OK;
}

void axc_runtime_forget_shard(axc_runtime *rt, int layer)
{
    if (!rt || layer < 0 || layer >= rt->nshards || !rt->shards[layer])
        return;
    void *old = rt->shards[layer];
    rt->shards[layer] = NULL;
    if (rt->release_kept)
        rt->release_kept(rt->kept_ctx, old);
}

int axc_runtime_is_open(const axc_runtime *rt) { return rt && rt->comm != NULL; }
axc_comm *axc_runtime_comm(const axc_runtime *rt) { return rt ? rt->comm : NULL; }
axc_sched *axc_runtime_sched(const axc_runtime *rt) { return rt ? rt->sched : NULL; }
axc_buckets *axc_runtime_buckets(const axc_runtime *rt) { return rt ? rt->buckets : NULL; }
axc_keeps *axc_runtime_keeps(const axc_runtime *rt) { return rt ? rt->keeps : NULL; }
axc_timeline *axc_runtime_timeline(const axc_runtime *rt) { return rt ? rt->timeline : NULL; }

axc_grad_records *axc_runtime_records(const axc_runtime *rt) { return rt ? rt->records : NULL; }

axc_layer_residuals *axc_runtime_layer_residuals(const axc_runtime *rt)
{
    return rt ? rt->layer_residuals : NULL;
}

/* A due sum this rank could not start (`st`, before its collective was entered) leaves its
 * peers waiting in theirs: unless every rank fails alike (a collective refused by its
 * description: INVALID, UNAVAILABLE; a usage error: STATE; a communicator already failed or
 * aborted: PEER, TIMEOUT), the job's collectives are aborted (without the GIL: on nccl the
 * abort may take a while) so that they fail at once, naming this rank's error, instead of at
 * the timeout. */
static axc_status unstarted_sum(axc_runtime *rt, axc_status st, axc_group_kind group)
{
    if (!rt->comm || st == AXC_ERR_INVALID || st == AXC_ERR_UNAVAILABLE || st == AXC_ERR_STATE ||
        st == AXC_ERR_PEER || st == AXC_ERR_TIMEOUT)
        return st;
    char msg[512];
    snprintf(msg, sizeof msg, "rank %d could not start a gradient sum over the %s group: %s",
             axc_comm_rank(rt->comm), axc_group_name(group), axc_last_error());
    void *b = blocking_begin(rt);
    st = axc_comm_abort(rt->comm, st, msg);
    blocking_end(rt, b);
    return st;
}

axc_status axc_runtime_start_due_sums(axc_runtime *rt)
{
    if (rt->starting)
        return AXC_OK;
    rt->starting = 1;
    axc_bucket_sum sum;
    axc_status st = AXC_OK;
    int more;
    /* (next_sum may allocate a residual through the ops: with the caller's lock held) */
    while (st == AXC_OK && (more = axc_buckets_next_sum(rt->buckets, &sum)) != 0) {
        if (more < 0) { /* (the ops set the message) */
            st = unstarted_sum(rt, AXC_ERR_NOMEM, sum.group);
            break;
        }
        axc_sched *sched = rt->sched; /* (read while the caller's lock is held) */
        if (!sched) {
            st = axc_fail(AXC_ERR_STATE, "axonn_c is not initialised: call axonn_c.init(...) "
                                         "first");
            break;
        }
        axc_coll c = {.kind = AXC_COLL_ALL_REDUCE, .send = sum.data, .recv = sum.data,
                      .count = sum.count, .dtype = sum.dtype, .op = AXC_RED_SUM,
                      .device = sum.device, .codec = sum.codec, .block = sum.block,
                      .residual = sum.residual, .check = sum.check};
        if (sum.device >= 0 && (st = axc_torch_cuda_current_stream(sum.device, &c.stream)))
            st = unstarted_sum(rt, st, sum.group);
        if (st == AXC_OK) {
            void *b = blocking_begin(rt);
            /* (the queued tasks first: a task's error is returned after its sum started) */
            axc_status ts = axc_sched_run_tasks(sched);
            int started = 0; /* (an error after the start: its peers are not left waiting) */
            st = axc_sched_start_after_deferred(sched, sum.group, &c, &started);
            blocking_end(rt, b);
            if (st != AXC_OK && !started)
                st = unstarted_sum(rt, st, sum.group);
            else
                st = ts;
        }
    }
    rt->starting = 0;
    return st;
}

void axc_runtime_grad_arrived(axc_runtime *rt, long long pass)
{
    rt->grad_arrivals++;
    if (pass >= 0)
        rt->grad_arrivals_pass = pass;
}
int axc_runtime_grad_pass_counted(const axc_runtime *rt, long long pass)
{
    return pass >= 0 && rt->grad_arrivals_pass == pass;
}
unsigned long long axc_runtime_grad_arrivals(const axc_runtime *rt) { return rt->grad_arrivals; }
unsigned long long axc_runtime_new_grad_ident(axc_runtime *rt) { return ++rt->grad_idents; }
unsigned long long axc_runtime_process_token(const axc_runtime *rt) { return rt->process_token; }

void axc_runtime_set_grad_sync(axc_runtime *rt, int on) { rt->grad_sync = on != 0; }
int axc_runtime_grad_sync(const axc_runtime *rt) { return rt->grad_sync; }
void axc_runtime_set_overlap_data(axc_runtime *rt, int on) { rt->overlap_data = on != 0; }
int axc_runtime_overlap_data(const axc_runtime *rt) { return rt->overlap_data; }
void axc_runtime_set_grad_bucket_bytes(axc_runtime *rt, size_t bytes)
{
    if (bytes > 0)
        rt->grad_bucket_bytes = bytes;
}
size_t axc_runtime_grad_bucket_bytes(const axc_runtime *rt) { return rt->grad_bucket_bytes; }
void axc_set_microbatch_thread(int on) { t_microbatch = on != 0; }
int axc_microbatch_thread(void) { return t_microbatch; }

int axc_runtime_grads_idle(const axc_runtime *rt)
{
    return !axc_records_count(rt->records) && !axc_records_taken(rt->records) &&
           !axc_keeps_count(rt->keeps, AXC_KEEP_RESULT) && !axc_buckets_open(rt->buckets);
}

int axc_runtime_grad_needs_work(const axc_runtime *rt, uintptr_t key, int own_overlap,
                                const axc_groups *groups)
{
    /* (its own mark only: another parameter's never changes what happens to this gradient) */
    if (t_microbatch || !axc_runtime_grads_idle(rt) ||
        (axc_records_marks(rt->records) && axc_records_marked(rt->records, key, NULL, NULL)))
        return 1;
    if (!rt->comm || !rt->grad_sync || !(own_overlap < 0 ? rt->overlap_data : own_overlap))
        return 0;
    const axc_grid *grid = axc_comm_grid(rt->comm);
    for (int i = 0; groups && i < groups->n; i++)
        if (axc_grid_group_size(grid, groups->g[i]) > 1)
            return 1;
    return 0;
}

axc_status axc_runtime_mb_begin(axc_runtime *rt, const void *owner, int n, size_t bucket_bytes,
                                axc_mb **out)
{
    if (out)
        *out = NULL;
    if (rt->mb)
        return axc_fail(AXC_ERR_STATE, "run_concurrent is already running: one call at a time");
    AXC_TRY(axc_mb_create(&rt->mb, n, bucket_bytes, rt->comm, rt->comm ? rt->mbmem : NULL));
    rt->mb_owner = owner;
    if (out)
        *out = rt->mb;
    return AXC_OK;
}

axc_mb *axc_runtime_mb(const axc_runtime *rt) { return rt ? rt->mb : NULL; }
axc_mb_memory *axc_runtime_mb_memory(const axc_runtime *rt) { return rt ? rt->mbmem : NULL; }

void axc_runtime_mb_end(axc_runtime *rt)
{
    axc_mb_destroy(rt->mb);
    rt->mb = NULL;
    rt->mb_owner = NULL;
}

int axc_runtime_mb_end_owned(axc_runtime *rt, const void *owner)
{
    if (!rt->mb || rt->mb_owner != owner)
        return 0;
    axc_runtime_mb_end(rt);
    return 1;
}
