/* The generic transport layer: groups over the grid, backend choice per call, byte counters,
 * and the life cycle of a work record. Backends only move bytes. */
#include "axc/comm.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "axc/bench_skip.h"
#include "axc/futex.h"
#include "axc/thread_channel.h"
#include "axc/timeline.h"

typedef struct group_slot {
    axc_group_info info;
    int *members;
    void *shm_group;
    void *nccl_group;
    axc_counters counters;
} group_slot;

struct axc_comm {
    axc_grid grid;
    int rank;
    double timeout_s;
    int nccl_preferred; /* CUDA buffers go to nccl (else staged through shm) */
    axc_backend *shm;
    axc_backend *nccl;
    int channels;
    group_slot *groups; /* [channels][AXC_GROUP_COUNT] */
    char backends[32];
    /* the compression of the layers' own collectives per group (axc_comm_set_layer_codec) */
    axc_codec layer_codec[AXC_GROUP_COUNT];
    int layer_block[AXC_GROUP_COUNT];
    int layer_ef[AXC_GROUP_COUNT];
    axc_timeline *timeline; /* cfg.timeline (not owned; NULL: not recorded) */
};


/* ---------------------------------------------------------------- dtypes and ops */

static const struct {
    const char *name;
    size_t size;
} dtypes[AXC_DT_COUNT] = {
    [AXC_DT_F32] = {"float32", 4}, [AXC_DT_BF16] = {"bfloat16", 2}, [AXC_DT_F16] = {"float16", 2},
    [AXC_DT_I8] = {"int8", 1},     [AXC_DT_U8] = {"uint8", 1},      [AXC_DT_I32] = {"int32", 4},
    [AXC_DT_I64] = {"int64", 8},   [AXC_DT_F64] = {"float64", 8},
};

size_t axc_dtype_size(axc_dtype dt) { return (dt >= 0 && dt < AXC_DT_COUNT) ? dtypes[dt].size : 0; }

const char *axc_dtype_name(axc_dtype dt)
{
    return (dt >= 0 && dt < AXC_DT_COUNT) ? dtypes[dt].name : "?";
}

axc_status axc_dtype_from_name(const char *name, axc_dtype *dt)
{
    for (int i = 0; i < AXC_DT_COUNT; i++) {
        if (name && strcmp(name, dtypes[i].name) == 0) {
            *dt = (axc_dtype)i;
            return AXC_OK;
        }
    }
    return axc_fail(AXC_ERR_INVALID,
                    "unsupported dtype '%s', expected float32, bfloat16, float16, int8, uint8, "
                    "int32, int64 or float64",
                    name ? name : "(null)");
}

static const char *const redop_names[] = {"sum", "avg", "max"};

const char *axc_redop_name(axc_redop op)
{
    int n = (int)(sizeof redop_names / sizeof *redop_names);
    return ((int)op >= 0 && (int)op < n) ? redop_names[op] : "?";
}

axc_status axc_redop_from_name(const char *name, axc_redop *op)
{
    for (int i = 0; i < (int)(sizeof redop_names / sizeof *redop_names); i++) {
        if (name && strcmp(name, redop_names[i]) == 0) {
            *op = (axc_redop)i;
            return AXC_OK;
        }
    }
    return axc_fail(AXC_ERR_INVALID, "unsupported reduction '%s', expected sum, avg or max",
                    name ? name : "(null)");
}

const char *axc_coll_name(axc_coll_kind kind)
{
    static const char *names[AXC_COLL_COUNT] = {"all_reduce", "all_gather", "reduce_scatter",
                                                "all_to_all", "broadcast",  "barrier"};
    return (kind >= 0 && kind < AXC_COLL_COUNT) ? names[kind] : "?";
}

/* ---------------------------------------------------------------- closed-form volumes */

void axc_coll_volume(const axc_coll *c, int G, int r, uint64_t *sent, uint64_t *recv)
{
    if (c->codec != AXC_CODEC_NONE && G > 1) {
        int ar = c->kind == AXC_COLL_ALL_REDUCE;
        size_t piece = ar ? (c->count + (size_t)G - 1) / (size_t)G : c->count, e = 0;
        if (axc_codec_encoded_bytes(c->codec, piece, c->block, &e) != AXC_OK)
            e = 0; /* (refused by validate before it runs) */
        *sent = *recv = (uint64_t)(ar ? 2 : 1) * (uint64_t)(G - 1) * e;
        return;
    }
    axc_coll_logical_volume(c, G, r, sent, recv);
}

void axc_coll_logical_volume(const axc_coll *c, int G, int r, uint64_t *sent, uint64_t *recv)
{
    uint64_t es = axc_dtype_size(c->dtype), n = c->count, s = 0, v = 0;
    if (G > 1) {
        switch (c->kind) {
        case AXC_COLL_ALL_REDUCE: {
            /* ring: reduce-scatter then all-gather of an even element split; a rank sends every
             * block but its own in each phase */
            uint64_t piece = n / (uint64_t)G + ((uint64_t)r < n % (uint64_t)G ? 1 : 0);
            s = v = 2 * (n - piece) * es;
            break;
        }
        case AXC_COLL_ALL_GATHER:
        case AXC_COLL_REDUCE_SCATTER:
        case AXC_COLL_ALL_TO_ALL: s = v = (uint64_t)(G - 1) * n * es; break;
        case AXC_COLL_BROADCAST: {
            /* chain root -> root+1 -> ...: all but the last rank send, all but the root receive */
            int pos = (r - c->root + G) % G;
            s = pos == G - 1 ? 0 : n * es;
            v = pos == 0 ? 0 : n * es;
            break;
        }
        case AXC_COLL_BARRIER:
        case AXC_COLL_COUNT: break;
        }
    }
    *sent = s;
    *recv = v;
}

/* ---------------------------------------------------------------- communicator */

static int n_slots(const axc_comm *comm) { return comm->channels * AXC_GROUP_COUNT; }

/* Opens the backend's groups. NCCL only on channel 0: the other channels carry concurrent
 * micro-batches (axonn_c.run_concurrent), which take host tensors only, and each NCCL group is
 * a communicator with its own GPU memory and proxy thread. */
static axc_status open_groups(axc_comm *comm, axc_backend *be, int is_nccl)
{
    int n = is_nccl ? AXC_GROUP_COUNT : n_slots(comm);
    for (int k = 0; k < n; k++) {
        group_slot *g = &comm->groups[k];
        void **slot = is_nccl ? &g->nccl_group : &g->shm_group;
        AXC_TRY(be->group_open(be, &g->info, slot));
    }
    return AXC_OK;
}

static void close_groups(axc_comm *comm, axc_backend *be, int is_nccl)
{
    for (int k = n_slots(comm) - 1; k >= 0; k--) {
        void **slot = is_nccl ? &comm->groups[k].nccl_group : &comm->groups[k].shm_group;
        if (*slot)
            be->group_close(be, *slot);
        *slot = NULL;
    }
}

axc_status axc_comm_create(axc_comm **out, const axc_comm_config *cfg)
{
    *out = NULL;
    const char *want = (cfg->backend && *cfg->backend) ? cfg->backend : "auto";
    int want_shm = strcmp(want, "shm") == 0, want_nccl = strcmp(want, "nccl") == 0;
    if (!want_shm && !want_nccl && strcmp(want, "auto") != 0)
        return axc_fail(AXC_ERR_INVALID, "unknown backend '%s', expected 'shm', 'nccl' or None",
                        want);
    if (cfg->rank < 0 || cfg->rank >= cfg->grid.world_size)
        return axc_fail(AXC_ERR_INVALID, "rank %d is outside the world of %d ranks", cfg->rank,
                        cfg->grid.world_size);
    if (!(cfg->timeout_s > 0 && cfg->timeout_s <= AXC_MAX_TIMEOUT_S)) /* NaN fails too */
        return axc_fail(AXC_ERR_INVALID, "timeout must be in (0, %.0f] seconds, got %g",
                        AXC_MAX_TIMEOUT_S, cfg->timeout_s);
    axc_comm *comm = calloc(1, sizeof *comm);
    if (!comm)
        return axc_fail(AXC_ERR_NOMEM, "out of memory creating the communicator");
    comm->grid = cfg->grid;
    comm->rank = cfg->rank;
    comm->timeout_s = cfg->timeout_s;
    comm->timeline = cfg->timeline;
    comm->channels = cfg->channels > 0 ? cfg->channels : 1;
    axc_status st = AXC_OK;
    if (comm->channels > AXC_MAX_CHANNELS) {
        st = axc_fail(AXC_ERR_INVALID, "%d channels requested, at most %d are supported",
                      comm->channels, AXC_MAX_CHANNELS);
        goto fail;
    }
    comm->groups = calloc((size_t)n_slots(comm), sizeof *comm->groups);
    if (!comm->groups) {
        st = axc_fail(AXC_ERR_NOMEM, "out of memory creating groups");
        goto fail;
    }
    for (int k = 0; k < n_slots(comm); k++) {
        group_slot *g = &comm->groups[k];
        axc_group_kind kind = (axc_group_kind)(k % AXC_GROUP_COUNT);
        g->info.channel = k / AXC_GROUP_COUNT;
        g->info.kind = kind;
        g->info.size = axc_grid_group_size(&cfg->grid, kind);
        g->info.rank = axc_grid_group_rank(&cfg->grid, kind, cfg->rank);
        g->info.color = axc_grid_group_color(&cfg->grid, kind, cfg->rank);
        g->members = malloc(sizeof(int) * (size_t)g->info.size);
        if (!g->members) {
            st = axc_fail(AXC_ERR_NOMEM, "out of memory creating groups");
            goto fail;
        }
        axc_grid_group_members(&cfg->grid, kind, cfg->rank, g->members);
        g->info.members = g->members;
    }

    /* shm serves host buffers whenever all ranks share this node; nccl serves CUDA buffers. */
    int single_node = cfg->local_world_size == cfg->grid.world_size;
    if (!want_nccl) {
        if (!single_node && want_shm) {
            st = axc_fail(AXC_ERR_INVALID,
                          "backend 'shm' needs all ranks on one node, but LOCAL_WORLD_SIZE=%d "
                          "and WORLD_SIZE=%d",
                          cfg->local_world_size, cfg->grid.world_size);
            goto fail;
        }
        if (single_node) {
            st = axc_shm_backend_create(&comm->shm, cfg);
            if (st == AXC_OK)
                st = open_groups(comm, comm->shm, 0);
            if (st != AXC_OK)
                goto fail;
        }
    }
    if (!want_shm && cfg->cuda_device >= 0) {
        st = axc_nccl_backend_create(&comm->nccl, cfg);
        if (st == AXC_OK) {
            st = open_groups(comm, comm->nccl, 1);
            if (st != AXC_OK)
                goto fail;
        } else if (want_nccl) {
            goto fail;
        } else {
            axc_log(1, "nccl backend not used: %s", axc_last_error());
            comm->nccl = NULL;
            st = AXC_OK;
        }
    } else if (want_nccl) {
        st = axc_fail(AXC_ERR_UNAVAILABLE, "backend 'nccl' needs a CUDA device for every rank");
        goto fail;
    }
    if (!comm->shm && !comm->nccl) {
        st = axc_fail(AXC_ERR_UNAVAILABLE,
                      "no backend can serve this job: shm needs all ranks on one node "
                      "(LOCAL_WORLD_SIZE=%d, WORLD_SIZE=%d) and nccl needs CUDA",
                      cfg->local_world_size, cfg->grid.world_size);
        goto fail;
    }
    comm->nccl_preferred = comm->nccl != NULL;
    snprintf(comm->backends, sizeof comm->backends, "%s%s%s", comm->shm ? "shm" : "",
             comm->shm && comm->nccl ? "+" : "", comm->nccl ? "nccl" : "");
    *out = comm;
    return AXC_OK;
fail: {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", axc_last_error());
    axc_comm_destroy(comm);
    axc_set_last_error(msg);
    return st;
}
}

void axc_comm_destroy(axc_comm *comm)
{
    if (!comm)
        return;
    if (comm->nccl) {
        close_groups(comm, comm->nccl, 1);
        comm->nccl->destroy(comm->nccl);
    }
    if (comm->shm) {
        close_groups(comm, comm->shm, 0);
        comm->shm->destroy(comm->shm);
    }
    if (comm->groups)
        for (int k = 0; k < n_slots(comm); k++)
            free(comm->groups[k].members);
    free(comm->groups);
    free(comm);
}

axc_status axc_comm_abort(axc_comm *comm, axc_status status, const char *msg)
{
    char kept[512]; /* (msg may be axc_last_error()'s buffer, which axc_fail rewrites) */
    snprintf(kept, sizeof kept, "%s", msg);
    axc_backend *backends[2] = {comm ? comm->shm : NULL, comm ? comm->nccl : NULL};
    for (int i = 0; i < 2; i++)
        if (backends[i] && backends[i]->abort)
            backends[i]->abort(backends[i], status, kept);
    return axc_fail(status, "%s", kept);
}

const axc_grid *axc_comm_grid(const axc_comm *comm) { return &comm->grid; }
int axc_comm_rank(const axc_comm *comm) { return comm->rank; }
double axc_comm_timeout(const axc_comm *comm) { return comm->timeout_s; }

axc_status axc_comm_set_layer_codec(axc_comm *comm, axc_group_kind kind, axc_codec codec, int block,
                                    int error_feedback)
{
    if (!comm || (unsigned)kind >= AXC_GROUP_COUNT)
        return axc_fail(AXC_ERR_INVALID, "layer codec: no communicator or unknown group %d",
                        (int)kind);
    if (error_feedback && kind != AXC_GROUP_DEPTH)
        return axc_fail(AXC_ERR_INVALID,
                        "layer codec: error feedback applies to the depth dW reduce-scatters "
                        "only, not to the %s group's activation collectives",
                        axc_group_name(kind));
    int b = 0;
    AXC_TRY(axc_codec_check(codec, block, &b));
    comm->layer_codec[kind] = codec;
    comm->layer_block[kind] = codec == AXC_CODEC_NONE ? 0 : b;
    comm->layer_ef[kind] = codec != AXC_CODEC_NONE && error_feedback;
    return AXC_OK;
}

int axc_comm_layer_error_feedback(const axc_comm *comm, axc_group_kind kind)
{
    return comm && (unsigned)kind < AXC_GROUP_COUNT && comm->layer_ef[kind];
}

void axc_comm_apply_layer_codec(const axc_comm *comm, axc_group_kind kind, axc_coll *c)
{
    if ((unsigned)kind < AXC_GROUP_COUNT)
        axc_comm_apply_codec(comm, comm->layer_codec[kind], comm->layer_block[kind], c);
}

void axc_comm_apply_codec(const axc_comm *comm, axc_codec codec, int block, axc_coll *c)
{
    if (codec == AXC_CODEC_NONE || c->dtype != AXC_DT_F32 || c->op == AXC_RED_MAX)
        return;
    if (c->kind != AXC_COLL_ALL_REDUCE && c->kind != AXC_COLL_REDUCE_SCATTER &&
        c->kind != AXC_COLL_ALL_GATHER)
        return;
    /* (only where a transport compresses: host buffers on shm, CUDA buffers on nccl with the
     * codec kernels built; CUDA buffers staged through shm stay exact) */
    if (c->device >= 0 ? !(comm->nccl_preferred && axc_codec_cuda_compiled()) : !comm->shm)
        return;
    c->codec = codec;
    c->block = block;
}
const char *axc_comm_backends(const axc_comm *comm) { return comm->backends; }
axc_timeline *axc_comm_timeline(const axc_comm *comm) { return comm ? comm->timeline : NULL; }
int axc_comm_host_collectives(const axc_comm *comm) { return comm->shm != NULL; }
int axc_comm_channels(const axc_comm *comm) { return comm->channels; }
int axc_comm_thread_channel(void) { return axc_thread_channel(); }

axc_status axc_comm_set_thread_channel(const axc_comm *comm, int channel)
{
    int n = comm ? comm->channels : 1;
    if (channel < 0 || channel >= n)
        return axc_fail(AXC_ERR_INVALID,
                        "channel %d does not exist: this communicator has %d channel%s "
                        "(0..%d; init(concurrent_microbatches=...) sets how many)",
                        channel, n, n == 1 ? "" : "s", n - 1);
    axc_thread_channel_set(channel);
    return AXC_OK;
}

/* ---------------------------------------------------------------- collectives */

static axc_status validate_compressed(const axc_comm *comm, const group_slot *g,
                                      const axc_coll *c)
{
    const char *what = axc_coll_name(c->kind);
    AXC_TRY(axc_codec_check(c->codec, c->block, NULL));
    if (c->kind != AXC_COLL_ALL_REDUCE && c->kind != AXC_COLL_REDUCE_SCATTER &&
        c->kind != AXC_COLL_ALL_GATHER)
        return axc_fail(AXC_ERR_INVALID,
                        "%s cannot be compressed: only all_reduce, reduce_scatter and all_gather",
                        what);
    if (c->dtype != AXC_DT_F32)
        return axc_fail(AXC_ERR_INVALID, "compressed %s needs float32 data, got %s", what,
                        axc_dtype_name(c->dtype));
    if (c->kind != AXC_COLL_ALL_GATHER && c->op == AXC_RED_MAX)
        return axc_fail(AXC_ERR_INVALID, "compressed %s supports sum and avg, not max", what);
    if (c->device >= 0) { /* the nccl backend runs the codec kernels on its comm stream */
        if (!comm->nccl_preferred)
            return axc_fail(AXC_ERR_INVALID,
                            "compressed %s of CUDA tensors needs the nccl backend (shm does not "
                            "stage compressed collectives through host memory)",
                            what);
        if (g->info.size > 1 && !axc_codec_cuda_compiled())
            return axc_fail(AXC_ERR_UNAVAILABLE,
                            "compressed %s of CUDA tensors: this build has no CUDA codec kernels "
                            "(nvcc was not found when axonn_c was built)",
                            what);
        return AXC_OK;
    }
    if (!comm->shm)
        return axc_fail(AXC_ERR_UNAVAILABLE,
                        "compressed %s needs the shm backend, which this job does not have", what);
    return AXC_OK;
}

static axc_status validate(const axc_comm *comm, const group_slot *g, const axc_coll *c)
{
    if (c->kind < 0 || c->kind >= AXC_COLL_COUNT)
        return axc_fail(AXC_ERR_INVALID, "unknown collective %d", (int)c->kind);
    if (c->dtype < 0 || c->dtype >= AXC_DT_COUNT)
        return axc_fail(AXC_ERR_INVALID, "unknown dtype code %d", (int)c->dtype);
    if (c->kind == AXC_COLL_BROADCAST && (c->root < 0 || c->root >= g->info.size))
        return axc_fail(AXC_ERR_INVALID, "broadcast root %d is outside the %s group of size %d",
                        c->root, axc_group_name(g->info.kind), g->info.size);
    if (c->kind != AXC_COLL_BARRIER && c->count > 0 && !c->recv)
        return axc_fail(AXC_ERR_INVALID, "%s: output buffer is NULL", axc_coll_name(c->kind));
    if (c->op < 0 || c->op > AXC_RED_MAX)
        return axc_fail(AXC_ERR_INVALID, "unknown reduction %d", (int)c->op);
    if (c->codec != AXC_CODEC_NONE)
        return validate_compressed(comm, g, c);
    (void)comm;
    return AXC_OK;
}

/* ---------------------------------------------------------------- benchmark-only skip knob */

/* Benchmark only (axc/bench_skip.h): with AXONN_C_BENCH_SKIP=comm every collective but a
 * barrier returns a work that is already complete: no data moves, nothing reaches a backend, no
 * timeline span is recorded; the byte counters still count. Barriers stay real (they move no
 * data; launchers rely on them). */
static axc_status skipped_wait(axc_backend *be, axc_work *w)
{
    (void)be;
    (void)w;
    return AXC_OK;
}

/* The "backend" of skipped works: waits return at once, and the state is already DONE. */
static axc_backend skipped_backend = {.name = "skipped", .wait = skipped_wait};

axc_status axc_comm_start(axc_comm *comm, axc_group_kind kind, const axc_coll *c,
                          axc_work **out)
{
    return axc_comm_start_after(comm, kind, c, NULL, 0, out);
}

axc_status axc_comm_start_after(axc_comm *comm, axc_group_kind kind, const axc_coll *c,
                                axc_work *const *after, size_t n_after, axc_work **out)
{
    *out = NULL;
    if (!comm)
        return axc_fail(AXC_ERR_STATE, "axonn_c is not initialised: call axonn_c.init() first");
    if (kind < 0 || kind >= AXC_GROUP_COUNT)
        return axc_fail(AXC_ERR_INVALID, "unknown group %d", (int)kind);
    int channel = axc_thread_channel();
    if (channel >= comm->channels) /* set for an earlier communicator with more channels */
        return axc_fail(AXC_ERR_STATE,
                        "this thread uses channel %d, but the communicator has %d channel%s",
                        channel, comm->channels, comm->channels == 1 ? "" : "s");
    group_slot *g = &comm->groups[channel * AXC_GROUP_COUNT + kind];
    AXC_TRY(validate(comm, g, c));

    axc_backend *be;
    void *bg;
    /* a barrier carries no data: NCCL serves it when there is no shm backend */
    int nccl_barrier = c->kind == AXC_COLL_BARRIER && !comm->shm && comm->nccl;
    if ((c->device >= 0 && comm->nccl_preferred) || nccl_barrier) {
        be = comm->nccl;
        bg = g->nccl_group;
        if (!bg) /* (open on channel 0 only: open_groups) */
            return axc_fail(AXC_ERR_INVALID,
                            "%s over NCCL from channel %d: only channel 0 has NCCL "
                            "communicators (concurrent micro-batches take host tensors)",
                            axc_coll_name(c->kind), axc_thread_channel());
    } else if (comm->shm) {
        be = comm->shm;
        bg = g->shm_group;
    } else {
        return axc_fail(AXC_ERR_UNAVAILABLE,
                        "host (CPU) tensors need the shm backend, which this job does not have "
                        "(ranks on several nodes or backend='nccl'); use CUDA tensors");
    }

    int skip = c->kind != AXC_COLL_BARRIER && axc_bench_skips("comm");
    /* a backend that follows orders the collective after its own works; the others' are
     * waited for here (a host wait, or for CUDA a join into the stream that work was started
     * on: only a mix of backends gets here) */
    int follows = !skip && be->follows_after;
    if (!skip)
        for (size_t i = 0; i < n_after; i++)
            if (after[i] && !after[i]->waited && (!follows || after[i]->backend != be))
                AXC_TRY(axc_work_wait(after[i]));
    axc_work *w = calloc(1, sizeof *w);
    if (!w)
        return axc_fail(AXC_ERR_NOMEM, "out of memory starting %s", axc_coll_name(c->kind));
    if (follows && n_after) {
        w->after = malloc(n_after * sizeof *w->after);
        if (!w->after) {
            free(w);
            return axc_fail(AXC_ERR_NOMEM, "out of memory starting %s", axc_coll_name(c->kind));
        }
        for (size_t i = 0; i < n_after; i++)
            if (after[i])
                w->after[w->n_after++] = after[i];
    }
    w->coll = *c;
    w->group = g->info;
    w->timeline = comm->timeline;
    w->backend = be;
    w->backend_group = bg;
    if (skip) {
        /* benchmark only: measures compute alone (see above) */
        w->backend = &skipped_backend;
        w->backend_group = NULL;
        atomic_store(&w->state, AXC_WORK_DONE);
    } else {
        atomic_store(&w->state, AXC_WORK_PENDING);
        axc_status st = be->start(be, bg, w);
        if (st != AXC_OK) {
            free(w->after);
            free(w);
            return st;
        }
    }
    uint64_t s, r;
    axc_coll_volume(c, g->info.size, g->info.rank, &s, &r);
    g->counters.bytes_sent += s;
    g->counters.bytes_recv += r;
    g->counters.calls += 1;
    axc_coll_logical_volume(c, g->info.size, g->info.rank, &s, &r);
    g->counters.logical_bytes_sent += s;
    g->counters.logical_bytes_recv += r;
    g->counters.compressed_calls += c->codec != AXC_CODEC_NONE;
    *out = w;
    return AXC_OK;
}

void axc_work_complete(axc_work *w, axc_status status, const char *message)
{
    /* before the state store: a waiter may free `w` as soon as it sees DONE */
    if (w->t_exec_begin > 0 && w->group.size > 1 && axc_timeline_enabled(w->timeline)) {
        uint64_t sent, recv;
        axc_coll_volume(&w->coll, w->group.size, w->group.rank, &sent, &recv);
        axc_timeline_record_on(w->timeline, AXC_SPAN_COMM, axc_coll_name(w->coll.kind),
                               (int)w->group.kind, w->group.channel, w->t_exec_begin,
                               axc_timeline_now(), sent);
    }
    w->status = status;
    if (status != AXC_OK)
        snprintf(w->message, sizeof w->message, "%s", message ? message : "");
    atomic_store_explicit(&w->state, status == AXC_OK ? AXC_WORK_DONE : AXC_WORK_FAILED,
                          memory_order_release);
    axc_futex_wake_all(&w->state, 0);
}

axc_status axc_work_host_wait(axc_work *w, double timeout_s)
{
    int64_t deadline = axc_now_ns() + (int64_t)(timeout_s * 1e9);
    for (;;) {
        uint32_t s = atomic_load_explicit(&w->state, memory_order_acquire);
        if (s != AXC_WORK_PENDING)
            break;
        int64_t left = deadline - axc_now_ns();
        if (left <= 0)
            return axc_fail(AXC_ERR_TIMEOUT, "%s on the %s group did not finish within %.1f s",
                            axc_coll_name(w->coll.kind), axc_group_name(w->group.kind),
                            timeout_s);
        axc_futex_wait(&w->state, AXC_WORK_PENDING, left, 0);
    }
    if (w->status != AXC_OK)
        return axc_fail(w->status, "%s", w->message);
    return AXC_OK;
}

axc_status axc_work_wait(axc_work *w)
{
    if (!w)
        return axc_fail(AXC_ERR_INVALID, "wait on a NULL work handle");
    if (w->waited) {
        if (w->status != AXC_OK)
            return axc_fail(w->status, "%s", w->message);
        return AXC_OK;
    }
    /* timeline: a host wait on a collective still running is exposed communication (CUDA
     * works are excluded: their wait only orders a stream) */
    int64_t t0 = (w->coll.device < 0 && w->group.size > 1 &&
                  atomic_load_explicit(&w->state, memory_order_acquire) == AXC_WORK_PENDING)
                     ? axc_timeline_begin(w->timeline)
                     : 0;
    axc_status st = w->backend->wait(w->backend, w);
    axc_timeline_end(w->timeline, AXC_SPAN_WAIT, axc_coll_name(w->coll.kind), (int)w->group.kind,
                     t0, 0);
    if (st == AXC_ERR_TIMEOUT && atomic_load(&w->state) == AXC_WORK_PENDING) {
        w->timed_out = 1;
        return st; /* still owned by the backend: not marked waited, must not be freed */
    }
    w->waited = 1;
    if (st != AXC_OK && w->status == AXC_OK) {
        w->status = st;
        snprintf(w->message, sizeof w->message, "%s", axc_last_error());
    }
    return st;
}

int axc_work_done(axc_work *w)
{
    if (w->backend->query)
        return w->backend->query(w->backend, w);
    return atomic_load_explicit(&w->state, memory_order_acquire) != AXC_WORK_PENDING;
}

/* A work that timed out while its backend still runs it: the job is out of step, so the
 * backend's collectives are aborted (every rank's wait fails: the peers learn it too), which lets
 * the backend give this one up within a moment. 1 once it did (the work may be freed, nothing
 * writes its buffers any more), 0 when it still runs (leaked: see axc_work_free). */
static int let_go_after_timeout(axc_work *w)
{
    if (axc_work_done(w))
        return 1;
    char msg[256];
    snprintf(msg, sizeof msg, "a %s on the %s group timed out while it still ran: the job's "
             "collectives were aborted", axc_coll_name(w->coll.kind),
             axc_group_name(w->group.kind));
    if (w->backend->abort)
        w->backend->abort(w->backend, AXC_ERR_TIMEOUT, msg);
    (void)axc_work_host_wait(w, AXC_WORK_ABORT_GRACE_S);
    if (axc_work_done(w))
        return 1;
    axc_log(2, "%s; it had not ended %.0f s later: its record is kept", msg,
            AXC_WORK_ABORT_GRACE_S);
    return 0;
}

/* After the backend let a work go (it ended): its wait returns at once, and the backend frees
 * its part of the record (e.g. CUDA events). 1 when it is waited. */
static int wait_ended(axc_work *w)
{
    (void)axc_work_wait(w);
    return w->waited;
}

int axc_work_free(axc_work *w)
{
    if (!w)
        return 1;
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", axc_last_error());
    if (!w->waited && !w->timed_out) /* (a wait that timed out is not waited out again) */
        (void)axc_work_wait(w);        /* (after it: waited, or timed out still running) */
    int gone = w->waited || (let_go_after_timeout(w) && wait_ended(w));
    axc_set_last_error(saved);
    if (!gone)
        return 0; /* the backend may still touch it: leak rather than corrupt */
    free(w->after);
    free(w);
    return 1;
}

/* summed over the kind's channels */
void axc_comm_counters(const axc_comm *comm, axc_group_kind kind, axc_counters *out)
{
    memset(out, 0, sizeof *out);
    for (int c = 0; c < comm->channels; c++) {
        const axc_counters *k = &comm->groups[c * AXC_GROUP_COUNT + kind].counters;
        out->bytes_sent += k->bytes_sent;
        out->bytes_recv += k->bytes_recv;
        out->calls += k->calls;
        out->logical_bytes_sent += k->logical_bytes_sent;
        out->logical_bytes_recv += k->logical_bytes_recv;
        out->compressed_calls += k->compressed_calls;
    }
}

void axc_comm_reset_counters(axc_comm *comm)
{
    for (int k = 0; k < n_slots(comm); k++)
        memset(&comm->groups[k].counters, 0, sizeof comm->groups[k].counters);
}
