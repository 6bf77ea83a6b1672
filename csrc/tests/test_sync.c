/* What sync_gradients sums (csrc/grads/sync.c): the decision per parameter, against the table
 * of what the Python loop it replaced did, and the order of the sums. */
#include <string.h>

#include "axc/sync.h"
#include "ctest.h"

enum { COL = AXC_GROUP_COL, ROW = AXC_GROUP_ROW, DEPTH = AXC_GROUP_DEPTH, DATA = AXC_GROUP_DATA,
       WORLD = AXC_GROUP_WORLD };

static axc_groups G(int n, int a, int b)
{
    axc_groups g = {.n = n};
    g.g[0] = (axc_group_kind)a;
    g.g[1] = (axc_group_kind)b;
    return g;
}

static int is(const axc_groups *g, axc_groups want)
{
    return g->n == want.n && memcmp(g->g, want.g, (size_t)want.n * sizeof want.g[0]) == 0;
}

/* one row of the table: groups, done (its synced scale, the scale it carries), only (NULL:
 * sync_gradients), .grad or not, the sync's scale -> skip, sum, mark, marked, the mark's synced
 * scale (or, not synced, the scale it carries), the factor of the sum, rescale */
static void row_f(int line, axc_groups groups, axc_groups done, double done_synced,
                  double done_scale, const axc_groups *only, int marks_grad, unsigned several,
                  double scale, int skip, axc_groups sum, axc_sync_mark mark, axc_groups marked,
                  double synced, double factor, double rescale)
{
    axc_sync_choice c;
    memset(&c, 0xAB, sizeof c); /* (every field must be written) */
    /* (a mark with a synced or carried scale is a sync's; a plain one a backward's) */
    axc_sync_decide(&groups, &done, done_synced, done_scale, done_synced > 0 || done_scale != 1.0,
                    several, only, marks_grad, scale, &c);
    double mark_scale = c.synced > 0 ? c.synced : only ? c.scaled : 0;
    int ok = c.skip == skip && is(&c.sum, sum) && c.mark == mark &&
             (mark != AXC_SYNC_MARK_SET || (is(&c.marked, marked) && mark_scale == synced)) &&
             (mark == AXC_SYNC_MARK_SET || c.synced == 0) && (skip || c.factor == factor) &&
             c.rescale == rescale;
    if (!ok)
        fprintf(stderr, "table row at line %d: skip %d sum.n %d mark %d synced %g scaled %g "
                        "factor %g rescale %g\n",
                line, c.skip, c.sum.n, (int)c.mark, c.synced, c.scaled, c.factor, c.rescale);
    CHECK(ok);
}

/* a row whose mark carries no scale: the sum's factor is the sync's scale */
static void row_s(int line, axc_groups groups, axc_groups done, double done_synced,
                  const axc_groups *only, int marks_grad, unsigned several, double scale,
                  int skip, axc_groups sum, axc_sync_mark mark, axc_groups marked,
                  double synced, double rescale)
{
    row_f(line, groups, done, done_synced, 1.0, only, marks_grad, several, scale, skip, sum,
          mark, marked, only && mark == AXC_SYNC_MARK_SET ? scale : synced, scale, rescale);
}

/* a row without synced marks nor scale; a full sync that marks .grad marks it synced by 1 */
static void row(int line, axc_groups groups, axc_groups done, const axc_groups *only,
                int marks_grad, unsigned several, int skip, axc_groups sum, axc_sync_mark mark,
                axc_groups marked)
{
    row_s(line, groups, done, 0, only, marks_grad, several, 1.0, skip, sum, mark, marked,
          mark == AXC_SYNC_MARK_SET ? 1.0 : 0, 0);
}

#define ROW(...) row(__LINE__, __VA_ARGS__)
#define ROW_S(...) row_s(__LINE__, __VA_ARGS__)
#define ROW_F(...) row_f(__LINE__, __VA_ARGS__)

int main(void)
{
    /* 2 data x 2 depth: data, depth, intra and world have several ranks; row and col one */
    axc_grid grid;
    CHECK_OK(axc_grid_make(&grid, 4, 2, 1, 1, 2, 1));
    unsigned several = axc_sync_several(&grid);
    CHECK(several == (1u << DEPTH | 1u << DATA | 1u << AXC_GROUP_INTRA | 1u << WORLD));
    axc_grid one;
    CHECK_OK(axc_grid_make(&one, 1, 1, 1, 1, 1, 1));
    CHECK(axc_sync_several(&one) == 0 && axc_sync_several(NULL) == 0);

    const axc_groups none = G(0, 0, 0), depth_only = G(1, DEPTH, 0);
    const axc_sync_mark KEEP = AXC_SYNC_MARK_KEEP, FORGET = AXC_SYNC_MARK_FORGET,
                        SET = AXC_SYNC_MARK_SET;

    /* sync_gradients: what .grad ends summed over is marked synced, with the scale */
    /* a Linear weight, not summed by backward (overlap off): over data */
    ROW(G(1, DATA, 0), none, NULL, 1, several, 0, G(1, DATA, 0), SET, G(1, DATA, 0));
    /* summed by backward: only scaled */
    ROW(G(1, DATA, 0), G(1, DATA, 0), NULL, 1, several, 0, none, SET, G(1, DATA, 0));
    /* a bias after sync_gradients_depth_parallel: over data only */
    ROW(G(2, DEPTH, DATA), G(1, DEPTH, 0), NULL, 1, several, 0, G(1, DATA, 0), SET,
        G(2, DEPTH, DATA));
    /* a replicated parameter (easy layout) over world; expert layout over depth then data */
    ROW(G(1, WORLD, 0), none, NULL, 1, several, 0, G(1, WORLD, 0), SET, G(1, WORLD, 0));
    ROW(G(2, DEPTH, DATA), none, NULL, 1, several, 0, G(2, DEPTH, DATA), SET, G(2, DEPTH, DATA));
    /* a group of one rank is left out, the order of the rest kept */
    ROW(G(2, ROW, DATA), none, NULL, 1, several, 0, G(1, DATA, 0), SET, G(1, DATA, 0));
    ROW(G(2, DATA, COL), none, NULL, 1, several, 0, G(1, DATA, 0), SET, G(1, DATA, 0));
    /* another attribute (main_grad): .grad's mark is forgotten */
    ROW(G(1, DATA, 0), G(1, DATA, 0), NULL, 0, several, 0, none, FORGET, none);
    ROW(G(1, DATA, 0), none, NULL, 0, several, 0, G(1, DATA, 0), KEEP, none);
    /* a world of one: nothing to sum nor scale, nothing marked; scaled: marked synced */
    ROW(G(1, WORLD, 0), none, NULL, 1, 0, 0, none, KEEP, none);
    ROW_S(G(1, WORLD, 0), none, 0, NULL, 1, 0, 0.5, 0, none, SET, none, 0.5, 0);
    /* mean=True: the scale goes into the mark */
    ROW_S(G(1, DATA, 0), G(1, DATA, 0), 0, NULL, 1, several, 0.25, 0, none, SET, G(1, DATA, 0),
          0.25, 0);
    /* a second sync_gradients (no backward since): nothing summed nor scaled again ... */
    ROW_S(G(1, DATA, 0), G(1, DATA, 0), 0.25, NULL, 1, several, 0.25, 1, none, KEEP, none, 0, 0);
    ROW_S(G(1, WORLD, 0), none, 1.0, NULL, 1, 0, 1.0, 1, none, KEEP, none, 0, 0);
    /* ... unless it asks for another scale: then only rescaled, and marked so */
    ROW_S(G(1, DATA, 0), G(1, DATA, 0), 0.25, NULL, 1, several, 1.0, 1, none, SET,
          G(1, DATA, 0), 1.0, 4.0);
    /* sync_gradients_depth_parallel after it: the sums are complete, nothing */
    ROW_S(G(2, DEPTH, DATA), G(2, DEPTH, DATA), 0.5, &depth_only, 1, several, 0.5, 1, none, KEEP,
          none, 0, 0);
    /* another attribute (main_grad) copied from a synced .grad: summed and scaled already, only
     * rescaled to this sync's scale; .grad's mark is forgotten (its sums are over) */
    ROW_S(G(2, DEPTH, DATA), G(2, DEPTH, DATA), 0.5, NULL, 0, several, 1.0, 1, none, FORGET,
          none, 0, 2.0);
    ROW_S(G(2, DEPTH, DATA), G(2, DEPTH, DATA), 0.5, NULL, 0, several, 0.5, 1, none, FORGET,
          none, 0, 0);
    /* ... and within `only`: left alone */
    ROW_S(G(2, DEPTH, DATA), G(2, DEPTH, DATA), 0.5, &depth_only, 0, several, 0.5, 1, none,
          KEEP, none, 0, 0);

    /* sync_gradients_depth_parallel (only depth) */
    /* a bias: over depth, marked so */
    ROW(G(2, DEPTH, DATA), none, &depth_only, 1, several, 0, G(1, DEPTH, 0), SET, G(1, DEPTH, 0));
    /* already summed over data by backward: the mark keeps data, then depth */
    ROW(G(2, DEPTH, DATA), G(1, DATA, 0), &depth_only, 1, several, 0, G(1, DEPTH, 0), SET,
        G(2, DATA, DEPTH));
    /* a Linear weight (data only) / already summed over depth: skipped, neither summed nor scaled */
    ROW(G(1, DATA, 0), none, &depth_only, 1, several, 1, none, KEEP, none);
    ROW(G(2, DEPTH, DATA), G(1, DEPTH, 0), &depth_only, 1, several, 1, none, KEEP, none);
    /* another attribute: summed, .grad not marked */
    ROW(G(2, DEPTH, DATA), none, &depth_only, 0, several, 0, G(1, DEPTH, 0), KEEP, none);
    /* a replicated parameter of the easy layout (world) has no depth part */
    ROW(G(1, WORLD, 0), none, &depth_only, 1, several, 1, none, KEEP, none);
    /* a world of one: skipped */
    ROW(G(2, DEPTH, DATA), none, &depth_only, 1, 0, 1, none, KEEP, none);
    /* mean=True: what it sums is multiplied by 1/depth, and the mark carries that scale ... */
    ROW_S(G(2, DEPTH, DATA), none, 0, &depth_only, 1, several, 0.5, 0, G(1, DEPTH, 0), SET,
          G(1, DEPTH, 0), 0, 0);
    /* ... which a later sync_gradients replaces by its own (mean=True: divided once in all;
     * mean=False: the plain sum again), where nothing is left to sum too */
    ROW_F(G(2, DEPTH, DATA), G(1, DEPTH, 0), 0, 0.5, NULL, 1, several, 0.25, 0, G(1, DATA, 0),
          SET, G(2, DEPTH, DATA), 0.25, 0.5, 0);
    ROW_F(G(2, DEPTH, DATA), G(1, DEPTH, 0), 0, 0.5, NULL, 1, several, 1.0, 0, G(1, DATA, 0),
          SET, G(2, DEPTH, DATA), 1.0, 2.0, 0);
    ROW_F(G(1, DEPTH, 0), G(1, DEPTH, 0), 0, 0.5, NULL, 1, several, 0.5, 0, none, SET,
          G(1, DEPTH, 0), 0.5, 1.0, 0);
    /* a copy under another attribute: the same factor, .grad's mark forgotten */
    ROW_F(G(2, DEPTH, DATA), G(1, DEPTH, 0), 0, 0.5, NULL, 0, several, 0.25, 0, G(1, DATA, 0),
          FORGET, none, 0, 0.5, 0);
    /* summed over depth by a backward (overlap on), mean=True: only scaled, and marked so */
    ROW_S(G(2, DEPTH, DATA), G(1, DEPTH, 0), 0, &depth_only, 1, several, 0.5, 0, none, SET,
          G(1, DEPTH, 0), 0, 0);
    /* ... a copy under another attribute too (not marked) */
    ROW_S(G(2, DEPTH, DATA), G(1, DEPTH, 0), 0, &depth_only, 0, several, 0.5, 0, none, KEEP,
          none, 0, 0);
    /* a second sync_gradients_depth_parallel: nothing (not scaled twice) */
    ROW_F(G(2, DEPTH, DATA), G(1, DEPTH, 0), 0, 0.5, &depth_only, 1, several, 0.5, 1, none, KEEP,
          none, 0, 1.0, 0);
    /* no done at all (NULL) reads as none */
    axc_sync_choice c;
    axc_groups dd = G(2, DEPTH, DATA);
    axc_sync_decide(&dd, NULL, 0, 1.0, 0, several, &depth_only, 1, 1.0, &c);
    CHECK(!c.skip && is(&c.sum, G(1, DEPTH, 0)) && c.mark == SET && is(&c.marked, G(1, DEPTH, 0)));
    /* summed over depth by a sync (mean=False, scale 1: dated), then mean=True: only scaled,
     * the mark's scale replaced; and back (mean=False after mean=True) */
    axc_groups d1 = G(1, DEPTH, 0);
    axc_sync_decide(&dd, &d1, 0, 1.0, 1, several, &depth_only, 1, 0.5, &c);
    CHECK(!c.skip && c.sum.n == 0 && c.factor == 0.5 && c.mark == SET &&
          is(&c.marked, G(1, DEPTH, 0)) && c.scaled == 0.5 && c.rescale == 0);
    axc_sync_decide(&dd, &d1, 0, 0.5, 1, several, &depth_only, 1, 1.0, &c);
    CHECK(!c.skip && c.sum.n == 0 && c.factor == 2.0 && c.mark == SET && c.scaled == 1.0);
    /* ... the same mean= again: nothing; a copy under another attribute: nothing */
    axc_sync_decide(&dd, &d1, 0, 1.0, 1, several, &depth_only, 1, 1.0, &c);
    CHECK(c.skip && c.mark == KEEP);
    axc_sync_decide(&dd, &d1, 0, 1.0, 1, several, &depth_only, 0, 0.5, &c);
    CHECK(c.skip && c.mark == KEEP);

    /* the order: sets by first appearance, members in parameter order, skipped ones out */
    axc_sync_choice ch[7] = {{0}};
    ch[0].sum = G(1, DATA, 0);
    ch[1].sum = G(1, WORLD, 0);
    ch[2].sum = G(1, DATA, 0);
    ch[3].sum = none;
    ch[4].sum = G(1, WORLD, 0);
    ch[5].skip = 1;
    ch[6].sum = G(1, DATA, 0);
    axc_sync_plan plan;
    CHECK_OK(axc_sync_plan_build(&plan, ch, 7));
    CHECK(plan.nsets == 3 && plan.n == 6);
    CHECK(is(&plan.sets[0].groups, G(1, DATA, 0)) && plan.sets[0].count == 3);
    CHECK(is(&plan.sets[1].groups, G(1, WORLD, 0)) && plan.sets[1].count == 2);
    CHECK(is(&plan.sets[2].groups, none) && plan.sets[2].count == 1);
    const size_t want[6] = {0, 2, 6, 1, 4, 3};
    CHECK(plan.sets[0].first == 0 && plan.sets[1].first == 3 && plan.sets[2].first == 5);
    CHECK(memcmp(plan.order, want, sizeof want) == 0);
    axc_sync_plan_free(&plan);
    CHECK(plan.sets == NULL && plan.order == NULL && plan.nsets == 0);
    /* the order of the groups matters: (depth, data) and (data, depth) are two sets */
    ch[0].sum = G(2, DEPTH, DATA);
    ch[1].sum = G(2, DATA, DEPTH);
    CHECK_OK(axc_sync_plan_build(&plan, ch, 2));
    CHECK(plan.nsets == 2 && plan.n == 2);
    axc_sync_plan_free(&plan);
    /* the same groups with another factor: another set, which keeps its factor */
    ch[0].sum = ch[1].sum = G(1, DATA, 0);
    ch[0].factor = 1.0;
    ch[1].factor = 0.5;
    CHECK_OK(axc_sync_plan_build(&plan, ch, 2));
    CHECK(plan.nsets == 2 && plan.n == 2 && plan.sets[0].factor == 1.0 &&
          plan.sets[1].factor == 0.5);
    axc_sync_plan_free(&plan);
    /* nothing to sum */
    CHECK_OK(axc_sync_plan_build(&plan, ch, 0));
    CHECK(plan.nsets == 0 && plan.n == 0);
    axc_sync_plan_free(&plan);
    ch[0].skip = 1;
    CHECK_OK(axc_sync_plan_build(&plan, ch, 1));
    CHECK(plan.nsets == 0 && plan.n == 0);
    axc_sync_plan_free(&plan);
    axc_sync_plan_free(NULL);
    return ctest_summary("test_sync");
}
