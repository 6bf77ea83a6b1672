/* What sync_gradients sums and in which order (axc/sync.h). */
#include "axc/sync.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

unsigned axc_sync_several(const axc_grid *grid)
{
    unsigned mask = 0;
    for (int k = 0; grid && k < AXC_GROUP_COUNT; k++)
        if (axc_grid_group_size(grid, (axc_group_kind)k) > 1)
            mask |= 1u << k;
    return mask;
}

static int has(const axc_groups *g, axc_group_kind k)
{
    for (int i = 0; g && i < g->n; i++)
        if (g->g[i] == k)
            return 1;
    return 0;
}

void axc_sync_decide(const axc_groups *groups, const axc_groups *done, double done_synced,
                     double done_scale, int done_dated, unsigned several,
                     const axc_groups *only, int marks_grad, double scale,
                     axc_sync_choice *out)
{
    memset(out, 0, sizeof *out);
    out->scaled = out->factor = 1.0;
    if (done_synced > 0) {
        /* synced already, no backward since: summing again would count it twice */
        out->skip = 1;
        if (!only && fabs(scale / done_synced - 1.0) > 1e-12) { /* another mean= than before */
            out->rescale = scale / done_synced;
            if (marks_grad) {
                out->mark = AXC_SYNC_MARK_SET;
                out->marked = *done;
                out->synced = scale;
            }
        }
        if (!marks_grad && !only) /* (a copy under another attribute: .grad's sums are over) */
            out->mark = AXC_SYNC_MARK_FORGET;
        return;
    }
    int any_done = done && done->n > 0;
    double carried = done_scale > 0 ? done_scale : 1.0;
    /* its groups with several ranks, less those a backward summed over, within `only` */
    for (int i = 0; i < groups->n; i++) {
        axc_group_kind k = groups->g[i];
        if ((several >> k & 1u) && !has(done, k) && (!only || has(only, k)) &&
            out->sum.n < AXC_GROUP_COUNT)
            out->sum.g[out->sum.n++] = k;
    }
    if (only) {
        /* a group of `only` a backward summed (not a sync: its mean is not applied yet) */
        int by_backward = 0;
        for (int i = 0; !done_dated && i < groups->n; i++)
            by_backward |= (several >> groups->g[i] & 1u) && has(done, groups->g[i]) &&
                           has(only, groups->g[i]);
        /* .grad summed over `only` by an earlier sync of `only` with another mean=: its
         * scale is replaced by this one, as a second sync_gradients does (a copy under another
         * attribute is left: no mark of its own would stop a repeat scaling it again) */
        int resync = marks_grad && done_dated && !out->sum.n && any_done &&
                     fabs(scale / carried - 1.0) > 1e-12;
        if (!out->sum.n && !(by_backward && scale != 1.0) && !resync) {
            out->skip = 1; /* nothing of `only` to sum nor to scale */
            return;
        }
        out->factor = resync ? scale / carried : scale;
        if (marks_grad) { /* .grad is then summed over what it was and these, and scaled */
            out->mark = AXC_SYNC_MARK_SET;
            if (done)
                out->marked = *done;
            axc_groups_union(&out->marked, &out->sum);
            out->scaled = resync ? scale : carried * scale;
        }
        return;
    }
    out->factor = scale / carried; /* (the scale carried is replaced by this one) */
    if (marks_grad) {
        /* the step's sums are complete */
        if (any_done || out->sum.n || scale != 1.0 || carried != 1.0) {
            out->mark = AXC_SYNC_MARK_SET;
            if (done)
                out->marked = *done;
            axc_groups_union(&out->marked, &out->sum);
            out->synced = scale;
        }
    } else if (any_done || carried != 1.0) {
        out->mark = AXC_SYNC_MARK_FORGET; /* (another attribute: .grad's sums are over) */
    }
}

static int same(const axc_sync_set *set, const axc_sync_choice *c)
{
    const axc_groups *a = &set->groups, *b = &c->sum;
    return a->n == b->n && memcmp(a->g, b->g, (size_t)a->n * sizeof a->g[0]) == 0 &&
           set->factor == c->factor;
}

axc_status axc_sync_plan_build(axc_sync_plan *plan, const axc_sync_choice *choices, size_t n)
{
    memset(plan, 0, sizeof *plan);
    int *set_of = n ? malloc(n * sizeof *set_of) : NULL;
    plan->order = n ? malloc(n * sizeof *plan->order) : NULL;
    /* (at most one set per parameter) */
    plan->sets = n ? calloc(n, sizeof *plan->sets) : NULL;
    if (n && (!set_of || !plan->order || !plan->sets)) {
        free(set_of);
        return axc_fail(AXC_ERR_NOMEM, "sync_gradients: no memory for the order of %zu "
                                       "parameters' sums", n);
    }
    for (size_t i = 0; i < n; i++) {
        set_of[i] = -1;
        if (choices[i].skip)
            continue;
        int s = 0;
        while (s < plan->nsets && !same(&plan->sets[s], &choices[i]))
            s++;
        if (s == plan->nsets) {
            plan->sets[plan->nsets].groups = choices[i].sum;
            plan->sets[plan->nsets++].factor = choices[i].factor;
        }
        plan->sets[s].count++;
        set_of[i] = s;
        plan->n++;
    }
    size_t at = 0;
    for (int s = 0; s < plan->nsets; s++) {
        plan->sets[s].first = at;
        at += plan->sets[s].count;
        plan->sets[s].count = 0; /* (counted again as the members are placed) */
    }
    for (size_t i = 0; i < n; i++) {
        if (set_of[i] < 0)
            continue;
        axc_sync_set *set = &plan->sets[set_of[i]];
        plan->order[set->first + set->count++] = i;
    }
    free(set_of);
    return AXC_OK;
}

void axc_sync_plan_free(axc_sync_plan *plan)
{
    if (!plan)
        return;
    free(plan->sets);
    free(plan->order);
    memset(plan, 0, sizeof *plan);
}
