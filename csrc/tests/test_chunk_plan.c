/* axonn_c.Sequential's chunk order (csrc/sched/chunk_plan.c): a worked example, then random
 * plans against the loop axonn_c/chunking.py ran before it moved into C. */
#include <stdlib.h>
#include <string.h>

#include "axc/chunk_plan.h"
#include "ctest.h"

enum { MAXC = 6, MAXL = 7, MAXSTEPS = 4 * MAXC * MAXL };

/* one step as both sides see it: a call (chunk, layer) or an await (number) */
typedef struct { int chunk, layer; unsigned long long number; } step_t;

/* the Python loop it replaced; result(c, l) is the number a call leaves held (0: none) */
static int reference(int n, int L, const unsigned char *holds, const unsigned long long *res,
                     step_t *out)
{
    int nxt[MAXC] = {0};
    unsigned long long held[MAXC] = {0}, number[MAXC] = {0}, ticket = 0;
    int k = 0;
    for (;;) {
        int c = -1;
        for (int i = 0; i < n && c < 0; i++)
            if (nxt[i] < L && !held[i])
                c = i;
        if (c < 0) {
            int oldest = -1;
            for (int i = 0; i < n; i++)
                if (held[i] && (oldest < 0 || held[i] < held[oldest]))
                    oldest = i;
            if (oldest < 0)
                return k;
            out[k++] = (step_t){-1, -1, number[oldest]};
            held[oldest] = number[oldest] = 0;
            continue;
        }
        int l = nxt[c];
        number[c] = res[c * MAXL + l];
        if (holds[l] || number[c])
            held[c] = ++ticket;
        nxt[c] = l + 1;
        out[k++] = (step_t){c, l, 0};
    }
}

static int planned(int n, int L, const unsigned char *holds, const unsigned long long *res,
                   step_t *out)
{
    axc_chunk_plan *p;
    if (axc_chunk_plan_new(n, L, holds, &p) != AXC_OK)
        return -1;
    int k = 0;
    for (;;) {
        int c, l;
        unsigned long long number;
        uint64_t num;
        axc_chunk_step s = axc_chunk_plan_next(p, &c, &l, &num);
        number = num;
        if (s == AXC_CHUNK_DONE || k >= MAXSTEPS)
            break;
        if (s == AXC_CHUNK_AWAIT) {
            out[k++] = (step_t){-1, -1, number};
            continue;
        }
        out[k++] = (step_t){c, l, 0};
        int waits = axc_chunk_plan_ran(p, res[c * MAXL + l]);
        CHECK(waits == (holds[l] || res[c * MAXL + l]));
    }
    axc_chunk_plan_free(p);
    return k;
}

int main(void)
{
    /* 2 chunks through Linear(holds) -> GELU -> Linear(holds): chunk 0 calls child 0 and waits,
     * chunk 1 calls child 0 and waits, chunk 0's result is awaited, it goes through child 1
     * and 2 and waits, chunk 1's result is awaited, ... */
    const unsigned char holds[3] = {1, 0, 1};
    unsigned long long res[MAXC * MAXL] = {0};
    res[0 * MAXL + 0] = 1;
    res[1 * MAXL + 0] = 2;
    res[0 * MAXL + 2] = 3;
    res[1 * MAXL + 2] = 4;
    const step_t want[] = {{0, 0, 0}, {1, 0, 0}, {-1, -1, 1}, {0, 1, 0}, {0, 2, 0},
                           {-1, -1, 2}, {1, 1, 0}, {1, 2, 0}, {-1, -1, 3}, {-1, -1, 4}};
    step_t got[MAXSTEPS];
    int k = planned(2, 3, holds, res, got);
    CHECK(k == (int)(sizeof want / sizeof want[0]));
    CHECK(k >= 0 && memcmp(got, want, (size_t)k * sizeof *got) == 0);

    /* random plans, some calls holding nothing, some held only by plan (number 0) */
    srand(7);
    int mismatches = 0;
    for (int trial = 0; trial < 2000; trial++) {
        int n = 1 + rand() % MAXC, L = rand() % (MAXL + 1);
        unsigned char h[MAXL];
        unsigned long long r[MAXC * MAXL] = {0}, next_number = 0;
        for (int l = 0; l < L; l++)
            h[l] = rand() % 3 == 0;
        for (int i = 0; i < MAXC * MAXL; i++)
            r[i] = rand() % 4 == 0 ? ++next_number : 0;
        step_t a[MAXSTEPS], b[MAXSTEPS];
        int ka = reference(n, L, h, r, a), kb = planned(n, L, h, r, b);
        if (ka != kb || memcmp(a, b, (size_t)ka * sizeof *a) != 0)
            mismatches++;
    }
    CHECK(mismatches == 0);

    /* bad arguments are refused with a message, not crashed on */
    axc_chunk_plan *p = NULL;
    CHECK(axc_chunk_plan_new(0, 2, holds, &p) == AXC_ERR_INVALID && !p);
    CHECK(axc_chunk_plan_new(2, 2, NULL, &p) == AXC_ERR_INVALID && !p);
    CHECK(axc_chunk_plan_new(3, 0, NULL, &p) == AXC_OK && p);
    int c, l;
    uint64_t num;
    CHECK(p && axc_chunk_plan_next(p, &c, &l, &num) == AXC_CHUNK_DONE);
    CHECK(p && axc_chunk_plan_ran(p, 5) == 0); /* (nothing handed out) */
    axc_chunk_plan_free(p);
    return ctest_summary("test_chunk_plan");
}
