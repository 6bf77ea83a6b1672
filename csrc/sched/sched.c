/* The cross-layer scheduler: learned-order prefetch of depth all-gathers, gathered-weight
 * lifetimes and their memory accounting, and deferred collectives (see axc/sched.h). */
#include "axc/sched.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <time.h>

#include "axc/cuda_rt.h"
#include "axc/thread_channel.h"
#include "axc/torch_shim.h"

typedef struct visit {
    int32_t layer, phase;
} visit;

typedef struct layer_slot {
    int used;
    /* the shard as last seen (what a prefetch reads) */
    const void *shard;
    int64_t shard_elems, version;
    axc_dtype dtype;
    int device;
    int prefetch_ok;
    int own_codec; /* the layer's depth codec (axc_sched_weight) */
    axc_codec codec;
    int block;
    /* the gathered weight, if any */
    void *full;
    size_t full_bytes;
    const void *full_src;
    int64_t full_version;
    /* the codec and block it was gathered with: a layer whose depth codec changed since
     * (Linear.compression, optimize_communication) gathers again */
    axc_codec full_codec;
    int full_block;
    /* CUDA: the stream its gather and every reader so far are ordered on (it was allocated
     * there; a visit on another stream first waits for it on the host, then owns it); frees go
     * there */
    void *full_stream;
    /* CUDA: the buffer is a block of torch's caching allocator, which belongs to the stream it
     * was allocated on (else it came from cudaMallocAsync, freed on full_stream) */
    int full_from_torch;
    void *full_alloc_stream;
    axc_work *gather;  /* in flight, or NULL once waited */
    int64_t pos;       /* position of its current visit in the learned order, -1 if none */
} layer_slot;

typedef struct visit_list {
    visit *v;
    size_t len, cap;
} visit_list;

/* A collective whose output a later call reads (axc_sched_hold_result). */
typedef struct held_result {
    const unsigned char *lo;
    size_t bytes;
    axc_work *w;
} held_result;

struct axc_sched {
    pthread_mutex_t mu;
    axc_comm *comm;
    axc_sched_config cfg;
    layer_slot *layers;
    int nlayers;
    visit_list order, trace;
    int trace_has_bwd;
    int on_order; /* the running trace is still a prefix of the learned order */
    axc_work **pending;
    size_t npending, pending_cap;
    axc_sched_task *tasks; /* a FIFO: [task_head, ntasks) */
    size_t task_head, ntasks, task_cap;
    uint64_t tasks_added, tasks_done; /* monotonic (not reset with the stats): task numbers */
    held_result *held; /* a FIFO: [held_head, nheld) */
    size_t held_head, nheld, held_cap;
    uint64_t held_added, held_done; /* monotonic: result numbers */
    axc_sched_stats st;
    axc_sched_event log[AXC_SCHED_LOG_CAP];
    size_t log_len, log_head;
};

/* ------------------------------------------------------------------ small helpers */

static void log_event(axc_sched *s, int kind, visit v)
{
    size_t i = (s->log_head + s->log_len) % AXC_SCHED_LOG_CAP;
    s->log[i] = (axc_sched_event){kind, v.layer, v.phase};
    if (s->log_len < AXC_SCHED_LOG_CAP)
        s->log_len++;
    else
        s->log_head = (s->log_head + 1) % AXC_SCHED_LOG_CAP;
}

static axc_status list_push(visit_list *l, visit v)
{
    if (l->len == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        visit *nv = realloc(l->v, cap * sizeof *nv);
        if (!nv)
            return axc_fail(AXC_ERR_NOMEM, "scheduler: out of memory recording the layer order");
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->len++] = v;
    return AXC_OK;
}

static int same(visit a, visit b) { return a.layer == b.layer && a.phase == b.phase; }

static layer_slot *slot(axc_sched *s, int id)
{
    return (id >= 0 && id < s->nlayers && s->layers[id].used) ? &s->layers[id] : NULL;
}

/* ------------------------------------------------------------------ gathered buffers */

static axc_status buf_alloc(axc_sched *s, layer_slot *L, size_t bytes, void *stream)
{
    void *p = NULL;
    size_t nb = bytes ? bytes : 1; /* an empty weight still gets a buffer (NULL means none) */
    if (L->device < 0) {
        p = aligned_alloc(64, (nb + 63) / 64 * 64);
        if (!p)
            return axc_fail(AXC_ERR_NOMEM, "scheduler: out of memory for a %zu-byte gathered "
                                           "weight", bytes);
    } else {
        /* torch's caching allocator where torch is there (its cached free blocks serve us, and
         * torch.cuda.memory_allocated() counts us); CUDA's stream-ordered pool otherwise */
        const axc_torch_cuda_api *tc = NULL;
        (void)axc_torch_cuda_load(&tc); /* NULL when unavailable */
        const axc_cuda_api *cu;
        int prev;
        AXC_TRY(axc_cuda_device_enter(L->device, &cu, &prev, "scheduler"));
        axc_status st = AXC_OK;
        if (tc)
            st = axc_torch_cuda_alloc(tc, nb, L->device, stream, &p);
        else if (!cu->MallocAsync)
            st = axc_fail(AXC_ERR_UNAVAILABLE,
                          "scheduler: the CUDA runtime has no cudaMallocAsync (CUDA >= 11.2 "
                          "needed for gathered weights)");
        else
            st = axc_cuda_check(cu->MallocAsync(&p, nb, stream), "cudaMallocAsync");
        AXC_TRY(axc_cuda_device_leave(cu, L->device, prev, st));
        L->full_from_torch = tc != NULL;
        L->full_alloc_stream = stream;
        s->st.torch_buffers += tc != NULL;
    }
    L->full = p;
    L->full_bytes = bytes;
    L->full_stream = stream;
    s->st.alive_bytes += bytes;
    s->st.alive_buffers++;
    if (s->st.alive_bytes > s->st.peak_bytes)
        s->st.peak_bytes = s->st.alive_bytes;
    if (s->st.alive_buffers > s->st.peak_buffers)
        s->st.peak_buffers = s->st.alive_buffers;
    return AXC_OK;
}

/* Makes `stream` the buffer's (L->full_stream): what is queued there next must not run ahead
 * of the gather or of readers on the old one, so when they differ (a prefetch used on another
 * stream, readers on two streams: rare) the old one is waited for on the host. (NULL is a
 * stream too: torch's default one.) */
static axc_status move_to_stream(layer_slot *L, void *stream)
{
    if (L->device < 0 || !L->full || stream == L->full_stream)
        return AXC_OK;
    const axc_cuda_api *cu;
    int prev;
    AXC_TRY(axc_cuda_device_enter(L->device, &cu, &prev, "scheduler"));
    axc_status st = axc_cuda_check(cu->StreamSynchronize(L->full_stream),
                                   "cudaStreamSynchronize (a gathered weight used on two streams)");
    if (st == AXC_OK)
        L->full_stream = stream;
    return axc_cuda_device_leave(cu, L->device, prev, st);
}

/* Hands a block of torch's caching allocator back. torch gives it to the next allocation on
 * the stream it was allocated on at once, and that stream is ordered after the gather (the
 * wait joined it) and after the readers that ran there; readers on another stream (the buffer
 * moved: rare) are waited for on the host first. A block is never freed while that is unsure:
 * it is kept (leaked) rather than handed out under a reader. */
static axc_status torch_block_free(layer_slot *L, const axc_cuda_api *cu)
{
    const axc_torch_cuda_api *tc = NULL;
    AXC_TRY(axc_torch_cuda_load(&tc));
    if (L->full_stream != L->full_alloc_stream)
        AXC_TRY(axc_cuda_check(cu->StreamSynchronize(L->full_stream),
                               "cudaStreamSynchronize (a gathered weight read on another stream "
                               "than the one it was allocated on)"));
    return axc_torch_check(tc->raw_delete(L->full), "freeing a gathered weight to torch's CUDA "
                                                    "caching allocator");
}

/* Frees L's buffer (CUDA: after the gather and every reader, see above). A device buffer whose
 * gather failed stays allocated: a failed wait does not order the collective's kernel before
 * anything (it may be aborted, or not started yet), and freed memory could be handed out under
 * it; the job is broken anyway. So does a host buffer whose gather timed out still owned by the
 * backend (gather_failed == 2): axc_work_free leaked that work, which may still write it. Keeps
 * the first error. */
static axc_status buf_free(axc_sched *s, layer_slot *L, int gather_failed, axc_status st)
{
    if (!L->full)
        return st;
    if (L->device < 0 && gather_failed == 2) {
        axc_log(2, "scheduler: a %zu-byte gathered weight stays allocated: its gather timed "
                   "out and may still write it",
                L->full_bytes);
    } else if (L->device < 0) {
        free(L->full);
    } else if (gather_failed) {
        axc_log(2, "scheduler: a %zu-byte gathered weight on cuda:%d stays allocated: its gather "
                   "failed and may still write it",
                L->full_bytes, L->device);
    } else {
        const axc_cuda_api *cu;
        int prev;
        axc_status cs = axc_cuda_device_enter(L->device, &cu, &prev, "scheduler");
        if (cs == AXC_OK) {
            if (L->full_from_torch)
                cs = torch_block_free(L, cu);
            else
                cs = axc_cuda_check(cu->FreeAsync(L->full, L->full_stream), "cudaFreeAsync");
            cs = axc_cuda_device_leave(cu, L->device, prev, cs);
        }
        if (st == AXC_OK)
            st = cs;
    }
    s->st.alive_bytes -= L->full_bytes;
    s->st.alive_buffers--;
    L->full = NULL;
    L->full_bytes = 0;
    return st;
}

/* Waits for L's gather (if any) and lets its work go: 0 done (or none), 1 failed, 2 timed out
 * and still owned by the backend after axc_work_free's abort (the work leaked, and buf_free
 * leaks its buffer). *st keeps the first error. */
static int gather_settle(layer_slot *L, axc_status *st)
{
    if (!L->gather)
        return 0;
    axc_status ws = axc_work_wait(L->gather);
    int owned = !axc_work_free(L->gather);
    L->gather = NULL;
    if (*st == AXC_OK)
        *st = ws;
    return owned ? 2 : ws != AXC_OK;
}

/* Waits for the layer's gather (if any) and frees its buffer. Keeps the first error. */
static axc_status buf_drop(axc_sched *s, layer_slot *L, axc_status st)
{
    int failed = gather_settle(L, &st);
    return buf_free(s, L, failed, st);
}

/* The depth all-gather of L's last-seen shard (into L->full), with the codec it takes now. */
static axc_coll gather_coll(const axc_sched *s, const layer_slot *L, void *stream)
{
    axc_coll c = {0};
    c.kind = AXC_COLL_ALL_GATHER;
    c.send = L->shard;
    c.recv = L->full;
    c.count = (size_t)L->shard_elems;
    c.dtype = L->dtype;
    c.device = L->device;
    c.stream = stream;
    if (L->own_codec)
        axc_comm_apply_codec(s->comm, L->codec, L->block, &c);
    else
        axc_comm_apply_layer_codec(s->comm, AXC_GROUP_DEPTH, &c);
    return c;
}

/* Starts the depth all-gather of L's last-seen shard into a new buffer. */
static axc_status gather_start(axc_sched *s, layer_slot *L, void *stream)
{
    const axc_grid *g = axc_comm_grid(s->comm);
    size_t bytes = (size_t)L->shard_elems * (size_t)g->G_d * axc_dtype_size(L->dtype);
    AXC_TRY(buf_alloc(s, L, bytes, stream));
    axc_coll c = gather_coll(s, L, stream);
    L->full_codec = c.codec;
    L->full_block = c.block;
    axc_status st = axc_comm_start(s->comm, AXC_GROUP_DEPTH, &c, &L->gather);
    if (st != AXC_OK) { /* refused arguments never reached the transport */
        L->gather = NULL;
        return buf_free(s, L, st != AXC_ERR_INVALID, st);
    }
    L->full_src = L->shard;
    L->full_version = L->version;
    return AXC_OK;
}

/* A prefetch reads the shard's values at issue time, whose version the core cannot see (torch
 * bumps it in place); it is recorded as -1 and adopted at the visit. So a weight modified in
 * place mid-step, between its prefetch and its use, is not detected; one modified between steps
 * is (nothing gathered survives a step). */
static int fresh(const axc_sched *s, const layer_slot *L)
{
    if (!L->full)
        return 0;
    axc_coll now = gather_coll(s, L, NULL);
    return L->full_src == L->shard && now.codec == L->full_codec &&
           now.block == L->full_block &&
           (L->full_version == -1 || L->full_version == L->version);
}

/* ------------------------------------------------------------------ order learning */

/* `learn`: the trace may become the learned order (0: a step that did not complete) */
static axc_status step_boundary(axc_sched *s, int learn)
{
    axc_status st = AXC_OK;
    if (learn && s->trace.len > 0) {
        int differs = s->trace.len != s->order.len ||
                      memcmp(s->trace.v, s->order.v, s->trace.len * sizeof(visit)) != 0;
        if (differs) {
            visit_list t = s->order; /* swap: the trace's storage becomes the order's */
            s->order = s->trace;
            s->trace = t;
            s->st.relearned++;
        }
    }
    s->trace.len = 0;
    s->trace_has_bwd = 0;
    s->on_order = 1;
    /* nothing gathered outlives a step (the optimizer changes every weight in between);
     * caching keeps a layer's forward gather for its backward within the step */
    for (int i = 0; i < s->nlayers; i++) {
        layer_slot *L = &s->layers[i];
        L->pos = -1;
        if (L->used && L->full)
            st = buf_drop(s, L, st);
    }
    return st;
}

/* Records visit v; returns its position in the learned order, or -1 when off the order. */
static axc_status record(axc_sched *s, visit v, int64_t *pos)
{
    /* a forward-only loop (evaluation) has no backward end: its step ends where it repeats.
     * A forward after backward visits is not a boundary: activation checkpointing recomputes
     * forwards inside backward */
    if (v.phase == AXC_PHASE_FWD && s->trace.len > 0 && !s->trace_has_bwd &&
        same(v, s->trace.v[0]))
        AXC_TRY(step_boundary(s, 1));
    size_t i = s->trace.len;
    AXC_TRY(list_push(&s->trace, v));
    if (v.phase == AXC_PHASE_BWD)
        s->trace_has_bwd = 1;
    if (s->on_order && (i >= s->order.len || !same(s->order.v[i], v))) {
        s->on_order = 0;
        if (s->order.len > 0)
            s->st.off_order++;
    }
    *pos = s->on_order ? (int64_t)i : -1;
    return AXC_OK;
}

/* ------------------------------------------------------------------ public API */

axc_status axc_sched_create(axc_sched **out, axc_comm *comm)
{
    axc_sched *s = calloc(1, sizeof *s);
    if (!s)
        return axc_fail(AXC_ERR_NOMEM, "out of memory creating the scheduler");
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s);
        return axc_fail(AXC_ERR_SYSTEM, "scheduler: pthread_mutex_init failed");
    }
    s->comm = comm;
    s->cfg.prefetch = 1;
    s->on_order = 1;
    *out = s;
    return AXC_OK;
}

void axc_sched_destroy(axc_sched *s)
{
    if (!s)
        return;
    /* tasks are dropped, not run: what they read may be gone (the caller's tensors) */
    for (size_t i = s->task_head; i < s->ntasks; i++)
        if (s->tasks[i].drop)
            s->tasks[i].drop(s->tasks[i].arg);
    free(s->tasks);
    s->ntasks = s->task_head = 0;
    (void)axc_sched_finish(s);
    for (int i = 0; i < s->nlayers; i++)
        if (s->layers[i].used)
            (void)buf_drop(s, &s->layers[i], AXC_OK);
    free(s->layers);
    free(s->order.v);
    free(s->trace.v);
    free(s->pending);
    free(s->held);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

axc_status axc_sched_configure(axc_sched *s, const axc_sched_config *cfg)
{
    if (cfg->prefetch < 0 || cfg->prefetch > 64)
        return axc_fail(AXC_ERR_INVALID, "prefetch must be in [0, 64] layers, got %d",
                        cfg->prefetch);
    if (cfg->budget_bytes < 0)
        return axc_fail(AXC_ERR_INVALID, "prefetch budget must be >= 0 bytes, got %lld",
                        (long long)cfg->budget_bytes);
    pthread_mutex_lock(&s->mu);
    s->cfg = *cfg;
    pthread_mutex_unlock(&s->mu);
    return AXC_OK;
}

void axc_sched_get_config(const axc_sched *s, axc_sched_config *cfg) { *cfg = s->cfg; }

axc_status axc_sched_layer_new(axc_sched *s, int *id)
{
    pthread_mutex_lock(&s->mu);
    int i = 0;
    while (i < s->nlayers && s->layers[i].used)
        i++;
    if (i == s->nlayers) {
        layer_slot *nl = realloc(s->layers, (size_t)(s->nlayers + 1) * sizeof *nl);
        if (!nl) {
            pthread_mutex_unlock(&s->mu);
            return axc_fail(AXC_ERR_NOMEM, "scheduler: out of memory registering a layer");
        }
        s->layers = nl;
        s->nlayers++;
    }
    memset(&s->layers[i], 0, sizeof s->layers[i]);
    s->layers[i].used = 1;
    s->layers[i].pos = -1;
    *id = i;
    pthread_mutex_unlock(&s->mu);
    return AXC_OK;
}

void axc_sched_forget(axc_sched *s, int id)
{
    pthread_mutex_lock(&s->mu);
    layer_slot *L = slot(s, id);
    if (L) {
        (void)buf_drop(s, L, AXC_OK);
        memset(L, 0, sizeof *L);
        /* an id reused by another layer must not inherit this one's place in the order */
        s->order.len = 0;
        s->on_order = 0;
    }
    pthread_mutex_unlock(&s->mu);
}

axc_status axc_sched_shard_passing(axc_sched *s, int id, const void *shard)
{
    pthread_mutex_lock(&s->mu);
    axc_status st = AXC_OK;
    layer_slot *L = slot(s, id);
    if (L && L->shard != shard) {
        /* (a buffer is always gathered from L->shard: acquire drops any other one) */
        st = buf_drop(s, L, AXC_OK);
        L->shard = NULL; /* no prefetch from the old one until the visit names the new one */
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* Issues the gathers of the visits after position `pos` (see the header). */
static axc_status prefetch_after(axc_sched *s, int64_t pos, int self, void *stream)
{
    for (int j = 1; j <= s->cfg.prefetch && pos + j < (int64_t)s->order.len; j++) {
        visit u = s->order.v[pos + j];
        layer_slot *U = slot(s, u.layer);
        if (!U || u.layer == self || !U->prefetch_ok || !U->shard || fresh(s, U))
            continue;
        size_t need = (size_t)U->shard_elems * (size_t)axc_comm_grid(s->comm)->G_d *
                      axc_dtype_size(U->dtype);
        if (s->cfg.budget_bytes > 0 && s->st.alive_bytes + need > (uint64_t)s->cfg.budget_bytes) {
            s->st.budget_skips++;
            break; /* later visits would overtake this one in memory order */
        }
        if (U->full)
            AXC_TRY(buf_drop(s, U, AXC_OK));
        /* the prefetch is ordered on this visit's stream, after everything queued so far */
        AXC_TRY(gather_start(s, U, U->device == -1 ? NULL : stream));
        U->full_version = -1;
        s->st.prefetches++;
        log_event(s, AXC_EV_PREFETCH, u);
    }
    return AXC_OK;
}

static axc_status acquire_locked(axc_sched *s, const axc_sched_weight *w, const void **full)
{
    layer_slot *L = slot(s, w->layer);
    if (!L)
        return axc_fail(AXC_ERR_INVALID, "scheduler: unknown layer id %d", w->layer);
    visit v = {w->layer, w->phase};
    int64_t pos;
    AXC_TRY(record(s, v, &pos));
    L->pos = pos;
    if (L->shard_elems != w->shard_elems || L->dtype != w->dtype || L->device != w->device)
        AXC_TRY(buf_drop(s, L, AXC_OK)); /* the layer changed shape/dtype/device */
    L->shard = w->shard;
    L->shard_elems = w->shard_elems;
    L->version = w->version;
    L->dtype = w->dtype;
    L->device = w->device;
    L->prefetch_ok = w->prefetch_ok;
    L->own_codec = w->own_codec;
    L->codec = w->codec;
    L->block = w->block;
    s->st.visits++;
    int kind;
    if (L->full && !fresh(s, L)) {
        s->st.stale++;
        AXC_TRY(buf_drop(s, L, AXC_OK));
    }
    if (!L->full) {
        kind = AXC_EV_MISS;
        AXC_TRY(gather_start(s, L, w->stream));
    } else {
        kind = (!L->gather || axc_work_done(L->gather)) ? AXC_EV_HIT : AXC_EV_WAIT;
    }
    L->full_version = L->version;
    if (kind == AXC_EV_MISS)
        s->st.misses++;
    else if (kind == AXC_EV_HIT)
        s->st.hits++;
    else
        s->st.waits++;
    log_event(s, kind, v);
    if (pos >= 0)
        AXC_TRY(prefetch_after(s, pos, w->layer, w->stream));
    axc_status st = AXC_OK;
    int failed = gather_settle(L, &st);
    if (st == AXC_OK)
        st = move_to_stream(L, w->stream);
    if (st != AXC_OK)
        return buf_free(s, L, failed ? failed : 1, st);
    *full = L->full;
    return AXC_OK;
}

axc_status axc_sched_acquire(axc_sched *s, const axc_sched_weight *w, const void **full)
{
    pthread_mutex_lock(&s->mu);
    axc_status st = acquire_locked(s, w, full);
    pthread_mutex_unlock(&s->mu);
    return st;
}

axc_status axc_sched_release(axc_sched *s, int layer, void *stream)
{
    pthread_mutex_lock(&s->mu);
    axc_status st = AXC_OK;
    layer_slot *L = slot(s, layer);
    if (L && L->full) {
        /* kept: cached until the step ends, or needed again within the prefetch window (not
         * gathered twice) */
        int keep = s->cfg.cache;
        for (int j = 1; L->pos >= 0 && j <= s->cfg.prefetch &&
                        L->pos + j < (int64_t)s->order.len && !keep;
             j++)
            keep = s->order.v[L->pos + j].layer == layer;
        /* its readers were queued on `stream`: the free, now or later, must follow them */
        st = move_to_stream(L, stream);
        if (!keep)
            st = buf_drop(s, L, st);
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

axc_status axc_sched_step_end(axc_sched *s)
{
    pthread_mutex_lock(&s->mu);
    axc_status st = step_boundary(s, 1);
    pthread_mutex_unlock(&s->mu);
    return st;
}

axc_status axc_sched_step_abort(axc_sched *s)
{
    pthread_mutex_lock(&s->mu);
    axc_status st = step_boundary(s, 0);
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* Grows *arr (of *cap elements of `elem` bytes, `len` used) so that one more fits; 0 when out
 * of memory (the array is left as it was). */
static int room_for_one(void **arr, size_t *cap, size_t len, size_t elem)
{
    if (len < *cap)
        return 1;
    size_t ncap = *cap ? *cap * 2 : 64;
    void *n = realloc(*arr, ncap * elem);
    if (!n)
        return 0;
    *arr = n;
    *cap = ncap;
    return 1;
}

static axc_status defer_locked(axc_sched *s, axc_work *w)
{
    if (!room_for_one((void **)&s->pending, &s->pending_cap, s->npending, sizeof *s->pending)) {
        axc_status st = axc_work_wait(w);
        axc_work_free(w);
        return st != AXC_OK ? st
                            : axc_fail(AXC_ERR_NOMEM, "scheduler: out of memory deferring "
                                                      "a collective (it was completed now)");
    }
    s->pending[s->npending++] = w;
    s->st.deferred++;
    return AXC_OK;
}

axc_status axc_sched_defer(axc_sched *s, axc_work *w)
{
    if (!w)
        return AXC_OK;
    pthread_mutex_lock(&s->mu);
    axc_status st = defer_locked(s, w);
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* Runs one task taken off the queue (outside the lock: it may defer collectives or add tasks)
 * and counts it done. */
static axc_status run_task(axc_sched *s, axc_sched_task t)
{
    axc_status st = t.run(t.arg);
    if (t.drop)
        t.drop(t.arg);
    pthread_mutex_lock(&s->mu);
    s->tasks_done++;
    pthread_mutex_unlock(&s->mu);
    return st;
}

axc_status axc_sched_add_task(axc_sched *s, axc_sched_task t, uint64_t *number)
{
    pthread_mutex_lock(&s->mu);
    if (s->task_head > 0 && s->task_head == s->ntasks)
        s->task_head = s->ntasks = 0; /* empty: start over at the front */
    int queued = room_for_one((void **)&s->tasks, &s->task_cap, s->ntasks, sizeof *s->tasks);
    if (queued)
        s->tasks[s->ntasks++] = t;
    s->tasks_added++;
    if (number)
        *number = s->tasks_added;
    pthread_mutex_unlock(&s->mu);
    if (queued)
        return AXC_OK;
    /* out of memory: run it now, after the queued ones (tasks_run stays "every task up to this
     * number") */
    axc_status st = axc_sched_run_tasks(s);
    axc_status ts = run_task(s, t);
    st = st != AXC_OK ? st : ts;
    return st != AXC_OK ? st
                        : axc_fail(AXC_ERR_NOMEM, "scheduler: out of memory deferring a task "
                                                  "(it was run now)");
}

axc_status axc_sched_run_tasks(axc_sched *s)
{
    axc_status st = AXC_OK;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (s->task_head == s->ntasks) {
            pthread_mutex_unlock(&s->mu);
            return st;
        }
        axc_sched_task t = s->tasks[s->task_head++];
        pthread_mutex_unlock(&s->mu);
        axc_status ts = run_task(s, t);
        if (st == AXC_OK)
            st = ts;
    }
}

axc_status axc_sched_start_after_deferred(axc_sched *s, axc_group_kind group, const axc_coll *c,
                                         int *started)
{
    /* the collective may read what a queued task writes (a dW GEMM into a gradient bucket);
     * it starts even when a task failed, so that a failure on one rank does not leave its
     * peers waiting in the collective: the task's error is returned afterwards */
    axc_status ts = axc_sched_run_tasks(s);
    pthread_mutex_lock(&s->mu);
    /* groups progress independently: this one reads what the deferred ones write */
    axc_work *w = NULL;
    axc_status st = axc_comm_start_after(s->comm, group, c, s->pending, s->npending, &w);
    if (started)
        *started = st == AXC_OK;
    if (st == AXC_OK)
        st = defer_locked(s, w);
    pthread_mutex_unlock(&s->mu);
    return ts != AXC_OK ? ts : st;
}

/* ------------------------------------------------------------------ held results */

axc_status axc_sched_hold_result(axc_sched *s, const void *ptr, size_t bytes, axc_work *w,
                                 uint64_t *number)
{
    if (!w)
        return AXC_OK;
    pthread_mutex_lock(&s->mu);
    if (s->held_head > 0 && s->held_head == s->nheld)
        s->held_head = s->nheld = 0; /* empty: start over at the front */
    int kept = room_for_one((void **)&s->held, &s->held_cap, s->nheld, sizeof *s->held);
    if (kept)
        s->held[s->nheld++] = (held_result){ptr, bytes, w};
    s->held_added++;
    if (number)
        *number = s->held_added;
    pthread_mutex_unlock(&s->mu);
    if (kept)
        return AXC_OK;
    /* out of memory: complete the older ones and this one now (numbers stay in order) */
    axc_status st = axc_sched_await_results(s);
    axc_status ws = axc_work_wait(w);
    axc_work_free(w);
    pthread_mutex_lock(&s->mu);
    s->held_done = s->held_added;
    pthread_mutex_unlock(&s->mu);
    st = st != AXC_OK ? st : ws;
    return st != AXC_OK ? st
                        : axc_fail(AXC_ERR_NOMEM, "scheduler: out of memory holding a result "
                                                  "(it was completed now)");
}

/* Takes the held results numbered up to `upto` off the FIFO, waits for them outside the lock
 * (the progress of other groups needs none of it) and counts them done; keeps the first error.
 * Each is taken under the lock, so a concurrent caller never takes one twice. */
static axc_status await_upto(axc_sched *s, uint64_t upto)
{
    axc_status st = AXC_OK;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (s->held_head == s->nheld || s->held_done + 1 > upto) {
            pthread_mutex_unlock(&s->mu);
            return st;
        }
        axc_work *w = s->held[s->held_head++].w;
        pthread_mutex_unlock(&s->mu);
        axc_status ws = axc_work_wait(w);
        axc_work_free(w);
        pthread_mutex_lock(&s->mu);
        s->held_done++;
        pthread_mutex_unlock(&s->mu);
        if (st == AXC_OK)
            st = ws;
    }
}

axc_status axc_sched_await_number(axc_sched *s, uint64_t number) { return await_upto(s, number); }

axc_status axc_sched_await_result(axc_sched *s, const void *ptr, size_t bytes)
{
    const unsigned char *lo = ptr, *hi = lo + bytes;
    uint64_t upto = 0; /* the FIFO holds numbers held_done + 1 ... in order */
    pthread_mutex_lock(&s->mu);
    for (size_t i = s->held_head; i < s->nheld; i++) {
        const held_result *h = &s->held[i];
        if (h->lo < hi && lo < h->lo + h->bytes)
            upto = s->held_done + (i - s->held_head) + 1;
    }
    pthread_mutex_unlock(&s->mu);
    return await_upto(s, upto);
}

axc_status axc_sched_await_results(axc_sched *s) { return await_upto(s, UINT64_MAX); }

/* ------------------------------------------------------------------ finish */

axc_status axc_sched_finish(axc_sched *s)
{
    axc_status st = axc_sched_run_tasks(s);
    axc_status hs = axc_sched_await_results(s);
    st = st != AXC_OK ? st : hs;
    pthread_mutex_lock(&s->mu);
    /* all waited before any is freed: a pending work may be another's `after` */
    for (size_t i = 0; i < s->npending; i++) {
        axc_status ws = axc_work_wait(s->pending[i]);
        if (st == AXC_OK)
            st = ws;
    }
    /* freed last first: a pending work may be a later one's `after`, which the later one's
     * lane reads until it has ended (see axc_comm_start_after); one that could not be let go
     * (leaked by axc_work_free: still running) keeps every earlier one too */
    int keep = 0;
    for (size_t i = s->npending; i-- > 0;)
        keep = keep || !axc_work_free(s->pending[i]);
    s->npending = 0;
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* axc_sched_finish on a thread of its own (axc_sched_finish_start) */
struct axc_sched_finishing {
    axc_sched *s;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    int channel; /* the starting thread's comm channel: its waits' spans carry it */
    int device;  /* the starting thread's CUDA device (-1: none): a new thread starts on 0 */
    axc_status status;
    char msg[1024]; /* its error message (the message is per thread) */
};

static void *finishing_main(void *arg)
{
    axc_sched_finishing *f = arg;
    axc_thread_channel_set(f->channel);
    /* the waits query events of the starter's device; on device 0 they would create a
     * context there (on every rank of a node). A failure is only logged: the works must be
     * waited for all the same */
    const axc_cuda_api *cu = NULL;
    int cur = -1; /* (a new thread reads 0 without making a context; set only if different) */
    if (f->device >= 0 && axc_cuda_load(&cu) == AXC_OK &&
        (cu->GetDevice(&cur) != 0 || cur != f->device) && cu->SetDevice(f->device) != 0)
        axc_log(2, "scheduler finish thread: cudaSetDevice(%d) failed", f->device);
    axc_status st = axc_sched_finish(f->s);
    pthread_mutex_lock(&f->mu);
    f->status = st;
    if (st != AXC_OK)
        snprintf(f->msg, sizeof f->msg, "%s", axc_last_error());
    f->done = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

axc_status axc_sched_finish_start(axc_sched *s, axc_sched_finishing **out)
{
    *out = NULL;
    axc_sched_finishing *f = calloc(1, sizeof *f);
    if (!f)
        return axc_fail(AXC_ERR_NOMEM, "scheduler: out of memory starting a finish");
    f->s = s;
    f->channel = axc_thread_channel();
    f->device = axc_cuda_current_device();
    pthread_mutex_init(&f->mu, NULL);
    pthread_condattr_t ca; /* (monotonic: a step of the wall clock cannot stretch a slice) */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&f->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&f->thread, NULL, finishing_main, f) != 0) {
        pthread_cond_destroy(&f->cv);
        pthread_mutex_destroy(&f->mu);
        free(f);
        return axc_fail(AXC_ERR_SYSTEM, "scheduler: cannot start a thread to finish on");
    }
    *out = f;
    return AXC_OK;
}

int axc_sched_finish_wait(axc_sched_finishing *f, int timeout_ms, axc_status *status)
{
    struct timespec until; /* (the condition variable's clock: monotonic) */
    clock_gettime(CLOCK_MONOTONIC, &until);
    int64_t ns = (int64_t)until.tv_nsec + (int64_t)timeout_ms * 1000000;
    until.tv_sec += (time_t)(ns / 1000000000);
    until.tv_nsec = (long)(ns % 1000000000);
    pthread_mutex_lock(&f->mu);
    while (!f->done && pthread_cond_timedwait(&f->cv, &f->mu, &until) == 0)
        ;
    int done = f->done;
    pthread_mutex_unlock(&f->mu);
    if (!done)
        return 0;
    pthread_join(f->thread, NULL);
    *status = f->status;
    if (f->status != AXC_OK)
        axc_set_last_error(f->msg);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f);
    return 1;
}

void axc_sched_stats_get(axc_sched *s, axc_sched_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->order_len = (int64_t)s->order.len;
    out->pending = (int64_t)s->npending;
    out->tasks = s->tasks_added;
    out->tasks_run = s->tasks_done;
    out->results_held = s->held_added;
    out->results_done = s->held_done;
    pthread_mutex_unlock(&s->mu);
}

void axc_sched_stats_reset(axc_sched *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t alive = s->st.alive_bytes;
    int buffers = s->st.alive_buffers;
    memset(&s->st, 0, sizeof s->st);
    s->st.alive_bytes = s->st.peak_bytes = alive;
    s->st.alive_buffers = s->st.peak_buffers = buffers;
    pthread_mutex_unlock(&s->mu);
}

size_t axc_sched_log_take(axc_sched *s, axc_sched_event *out, size_t cap)
{
    pthread_mutex_lock(&s->mu);
    size_t n = s->log_len < cap ? s->log_len : cap;
    for (size_t i = 0; i < n; i++)
        out[i] = s->log[(s->log_head + i) % AXC_SCHED_LOG_CAP];
    s->log_len = 0;
    s->log_head = 0;
    pthread_mutex_unlock(&s->mu);
    return n;
}

int64_t axc_sched_order(axc_sched *s, axc_sched_event *out, size_t cap)
{
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->order.len && i < cap; i++)
        out[i] = (axc_sched_event){0, s->order.v[i].layer, s->order.v[i].phase};
    int64_t n = (int64_t)s->order.len;
    pthread_mutex_unlock(&s->mu);
    return n;
}
