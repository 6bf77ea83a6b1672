/* What sync_gradients sums (docs/ARCHITECTURE.md#one-training-step): per parameter, the groups
 * its gradient still has to be summed over now, what that leaves its summed-over mark saying,
 * and the order of the sums (the parameters grouped by the groups they are summed over).
 *
 * A parameter's gradient is summed in all over its groups (an axonn_c.Linear's own, or the
 * groups a replicated parameter's copies differ over), of which only those with several ranks
 * count. A backward pass (or an earlier sync_gradients_depth_parallel) may have summed it over
 * some of them already (its mark, records.h): those are left out. sync_gradients_depth_parallel
 * sums over "depth" only (`only`) and marks the gradient so; sync_gradients marks it synced
 * (the step's sums are done, and it is scaled): a second sync_gradients before the next
 * backward sums nothing again (it only changes the scale when asked for another one). Pure
 * decisions: no collective, no tensor, no lock. */
#ifndef AXC_SYNC_H
#define AXC_SYNC_H

#include <stddef.h>

#include "axc/grid.h"
#include "axc/records.h"
#include "axc/status.h"

typedef enum axc_sync_mark {
    AXC_SYNC_MARK_KEEP = 0, /* the mark stays as it is */
    AXC_SYNC_MARK_FORGET,   /* the mark is forgotten */
    AXC_SYNC_MARK_SET       /* the mark becomes `marked` */
} axc_sync_mark;

/* One parameter's part in a sync. */
typedef struct axc_sync_choice {
    int skip;          /* neither summed nor scaled */
    axc_groups sum;    /* summed over these now, in order (none: only scaled) */
    axc_sync_mark mark;
    axc_groups marked; /* with AXC_SYNC_MARK_SET: what .grad is then summed over */
    double synced;     /* with AXC_SYNC_MARK_SET: > 0, the mark is synced with this scale */
    double scaled;     /* with AXC_SYNC_MARK_SET, not synced: the scale .grad then carries */
    double factor;     /* not skipped: what the summed gradient is multiplied by (1: nothing) */
    double rescale;    /* with skip: > 0, the gradient (synced already) is multiplied by this */
} axc_sync_choice;

/* The group kinds with more than one rank on `grid`, bit 1 << kind each. */
unsigned axc_sync_several(const axc_grid *grid);

/* The choice for one parameter whose gradient is summed over `groups` in all, of which `done`
 * are summed already (its mark; none when it has none), `done_synced` the mark's synced scale
 * (0: not synced), `done_scale` the scale the gradient carries already (a mark's that is not
 * synced: sync_gradients_depth_parallel(mean=True) divided it by the depth; 1: none), which a
 * later sync_gradients replaces by its own (so a mean is divided once), `done_dated` whether a
 * sync made the mark (else a backward's sums: not scaled yet). `several`:
 * axc_sync_several's mask. `only`: NULL for every group
 * (sync_gradients), else these only (sync_gradients_depth_parallel: a parameter with nothing to
 * sum over them is skipped). `marks_grad`: the gradient synced is .grad itself, which the marks
 * describe (another attribute, e.g. a main_grad copied from .grad, is summed but leaves .grad's
 * mark to sync_gradients). `scale`: what the sync multiplies by (1: nothing). */
void axc_sync_decide(const axc_groups *groups, const axc_groups *done, double done_synced,
                     double done_scale, int done_dated, unsigned several,
                     const axc_groups *only, int marks_grad, double scale,
                     axc_sync_choice *out);

/* The parameters of one set of sums: plan->order[first .. first + count) are their indices,
 * in parameter order, all summed over `groups` and multiplied by `factor`. */
typedef struct axc_sync_set {
    axc_groups groups;
    double factor;
    size_t first, count;
} axc_sync_set;

/* The order of a sync's sums, the same on every rank that decided the same: the parameters not
 * skipped, grouped into sets by the groups they are summed over and their factor, the sets in
 * the order their first parameter comes. */
typedef struct axc_sync_plan {
    axc_sync_set *sets;
    int nsets;
    size_t *order;
    size_t n; /* parameters in the plan */
} axc_sync_plan;

/* The plan of choices[0 .. n). Free it with axc_sync_plan_free (also after a failure). */
axc_status axc_sync_plan_build(axc_sync_plan *plan, const axc_sync_choice *choices, size_t n);
void axc_sync_plan_free(axc_sync_plan *plan);

#endif
