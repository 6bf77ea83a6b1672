/* The timeline buffer and its summary (see axc/timeline.h).
 *
 * Recording: a slot index is reserved with one atomic fetch-add; the slot's fields are written and
 * then its `gen` word is published (release) with the generation that was current when the
 * recorder started. A slot is visible only when its gen equals the current generation, so
 * axc_timeline_clear() (which bumps the generation) hides every older span without touching the
 * buffer, and a reader never sees a half-written span. */
#include "axc/timeline.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/futex.h"

typedef struct tl_slot {
    axc_span span;
    _Atomic uint32_t gen;
} tl_slot;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* allocation and free only */
static _Atomic int g_enabled;
static tl_slot *_Atomic g_buf;
static size_t g_cap = AXC_TIMELINE_DEFAULT_CAPACITY; /* capacity of g_buf (written under g_mu) */
static _Atomic size_t g_cap_pub; /* g_cap as published with g_buf */
static _Atomic size_t g_next;
static _Atomic uint64_t g_dropped;
static _Atomic uint32_t g_gen = 1;

axc_status axc_timeline_set_capacity(size_t spans)
{
    if (spans == 0 || spans > AXC_TIMELINE_MAX_CAPACITY)
        return axc_fail(AXC_ERR_INVALID, "timeline capacity must be in [1, %zu] spans, got %zu",
                        AXC_TIMELINE_MAX_CAPACITY, spans);
    pthread_mutex_lock(&g_mu);
    int has = atomic_load(&g_buf) != NULL;
    if (!has)
        g_cap = spans;
    pthread_mutex_unlock(&g_mu);
    if (has)
        return axc_fail(AXC_ERR_STATE,
                        "the timeline buffer already exists; set its capacity before enabling");
    return AXC_OK;
}

size_t axc_timeline_capacity(void)
{
    pthread_mutex_lock(&g_mu);
    size_t c = g_cap;
    pthread_mutex_unlock(&g_mu);
    return c;
}

axc_status axc_timeline_enable_checked(int on)
{
    if (!on) {
        atomic_store_explicit(&g_enabled, 0, memory_order_release);
        return AXC_OK;
    }
    axc_status st = AXC_OK;
    pthread_mutex_lock(&g_mu);
    if (!atomic_load(&g_buf)) {
        tl_slot *buf = calloc(g_cap, sizeof *buf);
        if (!buf) {
            st = axc_fail(AXC_ERR_NOMEM, "cannot allocate the timeline buffer (%zu spans)", g_cap);
        } else {
            atomic_store(&g_next, 0);
            atomic_store(&g_dropped, 0);
            atomic_store(&g_cap_pub, g_cap);
            atomic_store_explicit(&g_buf, buf, memory_order_release);
        }
    }
    if (st == AXC_OK)
        atomic_store_explicit(&g_enabled, 1, memory_order_release);
    pthread_mutex_unlock(&g_mu);
    return st;
}

void axc_timeline_enable(int on) { (void)axc_timeline_enable_checked(on); }

int axc_timeline_enabled(void) { return atomic_load_explicit(&g_enabled, memory_order_relaxed); }

void axc_timeline_clear(void)
{
    uint32_t g = atomic_load(&g_gen) + 1;
    if (g == 0)
        g = 1;
    atomic_store(&g_gen, g);
    atomic_store(&g_next, 0);
    atomic_store(&g_dropped, 0);
}

void axc_timeline_free(void)
{
    pthread_mutex_lock(&g_mu);
    atomic_store(&g_enabled, 0);
    tl_slot *buf = atomic_exchange(&g_buf, NULL);
    atomic_store(&g_cap_pub, 0);
    atomic_store(&g_next, 0);
    atomic_store(&g_dropped, 0);
    pthread_mutex_unlock(&g_mu);
    free(buf);
}

int64_t axc_timeline_now(void) { return axc_now_ns(); }

void axc_timeline_record(int kind, const char *name, int group, int64_t t_begin, int64_t t_end,
                         uint64_t bytes)
{
    axc_timeline_record_on(kind, name, group, axc_comm_thread_channel(), t_begin, t_end, bytes);
}

void axc_timeline_record_on(int kind, const char *name, int group, int channel, int64_t t_begin,
                            int64_t t_end, uint64_t bytes)
{
    if (!atomic_load_explicit(&g_enabled, memory_order_relaxed))
        return;
    tl_slot *buf = atomic_load_explicit(&g_buf, memory_order_acquire);
    if (!buf)
        return;
    uint32_t gen = atomic_load_explicit(&g_gen, memory_order_acquire);
    size_t cap = atomic_load_explicit(&g_cap_pub, memory_order_relaxed);
    size_t i = atomic_fetch_add_explicit(&g_next, 1, memory_order_relaxed);
    if (i >= cap) {
        atomic_fetch_add_explicit(&g_dropped, 1, memory_order_relaxed);
        return;
    }
    tl_slot *s = &buf[i];
    s->span.kind = kind;
    s->span.group = kind == AXC_SPAN_COMPUTE ? -1 : group;
    s->span.name = name ? name : "";
    s->span.t_begin = t_begin;
    s->span.t_end = t_end;
    s->span.bytes = bytes;
    s->span.channel = channel;
    atomic_store_explicit(&s->gen, gen, memory_order_release);
}

size_t axc_timeline_count(void)
{
    size_t n = atomic_load(&g_next), cap = atomic_load(&g_cap_pub);
    return n < cap ? n : cap;
}

uint64_t axc_timeline_dropped(void) { return atomic_load(&g_dropped); }

axc_status axc_timeline_get(size_t i, axc_span *out)
{
    tl_slot *buf = atomic_load_explicit(&g_buf, memory_order_acquire);
    if (!buf || i >= axc_timeline_count())
        return axc_fail(AXC_ERR_INVALID, "timeline span %zu out of range (%zu recorded)", i,
                        axc_timeline_count());
    if (atomic_load_explicit(&buf[i].gen, memory_order_acquire) != atomic_load(&g_gen))
        return axc_fail(AXC_ERR_STATE, "timeline span %zu is still being written", i);
    *out = buf[i].span;
    return AXC_OK;
}

/* ------------------------------------------------------------------ interval arithmetic */

typedef struct iv {
    int64_t a, b;
} iv;

static int iv_cmp(const void *x, const void *y)
{
    const iv *p = x, *q = y;
    if (p->a != q->a)
        return p->a < q->a ? -1 : 1;
    return (p->b > q->b) - (p->b < q->b);
}

/* Sorts and merges v[0..n) in place into disjoint intervals; returns their number. */
static size_t iv_union(iv *v, size_t n)
{
    if (n == 0)
        return 0;
    qsort(v, n, sizeof *v, iv_cmp);
    size_t m = 0;
    for (size_t i = 1; i < n; i++) {
        if (v[i].a <= v[m].b) {
            if (v[i].b > v[m].b)
                v[m].b = v[i].b;
        } else {
            v[++m] = v[i];
        }
    }
    return m + 1;
}

static int64_t iv_length(const iv *v, size_t n)
{
    int64_t s = 0;
    for (size_t i = 0; i < n; i++)
        s += v[i].b - v[i].a;
    return s;
}

/* The intersection of two sorted disjoint interval lists, into out (room for nx + ny). */
static size_t iv_intersect(const iv *x, size_t nx, const iv *y, size_t ny, iv *out)
{
    size_t i = 0, j = 0, m = 0;
    while (i < nx && j < ny) {
        int64_t a = x[i].a > y[j].a ? x[i].a : y[j].a;
        int64_t b = x[i].b < y[j].b ? x[i].b : y[j].b;
        if (b > a)
            out[m++] = (iv){a, b};
        if (x[i].b < y[j].b)
            i++;
        else
            j++;
    }
    return m;
}

/* Length of the intersection of two sorted disjoint interval lists (scratch: nx + ny). */
static int64_t iv_overlap(const iv *x, size_t nx, const iv *y, size_t ny, iv *scratch)
{
    return iv_length(scratch, iv_intersect(x, nx, y, ny, scratch));
}

/* Exposed communication in `comm`: with wait spans, the time a thread waited for it while no
 * GEMM ran (another thread's GEMM, e.g. a concurrent micro-batch's, hides it too); without,
 * the time no GEMM ran. */
static int64_t exposed(const iv *comm, size_t nm, const iv *cu, size_t ncu, const iv *wt,
                       size_t nwt, int waits, iv *scratch, iv *scratch2)
{
    if (!waits)
        return iv_length(comm, nm) - iv_overlap(comm, nm, cu, ncu, scratch);
    size_t nx = iv_intersect(comm, nm, wt, nwt, scratch);
    return iv_length(scratch, nx) - iv_overlap(scratch, nx, cu, ncu, scratch2);
}

/* Collects the non-empty spans matching (kind, group) into v (group < 0: any group). */
static size_t collect(const axc_span *spans, size_t n, int kind, int group, iv *v)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        const axc_span *s = &spans[i];
        if (s->kind != kind || (group >= 0 && s->group != group) || s->t_end <= s->t_begin)
            continue;
        v[m].a = s->t_begin;
        v[m].b = s->t_end;
        m++;
    }
    return m;
}

axc_status axc_timeline_summarize(const axc_span *spans, size_t n, axc_timeline_stats *out)
{
    if (!out || (n && !spans))
        return axc_fail(AXC_ERR_INVALID, "axc_timeline_summarize: NULL argument");
    memset(out, 0, sizeof *out);
    out->spans = n;
    if (n == 0)
        return AXC_OK;
    /* unions of compute, comm, wait spans (n each), and two intersections (2n each) */
    iv *cu = malloc(7 * n * sizeof *cu);
    if (!cu)
        return axc_fail(AXC_ERR_NOMEM, "out of memory summarising %zu timeline spans", n);
    iv *tmp = cu + n, *wt = cu + 2 * n, *s1 = cu + 3 * n, *s2 = cu + 5 * n;

    for (size_t i = 0; i < n; i++) {
        const axc_span *s = &spans[i];
        if (i == 0 || s->t_begin < out->t_first)
            out->t_first = s->t_begin;
        if (i == 0 || s->t_end > out->t_last)
            out->t_last = s->t_end;
        if (s->kind == AXC_SPAN_COMPUTE) {
            out->compute_spans++;
        } else if (s->kind == AXC_SPAN_WAIT) {
            out->wait_spans++;
        } else {
            out->comm_spans++;
            if (s->group >= 0 && s->group < AXC_GROUP_COUNT) {
                out->group[s->group].spans++;
                out->group[s->group].bytes += s->bytes;
            }
        }
    }

    size_t ncu = iv_union(cu, collect(spans, n, AXC_SPAN_COMPUTE, -1, cu));
    out->compute_ns = iv_length(cu, ncu);
    size_t nwt = iv_union(wt, collect(spans, n, AXC_SPAN_WAIT, -1, wt));
    out->wait_ns = iv_length(wt, nwt);
    int waits = out->wait_spans > 0;

    size_t nm = iv_union(tmp, collect(spans, n, AXC_SPAN_COMM, -1, tmp));
    out->comm_ns = iv_length(tmp, nm);
    out->exposed_comm_ns = exposed(tmp, nm, cu, ncu, wt, nwt, waits, s1, s2);

    for (int g = 0; g < AXC_GROUP_COUNT; g++) {
        axc_timeline_group_stats *gs = &out->group[g];
        if (!gs->spans)
            continue;
        size_t ng = iv_union(tmp, collect(spans, n, AXC_SPAN_COMM, g, tmp));
        gs->comm_ns = iv_length(tmp, ng);
        gs->exposed_ns = exposed(tmp, ng, cu, ncu, wt, nwt, waits, s1, s2);
    }
    free(cu);
    return AXC_OK;
}

axc_status axc_timeline_summary(axc_timeline_stats *out)
{
    if (!out)
        return axc_fail(AXC_ERR_INVALID, "axc_timeline_summary: NULL argument");
    size_t n = axc_timeline_count();
    axc_span *v = NULL;
    size_t m = 0;
    if (n) {
        v = malloc(n * sizeof *v);
        if (!v)
            return axc_fail(AXC_ERR_NOMEM, "out of memory copying %zu timeline spans", n);
        tl_slot *buf = atomic_load_explicit(&g_buf, memory_order_acquire);
        uint32_t gen = atomic_load(&g_gen);
        for (size_t i = 0; buf && i < n; i++)
            if (atomic_load_explicit(&buf[i].gen, memory_order_acquire) == gen)
                v[m++] = buf[i].span;
    }
    axc_status st = axc_timeline_summarize(v, m, out);
    free(v);
    out->dropped = axc_timeline_dropped();
    return st;
}
