/* The stream-ordering (happens-before) checker of the CPU mock libcudart: see
 * mock_stream_order.h for what it offers. The model:
 *
 * Clocks. Every stream handle maps to a small index (NULL, the legacy default stream, is one
 * more stream; all streams are independent: the core uses non-blocking streams and events).
 * Stream s has a vector clock VC_s, the host one VC_host (one for all host threads: the checker
 * cannot see hand-offs between them, so it assumes the most it may and never reports a false
 * positive). An op enqueued on s joins VC_host (what the host saw complete precedes anything it
 * enqueues next), then counts itself: its timestamp is (s, ++VC_s[s]).
 *   cudaEventRecord(e, s): e = VC_s      cudaStreamWaitEvent(s, e): VC_s |= e
 *   cudaStreamSynchronize(s): VC_host |= VC_s
 *   cudaEventSynchronize(e), a successful cudaEventQuery(e): VC_host |= e
 *   cudaFree: VC_host |= every stream (it synchronises the device)
 *
 * Memory. Allocations from cudaMalloc and cudaMallocAsync are tracked (not pinned host memory),
 * each with its last write (stream, count) and, since then, the latest read per stream. An op
 * on s touching any byte of one is checked at allocation granularity: a read must follow the
 * last write (VC_s[w.stream] >= w.count), a write must also follow every read since.
 * cudaMallocAsync is a write on its stream (the pool hands out what a previous owner freed
 * there); cudaFreeAsync a write that must follow every access, after which the allocation is
 * dead and any access to it is a use after free. A freed block stays allocated (quarantined, up
 * to a budget) so that its range cannot come back as untracked host memory meanwhile.
 *
 * Why no false positives: clocks only grow (joins and increments), so whatever truly happens
 * before an op is known to it, whatever the stream-to-index mapping (a destroyed stream's index
 * is not reused before MO_STREAMS streams were seen; past that, reuse or sharing only makes the
 * checker see less).
 *
 * What it cannot see: in the mock every event fires at once, so each successful cudaEventQuery
 * (the nccl watchdog's, its pool's reaping) tells the host that work finished, which on a GPU
 * still busy it would not; a test that wants the strict view makes the mock's queries answer
 * "not ready" meanwhile (g_query_err = 600, see test_nccl_mock). Host threads handing work to
 * each other (the shm lanes) are seen as one host. */
#include "mock_stream_order.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MO_STREAMS 256                     /* stream indices (each clock has one entry each) */
#define MO_QUARANTINE_BYTES ((size_t)64 << 20)
#define MO_QUARANTINE_BLOCKS 4096
#define MO_OP_ALLOCS 16                    /* allocations one op can touch that get checked */

typedef struct mo_stream {
    const void *handle;
    int live; /* 0 once destroyed: a new stream at the same address gets a new index */
    unsigned long long id; /* cudaStreamGetId: never repeated */
    char name[40];
    uint32_t vc[MO_STREAMS];
} mo_stream;

typedef struct mo_event {
    const void *handle;
    uint32_t vc[MO_STREAMS]; /* of its last record (a wait uses the record made before it) */
} mo_event;

typedef struct mo_read {
    int stream;
    uint32_t count;
    const char *op;
} mo_read;

typedef struct mo_alloc {
    unsigned char *base;
    size_t size;
    unsigned id; /* allocation number, for the descriptions */
    const char *how;
    int w_stream;      /* last write: (w_stream, w_count) by w_op; w_count 0: none */
    uint32_t w_count;
    const char *w_op;
    mo_read *reads;    /* the latest read per stream since the last write */
    int nreads, reads_cap;
    int dead;          /* freed (quarantined): any access is a use after free */
    uint64_t died;     /* order of death: the oldest leaves the quarantine first */
    const char *free_op;
    int free_stream;
} mo_alloc;

int mock_order_violations;
int mock_order_saturated;
char mock_order_text[MOCK_ORDER_KEEP * MOCK_ORDER_MSG];

static pthread_mutex_t mu_ = PTHREAD_MUTEX_INITIALIZER;
static mo_stream streams_[MO_STREAMS];
static int nstreams_;
static uint32_t host_vc_[MO_STREAMS];
static mo_event **events_;
static int nevents_, events_cap_;
static mo_alloc *allocs_; /* sorted by base; live and dead ones never overlap */
static int nallocs_, allocs_cap_;
static unsigned alloc_ids_;
static size_t dead_bytes_;
static int ndead_;
static uint64_t deaths_;
static size_t text_len_;

/* ------------------------------------------------------------------ clocks */

static void join(uint32_t *into, const uint32_t *from)
{
    for (int i = 0; i < nstreams_; i++)
        if (from[i] > into[i])
            into[i] = from[i];
}

/* Past MO_STREAMS streams, a destroyed stream's index is given again (its clock kept), or else
 * the last index is shared: either way the checker only sees less, never a false race. */
static int new_stream(const void *handle)
{
    int i;
    if (nstreams_ < MO_STREAMS) {
        i = nstreams_++;
        memset(&streams_[i], 0, sizeof streams_[i]);
    } else {
        mock_order_saturated++;
        for (i = 0; i < MO_STREAMS && streams_[i].live; i++) {
        }
        if (i == MO_STREAMS)
            return MO_STREAMS - 1;
    }
    static unsigned long long next_id;
    mo_stream *s = &streams_[i];
    s->handle = handle;
    s->live = 1;
    s->id = ++next_id;
    if (handle)
        snprintf(s->name, sizeof s->name, "stream #%d (%p)", i, handle);
    else
        snprintf(s->name, sizeof s->name, "the NULL stream");
    return i;
}

/* The index of a live stream, made on first sight (NULL, handles the core did not create). */
static int stream_index(const void *handle)
{
    for (int i = 0; i < nstreams_; i++)
        if (streams_[i].live && streams_[i].handle == handle)
            return i;
    return new_stream(handle);
}

static mo_event *find_event(const void *handle, int *at)
{
    for (int i = 0; i < nevents_; i++)
        if (events_[i]->handle == handle) {
            if (at)
                *at = i;
            return events_[i];
        }
    return NULL;
}

/* ------------------------------------------------------------------ violations */

static void violation(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void violation(const char *fmt, ...)
{
    char line[MOCK_ORDER_MSG];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (mock_order_violations < MOCK_ORDER_KEEP) {
        size_t n = strlen(line);
        if (text_len_ + n + 2 <= sizeof mock_order_text) {
            memcpy(mock_order_text + text_len_, line, n);
            text_len_ += n;
            mock_order_text[text_len_++] = '\n';
            mock_order_text[text_len_] = '\0';
        }
    }
    __atomic_add_fetch(&mock_order_violations, 1, __ATOMIC_SEQ_CST); /* tests read it */
    const char *v = getenv("MOCK_ORDER_VERBOSE"); /* every one, as it happens */
    if (v && *v == '1')
        fprintf(stderr, "stream-order violation: %s\n", line);
}

/* -1: the host (cudaFree) */
static const char *sname(int i) { return i < 0 ? "the host" : streams_[i].name; }

/* ------------------------------------------------------------------ allocations */

/* The index of the last allocation whose base is <= p, or -1. */
static int floor_index(const void *p)
{
    int lo = 0, hi = nallocs_ - 1, found = -1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if ((const void *)allocs_[mid].base <= p) {
            found = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return found;
}

static mo_alloc *containing(const void *p)
{
    int i = floor_index(p);
    if (i < 0)
        return NULL;
    mo_alloc *a = &allocs_[i];
    return (const unsigned char *)p < a->base + a->size ? a : NULL;
}

static void remove_at(int i)
{
    free(allocs_[i].reads);
    memmove(&allocs_[i], &allocs_[i + 1], (size_t)(nallocs_ - i - 1) * sizeof *allocs_);
    nallocs_--;
}

/* Records [p, p + n) as a new live allocation; NULL when out of memory (then untracked). */
static mo_alloc *insert(unsigned char *p, size_t n, const char *how)
{
    /* a record overlapping it would be a block freed behind the checker's back: forget it */
    int first = floor_index(p);
    for (int i = first < 0 ? 0 : first; i < nallocs_ && allocs_[i].base < p + n;) {
        if (allocs_[i].base + allocs_[i].size > p) {
            if (allocs_[i].dead) {
                dead_bytes_ -= allocs_[i].size;
                ndead_--;
            }
            remove_at(i);
        } else {
            i++;
        }
    }
    if (nallocs_ == allocs_cap_) {
        int cap = allocs_cap_ ? allocs_cap_ * 2 : 256;
        mo_alloc *na = realloc(allocs_, (size_t)cap * sizeof *na);
        if (!na)
            return NULL;
        allocs_ = na;
        allocs_cap_ = cap;
    }
    int at = floor_index(p) + 1;
    memmove(&allocs_[at + 1], &allocs_[at], (size_t)(nallocs_ - at) * sizeof *allocs_);
    nallocs_++;
    mo_alloc *a = &allocs_[at];
    memset(a, 0, sizeof *a);
    a->base = p;
    a->size = n;
    a->id = ++alloc_ids_;
    a->how = how;
    return a;
}

/* The quarantine: past its budget, the blocks that died first are really freed (and their
 * ranges forgotten). */
static void trim_quarantine(void)
{
    while (ndead_ > 0 && (dead_bytes_ > MO_QUARANTINE_BYTES || ndead_ > MO_QUARANTINE_BLOCKS)) {
        int oldest = -1;
        for (int i = 0; i < nallocs_; i++)
            if (allocs_[i].dead && (oldest < 0 || allocs_[i].died < allocs_[oldest].died))
                oldest = i;
        if (oldest < 0)
            return;
        dead_bytes_ -= allocs_[oldest].size;
        ndead_--;
        free(allocs_[oldest].base);
        remove_at(oldest);
    }
}

static void mark_dead(mo_alloc *a, const char *op, int stream)
{
    a->dead = 1;
    a->died = ++deaths_;
    a->free_op = op;
    a->free_stream = stream;
    free(a->reads);
    a->reads = NULL;
    a->nreads = a->reads_cap = 0;
    dead_bytes_ += a->size;
    ndead_++;
}

static void note_read(mo_alloc *a, int s, uint32_t now, const char *op)
{
    for (int i = 0; i < a->nreads; i++)
        if (a->reads[i].stream == s) {
            a->reads[i].count = now;
            a->reads[i].op = op;
            return;
        }
    if (a->nreads == a->reads_cap) {
        int cap = a->reads_cap ? a->reads_cap * 2 : 4;
        mo_read *nr = realloc(a->reads, (size_t)cap * sizeof *nr);
        if (!nr)
            return; /* out of memory: this read goes unchecked */
        a->reads = nr;
        a->reads_cap = cap;
    }
    a->reads[a->nreads++] = (mo_read){s, now, op};
}

/* The access of op (s, now) to allocation a: checked against what it must follow, then
 * recorded. */
static void access_locked(const char *op, int s, uint32_t now, mo_alloc *a, int write)
{
    const uint32_t *vc = streams_[s].vc;
    const char *kind = write ? "write" : "read";
    if (a->dead) {
        violation("%s on %s: use after free: %s of alloc#%u (%p, %zu bytes, %s), freed by %s on "
                  "%s",
                  op, sname(s), kind, a->id, (void *)a->base, a->size, a->how, a->free_op,
                  sname(a->free_stream));
        return;
    }
    const char *other_kind = NULL, *other_op = NULL;
    int other = -1;
    uint32_t other_count = 0;
    if (a->w_count && vc[a->w_stream] < a->w_count) {
        other_kind = "write", other_op = a->w_op, other = a->w_stream, other_count = a->w_count;
    } else if (write) {
        for (int i = 0; i < a->nreads; i++)
            if (vc[a->reads[i].stream] < a->reads[i].count) {
                other_kind = "read", other_op = a->reads[i].op, other = a->reads[i].stream;
                other_count = a->reads[i].count;
                break;
            }
    }
    if (other_kind)
        violation("%s on %s: %s of alloc#%u (%p, %zu bytes, %s) not ordered after its %s by %s "
                  "on %s (that was op %u there; %s knows up to op %u)",
                  op, sname(s), kind, a->id, (void *)a->base, a->size, a->how, other_kind,
                  other_op, sname(other), other_count, sname(s), vc[other]);
    if (write) {
        a->nreads = 0;
        a->w_stream = s;
        a->w_count = now;
        a->w_op = op;
    } else {
        note_read(a, s, now, op);
    }
}

/* Starts an op on the stream with this handle: its index, *now its count. */
static int op_begin(const void *handle, uint32_t *now)
{
    int s = stream_index(handle);
    join(streams_[s].vc, host_vc_);
    *now = ++streams_[s].vc[s];
    return s;
}

/* ------------------------------------------------------------------ exported: streams, events */

void mock_order_stream_created(void *s)
{
    pthread_mutex_lock(&mu_);
    /* a handle reused after cudaStreamDestroy is another stream */
    for (int i = 0; i < nstreams_; i++)
        if (streams_[i].handle == s)
            streams_[i].live = 0;
    (void)new_stream(s);
    pthread_mutex_unlock(&mu_);
}

unsigned long long mock_order_stream_id(const void *s)
{
    pthread_mutex_lock(&mu_);
    unsigned long long id = streams_[stream_index(s)].id;
    pthread_mutex_unlock(&mu_);
    return id;
}

void mock_order_stream_destroyed(void *s)
{
    pthread_mutex_lock(&mu_);
    for (int i = 0; i < nstreams_; i++)
        if (streams_[i].live && streams_[i].handle == s)
            streams_[i].live = 0; /* its clock stays: events recorded on it keep copies */
    pthread_mutex_unlock(&mu_);
}

void mock_order_event_record(void *e, void *s)
{
    pthread_mutex_lock(&mu_);
    mo_event *ev = find_event(e, NULL);
    if (!ev) {
        if (nevents_ == events_cap_) {
            int cap = events_cap_ ? events_cap_ * 2 : 64;
            mo_event **ne = realloc(events_, (size_t)cap * sizeof *ne);
            if (!ne) {
                pthread_mutex_unlock(&mu_);
                return; /* out of memory: the event orders nothing (fewer checks only) */
            }
            events_ = ne;
            events_cap_ = cap;
        }
        ev = malloc(sizeof *ev);
        if (!ev) {
            pthread_mutex_unlock(&mu_);
            return;
        }
        ev->handle = e;
        events_[nevents_++] = ev;
    }
    int i = stream_index(s);
    join(streams_[i].vc, host_vc_);
    memcpy(ev->vc, streams_[i].vc, sizeof ev->vc);
    pthread_mutex_unlock(&mu_);
}

void mock_order_event_destroyed(void *e)
{
    pthread_mutex_lock(&mu_);
    int at = -1;
    mo_event *ev = find_event(e, &at);
    if (ev) {
        free(ev);
        events_[at] = events_[--nevents_];
    }
    pthread_mutex_unlock(&mu_);
}

void mock_order_stream_waits(void *s, void *e)
{
    pthread_mutex_lock(&mu_);
    int i = stream_index(s);
    join(streams_[i].vc, host_vc_);
    mo_event *ev = find_event(e, NULL);
    if (ev) /* an event never recorded: the wait is a no-op, as in CUDA */
        join(streams_[i].vc, ev->vc);
    pthread_mutex_unlock(&mu_);
}

void mock_order_host_waits_stream(void *s)
{
    pthread_mutex_lock(&mu_);
    join(host_vc_, streams_[stream_index(s)].vc);
    pthread_mutex_unlock(&mu_);
}

void mock_order_host_waits_event(void *e)
{
    pthread_mutex_lock(&mu_);
    mo_event *ev = find_event(e, NULL);
    if (ev)
        join(host_vc_, ev->vc);
    pthread_mutex_unlock(&mu_);
}

static void host_waits_all_locked(void)
{
    for (int i = 0; i < nstreams_; i++) /* destroyed streams too: their work is done as well */
        join(host_vc_, streams_[i].vc);
}

void mock_order_host_waits_all(void)
{
    pthread_mutex_lock(&mu_);
    host_waits_all_locked();
    pthread_mutex_unlock(&mu_);
}

/* ------------------------------------------------------------------ exported: memory */

void *mock_order_malloc(size_t n)
{
    size_t bytes = n ? n : 1;
    unsigned char *p = malloc(bytes);
    if (!p)
        return NULL;
    pthread_mutex_lock(&mu_);
    (void)insert(p, bytes, "cudaMalloc"); /* ready for every stream: no write to follow */
    pthread_mutex_unlock(&mu_);
    return p;
}

void *mock_order_malloc_async(size_t n, void *s)
{
    size_t bytes = n ? n : 1;
    unsigned char *p = malloc(bytes);
    if (!p)
        return NULL;
    pthread_mutex_lock(&mu_);
    mo_alloc *a = insert(p, bytes, "cudaMallocAsync");
    if (a) {
        uint32_t now;
        int i = op_begin(s, &now);
        a->w_stream = i;
        a->w_count = now;
        a->w_op = "cudaMallocAsync";
    }
    pthread_mutex_unlock(&mu_);
    return p;
}

/* The allocation p names for a free (NULL: not ours, or a violation already reported). */
static mo_alloc *to_free(void *p, const char *op, int s)
{
    mo_alloc *a = containing(p);
    if (!a)
        return NULL; /* not from the mock (or long gone from the quarantine): left alone */
    if (a->dead) {
        violation("%s on %s: double free of alloc#%u (%p, %zu bytes, %s), freed before by %s on "
                  "%s",
                  op, sname(s), a->id, (void *)a->base, a->size, a->how, a->free_op,
                  sname(a->free_stream));
        return NULL;
    }
    if (a->base != (unsigned char *)p) {
        violation("%s on %s: frees %p, inside alloc#%u (%p, %zu bytes, %s)", op, sname(s), p,
                  a->id, (void *)a->base, a->size, a->how);
        return NULL;
    }
    return a;
}

void mock_order_free(void *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&mu_);
    host_waits_all_locked(); /* cudaFree synchronises the device first */
    mo_alloc *a = to_free(p, "cudaFree", -1);
    if (a) {
        mark_dead(a, "cudaFree", -1);
        trim_quarantine();
    }
    pthread_mutex_unlock(&mu_);
}

void mock_order_free_async(void *p, void *s)
{
    if (!p)
        return;
    pthread_mutex_lock(&mu_);
    uint32_t now;
    int i = op_begin(s, &now);
    mo_alloc *a = to_free(p, "cudaFreeAsync", i);
    if (a) {
        access_locked("cudaFreeAsync", i, now, a, 1); /* after every access so far */
        mark_dead(a, "cudaFreeAsync", i);
        trim_quarantine();
    }
    pthread_mutex_unlock(&mu_);
}

/* ------------------------------------------------------------------ exported: ops */

void mock_order_op(const char *op, void *s, const mock_span *spans, int nspans)
{
    pthread_mutex_lock(&mu_);
    uint32_t now;
    int i = op_begin(s, &now);
    /* each allocation once per op, as a write if any span writes it (an in-place collective
     * reads and writes its buffer: one access, one violation at most) */
    mo_alloc *hit[MO_OP_ALLOCS];
    int wr[MO_OP_ALLOCS], nhit = 0;
    for (int k = 0; k < nspans; k++) {
        const unsigned char *p = spans[k].p;
        size_t n = spans[k].n;
        if (!p || n == 0)
            continue;
        int j = floor_index(p);
        if (j < 0 || allocs_[j].base + allocs_[j].size <= p)
            j++; /* p is not inside allocs_[j]: the next one may still start in the span */
        for (; j < nallocs_ && allocs_[j].base < p + n; j++) {
            int h = 0;
            while (h < nhit && hit[h] != &allocs_[j])
                h++;
            if (h == nhit) {
                if (nhit == MO_OP_ALLOCS)
                    continue;
                hit[nhit] = &allocs_[j];
                wr[nhit++] = 0;
            }
            wr[h] |= spans[k].write != 0;
        }
    }
    for (int h = 0; h < nhit; h++)
        access_locked(op, i, now, hit[h], wr[h]);
    pthread_mutex_unlock(&mu_);
}

void mock_order_rw(const char *op, void *s, const void *r, size_t rn, const void *w, size_t wn)
{
    mock_span sp[2] = {{r, rn, 0}, {w, wn, 1}};
    mock_order_op(op, s, sp, 2);
}

/* ------------------------------------------------------------------ exported: for tests */

void mock_order_access(const void *p, void *s, int is_write)
{
    mock_span sp = {p, 1, is_write};
    mock_order_op(is_write ? "a test kernel writing" : "a test kernel reading", s, &sp, 1);
}

void mock_order_name_stream(const void *s, const char *name)
{
    pthread_mutex_lock(&mu_);
    int i = stream_index(s);
    snprintf(streams_[i].name, sizeof streams_[i].name, "%s", name);
    pthread_mutex_unlock(&mu_);
}

void mock_order_reset(void)
{
    pthread_mutex_lock(&mu_);
    mock_order_violations = 0;
    mock_order_text[0] = '\0';
    text_len_ = 0;
    pthread_mutex_unlock(&mu_);
}
