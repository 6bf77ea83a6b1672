/* Timeline: interval arithmetic of the summary on hand-made spans, the per-group split, concurrent
 * recording from several threads, clear (the generation), capacity, drop counting when the
 * buffer is full, a NULL timeline, and two timeline objects kept apart. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "axc/comm.h"
#include "axc/timeline.h"
#include "ctest.h"

static axc_span cs(int64_t a, int64_t b)
{
    axc_span s = {AXC_SPAN_COMPUTE, -1, "gemm", a, b, 0};
    return s;
}

static axc_span ms(int group, int64_t a, int64_t b, uint64_t bytes)
{
    axc_span s = {AXC_SPAN_COMM, group, "all_reduce", a, b, bytes};
    return s;
}

static void test_empty(void)
{
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summarize(NULL, 0, &st));
    CHECK(st.compute_ns == 0 && st.comm_ns == 0 && st.exposed_comm_ns == 0 && st.spans == 0);
    /* empty and inverted spans count as spans but add no time */
    axc_span v[] = {cs(10, 10), ms(AXC_GROUP_ROW, 30, 20, 8)};
    CHECK_OK(axc_timeline_summarize(v, 2, &st));
    CHECK(st.spans == 2 && st.compute_ns == 0 && st.comm_ns == 0 && st.exposed_comm_ns == 0);
    CHECK(st.group[AXC_GROUP_ROW].spans == 1 && st.group[AXC_GROUP_ROW].bytes == 8);
}

static void test_union_intersection(void)
{
    axc_timeline_stats st;
    /* compute: [0,10) and [5,20) overlap -> [0,20); [30,40) disjoint; [32,35) nested -> 30 total */
    /* comm: [15,35) -> overlaps compute on [15,20) and [30,35): 10 hidden, 10 exposed;
     *       [50,60) disjoint from compute -> exposed; [52,55) nested in it */
    axc_span v[] = {cs(5, 20),  ms(AXC_GROUP_COL, 15, 35, 100), cs(0, 10),
                    cs(30, 40), ms(AXC_GROUP_COL, 52, 55, 1),   cs(32, 35),
                    ms(AXC_GROUP_COL, 50, 60, 10)};
    CHECK_OK(axc_timeline_summarize(v, sizeof v / sizeof v[0], &st));
    CHECK(st.compute_ns == 30);
    CHECK(st.comm_ns == 30);
    CHECK(st.exposed_comm_ns == 20);
    CHECK(st.compute_spans == 4 && st.comm_spans == 3);
    CHECK(st.t_first == 0 && st.t_last == 60);
    CHECK(st.group[AXC_GROUP_COL].comm_ns == 30 && st.group[AXC_GROUP_COL].exposed_ns == 20);
    CHECK(st.group[AXC_GROUP_COL].bytes == 111 && st.group[AXC_GROUP_COL].spans == 3);

    /* comm fully hidden: nested inside one compute span */
    axc_span h[] = {cs(0, 100), ms(AXC_GROUP_DEPTH, 10, 90, 4)};
    CHECK_OK(axc_timeline_summarize(h, 2, &st));
    CHECK(st.comm_ns == 80 && st.exposed_comm_ns == 0);
    /* a comm span covering several compute spans: exposed = the gaps */
    axc_span g[] = {cs(10, 20), cs(30, 40), cs(50, 60), ms(AXC_GROUP_DATA, 0, 70, 4)};
    CHECK_OK(axc_timeline_summarize(g, 4, &st));
    CHECK(st.comm_ns == 70 && st.exposed_comm_ns == 40 && st.compute_ns == 30);
    /* no compute: everything exposed; adjacent comm spans merge */
    axc_span n[] = {ms(AXC_GROUP_ROW, 0, 10, 1), ms(AXC_GROUP_ROW, 10, 25, 1)};
    CHECK_OK(axc_timeline_summarize(n, 2, &st));
    CHECK(st.comm_ns == 25 && st.exposed_comm_ns == 25 && st.compute_ns == 0);
}

static void test_per_group(void)
{
    axc_timeline_stats st;
    /* row [0,10) exposed; col [5,15) half hidden by compute [10,20); groups overlap each other,
     * so the total union is [0,15) = 15, exposed [0,10) = 10 */
    axc_span v[] = {ms(AXC_GROUP_ROW, 0, 10, 64), ms(AXC_GROUP_COL, 5, 15, 32), cs(10, 20)};
    CHECK_OK(axc_timeline_summarize(v, 3, &st));
    CHECK(st.comm_ns == 15 && st.exposed_comm_ns == 10);
    CHECK(st.group[AXC_GROUP_ROW].comm_ns == 10 && st.group[AXC_GROUP_ROW].exposed_ns == 10);
    CHECK(st.group[AXC_GROUP_ROW].bytes == 64);
    CHECK(st.group[AXC_GROUP_COL].comm_ns == 10 && st.group[AXC_GROUP_COL].exposed_ns == 5);
    CHECK(st.group[AXC_GROUP_COL].bytes == 32);
    CHECK(st.group[AXC_GROUP_DEPTH].spans == 0 && st.group[AXC_GROUP_DEPTH].comm_ns == 0);
}

static void test_record_get_clear(void)
{
    axc_timeline *tl;
    CHECK_OK(axc_timeline_create(&tl));
    CHECK(!axc_timeline_enabled(tl));
    CHECK(axc_timeline_capacity(tl) == AXC_TIMELINE_DEFAULT_CAPACITY);
    axc_timeline_record(tl, AXC_SPAN_COMPUTE, "off", -1, 1, 2, 0); /* disabled: ignored */
    CHECK(axc_timeline_count(tl) == 0);
    CHECK_OK(axc_timeline_enable_checked(tl, 1));
    CHECK(axc_timeline_enabled(tl));
    int64_t t0 = axc_timeline_begin(tl);
    CHECK(t0 > 0);
    axc_timeline_end(tl, AXC_SPAN_COMPUTE, "gemm", 5 /* ignored for compute */, t0, 42);
    int x = 0;
    AXC_TIMED(tl, AXC_SPAN_COMM, "all_gather", AXC_GROUP_DEPTH, 7, x = 1);
    CHECK(x == 1);
    CHECK(axc_timeline_count(tl) == 2);
    axc_span s;
    CHECK_OK(axc_timeline_get(tl, 0, &s));
    CHECK(s.kind == AXC_SPAN_COMPUTE && s.group == -1 && strcmp(s.name, "gemm") == 0 &&
          s.bytes == 42 && s.t_end >= s.t_begin && s.t_begin == t0);
    CHECK_OK(axc_timeline_get(tl, 1, &s));
    CHECK(s.kind == AXC_SPAN_COMM && s.group == AXC_GROUP_DEPTH && s.bytes == 7);
    CHECK(axc_timeline_get(tl, 2, &s) == AXC_ERR_INVALID);
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summary(tl, &st));
    CHECK(st.spans == 2 && st.group[AXC_GROUP_DEPTH].spans == 1);
    axc_timeline_clear(tl);
    CHECK(axc_timeline_count(tl) == 0 && axc_timeline_dropped(tl) == 0);
    CHECK_OK(axc_timeline_summary(tl, &st));
    CHECK(st.spans == 0);
    axc_timeline_enable(tl, 0);
    axc_timeline_record(tl, AXC_SPAN_COMPUTE, "off", -1, 1, 2, 0);
    CHECK(axc_timeline_count(tl) == 0);
    CHECK(axc_timeline_set_capacity(tl, 16) == AXC_ERR_STATE); /* buffer exists */
    axc_timeline_free(tl); /* (the buffer: a later enable makes a new one of the new capacity) */
    CHECK_OK(axc_timeline_set_capacity(tl, 16));
    CHECK_OK(axc_timeline_enable_checked(tl, 1));
    axc_timeline_record(tl, AXC_SPAN_COMPUTE, "again", -1, 1, 2, 0);
    CHECK(axc_timeline_count(tl) == 1);
    axc_timeline_destroy(tl);
}

/* A NULL timeline records nothing and reads as empty; enabling it is refused. */
static void test_null_timeline(void)
{
    CHECK(!axc_timeline_enabled(NULL) && axc_timeline_begin(NULL) == 0);
    axc_timeline_record(NULL, AXC_SPAN_COMPUTE, "c", -1, 1, 2, 0);
    axc_timeline_record_on(NULL, AXC_SPAN_COMM, "c", AXC_GROUP_ROW, 1, 1, 2, 0);
    int x = 0;
    AXC_TIMED(NULL, AXC_SPAN_COMPUTE, "c", -1, 0, x = 1);
    CHECK(x == 1);
    axc_timeline_end(NULL, AXC_SPAN_COMPUTE, "c", -1, 5, 0);
    CHECK(axc_timeline_count(NULL) == 0 && axc_timeline_dropped(NULL) == 0);
    axc_span s;
    CHECK(axc_timeline_get(NULL, 0, &s) == AXC_ERR_INVALID);
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summary(NULL, &st));
    CHECK(st.spans == 0);
    CHECK(axc_timeline_enable_checked(NULL, 1) == AXC_ERR_INVALID);
    CHECK_OK(axc_timeline_enable_checked(NULL, 0));
    CHECK(axc_timeline_set_capacity(NULL, 8) == AXC_ERR_INVALID);
    CHECK(axc_timeline_intern(NULL, "x") == NULL);
    axc_timeline_clear(NULL);
    axc_timeline_free(NULL);
    axc_timeline_destroy(NULL);
}

/* Two timelines do not see each other's spans, switches, clears, capacities or names. */
static void test_two_timelines_apart(void)
{
    axc_timeline *a, *b;
    CHECK_OK(axc_timeline_create(&a));
    CHECK_OK(axc_timeline_create(&b));
    CHECK_OK(axc_timeline_set_capacity(a, 4));
    CHECK(axc_timeline_capacity(b) == AXC_TIMELINE_DEFAULT_CAPACITY);
    CHECK_OK(axc_timeline_enable_checked(a, 1));
    CHECK(axc_timeline_enabled(a) && !axc_timeline_enabled(b));
    axc_timeline_record(a, AXC_SPAN_COMPUTE, "a", -1, 1, 2, 0);
    axc_timeline_record(b, AXC_SPAN_COMPUTE, "b", -1, 1, 2, 0); /* b is off */
    CHECK(axc_timeline_count(a) == 1 && axc_timeline_count(b) == 0);
    CHECK_OK(axc_timeline_enable_checked(b, 1));
    for (int i = 0; i < 3; i++)
        axc_timeline_record(b, AXC_SPAN_COMM, "b", AXC_GROUP_ROW, 10 * i, 10 * i + 5, 1);
    CHECK(axc_timeline_count(a) == 1 && axc_timeline_count(b) == 3);
    axc_timeline_clear(a); /* b keeps its spans */
    CHECK(axc_timeline_count(a) == 0 && axc_timeline_count(b) == 3);
    for (int i = 0; i < 6; i++) /* a is full at 4: its drops are its own */
        axc_timeline_record(a, AXC_SPAN_COMPUTE, "a", -1, i, i + 1, 0);
    CHECK(axc_timeline_dropped(a) == 2 && axc_timeline_dropped(b) == 0);
    axc_timeline_enable(a, 0);
    CHECK(axc_timeline_enabled(b));
    axc_span s;
    CHECK_OK(axc_timeline_get(b, 2, &s));
    CHECK(strcmp(s.name, "b") == 0 && s.group == AXC_GROUP_ROW && s.t_begin == 20);
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summary(b, &st));
    CHECK(st.spans == 3 && st.comm_spans == 3 && st.compute_spans == 0 && st.dropped == 0);
    /* interned names: one copy per timeline and string, owned by that timeline */
    char name[16];
    snprintf(name, sizeof name, "loss");
    const char *na = axc_timeline_intern(a, name), *nb = axc_timeline_intern(b, name);
    CHECK(na && nb && na != nb && na != name && strcmp(na, "loss") == 0);
    CHECK(axc_timeline_intern(a, "loss") == na);
    axc_timeline_destroy(a);
    CHECK(axc_timeline_count(b) == 3); /* (a's end frees nothing of b's) */
    axc_timeline_destroy(b);
}

/* The name table is bounded: beyond AXC_TIMELINE_MAX_NAMES new names get NULL, known ones
 * their copy. */
static void test_intern_bound(void)
{
    axc_timeline *tl;
    CHECK_OK(axc_timeline_create(&tl));
    char name[32];
    const char *first = NULL;
    for (int i = 0; i < AXC_TIMELINE_MAX_NAMES; i++) {
        snprintf(name, sizeof name, "n%d", i);
        const char *c = axc_timeline_intern(tl, name);
        CHECK(c && strcmp(c, name) == 0);
        if (i == 0)
            first = c;
    }
    CHECK(axc_timeline_intern(tl, "one too many") == NULL);
    CHECK(axc_timeline_intern(tl, "n0") == first);
    axc_timeline_destroy(tl);
}

#define NTHREADS 4
#define PER_THREAD 5000

typedef struct recorder_arg {
    axc_timeline *tl;
    int id;
} recorder_arg;

static void *recorder(void *arg)
{
    axc_timeline *tl = ((recorder_arg *)arg)->tl;
    int id = ((recorder_arg *)arg)->id;
    for (int i = 0; i < PER_THREAD; i++) {
        int64_t t = (int64_t)id * 1000000 + i * 10;
        axc_timeline_record(tl, id % 2 ? AXC_SPAN_COMM : AXC_SPAN_COMPUTE, "t", id, t + 1, t + 6,
                            (uint64_t)id);
    }
    return NULL;
}

static void test_concurrency(void)
{
    axc_timeline *tl;
    CHECK_OK(axc_timeline_create(&tl));
    CHECK_OK(axc_timeline_set_capacity(tl, NTHREADS * PER_THREAD));
    CHECK(axc_timeline_capacity(tl) == NTHREADS * PER_THREAD);
    CHECK_OK(axc_timeline_enable_checked(tl, 1));
    pthread_t th[NTHREADS];
    recorder_arg args[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        args[i] = (recorder_arg){tl, i};
        pthread_create(&th[i], NULL, recorder, &args[i]);
    }
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);
    CHECK(axc_timeline_count(tl) == NTHREADS * PER_THREAD);
    CHECK(axc_timeline_dropped(tl) == 0);
    size_t per[NTHREADS] = {0};
    int ok = 1;
    for (size_t i = 0; i < axc_timeline_count(tl); i++) {
        axc_span s;
        if (axc_timeline_get(tl, i, &s) != AXC_OK) {
            ok = 0;
            continue;
        }
        int id = (int)s.bytes;
        if (id < 0 || id >= NTHREADS || s.t_end - s.t_begin != 5) {
            ok = 0;
            continue;
        }
        per[id]++;
    }
    CHECK(ok);
    for (int i = 0; i < NTHREADS; i++)
        CHECK(per[i] == PER_THREAD);
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summary(tl, &st));
    CHECK(st.compute_ns == 2 * PER_THREAD * 5 && st.comm_ns == 2 * PER_THREAD * 5);
    CHECK(st.exposed_comm_ns == st.comm_ns); /* threads' time ranges are disjoint */
    CHECK(st.group[1].spans == PER_THREAD && st.group[3].spans == PER_THREAD);
    axc_timeline_destroy(tl);
}

static void test_overflow(void)
{
    axc_timeline *tl;
    CHECK_OK(axc_timeline_create(&tl));
    CHECK_OK(axc_timeline_set_capacity(tl, 8));
    CHECK_OK(axc_timeline_enable_checked(tl, 1));
    for (int i = 0; i < 20; i++)
        axc_timeline_record(tl, AXC_SPAN_COMPUTE, "c", -1, i * 10, i * 10 + 5, 0);
    CHECK(axc_timeline_count(tl) == 8);
    CHECK(axc_timeline_dropped(tl) == 12);
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summary(tl, &st));
    CHECK(st.spans == 8 && st.dropped == 12 && st.compute_ns == 40);
    axc_timeline_clear(tl);
    CHECK(axc_timeline_count(tl) == 0 && axc_timeline_dropped(tl) == 0);
    axc_timeline_record(tl, AXC_SPAN_COMPUTE, "c", -1, 0, 1, 0);
    CHECK(axc_timeline_count(tl) == 1);
    axc_timeline_free(tl);
    CHECK_OK(axc_timeline_set_capacity(tl, AXC_TIMELINE_DEFAULT_CAPACITY));
    CHECK(axc_timeline_set_capacity(tl, 0) == AXC_ERR_INVALID);
    CHECK(axc_timeline_set_capacity(tl, AXC_TIMELINE_MAX_CAPACITY + 1) == AXC_ERR_INVALID);
    axc_timeline_destroy(tl);
}

/* With wait spans, exposed communication is the communication they overlap (minus GEMMs). */
static void test_waits_define_exposure(void)
{
    axc_timeline_stats st;
    axc_span w1 = {AXC_SPAN_WAIT, AXC_GROUP_COL, "all_reduce", 25, 40, 0};
    axc_span w2 = {AXC_SPAN_WAIT, AXC_GROUP_DEPTH, "all_gather", 70, 80, 0}; /* no comm then */
    /* comm [10,40) col and [50,60) depth; compute only [0,12): without waits 38 would be exposed */
    axc_span v[] = {cs(0, 12), ms(AXC_GROUP_COL, 10, 40, 8), ms(AXC_GROUP_DEPTH, 50, 60, 8), w1,
                    w2};
    CHECK_OK(axc_timeline_summarize(v, 5, &st));
    CHECK(st.comm_ns == 40 && st.wait_ns == 25 && st.wait_spans == 2 && st.comm_spans == 2);
    CHECK(st.exposed_comm_ns == 15); /* [25,40): the only waited-for communication */
    CHECK(st.group[AXC_GROUP_COL].exposed_ns == 15 && st.group[AXC_GROUP_DEPTH].exposed_ns == 0);
    CHECK_OK(axc_timeline_summarize(v, 3, &st)); /* the same spans without waits */
    CHECK(st.exposed_comm_ns == 38 && st.wait_ns == 0);
}

/* Two threads (concurrent micro-batches): one waits for a collective while the other runs a
 * GEMM; only the waited-for communication that no GEMM covers is exposed. */
static void test_wait_hidden_by_another_thread(void)
{
    axc_timeline_stats st;
    axc_span w = {AXC_SPAN_WAIT, AXC_GROUP_ROW, "all_reduce", 0, 100, 0};
    axc_span v[] = {ms(AXC_GROUP_ROW, 0, 100, 8), w, cs(20, 50), cs(40, 70)};
    CHECK_OK(axc_timeline_summarize(v, 4, &st));
    CHECK(st.comm_ns == 100 && st.wait_ns == 100 && st.compute_ns == 50);
    CHECK(st.exposed_comm_ns == 50); /* [0,20) and [70,100) */
    CHECK(st.group[AXC_GROUP_ROW].exposed_ns == 50);
}

int main(void)
{
    test_empty();
    test_waits_define_exposure();
    test_wait_hidden_by_another_thread();
    test_union_intersection();
    test_per_group();
    test_record_get_clear();
    test_null_timeline();
    test_two_timelines_apart();
    test_intern_bound();
    test_concurrency();
    test_overflow();
    return ctest_summary("test_timeline");
}
