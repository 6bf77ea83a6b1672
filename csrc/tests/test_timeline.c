/* Timeline: interval arithmetic of the summary on hand-made spans, the per-group split, concurrent
 * recording from several threads, and drop counting when the buffer is full. */
#include <pthread.h>
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
    axc_timeline_free();
    CHECK(!axc_timeline_enabled());
    axc_timeline_record(AXC_SPAN_COMPUTE, "off", -1, 1, 2, 0); /* disabled: ignored */
    CHECK(axc_timeline_count() == 0);
    CHECK_OK(axc_timeline_enable_checked(1));
    CHECK(axc_timeline_enabled());
    int64_t t0 = axc_timeline_begin();
    CHECK(t0 > 0);
    axc_timeline_end(AXC_SPAN_COMPUTE, "gemm", 5 /* ignored for compute */, t0, 42);
    int x = 0;
    AXC_TIMED(AXC_SPAN_COMM, "all_gather", AXC_GROUP_DEPTH, 7, x = 1);
    CHECK(x == 1);
    CHECK(axc_timeline_count() == 2);
    axc_span s;
    CHECK_OK(axc_timeline_get(0, &s));
    CHECK(s.kind == AXC_SPAN_COMPUTE && s.group == -1 && strcmp(s.name, "gemm") == 0 &&
          s.bytes == 42 && s.t_end >= s.t_begin && s.t_begin == t0);
    CHECK_OK(axc_timeline_get(1, &s));
    CHECK(s.kind == AXC_SPAN_COMM && s.group == AXC_GROUP_DEPTH && s.bytes == 7);
    CHECK(axc_timeline_get(2, &s) == AXC_ERR_INVALID);
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summary(&st));
    CHECK(st.spans == 2 && st.group[AXC_GROUP_DEPTH].spans == 1);
    axc_timeline_clear();
    CHECK(axc_timeline_count() == 0 && axc_timeline_dropped() == 0);
    CHECK_OK(axc_timeline_summary(&st));
    CHECK(st.spans == 0);
    axc_timeline_enable(0);
    axc_timeline_record(AXC_SPAN_COMPUTE, "off", -1, 1, 2, 0);
    CHECK(axc_timeline_count() == 0);
    CHECK(axc_timeline_set_capacity(16) == AXC_ERR_STATE); /* buffer exists */
    axc_timeline_free();
}

#define NTHREADS 4
#define PER_THREAD 5000

static void *recorder(void *arg)
{
    int id = (int)(intptr_t)arg;
    for (int i = 0; i < PER_THREAD; i++) {
        int64_t t = (int64_t)id * 1000000 + i * 10;
        axc_timeline_record(id % 2 ? AXC_SPAN_COMM : AXC_SPAN_COMPUTE, "t", id, t + 1, t + 6,
                            (uint64_t)id);
    }
    return NULL;
}

static void test_concurrency(void)
{
    CHECK_OK(axc_timeline_set_capacity(NTHREADS * PER_THREAD));
    CHECK(axc_timeline_capacity() == NTHREADS * PER_THREAD);
    CHECK_OK(axc_timeline_enable_checked(1));
    pthread_t th[NTHREADS];
    for (int i = 0; i < NTHREADS; i++)
        pthread_create(&th[i], NULL, recorder, (void *)(intptr_t)i);
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);
    CHECK(axc_timeline_count() == NTHREADS * PER_THREAD);
    CHECK(axc_timeline_dropped() == 0);
    size_t per[NTHREADS] = {0};
    int ok = 1;
    for (size_t i = 0; i < axc_timeline_count(); i++) {
        axc_span s;
        if (axc_timeline_get(i, &s) != AXC_OK) {
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
    CHECK_OK(axc_timeline_summary(&st));
    CHECK(st.compute_ns == 2 * PER_THREAD * 5 && st.comm_ns == 2 * PER_THREAD * 5);
    CHECK(st.exposed_comm_ns == st.comm_ns); /* threads' time ranges are disjoint */
    CHECK(st.group[1].spans == PER_THREAD && st.group[3].spans == PER_THREAD);
    axc_timeline_free();
}

static void test_overflow(void)
{
    CHECK_OK(axc_timeline_set_capacity(8));
    CHECK_OK(axc_timeline_enable_checked(1));
    for (int i = 0; i < 20; i++)
        axc_timeline_record(AXC_SPAN_COMPUTE, "c", -1, i * 10, i * 10 + 5, 0);
    CHECK(axc_timeline_count() == 8);
    CHECK(axc_timeline_dropped() == 12);
    axc_timeline_stats st;
    CHECK_OK(axc_timeline_summary(&st));
    CHECK(st.spans == 8 && st.dropped == 12 && st.compute_ns == 40);
    axc_timeline_clear();
    CHECK(axc_timeline_count() == 0 && axc_timeline_dropped() == 0);
    axc_timeline_record(AXC_SPAN_COMPUTE, "c", -1, 0, 1, 0);
    CHECK(axc_timeline_count() == 1);
    axc_timeline_free();
    CHECK_OK(axc_timeline_set_capacity(AXC_TIMELINE_DEFAULT_CAPACITY));
    CHECK(axc_timeline_set_capacity(0) == AXC_ERR_INVALID);
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
    test_concurrency();
    test_overflow();
    return ctest_summary("test_timeline");
}
