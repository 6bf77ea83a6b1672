/* The shm backend: collectives between the ranks of one node through a POSIX shared-memory
 * segment. Each rank owns a data slot per group kind; a collective moves data in rounds through
 * the slots, separated by futex barriers, so waiting ranks sleep instead of spinning. Each group
 * kind has its own progress thread (a "lane") that executes that group's works in issue order,
 * so groups progress independently, as NCCL communicators on their own streams do; a work
 * started "after" others (axc_comm_start_after) waits for them on its lane. With several
 * channels (axc_comm_set_thread_channel) every (channel, kind) pair has its own lane, slots
 * and barriers; the simulated link of a kind is shared by its channels. CUDA buffers are
 * staged through pinned host memory. A dead or late peer fails the op on every rank within the
 * timeout; a peer that runs a different collective (out of step: another kind, length, dtype,
 * op or root) fails it on every rank at the collective's first barrier. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "axc/comm.h"
#include "axc/cuda_rt.h"
#include "axc/env.h"
#include "axc/futex.h"
#include "axc/reduce.h"
#include "axc/timeline.h"

#define SHM_MAGIC 0x61786373u /* "axcs" */
#define CACHE_LINE 64
#define POLL_NS 20000000LL /* how often a waiter checks for dead peers and aborts */

typedef struct shm_barrier {
    _Atomic uint32_t count;
    _Atomic uint32_t gen;
    char pad[CACHE_LINE - 8];
} shm_barrier;

typedef struct shm_header {
    uint32_t magic;
    uint32_t world;
    uint64_t slot_bytes;
    uint32_t channels;
    _Atomic uint32_t attached;
    _Atomic uint32_t aborted; /* 0, or 1 + the rank that aborted (| ABORT_WRITING meanwhile) */
    uint32_t abort_status;    /* its axc_status, so every rank reports the same kind of error */
    char abort_msg[512];
    char pad[CACHE_LINE];
} shm_header;

/* What a rank runs on a lane, published for its group's peers before the collective's first
 * barrier and compared after it. Two per rank and lane (by the call number's parity): a peer
 * can be at most one collective ahead, since each needs every member. */
typedef struct shm_call {
    uint64_t seq; /* the lane's collectives so far, this one included */
    uint64_t count;
    uint32_t kind, dtype, op;
    int32_t root;
    uint32_t codec, block; /* compressed collectives (axc_coll.codec, .block) */
    uint64_t check;        /* axc_coll.check */
} shm_call;

typedef struct shm_group {
    axc_group_info info;
    int *members;
    shm_barrier *barrier;
} shm_group;

typedef struct shm_backend shm_backend;

/* One group kind's progress thread, its FIFO and its staging state. */
typedef struct shm_lane {
    shm_backend *b;
    unsigned char *slots; /* this lane's slots, [world][slot_bytes]; NULL for size-1 groups */
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    axc_work *head, *tail;
    int stop;
    uint64_t calls; /* collectives run (this lane's thread only) */
    /* CUDA staging (this lane's thread only) */
    void *stage_stream;
    int stage_device;
    void *host_buf;
    size_t host_bytes;
} shm_lane;

struct shm_backend {
    axc_backend base;
    int rank, world;
    double timeout_s;
    double sim_gbps, sim_us; /* simulated link, 0 = off */
    char name[200];
    void *map;
    size_t map_bytes;
    shm_header *hdr;
    _Atomic int32_t *pids;
    shm_barrier *barriers; /* [lane][world], indexed by group colour */
    shm_call *calls;       /* [lane][rank][2] */
    _Atomic uint64_t *issued;  /* [lane][rank]: collectives each rank started on each lane (its
                                * groups of more than one rank), counted at shm_start */
    _Atomic uint64_t *waiting; /* [lane][rank]: the call number a rank's thread waits for in
                                * shm_wait on that lane, 0 when none */
    const shm_group *lane_group[AXC_MAX_CHANNELS * AXC_GROUP_COUNT]; /* this rank's, per lane */
    size_t slot_bytes;
    int channels;
    shm_lane lanes[AXC_MAX_CHANNELS * AXC_GROUP_COUNT]; /* [channel][kind] */
    /* simulated link, one per kind, shared by its channels: busy until link_free[kind] */
    pthread_mutex_t link_mu;
    int64_t link_free[AXC_GROUP_COUNT];
    /* sticky failure: once a collective failed every later one (of any lane) fails the same way */
    pthread_mutex_t fail_mu;
    axc_status failed;
    char failed_msg[512];
    const axc_cuda_api *cuda;
};

/* Per-work CUDA state: the event the user stream recorded at start. */
typedef struct shm_cuda_work {
    void *ready;
} shm_cuda_work;

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static int lane_index(const axc_group_info *info)
{
    return info->channel * AXC_GROUP_COUNT + (int)info->kind;
}


/* ------------------------------------------------------------------ failure handling */

static int pid_alive(int32_t pid)
{
    if (pid <= 0)
        return 1; /* not registered yet: cannot judge */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* state follows the command name */
    return !(p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'));
}

/* `aborted` while the aborting rank writes its reason: readers wait for the final value */
#define ABORT_WRITING 0x80000000u

/* Marks the segment aborted so every waiting rank fails promptly, then returns `st`. The first
 * abort wins; its status and reason are written before `aborted` takes its final value. */
static axc_status shm_abort(shm_backend *b, axc_status st, const char *msg)
{
    uint32_t expected = 0, who = (uint32_t)b->rank + 1;
    if (atomic_compare_exchange_strong(&b->hdr->aborted, &expected, who | ABORT_WRITING)) {
        b->hdr->abort_status = (uint32_t)st;
        snprintf(b->hdr->abort_msg, sizeof b->hdr->abort_msg, "%s", msg);
        atomic_store_explicit(&b->hdr->aborted, who, memory_order_release);
    }
    return axc_fail(st, "%s", msg);
}

static void shm_abort_job(axc_backend *be, axc_status st, const char *msg)
{
    (void)shm_abort((shm_backend *)be, st, msg);
}

/* The error of a rank that aborted the segment, as seen by the others. */
static axc_status aborted_error(shm_backend *b, const char *what)
{
    uint32_t ab = atomic_load_explicit(&b->hdr->aborted, memory_order_acquire);
    /* the aborting rank is writing its reason: a few microseconds, unless it died meanwhile */
    for (int tries = 0; (ab & ABORT_WRITING) && tries < 1000; tries++) {
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
        ab = atomic_load_explicit(&b->hdr->aborted, memory_order_acquire);
    }
    if (ab & ABORT_WRITING)
        return axc_fail(AXC_ERR_PEER, "%s failed because rank %u aborted the job (it did not "
                        "write why)", what, (ab & ~ABORT_WRITING) - 1);
    axc_status st = b->hdr->abort_status == AXC_ERR_TIMEOUT ? AXC_ERR_TIMEOUT : AXC_ERR_PEER;
    return axc_fail(st, "%s failed because rank %u aborted the job: %s", what, ab - 1,
                    b->hdr->abort_msg);
}

static axc_status check_peers(shm_backend *b, const shm_group *g, const char *what)
{
    if (atomic_load(&b->hdr->aborted))
        return aborted_error(b, what);
    for (int k = 0; k < g->info.size; k++) {
        int r = g->members[k];
        if (r != b->rank && !pid_alive(atomic_load(&b->pids[r]))) {
            char msg[400];
            snprintf(msg, sizeof msg, "rank %d (pid %d) died during %s on the %s group", r,
                     (int)atomic_load(&b->pids[r]), what, axc_group_name(g->info.kind));
            return shm_abort(b, AXC_ERR_PEER, msg);
        }
    }
    return AXC_OK;
}

static axc_status check_crossed(shm_backend *b, const shm_group *g, const shm_call *mine);

/* A sense-reversing barrier over the group's members that sleeps on a futex. `mine`: this rank's
 * call, at a collective's first barrier (NULL at the others). */
static axc_status group_barrier(shm_backend *b, const shm_group *g, int64_t deadline,
                                const char *what, const shm_call *mine)
{
    int G = g->info.size;
    if (G == 1)
        return AXC_OK;
    shm_barrier *bar = g->barrier;
    uint32_t gen = atomic_load(&bar->gen);
    if (atomic_fetch_add(&bar->count, 1) == (uint32_t)G - 1) {
        atomic_store(&bar->count, 0);
        atomic_fetch_add(&bar->gen, 1);
        axc_futex_wake_all(&bar->gen, 1);
        return AXC_OK;
    }
    while (atomic_load(&bar->gen) == gen) {
        int64_t now = axc_now_ns();
        if (now >= deadline) {
            char msg[400];
            snprintf(msg, sizeof msg,
                     "%s on the %s group (ranks %d..): rank %d waited past the timeout for "
                     "its %d peers",
                     what, axc_group_name(g->info.kind), g->members[0], b->rank, G - 1);
            return shm_abort(b, AXC_ERR_TIMEOUT, msg);
        }
        int64_t slice = deadline - now < POLL_NS ? deadline - now : POLL_NS;
        axc_futex_wait(&bar->gen, gen, slice, 1);
        if (atomic_load(&bar->gen) != gen)
            break;
        AXC_TRY(check_peers(b, g, what));
        if (mine)
            AXC_TRY(check_crossed(b, g, mine));
    }
    return AXC_OK;
}

/* ------------------------------------------------------------------ the collectives */

typedef struct run_ctx {
    shm_backend *b;
    const shm_group *g;
    unsigned char *slots; /* the group kind's slots */
    int64_t deadline;
    const char *what;
    const shm_call *mine; /* this rank's published call, until the peers' are compared */
} run_ctx;

static shm_call *call_slot(shm_backend *b, int lane, int rank, uint64_t seq)
{
    return &b->calls[((size_t)lane * (size_t)b->world + (size_t)rank) * 2 + (seq & 1)];
}

static int reduces(uint32_t kind)
{
    return kind == AXC_COLL_ALL_REDUCE || kind == AXC_COLL_REDUCE_SCATTER;
}

static int same_call(const shm_call *x, const shm_call *y)
{
    return x->seq == y->seq && x->kind == y->kind && x->count == y->count &&
           x->dtype == y->dtype && (!reduces(x->kind) || x->op == y->op) &&
           (x->kind != AXC_COLL_BROADCAST || x->root == y->root) && x->codec == y->codec &&
           x->block == y->block &&
           (x->check == y->check || !x->check || !y->check); /* (0: not known) */
}

static int describe_call(char *out, size_t cap, int rank, const shm_call *x,
                         axc_group_kind group)
{
    int n = x->kind == AXC_COLL_BARRIER
                ? snprintf(out, cap, "rank %d runs a barrier", rank)
                : snprintf(out, cap, "rank %d runs %s of %llu %s", rank,
                           axc_coll_name((axc_coll_kind)x->kind), (unsigned long long)x->count,
                           axc_dtype_name((axc_dtype)x->dtype));
    if (reduces(x->kind))
        n += snprintf(out + n, cap - (size_t)n, " (%s)", axc_redop_name((axc_redop)x->op));
    if (x->kind == AXC_COLL_BROADCAST)
        n += snprintf(out + n, cap - (size_t)n, " from group rank %d", (int)x->root);
    if (x->codec != AXC_CODEC_NONE)
        n += snprintf(out + n, cap - (size_t)n, " compressed %s/%u",
                      axc_codec_name((axc_codec)x->codec), x->block);
    if (x->check)
        n += snprintf(out + n, cap - (size_t)n, " holding contents %016llx",
                      (unsigned long long)x->check);
    return n + snprintf(out + n, cap - (size_t)n, " as its collective %llu on the %s group",
                        (unsigned long long)x->seq, axc_group_name(group));
}

/* After the collective's first barrier: every peer published the same call, else the job's
 * ranks are out of step (a caller bug that would corrupt data or hang): fail them all now. */
static axc_status check_calls(run_ctx *c)
{
    const shm_group *g = c->g;
    int lane = lane_index(&g->info);
    for (int k = 0; k < g->info.size; k++) {
        int r = g->members[k];
        const shm_call *peer = call_slot(c->b, lane, r, c->mine->seq);
        if (r == c->b->rank || same_call(peer, c->mine))
            continue;
        char msg[600];
        shm_call same = *peer;
        same.check = c->mine->check;
        int contents = same_call(&same, c->mine); /* only what the buffers hold differs */
        int n = snprintf(msg, sizeof msg, "collectives out of step on the %s group: ",
                         axc_group_name(g->info.kind));
        n += describe_call(msg + n, sizeof msg - (size_t)n, c->b->rank, c->mine, g->info.kind);
        n += snprintf(msg + n, sizeof msg - (size_t)n, ", ");
        n += describe_call(msg + n, sizeof msg - (size_t)n, r, peer, g->info.kind);
        snprintf(msg + n, sizeof msg - (size_t)n, "%s",
                 contents ? " (the ranks packed different gradients into one sum: every rank "
                            "must have gradients for the same parameters, e.g. run the same "
                            "layers in forward)"
                          : " (every rank of a group must make the same calls in the same "
                            "order)");
        return shm_abort(c->b, AXC_ERR_PEER, msg);
    }
    return AXC_OK;
}

static int same_members(const shm_group *x, const shm_group *y)
{
    if (x->info.size != y->info.size)
        return 0;
    for (int i = 0; i < x->info.size; i++) {
        int found = 0;
        for (int j = 0; j < y->info.size && !found; j++)
            found = x->members[i] == y->members[j];
        if (!found)
            return 0;
    }
    return 1;
}

/* Groups of one channel with the same ranks (intra and world when G_data = 1, say) have lanes of
 * their own, whose calls check_calls never compares: a rank waiting for a collective on one
 * while its peer waits for one on the other would wait out the timeout. Lanes progress
 * independently, so ranks may start such collectives in different orders (test_shm's
 * independent_main); what cannot end is this, seen without any timing: this rank's thread waits
 * (shm_wait) for this very call (#seq on this lane), which the peer has not started, while the
 * peer's thread waits for a call on a lane of the same ranks that this rank has not started.
 * Neither thread starts anything more, so each waits for the other: a caller bug, failed at
 * once naming both calls. (The peer's wait is read before its start count: a peer that started
 * this call and then waited shows the start whenever it shows the wait.) */
static axc_status check_crossed(shm_backend *b, const shm_group *g, const shm_call *mine)
{
    int lane = lane_index(&g->info), first = g->info.channel * AXC_GROUP_COUNT;
    size_t W = (size_t)b->world;
    if (atomic_load(&b->waiting[(size_t)lane * W + (size_t)b->rank]) != mine->seq)
        return AXC_OK; /* this rank's thread may still start the peer's call */
    for (int other = first; other < first + AXC_GROUP_COUNT; other++) {
        const shm_group *og = b->lane_group[other];
        if (other == lane || !og || !same_members(og, g))
            continue;
        for (int k = 0; k < g->info.size; k++) {
            int r = g->members[k];
            if (r == b->rank)
                continue;
            uint64_t theirs = atomic_load(&b->waiting[(size_t)other * W + (size_t)r]);
            if (!theirs || atomic_load(&b->issued[(size_t)lane * W + (size_t)r]) >= mine->seq)
                continue; /* the peer waits for nothing there, or started this call */
            if (theirs <= atomic_load(&b->issued[(size_t)other * W + (size_t)b->rank]))
                continue; /* this rank started the call the peer waits for: it comes */
            shm_call peer = *call_slot(b, other, r, theirs);
            if (peer.seq != theirs)
                continue; /* its lane has not reached it yet: seen at the next look */
            char msg[512];
            int n = snprintf(msg, sizeof msg,
                             "collectives out of step on the %s and %s groups, which have the "
                             "same ranks: ",
                             axc_group_name(g->info.kind), axc_group_name(og->info.kind));
            n += describe_call(msg + n, sizeof msg - (size_t)n, b->rank, mine, g->info.kind);
            n += snprintf(msg + n, sizeof msg - (size_t)n, ", ");
            n += describe_call(msg + n, sizeof msg - (size_t)n, r, &peer, og->info.kind);
            snprintf(msg + n, sizeof msg - (size_t)n,
                     " (every rank must issue the collectives of groups with the same ranks in "
                     "the same order)");
            return shm_abort(b, AXC_ERR_PEER, msg);
        }
    }
    return AXC_OK;
}

static axc_status bar(run_ctx *c)
{
    AXC_TRY(group_barrier(c->b, c->g, c->deadline, c->what, c->mine));
    if (!c->mine)
        return AXC_OK;
    axc_status st = check_calls(c);
    c->mine = NULL;
    return st;
}

/* The half of member k's slot used in round `round` (double buffering: 1 barrier per round). */
static unsigned char *half(run_ctx *c, int k, size_t round)
{
    return c->slots + (size_t)c->g->members[k] * c->b->slot_bytes +
           (round & 1) * (c->b->slot_bytes / 2);
}

static void even_split(size_t n, int G, int k, size_t *lo, size_t *hi)
{
    size_t q = n / (size_t)G, r = n % (size_t)G;
    *lo = (size_t)k * q + ((size_t)k < r ? (size_t)k : r);
    *hi = *lo + q + ((size_t)k < r ? 1 : 0);
}

static axc_status run_all_reduce(run_ctx *c, const axc_coll *a, const void *send, void *recv)
{
    int G = c->g->info.size, me = c->g->info.rank;
    size_t es = axc_dtype_size(a->dtype), cap = c->b->slot_bytes / 2 / es;
    const void *srcs[1024];
    for (size_t off = 0, round = 0; off < a->count; off += cap, round++) {
        size_t len = a->count - off < cap ? a->count - off : cap, lo, hi;
        memcpy(half(c, me, round), (const unsigned char *)send + off * es, len * es);
        AXC_TRY(bar(c));
        /* reduce my slice from every slot (same order on every rank), in place in my slot */
        even_split(len, G, me, &lo, &hi);
        for (int k = 0; k < G; k++)
            srcs[k] = half(c, k, round) + lo * es;
        axc_reduce(a->dtype, a->op, half(c, me, round) + lo * es, srcs, G, hi - lo, G);
        AXC_TRY(bar(c));
        for (int k = 0; k < G; k++) {
            even_split(len, G, k, &lo, &hi);
            memcpy((unsigned char *)recv + (off + lo) * es, half(c, k, round) + lo * es,
                   (hi - lo) * es);
        }
    }
    return AXC_OK;
}

static axc_status run_all_gather(run_ctx *c, const axc_coll *a, const void *send, void *recv)
{
    int G = c->g->info.size, me = c->g->info.rank;
    size_t es = axc_dtype_size(a->dtype), cap = c->b->slot_bytes / 2 / es;
    for (size_t off = 0, round = 0; off < a->count; off += cap, round++) {
        size_t len = a->count - off < cap ? a->count - off : cap;
        memcpy(half(c, me, round), (const unsigned char *)send + off * es, len * es);
        AXC_TRY(bar(c));
        for (int k = 0; k < G; k++)
            memcpy((unsigned char *)recv + ((size_t)k * a->count + off) * es, half(c, k, round),
                   len * es);
    }
    return AXC_OK;
}

/* reduce_scatter and all_to_all: every rank posts G pieces, then takes piece `me` of each. */
static axc_status run_exchange(run_ctx *c, const axc_coll *a, const void *send, void *recv,
                               int reduce)
{
    int G = c->g->info.size, me = c->g->info.rank;
    size_t es = axc_dtype_size(a->dtype), cap = c->b->slot_bytes / 2 / es / (size_t)G;
    const void *srcs[1024];
    for (size_t off = 0, round = 0; off < a->count; off += cap, round++) {
        size_t len = a->count - off < cap ? a->count - off : cap;
        for (int k = 0; k < G; k++)
            memcpy(half(c, me, round) + (size_t)k * len * es,
                   (const unsigned char *)send + ((size_t)k * a->count + off) * es, len * es);
        AXC_TRY(bar(c));
        if (reduce) {
            for (int k = 0; k < G; k++)
                srcs[k] = half(c, k, round) + (size_t)me * len * es;
            axc_reduce(a->dtype, a->op, (unsigned char *)recv + off * es, srcs, G, len, G);
        } else {
            for (int k = 0; k < G; k++)
                memcpy((unsigned char *)recv + ((size_t)k * a->count + off) * es,
                       half(c, k, round) + (size_t)me * len * es, len * es);
        }
    }
    return AXC_OK;
}

static axc_status run_broadcast(run_ctx *c, const axc_coll *a, const void *send, void *recv)
{
    int me = c->g->info.rank;
    size_t es = axc_dtype_size(a->dtype), cap = c->b->slot_bytes / 2 / es;
    for (size_t off = 0, round = 0; off < a->count; off += cap, round++) {
        size_t len = a->count - off < cap ? a->count - off : cap;
        if (me == a->root)
            memcpy(half(c, me, round), (const unsigned char *)send + off * es, len * es);
        AXC_TRY(bar(c));
        if (me != a->root)
            memcpy((unsigned char *)recv + off * es, half(c, a->root, round), len * es);
    }
    if (me == a->root && send != recv && a->count)
        memmove(recv, send, a->count * es);
    return AXC_OK;
}

/* A compressed collective (axc_coll.codec, see axc/comm.h): encode once, move the encoded
 * pieces with the byte all-to-all / all-gather above, decode (and sum in group-rank order). */
static axc_status run_compressed(run_ctx *c, const axc_coll *a, const float *send, float *recv)
{
    int G = c->g->info.size, me = c->g->info.rank;
    int ar = a->kind == AXC_COLL_ALL_REDUCE, ag = a->kind == AXC_COLL_ALL_GATHER;
    size_t piece = ar ? (a->count + (size_t)G - 1) / (size_t)G : a->count;
    size_t n_in = a->kind == AXC_COLL_REDUCE_SCATTER ? a->count * (size_t)G : a->count, E = 0;
    AXC_TRY(axc_codec_encoded_bytes(a->codec, piece, a->block, &E));
    /* encoded pieces to send (G of them, one for all_gather), received pieces, the owner's sum */
    size_t n_send = ag ? 1 : (size_t)G;
    unsigned char *enc = calloc(n_send * E + (size_t)G * E + 1, 1);
    float *sum = ar ? malloc(piece * sizeof *sum + 1) : NULL;
    if (!enc || (ar && !sum)) {
        free(enc);
        free(sum);
        return axc_fail(AXC_ERR_NOMEM, "out of memory for a compressed %s of %zu elements",
                        axc_coll_name(a->kind), a->count);
    }
    unsigned char *got = enc + n_send * E;
    axc_status st = AXC_OK;
    for (size_t k = 0; k < n_send && st == AXC_OK; k++) {
        size_t lo = k * piece < n_in ? k * piece : n_in;
        size_t len = n_in - lo < piece ? n_in - lo : piece;
        st = a->residual ? axc_codec_encode_ef(a->codec, a->block, send + lo, a->residual + lo,
                                               len, enc + k * E)
                         : axc_codec_encode(a->codec, a->block, send + lo, len, enc + k * E);
    }
    axc_coll bytes = {.kind = ag ? AXC_COLL_ALL_GATHER : AXC_COLL_ALL_TO_ALL,
                      .count = E, .dtype = AXC_DT_U8, .device = -1};
    if (st == AXC_OK)
        st = ag ? run_all_gather(c, &bytes, enc, got) : run_exchange(c, &bytes, enc, got, 0);
    if (st == AXC_OK && !ag) {
        /* my piece from every rank, summed in group-rank order */
        size_t lo = (size_t)me * piece < n_in ? (size_t)me * piece : n_in;
        size_t len = ar ? (n_in - lo < piece ? n_in - lo : piece) : a->count;
        float *out = ar ? sum : recv;
        for (int k = 0; k < G && st == AXC_OK; k++)
            st = axc_codec_decode(a->codec, a->block, got + (size_t)k * E, len, out, k > 0);
        if (a->op == AXC_RED_AVG)
            axc_codec_div(out, len, (float)G);
        if (ar && st == AXC_OK) { /* then every rank decodes the owners' encoded sums */
            memset(enc, 0, E);
            st = axc_codec_encode(a->codec, a->block, sum, len, enc);
            bytes.kind = AXC_COLL_ALL_GATHER;
            /* the peers are done reading my slot's pieces before I post the sum there */
            if (st == AXC_OK)
                st = bar(c);
            if (st == AXC_OK)
                st = run_all_gather(c, &bytes, enc, got);
        }
    }
    if (st == AXC_OK && (ar || ag)) {
        for (int k = 0; k < G && st == AXC_OK; k++) {
            size_t lo = ar ? ((size_t)k * piece < n_in ? (size_t)k * piece : n_in)
                           : (size_t)k * a->count;
            size_t len = ar ? (n_in - lo < piece ? n_in - lo : piece) : a->count;
            st = axc_codec_decode(a->codec, a->block, got + (size_t)k * E, len, recv + lo, 0);
            if (st == AXC_OK && ar && k == me && a->residual) /* what encoding my sum lost */
                axc_codec_feedback(a->codec, a->block, sum, recv + lo, len,
                                   a->op == AXC_RED_AVG ? (float)G : 1.0f, a->residual + lo);
        }
    }
    free(enc);
    free(sum);
    return st;
}

static size_t send_elems(const axc_coll *a, int G)
{
    switch (a->kind) {
    case AXC_COLL_REDUCE_SCATTER:
    case AXC_COLL_ALL_TO_ALL: return a->count * (size_t)G;
    case AXC_COLL_BARRIER: return 0;
    default: return a->count;
    }
}

static size_t recv_elems(const axc_coll *a, int G)
{
    switch (a->kind) {
    case AXC_COLL_ALL_GATHER:
    case AXC_COLL_ALL_TO_ALL: return a->count * (size_t)G;
    case AXC_COLL_BARRIER: return 0;
    default: return a->count;
    }
}

/* Runs one collective on host buffers. */
static axc_status run_host(shm_backend *b, const shm_group *g, const axc_coll *a,
                           const void *send, void *recv)
{
    int lane = lane_index(&g->info);
    run_ctx c = {b, g, b->lanes[lane].slots, axc_now_ns() + (int64_t)(b->timeout_s * 1e9),
                 axc_coll_name(a->kind), NULL};
    int G = g->info.size;
    axc_status st = AXC_OK;
    if (G == 1) { /* nothing to exchange: a local copy, and the avg of one value is itself */
        if (a->kind != AXC_COLL_BARRIER && send && send != recv)
            memmove(recv, send, recv_elems(a, G) * axc_dtype_size(a->dtype));
        return AXC_OK;
    }
    if (atomic_load(&b->hdr->aborted)) /* peers are checked only while waiting: no syscall */
        return aborted_error(b, c.what);
    uint64_t seq = ++b->lanes[lane].calls;
    shm_call *mine = call_slot(b, lane, b->rank, seq);
    *mine = (shm_call){seq,     a->count, (uint32_t)a->kind,  (uint32_t)a->dtype,
                       (uint32_t)a->op, a->root,  (uint32_t)a->codec, (uint32_t)a->block,
                       a->check};
    c.mine = mine; /* compared at the first barrier (the barrier's atomics publish it) */
    if (a->codec != AXC_CODEC_NONE)
        st = run_compressed(&c, a, send, recv);
    else
        switch (a->kind) {
        case AXC_COLL_ALL_REDUCE: st = run_all_reduce(&c, a, send, recv); break;
        case AXC_COLL_ALL_GATHER: st = run_all_gather(&c, a, send, recv); break;
        case AXC_COLL_REDUCE_SCATTER: st = run_exchange(&c, a, send, recv, 1); break;
        case AXC_COLL_ALL_TO_ALL: st = run_exchange(&c, a, send, recv, 0); break;
        case AXC_COLL_BROADCAST: st = run_broadcast(&c, a, send, recv); break;
        case AXC_COLL_BARRIER:
        case AXC_COLL_COUNT: break;
        }
    /* closing barrier: the slots may be reused by the group's next collective */
    if (st == AXC_OK)
        st = bar(&c);
    return st;
}

/* ------------------------------------------------------------------ CUDA staging */

static axc_status ensure_host_buf(shm_lane *l, const axc_cuda_api *cu, size_t bytes)
{
    if (l->host_bytes >= bytes)
        return AXC_OK;
    if (l->host_buf)
        cu->FreeHost(l->host_buf);
    l->host_buf = NULL;
    l->host_bytes = 0;
    AXC_TRY(axc_cuda_check(cu->MallocHost(&l->host_buf, bytes), "cudaMallocHost"));
    l->host_bytes = bytes;
    return AXC_OK;
}

static axc_status run_cuda(shm_lane *l, const shm_group *g, axc_work *w)
{
    shm_backend *b = l->b;
    const axc_cuda_api *cu = b->cuda;
    const axc_coll *a = &w->coll;
    shm_cuda_work *cw = w->backend_data;
    int G = g->info.size;
    size_t es = axc_dtype_size(a->dtype), sb = send_elems(a, G) * es, rb = recv_elems(a, G) * es;
    if (l->stage_stream == NULL || l->stage_device != a->device) {
        AXC_TRY(axc_cuda_check(cu->SetDevice(a->device), "cudaSetDevice"));
        if (l->stage_stream)
            cu->StreamDestroy(l->stage_stream);
        l->stage_stream = NULL;
        AXC_TRY(axc_cuda_check(cu->StreamCreateWithFlags(&l->stage_stream, 1), "cudaStreamCreate"));
        l->stage_device = a->device;
    }
    AXC_TRY(ensure_host_buf(l, cu, align_up(sb, 64) + rb + 64));
    unsigned char *hsend = l->host_buf, *hrecv = hsend + align_up(sb, 64);
    int in_place = a->send == a->recv || a->kind == AXC_COLL_BARRIER;
    AXC_TRY(axc_cuda_check(cu->StreamWaitEvent(l->stage_stream, cw->ready, 0), "cudaStreamWaitEvent"));
    if (sb && a->send)
        AXC_TRY(axc_cuda_check(cu->MemcpyAsync(hsend, a->send, sb, AXC_CUDA_MEMCPY_D2H,
                                               l->stage_stream), "cudaMemcpyAsync D2H"));
    AXC_TRY(axc_cuda_check(cu->StreamSynchronize(l->stage_stream), "cudaStreamSynchronize"));
    AXC_TRY(run_host(b, g, a, a->send ? hsend : NULL, in_place ? hsend : hrecv));
    if (rb)
        AXC_TRY(axc_cuda_check(cu->MemcpyAsync(a->recv, in_place ? hsend : hrecv, rb,
                                               AXC_CUDA_MEMCPY_H2D, l->stage_stream),
                               "cudaMemcpyAsync H2D"));
    return axc_cuda_check(cu->StreamSynchronize(l->stage_stream), "cudaStreamSynchronize");
}

/* ------------------------------------------------------------------ lanes (progress threads) */

static void sim_link_sleep(shm_backend *b, const axc_work *w, int64_t t0)
{
    if (b->sim_gbps <= 0 && b->sim_us <= 0)
        return;
    uint64_t sent, recv;
    axc_coll_volume(&w->coll, w->group.size, w->group.rank, &sent, &recv);
    if (w->group.size == 1)
        return;
    double secs = b->sim_us * 1e-6 + (b->sim_gbps > 0 ? (double)sent / (b->sim_gbps * 1e9) : 0);
    /* the kind's channels share one link: a collective occupies it after the ones before it */
    pthread_mutex_lock(&b->link_mu);
    int64_t start = t0 > b->link_free[w->group.kind] ? t0 : b->link_free[w->group.kind];
    int64_t until = start + (int64_t)(secs * 1e9);
    b->link_free[w->group.kind] = until;
    pthread_mutex_unlock(&b->link_mu);
    struct timespec ts = {(time_t)(until / 1000000000LL), (long)(until % 1000000000LL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static axc_status sticky_failure(shm_backend *b, char *msg, size_t cap)
{
    pthread_mutex_lock(&b->fail_mu);
    axc_status st = b->failed;
    if (st != AXC_OK)
        snprintf(msg, cap, "%s", b->failed_msg);
    pthread_mutex_unlock(&b->fail_mu);
    return st;
}

static void set_failure(shm_backend *b, axc_status st, const char *msg)
{
    pthread_mutex_lock(&b->fail_mu);
    if (b->failed == AXC_OK) {
        b->failed = st;
        snprintf(b->failed_msg, sizeof b->failed_msg, "%s", msg);
    }
    pthread_mutex_unlock(&b->fail_mu);
}

/* Waits for the works `w` must follow (other lanes' works, started earlier on this rank). */
static axc_status wait_after(shm_backend *b, axc_work *w)
{
    for (size_t i = 0; i < w->n_after; i++) {
        axc_work *d = w->after[i];
        if (axc_work_host_wait(d, 2 * b->timeout_s + 30.0) != AXC_OK)
            return axc_fail(AXC_ERR_PEER, "%s on the %s group did not run: the %s on the %s "
                                          "group it follows failed: %s",
                            axc_coll_name(w->coll.kind), axc_group_name(w->group.kind),
                            axc_coll_name(d->coll.kind), axc_group_name(d->group.kind),
                            axc_last_error());
    }
    return AXC_OK;
}

static void execute(shm_lane *l, axc_work *w)
{
    shm_backend *b = l->b;
    const shm_group *g = w->backend_group;
    char msg[512];
    axc_status st = sticky_failure(b, msg, sizeof msg);
    if (st != AXC_OK) {
        axc_work_complete(w, st, msg);
        return;
    }
    st = wait_after(b, w);
    int64_t t0 = axc_now_ns();
    w->t_exec_begin = axc_timeline_begin(w->timeline); /* (the communicator's; 0: off) */
    if (st == AXC_OK)
        st = w->coll.device >= 0 ? run_cuda(l, g, w)
                                 : run_host(b, g, &w->coll, w->coll.send, w->coll.recv);
    if (st == AXC_OK) {
        sim_link_sleep(b, w, t0);
        axc_work_complete(w, st, NULL);
        return;
    }
    snprintf(msg, sizeof msg, "%s", axc_last_error());
    set_failure(b, st, msg);
    axc_work_complete(w, st, msg);
}

static void *lane_main(void *arg)
{
    shm_lane *l = arg;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->head && !l->stop)
            pthread_cond_wait(&l->cv, &l->mu);
        if (!l->head && l->stop)
            break;
        axc_work *w = l->head;
        l->head = w->next;
        if (!l->head)
            l->tail = NULL;
        pthread_mutex_unlock(&l->mu);
        execute(l, w);
        pthread_mutex_lock(&l->mu);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* ------------------------------------------------------------------ vtable */

static axc_status shm_start(axc_backend *be, void *group, axc_work *w)
{
    shm_backend *b = (shm_backend *)be;
    const shm_group *g = group;
    shm_lane *l = &b->lanes[lane_index(&g->info)];
    if (w->coll.device >= 0) {
        axc_status st = axc_cuda_load(&b->cuda);
        if (st != AXC_OK)
            return axc_fail(st, "shm backend got a CUDA tensor but CUDA is unavailable: %s",
                            axc_last_error());
        shm_cuda_work *cw = calloc(1, sizeof *cw);
        if (!cw)
            return axc_fail(AXC_ERR_NOMEM, "out of memory");
        /* the lane starts copying only after the user's stream reached this point; the event
         * must live on the stream's device, not the calling thread's current one */
        const axc_cuda_api *cu = b->cuda;
        int prev = -1;
        st = axc_cuda_device_enter(w->coll.device, &cu, &prev, "shm");
        if (st == AXC_OK) {
            st = axc_cuda_check(cu->EventCreateWithFlags(&cw->ready, 2 /* disable timing */),
                                "cudaEventCreate");
            if (st == AXC_OK)
                st = axc_cuda_check(cu->EventRecord(cw->ready, w->coll.stream),
                                    "cudaEventRecord");
            st = axc_cuda_device_leave(cu, w->coll.device, prev, st);
        }
        if (st != AXC_OK) {
            if (cw->ready)
                b->cuda->EventDestroy(cw->ready);
            free(cw);
            return st;
        }
        w->backend_data = cw;
    }
    w->next = NULL;
    pthread_mutex_lock(&l->mu);
    /* the lane's thread starts with its first work: kinds never used cost nothing */
    if (!l->thread_started) {
        if (pthread_create(&l->thread, NULL, lane_main, l) != 0) {
            pthread_mutex_unlock(&l->mu);
            if (w->backend_data) {
                b->cuda->EventDestroy(((shm_cuda_work *)w->backend_data)->ready);
                free(w->backend_data);
                w->backend_data = NULL;
            }
            return axc_fail(AXC_ERR_SYSTEM, "cannot start the shm progress thread of the %s group",
                            axc_group_name(g->info.kind));
        }
        l->thread_started = 1;
    }
    if (l->tail)
        l->tail->next = w;
    else
        l->head = w;
    l->tail = w;
    if (g->info.size > 1) /* (before the lane can run it: see check_crossed) */
        w->backend_seq = atomic_fetch_add(&b->issued[(size_t)lane_index(&g->info) *
                                                         (size_t)b->world +
                                                     (size_t)b->rank],
                                          1) +
                         1;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return AXC_OK;
}

static axc_status shm_wait(axc_backend *be, axc_work *w)
{
    shm_backend *b = (shm_backend *)be;
    const shm_group *g = w->backend_group;
    _Atomic uint64_t *waiting =
        w->backend_seq ? &b->waiting[(size_t)lane_index(&g->info) * (size_t)b->world +
                                     (size_t)b->rank]
                       : NULL;
    if (waiting) /* published for the peers' check_crossed */
        atomic_store(waiting, w->backend_seq);
    /* the lane bounds every peer wait by the timeout; the margin covers the copy */
    axc_status st = axc_work_host_wait(w, 2 * b->timeout_s + 30.0);
    if (waiting)
        atomic_store(waiting, 0);
    if (atomic_load(&w->state) != AXC_WORK_PENDING && w->backend_data) {
        shm_cuda_work *cw = w->backend_data;
        b->cuda->EventDestroy(cw->ready);
        free(cw);
        w->backend_data = NULL;
    }
    return st;
}

static axc_status shm_group_open(axc_backend *be, const axc_group_info *info, void **out)
{
    shm_backend *b = (shm_backend *)be;
    if (info->channel < 0 || info->channel >= b->channels)
        return axc_fail(AXC_ERR_INVALID, "shm: channel %d of %d", info->channel, b->channels);
    shm_group *g = calloc(1, sizeof *g);
    if (!g)
        return axc_fail(AXC_ERR_NOMEM, "out of memory");
    g->info = *info;
    g->members = malloc(sizeof(int) * (size_t)info->size);
    if (!g->members) {
        free(g);
        return axc_fail(AXC_ERR_NOMEM, "out of memory");
    }
    memcpy(g->members, info->members, sizeof(int) * (size_t)info->size);
    g->info.members = g->members;
    g->barrier = &b->barriers[(size_t)lane_index(info) * (size_t)b->world + (size_t)info->color];
    b->lane_group[lane_index(info)] = g; /* (groups open and close with the communicator) */
    *out = g;
    return AXC_OK;
}

static void shm_group_close(axc_backend *be, void *group)
{
    shm_backend *b = (shm_backend *)be;
    shm_group *g = group;
    if (b->lane_group[lane_index(&g->info)] == g)
        b->lane_group[lane_index(&g->info)] = NULL;
    free(g->members);
    free(g);
}

static void shm_destroy(axc_backend *be)
{
    shm_backend *b = (shm_backend *)be;
    for (int k = 0; k < AXC_MAX_CHANNELS * AXC_GROUP_COUNT; k++) {
        shm_lane *l = &b->lanes[k];
        if (l->thread_started) {
            pthread_mutex_lock(&l->mu);
            l->stop = 1;
            pthread_cond_signal(&l->cv);
            pthread_mutex_unlock(&l->mu);
            pthread_join(l->thread, NULL);
        }
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->cv);
        if (b->cuda) {
            if (l->stage_stream)
                b->cuda->StreamDestroy(l->stage_stream);
            if (l->host_buf)
                b->cuda->FreeHost(l->host_buf);
        }
    }
    pthread_mutex_destroy(&b->fail_mu);
    pthread_mutex_destroy(&b->link_mu);
    if (b->map)
        munmap(b->map, b->map_bytes);
    if (b->name[0])
        shm_unlink(b->name); /* normally gone already; ENOENT is fine */
    free(b);
}

/* ------------------------------------------------------------------ creation */

/* Removes /dev/shm/axonn_c.<pid>.* segments of this user whose creator (the pid in the name) no
 * longer exists: a rank 0 killed while it waited in init for the others to attach left its
 * segment there (issue 28 item 12). Names are unlinked once every rank attached, so a live
 * job's segment is named only during its init, and its creator is alive then. */
enum { STALE_SEGMENT_AGE_S = 120 }; /* a dead process's segment is swept once this old */

static void sweep_stale_segments(void)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "axonn_c.", 8) != 0)
            continue;
        char *end;
        long pid = strtol(e->d_name + 8, &end, 10);
        if (end == e->d_name + 8 || *end != '.' || pid <= 0)
            continue;
        struct stat stt;
        char path[320];
        snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
        if (stat(path, &stt) != 0 || stt.st_uid != geteuid())
            continue;
        /* only what has lain there a while: kill() sees this PID namespace only (a job in
         * another one sharing /dev/shm may be inside its init), and a job's own leak check
         * looks at what it left right after it ended */
        if (time(NULL) - stt.st_mtime < STALE_SEGMENT_AGE_S)
            continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) {
            char name[300];
            snprintf(name, sizeof name, "/%s", e->d_name);
            if (shm_unlink(name) == 0)
                axc_log(1, "removed the shared-memory segment %s of the dead process %ld", name,
                        pid);
        }
    }
    closedir(d);
}

static axc_status attach_segment(shm_backend *b, const axc_comm_config *cfg)
{
    /* a slot per rank for every lane (channel, kind) whose groups have more than one rank: the
     * lanes run at once */
    size_t slot_kb = (size_t)axc_env_double("AXONN_C_SHM_SLOT_KB", 2048);
    if (slot_kb < 64)
        slot_kb = 64;
    size_t slot = align_up(slot_kb * 1024, 4096);
    size_t hdr = align_up(sizeof(shm_header) + sizeof(int32_t) * (size_t)b->world, 4096);
    int n_lanes = b->channels * AXC_GROUP_COUNT;
    size_t bars = align_up(sizeof(shm_barrier) * (size_t)n_lanes * (size_t)b->world, 4096);
    size_t calls = align_up(sizeof(shm_call) * (size_t)n_lanes * (size_t)b->world * 2, 4096);
    size_t issued = align_up(sizeof(uint64_t) * (size_t)n_lanes * (size_t)b->world * 2, 4096);
    size_t lane_off[AXC_MAX_CHANNELS * AXC_GROUP_COUNT], total = hdr + bars + calls + issued;
    for (int k = 0; k < n_lanes; k++) {
        lane_off[k] = total;
        if (axc_grid_group_size(&cfg->grid, (axc_group_kind)(k % AXC_GROUP_COUNT)) > 1)
            total += slot * (size_t)b->world;
    }
    char key[256];
    snprintf(key, sizeof key, "%s/shm/name", cfg->job_id);
    /* an optional job tag ends the name, so a leak check (tests, CI) can tell its own segments
     * from those of other jobs on the machine */
    const char *tag = axc_env_str("AXONN_C_SHM_TAG");
    if (tag && *tag) {
        size_t n = strlen(tag);
        if (n > 64 || strspn(tag, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                  "0123456789_-") != n)
            return axc_fail(AXC_ERR_INVALID,
                            "AXONN_C_SHM_TAG=%.80s: expected at most 64 letters, digits, '_' "
                            "or '-'", tag);
    }
    int fd = -1;
    if (b->rank == 0) {
        static _Atomic unsigned counter = 0;
        sweep_stale_segments();
        snprintf(b->name, sizeof b->name, "/axonn_c.%d.%u.%lx%s%s", (int)getpid(),
                 atomic_fetch_add(&counter, 1), (unsigned long)axc_now_ns(),
                 tag && *tag ? "." : "", tag && *tag ? tag : "");
        fd = shm_open(b->name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0)
            return axc_fail(AXC_ERR_SYSTEM, "shm_open(%s) failed: %s", b->name, strerror(errno));
        if (ftruncate(fd, (off_t)total) != 0) {
            int e = errno;
            close(fd);
            shm_unlink(b->name);
            return axc_fail(AXC_ERR_SYSTEM,
                            "cannot size the shared-memory segment to %zu bytes (%s); /dev/shm "
                            "may be too small: lower AXONN_C_SHM_SLOT_KB",
                            total, strerror(e));
        }
    } else {
        size_t len = 0;
        axc_status st = cfg->bootstrap.get(cfg->bootstrap.ctx, key, b->name, sizeof b->name - 1,
                                           &len, cfg->timeout_s);
        if (st != AXC_OK)
            return st;
        b->name[len] = 0;
        fd = shm_open(b->name, O_RDWR, 0600);
        if (fd < 0)
            return axc_fail(AXC_ERR_SYSTEM,
                            "rank %d cannot open the shared-memory segment %s of rank 0: %s "
                            "(are all ranks on one node?)",
                            b->rank, b->name, strerror(errno));
    }
    void *map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        if (b->rank == 0)
            shm_unlink(b->name);
        return axc_fail(AXC_ERR_SYSTEM, "mmap of %zu bytes failed: %s", total, strerror(errno));
    }
    b->map = map;
    b->map_bytes = total;
    b->hdr = map;
    b->pids = (_Atomic int32_t *)((unsigned char *)map + sizeof(shm_header));
    b->barriers = (shm_barrier *)((unsigned char *)map + hdr);
    b->calls = (shm_call *)((unsigned char *)map + hdr + bars);
    b->issued = (_Atomic uint64_t *)((unsigned char *)map + hdr + bars + calls);
    b->waiting = b->issued + (size_t)n_lanes * (size_t)b->world;
    for (int k = 0; k < n_lanes; k++)
        if (axc_grid_group_size(&cfg->grid, (axc_group_kind)(k % AXC_GROUP_COUNT)) > 1)
            b->lanes[k].slots = (unsigned char *)map + lane_off[k];
    b->slot_bytes = slot;
    if (b->rank == 0) {
        b->hdr->world = (uint32_t)b->world;
        b->hdr->slot_bytes = slot;
        b->hdr->channels = (uint32_t)b->channels;
        atomic_store(&b->hdr->magic, SHM_MAGIC); /* (memory is zeroed by ftruncate) */
        axc_status st = cfg->bootstrap.set(cfg->bootstrap.ctx, key, b->name, strlen(b->name));
        if (st != AXC_OK) {
            shm_unlink(b->name);
            return st;
        }
    } else if (b->hdr->magic != SHM_MAGIC || b->hdr->world != (uint32_t)b->world ||
               b->hdr->slot_bytes != slot || b->hdr->channels != (uint32_t)b->channels) {
        return axc_fail(AXC_ERR_INVALID,
                        "rank %d: shared-memory segment %s does not match this job (world %u vs "
                        "%d, slot %llu vs %zu bytes, channels %u vs %d): do all ranks use the "
                        "same settings?",
                        b->rank, b->name, b->hdr->world, b->world,
                        (unsigned long long)b->hdr->slot_bytes, slot, b->hdr->channels,
                        b->channels);
    }
    atomic_store(&b->pids[b->rank], (int32_t)getpid());
    atomic_fetch_add(&b->hdr->attached, 1);
    axc_futex_wake_all(&b->hdr->attached, 1);
    /* wait for everyone, then remove the name: the memory lives while mapped, and a crash can
     * no longer leave anything behind in /dev/shm */
    int64_t deadline = axc_now_ns() + (int64_t)(cfg->timeout_s * 1e9);
    axc_status st = AXC_OK;
    unsigned polls = 0;
    for (;;) {
        uint32_t n = atomic_load(&b->hdr->attached);
        if (n >= (uint32_t)b->world)
            break;
        int64_t left = deadline - axc_now_ns();
        if (left <= 0) {
            st = axc_fail(AXC_ERR_TIMEOUT,
                          "only %u of %d ranks attached to the shared-memory segment within "
                          "%.1f s",
                          n, b->world, cfg->timeout_s);
            break;
        }
        if (cfg->bootstrap.peer_failed && ++polls % 5 == 0 &&
            (st = cfg->bootstrap.peer_failed(cfg->bootstrap.ctx)) != AXC_OK)
            break;
        axc_futex_wait(&b->hdr->attached, n, left < POLL_NS ? left : POLL_NS, 1);
    }
    shm_unlink(b->name);
    b->name[0] = 0;
    return st;
}

axc_status axc_shm_backend_create(axc_backend **out, const axc_comm_config *cfg)
{
    *out = NULL;
    if (cfg->grid.world_size > 1024)
        return axc_fail(AXC_ERR_UNAVAILABLE, "shm backend supports at most 1024 ranks, got %d",
                        cfg->grid.world_size);
    shm_backend *b = calloc(1, sizeof *b);
    if (!b)
        return axc_fail(AXC_ERR_NOMEM, "out of memory");
    b->base.name = "shm";
    b->base.group_open = shm_group_open;
    b->base.group_close = shm_group_close;
    b->base.start = shm_start;
    b->base.follows_after = 1;
    b->base.wait = shm_wait;
    b->base.query = NULL;
    b->base.abort = shm_abort_job;
    b->base.destroy = shm_destroy;
    b->rank = cfg->rank;
    b->world = cfg->grid.world_size;
    b->timeout_s = cfg->timeout_s;
    b->sim_gbps = axc_env_double("AXONN_C_SIM_GBPS", 0);
    b->sim_us = axc_env_double("AXONN_C_SIM_US", 0);
    b->channels = cfg->channels > 0 ? cfg->channels : 1;
    if (b->channels > AXC_MAX_CHANNELS) {
        free(b);
        return axc_fail(AXC_ERR_INVALID, "shm: %d channels, at most %d", cfg->channels,
                        AXC_MAX_CHANNELS);
    }
    pthread_mutex_init(&b->fail_mu, NULL);
    pthread_mutex_init(&b->link_mu, NULL);
    for (int k = 0; k < AXC_MAX_CHANNELS * AXC_GROUP_COUNT; k++) {
        shm_lane *l = &b->lanes[k];
        l->b = b;
        l->stage_device = -1;
        pthread_mutex_init(&l->mu, NULL);
        pthread_cond_init(&l->cv, NULL);
    }
    axc_status st = attach_segment(b, cfg);
    if (st != AXC_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", axc_last_error());
        shm_destroy(&b->base);
        axc_set_last_error(msg);
        return st;
    }
    *out = &b->base;
    return AXC_OK;
}
