/* The transport: communicators over the grid's groups, asynchronous collectives, byte counters.
 * Backends (shm, nccl) implement axc_backend; this header is what the rest of the core uses. */
#ifndef AXC_COMM_H
#define AXC_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "axc/compress.h"
#include "axc/grid.h"
#include "axc/status.h"
#include "axc/timeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum axc_dtype {
    AXC_DT_F32 = 0,
    AXC_DT_BF16 = 1,
    AXC_DT_F16 = 2,
    AXC_DT_I8 = 3,
    AXC_DT_U8 = 4,
    AXC_DT_I32 = 5,
    AXC_DT_I64 = 6,
    AXC_DT_F64 = 7,
    AXC_DT_COUNT = 8
} axc_dtype;

size_t axc_dtype_size(axc_dtype dt);
const char *axc_dtype_name(axc_dtype dt);
axc_status axc_dtype_from_name(const char *name, axc_dtype *dt);

typedef enum axc_redop { AXC_RED_SUM = 0, AXC_RED_AVG = 1, AXC_RED_MAX = 2 } axc_redop;
axc_status axc_redop_from_name(const char *name, axc_redop *op);
const char *axc_redop_name(axc_redop op);

typedef enum axc_coll_kind {
    AXC_COLL_ALL_REDUCE = 0,     /* send: count, recv: count (may alias send) */
    AXC_COLL_ALL_GATHER = 1,     /* send: count, recv: count * G (rank k's piece at k*count) */
    AXC_COLL_REDUCE_SCATTER = 2, /* send: count * G, recv: count (piece of my group rank) */
    AXC_COLL_ALL_TO_ALL = 3,     /* send: count * G (piece k to rank k), recv: count * G */
    AXC_COLL_BROADCAST = 4,      /* recv: count on every rank; send: root's data (may alias) */
    AXC_COLL_BARRIER = 5,        /* no data */
    AXC_COLL_COUNT = 6
} axc_coll_kind;

const char *axc_coll_name(axc_coll_kind kind);

/* One collective call. Buffers live in host memory (device < 0) or on CUDA device `device`. */
typedef struct axc_coll {
    axc_coll_kind kind;
    const void *send;
    void *recv;
    size_t count; /* elements of one rank's piece, see axc_coll_kind */
    axc_dtype dtype;
    axc_redop op;
    int root;     /* broadcast: group rank of the source */
    int device;   /* -1: host memory; >= 0: CUDA device index */
    void *stream; /* CUDA: the stream the buffers are ordered on (torch's current stream) */
    /* Compressed collective (codec != AXC_CODEC_NONE; float32 all_reduce, reduce_scatter or
     * all_gather, sum or avg; host buffers on shm, CUDA buffers on nccl): every rank encodes its input once with `codec` in
     * blocks of `block` elements (0: the default). all_reduce: piece k of ceil(count / G)
     * elements goes to rank k (an all-to-all of encoded pieces), which decodes and sums them in
     * fp32 in group-rank order, encodes the sum and all-gathers it; every rank decodes the same
     * bytes, so all hold bit-identical results. reduce_scatter: the owner's decoded sum is the
     * result. all_gather: every rank decodes every encoded piece, its own included. A group of
     * one rank copies exactly. `residual` (NULL: none) is the error feedback, an fp32 buffer of
     * the send length: the input encoded is send + residual, and residual becomes what the
     * encoding lost (axc_codec_encode_ef); in an all_reduce the owner of piece k also adds
     * there what encoding its sum lost (times G for avg), so over steps the results add up to
     * the exact sums minus the residuals still held. */
    axc_codec codec;
    int block;
    float *residual;
    /* What the buffer holds, the same on every rank for the same call (0: not said), e.g. a
     * gradient bucket's pieces (axc/buckets.h): the shm transport compares it with the peers'
     * that say one too and fails the call on every rank when it differs (ranks that packed different gradients
     * of the same total size would otherwise sum them into each other silently); NCCL does not
     * compare it. */
    uint64_t check;
} axc_coll;

/* Closed-form ring volumes (bytes) one rank of a `G`-rank group sends and receives for `c`.
 * These are the numbers the byte counters add and the communication model predicts. A
 * compressed collective counts its wire bytes: E = the encoded bytes of one piece (all_reduce:
 * ceil(count / G) elements, else count), (G - 1) * E each way, twice for all_reduce. */
void axc_coll_volume(const axc_coll *c, int G, int group_rank, uint64_t *sent, uint64_t *recv);
/* What `c` would move uncompressed (the same as axc_coll_volume when it is not compressed). */
void axc_coll_logical_volume(const axc_coll *c, int G, int group_rank, uint64_t *sent,
                             uint64_t *recv);

/* How the job's ranks find each other: a key-value store (torch's c10d store in practice). */
typedef struct axc_bootstrap {
    void *ctx;
    axc_status (*set)(void *ctx, const char *key, const void *value, size_t len);
    /* Blocks until `key` exists or `timeout_s` passes; writes at most `cap` bytes. */
    axc_status (*get)(void *ctx, const char *key, void *value, size_t cap, size_t *len,
                      double timeout_s);
    /* Optional (NULL: never): non-AXC_OK, with a message, once another rank has published that
     * its init failed; waits for peers during creation poll it, so that one rank's failure
     * fails init on every rank at once instead of at the timeout. */
    axc_status (*peer_failed)(void *ctx);
} axc_bootstrap;

typedef struct axc_comm axc_comm;
typedef struct axc_work axc_work;

/* The longest wait for a peer a communicator accepts (one week, in seconds): larger values,
 * NaN and infinities would overflow the nanosecond deadlines. */
#define AXC_MAX_TIMEOUT_S 604800.0

typedef struct axc_comm_config {
    axc_grid grid;
    int rank;
    int local_rank;
    int local_world_size;
    int cuda_device;    /* device for the nccl backend, -1 when none */
    const char *backend; /* NULL/"auto", "shm" or "nccl" */
    const char *job_id;  /* unique per job/init; names shm segments and store keys */
    double timeout_s;    /* bound on every wait for a peer */
    int channels;        /* independent sets of groups (>= 1; 0 means 1), see below */
    axc_bootstrap bootstrap;
    /* where the communicator's collectives record their COMM and WAIT spans, and the layers
     * over it their GEMMs (axc_comm_timeline); NULL: nothing is recorded. Not owned: it must
     * outlive the communicator (the runtime passes its own) */
    axc_timeline *timeline;
} axc_comm_config;

/* Collective over the whole world: every rank calls it with the same config. */
axc_status axc_comm_create(axc_comm **out, const axc_comm_config *cfg);
void axc_comm_destroy(axc_comm *comm);
/* Aborts the job's collectives for a rank that cannot go on with them (an interrupted call, a
 * collective it failed to enter): every wait of this rank's pending and later collectives fails
 * promptly with `msg` (the backends' abort); on shm every peer's too, at once; on nccl the peers
 * fail when their own watchdog gives up on the collective this rank left (at their timeout).
 * For good: the job must init() again. Later collectives fail with AXC_ERR_PEER (TIMEOUT when
 * `status` is), whatever `status`; a second abort changes nothing. Returns `status` with `msg`
 * as the error. May block (ncclCommAbort): call it without the caller's lock (the GIL). */
axc_status axc_comm_abort(axc_comm *comm, axc_status status, const char *msg);

const axc_grid *axc_comm_grid(const axc_comm *comm);
int axc_comm_rank(const axc_comm *comm);
double axc_comm_timeout(const axc_comm *comm);

/* The compression of the layers' own collectives over `kind` (init(compression={"row": ...})):
 * the linear layer's and the scheduler's float32 all_reduce, reduce_scatter and all_gather
 * over that group use `codec` where the transport can compress them (host buffers on shm, CUDA
 * buffers on nccl); AXC_CODEC_NONE: exact (the default). `error_feedback` (depth only, refused
 * elsewhere): the linear layer's depth dW reduce-scatters carry a residual (gradient rules,
 * axc_linear_io.dw_residual); the weight all-gathers never do. */
axc_status axc_comm_set_layer_codec(axc_comm *comm, axc_group_kind kind, axc_codec codec,
                                    int block, int error_feedback);
/* Whether that policy asks for error feedback over `kind` (with a codec set). */
int axc_comm_layer_error_feedback(const axc_comm *comm, axc_group_kind kind);
/* Sets c's codec and block from that policy when it applies to c; leaves c exact otherwise. */
void axc_comm_apply_layer_codec(const axc_comm *comm, axc_group_kind kind, axc_coll *c);
/* The same with a codec of the caller's (a layer's own policy, Linear(compression=...)). */
void axc_comm_apply_codec(const axc_comm *comm, axc_codec codec, int block, axc_coll *c);
/* Names of the backends in use ("shm", "nccl", "shm+nccl"). */
const char *axc_comm_backends(const axc_comm *comm);
/* The timeline it was opened with (axc_comm_config.timeline; NULL: none). */
axc_timeline *axc_comm_timeline(const axc_comm *comm);
/* 1 when collectives on host (CPU) memory work: a shm backend is there (not when the job is
 * NCCL only: backend="nccl", or ranks on several nodes). */
int axc_comm_host_collectives(const axc_comm *comm);

/* Channels: `cfg.channels` independent copies of every group (shm: own slots and progress
 * thread). NCCL communicators exist on channel 0 only: the other channels carry concurrent
 * micro-batches, which take host tensors; a CUDA collective there is refused (AXC_ERR_INVALID).
 * Collectives are matched across ranks in issue
 * order per (group, channel), so threads that run concurrently (e.g. concurrent micro-batches)
 * each take a channel of their own and need no common order between them. A thread uses
 * channel 0 until it sets another; the setting is per thread. */
#define AXC_MAX_CHANNELS 16 /* init(concurrent_microbatches=8) needs 8 + 3 */
int axc_comm_channels(const axc_comm *comm);
axc_status axc_comm_set_thread_channel(const axc_comm *comm, int channel);
int axc_comm_thread_channel(void);

/* Starts `c` on group `kind`; `*work` must be waited on (or freed, which waits). */
axc_status axc_comm_start(axc_comm *comm, axc_group_kind kind, const axc_coll *c,
                          axc_work **work);

/* Like axc_comm_start, but the collective begins only after the works `after` (started earlier
 * on this rank, typically on other groups) have finished, e.g. a sum over data-parallel ranks of
 * what depth reduce-scatters produce. Groups progress independently (NCCL: a stream per group;
 * shm: a thread per group kind), so without this a collective may run before another group's
 * earlier one. The shm backend waits for them on the group's thread, and the nccl backend makes
 * the group's comm stream wait on their completion events: neither blocks the caller or its
 * stream (nccl also orders it after a work already waited on another stream). Works of another
 * backend that are still pending are waited for here (a host wait, or for CUDA a join into the
 * stream that work was started on). The works in `after` must stay alive until this one has
 * finished. */
axc_status axc_comm_start_after(axc_comm *comm, axc_group_kind kind, const axc_coll *c,
                                axc_work *const *after, size_t n_after, axc_work **work);

/* Waits for completion. Host buffers: on return they hold the result. CUDA buffers: on return
 * the stream given at start is ordered after the collective (no host synchronisation). */
axc_status axc_work_wait(axc_work *work);
/* 1 when finished (successfully or not), 0 otherwise; never blocks. */
int axc_work_done(axc_work *work);
/* Waits if needed, then frees. A work whose wait timed out while the backend still ran it
 * (no second timeout is waited out) aborts the backend's collectives (the job is out of step;
 * every rank's waits fail) and is freed once the backend let it go, which it does at once
 * unless it is stuck: after AXC_WORK_ABORT_GRACE_S more it is leaked instead (its buffers may
 * still be written; only then can freeing them corrupt memory). */
#define AXC_WORK_ABORT_GRACE_S 2.0
/* 1: freed (NULL included); 0: leaked, the backend may still write the work's buffers. */
int axc_work_free(axc_work *work);

/* bytes_*: what was sent/received (wire bytes, compressed or not); logical_bytes_*: what the
 * uncompressed collectives would have moved (equal to bytes_* without compression). */
typedef struct axc_counters {
    uint64_t bytes_sent, bytes_recv, calls;
    uint64_t logical_bytes_sent, logical_bytes_recv, compressed_calls;
} axc_counters;
void axc_comm_counters(const axc_comm *comm, axc_group_kind kind, axc_counters *out);
void axc_comm_reset_counters(axc_comm *comm);

/* ---- backend interface (implemented in comm/shm.c and comm/nccl_*.c) ---- */

/* What a backend knows of one group. */
typedef struct axc_group_info {
    axc_group_kind kind;
    int size;
    int rank;     /* my index in the group */
    int color;    /* identical for all members; distinct per group of the same kind */
    int channel;  /* which copy of the group (axc_comm_set_thread_channel) */
    const int *members; /* global ranks, group order */
} axc_group_info;

typedef enum axc_work_state { AXC_WORK_PENDING = 0, AXC_WORK_DONE = 1, AXC_WORK_FAILED = 2 } axc_work_state;

typedef struct axc_backend axc_backend;
struct axc_backend {
    const char *name;
    /* Opens group `info` (collective over the world, called for every channel and kind in the
     * same order). */
    axc_status (*group_open)(axc_backend *be, const axc_group_info *info, void **group);
    void (*group_close)(axc_backend *be, void *group);
    /* Starts the collective; completion is reported by axc_work_complete(). */
    axc_status (*start)(axc_backend *be, void *group, axc_work *work);
    /* 1: start() honours work->after (the backend orders the collective after those of its own
     * works, without the caller waiting) */
    int follows_after;
    /* Waits for `work` (host or stream wait, see axc_work_wait). */
    axc_status (*wait)(axc_backend *be, axc_work *work);
    /* Optional: 1 when the work has finished (e.g. its CUDA event fired). NULL: use work->state. */
    int (*query)(axc_backend *be, axc_work *work);
    /* Optional: fails this rank's pending and later collectives with `msg` (shm: every rank's,
     * through the segment; nccl: this rank's communicators, its peers see it at their own
     * timeout or when NCCL reports the lost peer). */
    void (*abort)(axc_backend *be, axc_status status, const char *msg);
    void (*destroy)(axc_backend *be);
};

/* Backend constructors; each returns AXC_ERR_UNAVAILABLE with a reason when it cannot run. */
axc_status axc_shm_backend_create(axc_backend **out, const axc_comm_config *cfg);
axc_status axc_nccl_backend_create(axc_backend **out, const axc_comm_config *cfg);
/* NCCL facts for build_info(): the nccl.h version compiled against (0: none), and the version of
 * the libnccl.so.2 bound at run time (0 with a message when none can be loaded). */
int axc_nccl_header_version(void);
int axc_nccl_runtime_version(void);

/* The work record shared by the generic layer and the backends. */
struct axc_work {
    axc_coll coll;
    axc_group_info group;
    axc_backend *backend;
    void *backend_group;
    void *backend_data;      /* owned by the backend (e.g. CUDA events) */
    uint64_t backend_seq;    /* the backend's number for it (shm: its call number on the lane) */
    _Atomic uint32_t state;  /* axc_work_state; futex word for host waiters */
    axc_status status;
    int waited;              /* axc_work_wait ran; its result is `status` */
    int timed_out;           /* an axc_work_wait timed out while the backend still owned it */
    char message[512];
    axc_work *next;          /* backend queue link */
    axc_work **after;        /* run only after these finished (owned; see axc_comm_start_after) */
    size_t n_after;
    axc_timeline *timeline;  /* the communicator's (axc_comm_timeline): where it is recorded */
    int64_t t_exec_begin;    /* timeline: when the backend began executing it (0: not timed) */
};

/* Backends call this once per work, from any thread. */
void axc_work_complete(axc_work *work, axc_status status, const char *message);
/* Host-side wait on work->state with the comm timeout; used by backends' wait(). */
axc_status axc_work_host_wait(axc_work *work, double timeout_s);

#ifdef __cplusplus
}
#endif
#endif
