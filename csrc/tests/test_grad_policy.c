/* The gradient hook's decision (csrc/grads/grad_policy.c): every branch of grads.py's former
 * _take_grad / _add_after_pending, and the copies and groups it reads. */
#include "axc/grad_policy.h"
#include "ctest.h"

/* the facts of the common case: a plain gradient of a pass that accumulates, sums on */
static axc_grad_facts base(void)
{
    return (axc_grad_facts){.initialized = 1, .accumulates = 1, .abandoned_checked = 1,
                            .sync = 1, .overlap = 1, .groups = 1, .plain = 1};
}

int main(void)
{
    axc_grad_facts f = base();
    CHECK(axc_grad_decide(&f) == AXC_GRAD_RECORD);

    /* a micro-batch thread only checks, before anything else */
    f.microbatch = 1;
    f.initialized = 0;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_CHECK_UNSYNCED);
    f = base();
    f.initialized = 0;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_NOTHING);

    /* a synced .grad (sync_gradients ran, no backward since) first goes back to this rank's
     * share, only for a pass that accumulates into it (a micro-batch's always does) */
    f = base();
    f.synced = 1;
    f.accumulates = -1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_ASK_ACCUMULATES);
    f.accumulates = 1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_UNSYNC);
    f.microbatch = 1; /* (a micro-batch's backward always accumulates: not asked) */
    CHECK(axc_grad_decide(&f) == AXC_GRAD_UNSYNC);
    f.accumulates = -1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_UNSYNC);
    f.microbatch = 0;
    f.accumulates = 0;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_NOTHING);
    f.synced = 0; /* (after it: decided as without) */
    f.accumulates = 1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_RECORD);
    f = base();
    f.synced = 1;
    f.initialized = 0; /* (no grid to count the copies on: finalized) */
    CHECK(axc_grad_decide(&f) == AXC_GRAD_NOTHING);

    /* accumulates is asked for only when it matters; autograd.grad gets its gradient back */
    f = base();
    f.accumulates = -1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_ASK_ACCUMULATES);
    f.accumulates = 0;
    f.abandoned_checked = 0;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_NOTHING);
    f.accumulates = 1; /* then an abandoned pass is dropped, before anything pending is read */
    f.pending = 1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_DROP_ABANDONED);

    /* pending: added after a record that replaces .grad, else the pending work completes */
    f = base();
    f.pending = f.last_replace = 1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_ADD_AFTER);
    f.sync = f.overlap = f.groups = 0; /* (the pending record's groups count, not these) */
    CHECK(axc_grad_decide(&f) == AXC_GRAD_ADD_AFTER);
    f = base();
    f.pending = 1; /* adds to a .grad summed earlier */
    CHECK(axc_grad_decide(&f) == AXC_GRAD_FINISH_FIRST);
    f.last_replace = 1;
    f.create_graph = 1;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_FINISH_FIRST);
    f.create_graph = 0;
    f.plain = 0;
    CHECK(axc_grad_decide(&f) == AXC_GRAD_FINISH_FIRST);
    f.pending = 0; /* (after the finish: decided as without) */
    CHECK(axc_grad_decide(&f) == AXC_GRAD_UNREDUCE);

    /* no sum now: no_grad_sync, the overlap off, nothing to sum */
    for (int i = 0; i < 3; i++) {
        f = base();
        *(i == 0 ? &f.sync : i == 1 ? &f.overlap : &f.groups) = 0;
        CHECK(axc_grad_decide(&f) == AXC_GRAD_UNREDUCE);
    }

    /* a deferred weight gradient: summed over data when the knob and sync say so, or when
     * .grad is summed over data already (then added, not folded) */
    axc_dw_plan d = axc_grad_plan_deferred(2, 1, 1, 0, 1);
    CHECK(d.reduce && d.fold && d.replace);
    d = axc_grad_plan_deferred(2, 1, 0, 0, 1); /* no_grad_sync */
    CHECK(!d.reduce && d.fold && d.replace);
    d = axc_grad_plan_deferred(2, 0, 1, 0, 0); /* the layer's knob off, no .grad */
    CHECK(!d.reduce && !d.fold && d.replace);
    d = axc_grad_plan_deferred(2, 0, 0, 1, 1); /* summed over data already */
    CHECK(d.reduce && !d.fold && !d.replace);
    d = axc_grad_plan_deferred(1, 1, 1, 1, 1); /* one data rank: nothing to sum */
    CHECK(!d.reduce && !d.fold && !d.replace);

    /* copies and groups */
    axc_grid g;
    CHECK_OK(axc_grid_make(&g, 8, 2, 1, 2, 2, 1));
    axc_groups none = {.n = 0}, dd = {.n = 2, .g = {AXC_GROUP_DEPTH, AXC_GROUP_DATA}};
    axc_groups rw = {.n = 2, .g = {AXC_GROUP_ROW, AXC_GROUP_WORLD}}, out;
    CHECK(axc_grad_copies(&g, &none) == 1 && axc_grad_copies(&g, NULL) == 1);
    CHECK(axc_grad_copies(&g, &dd) == 4 && axc_grad_copies(&g, &rw) == 8);
    axc_grad_groups_to_sum(&g, &rw, &out);
    CHECK(out.n == 1 && out.g[0] == AXC_GROUP_WORLD);
    axc_grad_groups_to_sum(&g, &dd, &out);
    CHECK(out.n == 2 && out.g[0] == AXC_GROUP_DEPTH && out.g[1] == AXC_GROUP_DATA);
    axc_grad_groups_to_sum(&g, NULL, &out);
    CHECK(out.n == 0);
    return ctest_summary("test_grad_policy");
}
