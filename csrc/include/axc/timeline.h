/* The timeline: compute and communication spans of this process, recorded into a preallocated
 * fixed-capacity buffer (thread-safe, lock-free, a few atomics per span), and the summary that
 * turns them into compute time, communication time and exposed (not hidden) communication time.
 *
 * One axc_timeline object holds a buffer and its state. The runtime (axc/runtime.h) owns the
 * process's: made with the runtime and kept across init/finalize (axc_runtime_timeline). The
 * recorders reach it through what they already hold: the communicator is opened with it
 * (axc_comm_config.timeline; each work carries it, so the backends record through the work),
 * and the linear layer takes it from its communicator (axc_comm_timeline). Code that uses a
 * communicator without a runtime (the C tests) passes NULL or a timeline of its own.
 *
 * Recording is off by default; when off, a record costs a NULL test and one relaxed atomic load
 * (a NULL timeline records nothing). Call sites:
 *
 *     int64_t t0 = axc_timeline_begin(tl);        // 0 when the timeline is off or NULL
 *     st = axc_gemm(...);
 *     axc_timeline_end(tl, AXC_SPAN_COMPUTE, "fwd_gemm", -1, t0, 0);
 *
 * or AXC_TIMED(tl, AXC_SPAN_COMPUTE, "fwd_gemm", -1, 0, st = axc_gemm(...));
 * Names must outlive the timeline: static strings, or axc_timeline_intern's copies (the buffer
 * keeps the pointer). Times are axc_now_ns() (monotonic ns). Host timestamps of CUDA work
 * measure the launch, not the kernel. */
#ifndef AXC_TIMELINE_H
#define AXC_TIMELINE_H

#include <stddef.h>
#include <stdint.h>

#include "axc/grid.h"
#include "axc/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* WAIT: a thread that computes was blocked on a collective (axc_work_wait on a pending work).
 * When waits are recorded, exposed communication is the communication they overlap while no
 * GEMM ran: the time a computing thread spent waiting while bytes moved, unless another thread
 * (a concurrent micro-batch) computed meanwhile. Without waits (spans recorded by hand) it is
 * the communication no compute span covers. */
enum { AXC_SPAN_COMPUTE = 0, AXC_SPAN_COMM = 1, AXC_SPAN_WAIT = 2 };

/* Default capacity (spans) of the buffer allocated on the first enable. */
#define AXC_TIMELINE_DEFAULT_CAPACITY ((size_t)1 << 20)
/* the most spans a buffer may hold (2^26: a few GiB); more is refused, not left to fail every
 * later enable with an allocation error */
#define AXC_TIMELINE_MAX_CAPACITY ((size_t)1 << 26)

typedef struct axc_span {
    int kind;         /* AXC_SPAN_COMPUTE, AXC_SPAN_COMM or AXC_SPAN_WAIT */
    int group;        /* axc_group_kind of a comm or wait span; -1 for compute */
    const char *name; /* static string */
    int64_t t_begin, t_end; /* monotonic ns */
    uint64_t bytes;   /* comm: closed-form bytes sent by this rank; compute: caller's figure */
    int channel;      /* comm channel (axc_comm_set_thread_channel) of the recording thread, or of
                         the collective for comm spans: tells concurrent micro-batches apart */
} axc_span;

typedef struct axc_timeline_group_stats {
    int64_t comm_ns;    /* length of the union of this group's comm spans */
    int64_t exposed_ns; /* of which exposed (see AXC_SPAN_WAIT) */
    uint64_t bytes;     /* sum of the spans' bytes */
    uint64_t spans;     /* number of spans */
} axc_timeline_group_stats;

typedef struct axc_timeline_stats {
    int64_t compute_ns;      /* length of the union of compute spans */
    int64_t comm_ns;         /* length of the union of all comm spans */
    int64_t exposed_comm_ns; /* the part of comm_ns that was exposed (see AXC_SPAN_WAIT) */
    int64_t t_first, t_last; /* earliest begin, latest end over all spans (0 when none) */
    size_t spans;            /* spans summarised */
    size_t compute_spans, comm_spans, wait_spans;
    int64_t wait_ns;         /* length of the union of wait spans */
    uint64_t dropped;        /* spans lost because the buffer was full */
    axc_timeline_group_stats group[AXC_GROUP_COUNT];
} axc_timeline_stats;

/* The most names axc_timeline_intern keeps per timeline. */
#define AXC_TIMELINE_MAX_NAMES 256

typedef struct axc_timeline axc_timeline;

/* An empty timeline, recording off, capacity AXC_TIMELINE_DEFAULT_CAPACITY. */
axc_status axc_timeline_create(axc_timeline **out);
/* Frees the buffer and the interned names; only when no thread can be recording (no open
 * communicator uses it). NULL is a no-op. */
void axc_timeline_destroy(axc_timeline *tl);

/* Every function below takes the timeline; with NULL the recorders do nothing, the queries see an
 * empty timeline, and enabling fails (AXC_ERR_INVALID). */

/* Turns recording on or off. The first enable allocates the buffer (on failure recording stays
 * off and axc_timeline_enable_checked reports it). */
void axc_timeline_enable(axc_timeline *tl, int on);
axc_status axc_timeline_enable_checked(axc_timeline *tl, int on);
int axc_timeline_enabled(const axc_timeline *tl);
/* Capacity for the next allocation; fails with AXC_ERR_STATE once the buffer exists. */
axc_status axc_timeline_set_capacity(axc_timeline *tl, size_t spans);
size_t axc_timeline_capacity(axc_timeline *tl);
/* Forgets every span and the drop count (call while nothing records concurrently for exactness). */
void axc_timeline_clear(axc_timeline *tl);
/* Disables and frees the buffer (the next enable makes a new one); only when no thread can be
 * recording. */
void axc_timeline_free(axc_timeline *tl);
/* A copy of `name` that lives as long as the timeline (the same pointer for the same string),
 * for span names that are not static; NULL when AXC_TIMELINE_MAX_NAMES are kept already or
 * memory runs out. Takes the timeline's lock: not for the hot path. */
const char *axc_timeline_intern(axc_timeline *tl, const char *name);

int64_t axc_timeline_now(void);
/* Thread-safe; drops (and counts) the span when the buffer is full; no-op when disabled or NULL.
 * The span's channel is the calling thread's. */
void axc_timeline_record(axc_timeline *tl, int kind, const char *name, int group, int64_t t_begin,
                         int64_t t_end, uint64_t bytes);
/* The same with an explicit channel (a progress thread recording a collective's span). */
void axc_timeline_record_on(axc_timeline *tl, int kind, const char *name, int group, int channel,
                            int64_t t_begin, int64_t t_end, uint64_t bytes);

size_t axc_timeline_count(axc_timeline *tl);
axc_status axc_timeline_get(axc_timeline *tl, size_t i, axc_span *out);
uint64_t axc_timeline_dropped(axc_timeline *tl);

/* Summary of the recorded spans. */
axc_status axc_timeline_summary(axc_timeline *tl, axc_timeline_stats *out);
/* The same arithmetic over any array of spans (dropped is left 0). O(n log n). */
axc_status axc_timeline_summarize(const axc_span *spans, size_t n, axc_timeline_stats *out);

/* ---- call-site helpers ---- */

/* 0 when the timeline is off or NULL, else the current time: pass it to axc_timeline_end. */
static inline int64_t axc_timeline_begin(const axc_timeline *tl)
{
    return tl && axc_timeline_enabled(tl) ? axc_timeline_now() : 0;
}

static inline void axc_timeline_end(axc_timeline *tl, int kind, const char *name, int group,
                                    int64_t t0, uint64_t bytes)
{
    if (t0 > 0)
        axc_timeline_record(tl, kind, name, group, t0, axc_timeline_now(), bytes);
}

/* Runs the statement `expr` and records it as one span on `tl` when it is on. A `return`
 * inside expr (e.g. AXC_TRY) skips the record. */
#define AXC_TIMED(tl, kind, name, group, bytes, expr)                            \
    do {                                                                         \
        axc_timeline *axc_timed_tl_ = (tl);                                      \
        int64_t axc_timed_t0_ = axc_timeline_begin(axc_timed_tl_);               \
        expr;                                                                    \
        axc_timeline_end(axc_timed_tl_, (kind), (name), (group), axc_timed_t0_, (bytes)); \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif
