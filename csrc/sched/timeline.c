/* The timeline buffer and its summary (see axc/timeline.h).
 *
 * Recording: a slot index is reserved with one atomic fetch-add; the slot's fields are written and
 * then its `gen` word is published (release) with the generation that was current when the
 * recorder started. A slot is visible only when its gen equals the current generation, so
 * axc_timeline_clear() (which bumps the generation) hides every older span without touching the
 * buffer, and a reader never sees a half-written span. All of it lives in one axc_timeline
 * (the runtime's, axc_runtime_timeline); a NULL timeline records nothing. */
#include "axc/timeline.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "axc/futex.h"
#include "axc/thread_channel.h"

typedef struct tl_slot {
    axc_span span;
    _Atomic uint32_t gen;
} tl_slot;

struct axc_timeline {
    pthread_mutex_t mu; /* allocation, free and the name table only */
    _Atomic int enabled;
    tl_slot *_Atomic buf;
    size_t cap;              /* capacity of buf (written under mu) */
    _Atomic size_t cap_pub;  /* cap as published with buf */
    _Atomic size_t next;
    _Atomic uint64_t dropped;
    _Atomic uint32_t gen;
    char *names[AXC_TIMELINE_MAX_NAMES]; /* axc_timeline_intern's copies (under mu) */
    int n_names;
};

axc_status axc_timeline_create(axc_timeline **out)
{
    if (!out)
        return axc_fail(AXC_ERR_INVALID, "axc_timeline_create: NULL argument");
    *out = NULL;
    axc_timeline *tl = calloc(1, sizeof *tl);
    if (!tl)
        return axc_fail(AXC_ERR_NOMEM, "axc_timeline_create: out of memory");
    if (pthread_mutex_init(&tl->mu, NULL) != 0) {
        free(tl);
        return axc_fail(AXC_ERR_NOMEM, "axc_timeline_create: cannot make its mutex");
    }
    tl->cap = AXC_TIMELINE_DEFAULT_CAPACITY;
    atomic_init(&tl->gen, 1);
    *out = tl;
    return AXC_OK;
}

void axc_timeline_destroy(axc_timeline *tl)
{
    if (!tl)
        return;
    axc_timeline_free(tl);
    for (int i = 0; i < tl->n_names; i++)
        free(tl->names[i]);
    pthread_mutex_destroy(&tl->mu);
    free(tl);
}

axc_status axc_timeline_set_capacity(axc_timeline *tl, size_t spans)
{
    if (!tl)
        return axc_fail(AXC_ERR_INVALID, "axc_timeline_set_capacity: no timeline");
    if (spans == 0 || spans > AXC_TIMELINE_MAX_CAPACITY)
        return axc_fail(AXC_ERR_INVALID, "timeline capacity must be in [1, %zu] spans, got %zu",
                        AXC_TIMELINE_MAX_CAPACITY, spans);
    pthread_mutex_lock(&tl->mu);
    int has = atomic_load(&tl->buf) != NULL;
    if (!has)
        tl->cap = spans;
    pthread_mutex_unlock(&tl->mu);
    if (has)
        return axc_fail(AXC_ERR_STATE,
                        "the timeline buffer already exists; set its capacity before enabling");
    return AXC_OK;
}

size_t axc_timeline_capacity(axc_timeline *tl)
{
    if (!tl)
        return 0;
    pthread_mutex_lock(&tl->mu);
    size_t c = tl->cap;
    pthread_mutex_unlock(&tl->mu);
    return c;
}

axc_status axc_timeline_enable_checked(axc_timeline *tl, int on)
{
    if (!tl)
        return on ? axc_fail(AXC_ERR_INVALID, "axc_timeline_enable: no timeline") : AXC_OK;
    if (!on) {
        atomic_store_explicit(&tl->enabled, 0, memory_order_release);
        return AXC_OK;
    }
    axc_status st = AXC_OK;
    pthread_mutex_lock(&tl->mu);
    if (!atomic_load(&tl->buf)) {
        tl_slot *buf = calloc(tl->cap, sizeof *buf);
        if (!buf) {
            st = axc_fail(AXC_ERR_NOMEM, "cannot allocate the timeline buffer (%zu spans)",
                          tl->cap);
        } else {
            atomic_store(&tl->next, 0);
            atomic_store(&tl->dropped, 0);
            atomic_store(&tl->cap_pub, tl->cap);
            atomic_store_explicit(&tl->buf, buf, memory_order_release);
        }
    }
    if (st == AXC_OK)
        atomic_store_explicit(&tl->enabled, 1, memory_order_release);
    pthread_mutex_unlock(&tl->mu);
    return st;
}

void axc_timeline_enable(axc_timeline *tl, int on) { (void)axc_timeline_enable_checked(tl, on); }

int axc_timeline_enabled(const axc_timeline *tl)
{
    return tl && atomic_load_explicit(&tl->enabled, memory_order_relaxed);
}

void axc_timeline_clear(axc_timeline *tl)
{
    if (!tl)
        return;
    uint32_t g = atomic_load(&tl->gen) + 1;
    if (g == 0)
        g = 1;
    atomic_store(&tl->gen, g);
    atomic_store(&tl->next, 0);
    atomic_store(&tl->dropped, 0);
}

void axc_timeline_free(axc_timeline *tl)
{
    if (!tl)
        return;
    pthread_mutex_lock(&tl->mu);
    atomic_store(&tl->enabled, 0);
    tl_slot *buf = atomic_exchange(&tl->buf, NULL);
    atomic_store(&tl->cap_pub, 0);
    atomic_store(&tl->next, 0);
    atomic_store(&tl->dropped, 0);
    pthread_mutex_unlock(&tl->mu);
    free(buf);
}

const char *axc_timeline_intern(axc_timeline *tl, const char *name)
{
    if (!tl || !name)
        return NULL;
    const char *r = NULL;
    pthread_mutex_lock(&tl->mu);
    for (int i = 0; i < tl->n_names && !r; i++)
        if (strcmp(tl->names[i], name) == 0)
            r = tl->names[i];
    if (!r && tl->n_names < AXC_TIMELINE_MAX_NAMES) {
        size_t len = strlen(name) + 1;
        char *c = malloc(len);
        if (c) {
            memcpy(c, name, len);
            r = tl->names[tl->n_names++] = c;
        }
    }
    pthread_mutex_unlock(&tl->mu);
    return r;
}

int64_t axc_timeline_now(void) { return axc_now_ns(); }

void axc_timeline_record(axc_timeline *tl, int kind, const char *name, int group, int64_t t_begin,
                         int64_t t_end, uint64_t bytes)
{
    axc_timeline_record_on(tl, kind, name, group, axc_thread_channel(), t_begin, t_end,
                           bytes);
}

void axc_timeline_record_on(axc_timeline *tl, int kind, const char *name, int group, int channel,
                            int64_t t_begin, int64_t t_end, uint64_t bytes)
{
    if (!tl || !atomic_load_explicit(&tl->enabled, memory_order_relaxed))
        return;
    tl_slot *buf = atomic_load_explicit(&tl->buf, memory_order_acquire);
    if (!buf)
        return;
    uint32_t gen = atomic_load_explicit(&tl->gen, memory_order_acquire);
    size_t cap = atomic_load_explicit(&tl->cap_pub, memory_order_relaxed);
    size_t i = atomic_fetch_add_explicit(&tl->next, 1, memory_order_relaxed);
    if (i >= cap) {
        atomic_fetch_add_explicit(&tl->dropped, 1, memory_order_relaxed);
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

size_t axc_timeline_count(axc_timeline *tl)
{
    if (!tl)
        return 0;
    size_t n = atomic_load(&tl->next), cap = atomic_load(&tl->cap_pub);
    return n < cap ? n : cap;
}

uint64_t axc_timeline_dropped(axc_timeline *tl) { return tl ? atomic_load(&tl->dropped) : 0; }

axc_status axc_timeline_get(axc_timeline *tl, size_t i, axc_span *out)
{
    tl_slot *buf = tl ? atomic_load_explicit(&tl->buf, memory_order_acquire) : NULL;
    if (!buf || i >= axc_timeline_count(tl))
        return axc_fail(AXC_ERR_INVALID, "timeline span %zu out of range (%zu recorded)", i,
                        axc_timeline_count(tl));
    if (atomic_load_explicit(&buf[i].gen, memory_order_acquire) != atomic_load(&tl->gen))
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

axc_status axc_timeline_summary(axc_timeline *tl, axc_timeline_stats *out)
{
    if (!out)
        return axc_fail(AXC_ERR_INVALID, "axc_timeline_summary: NULL argument");
    size_t n = axc_timeline_count(tl);
    axc_span *v = NULL;
    size_t m = 0;
    if (n) {
        v = malloc(n * sizeof *v);
        if (!v)
            return axc_fail(AXC_ERR_NOMEM, "out of memory copying %zu timeline spans", n);
        tl_slot *buf = atomic_load_explicit(&tl->buf, memory_order_acquire);
        uint32_t gen = atomic_load(&tl->gen);
        for (size_t i = 0; buf && i < n; i++)
            if (atomic_load_explicit(&buf[i].gen, memory_order_acquire) == gen)
                v[m++] = buf[i].span;
    }
    axc_status st = axc_timeline_summarize(v, m, out);
    free(v);
    out->dropped = axc_timeline_dropped(tl);
    return st;
}
