/* The gradient hook's decision (axc/grad_policy.h). */
#include "axc/grad_policy.h"

axc_grad_action axc_grad_decide(const axc_grad_facts *f)
{
    /* a .grad a sync marked (sync_gradients, sync_gradients_depth_parallel), about to take
     * more: first back to this rank's share
     * (only when the pass accumulates into it: torch.autograd.grad leaves .grad as it is; a
     * micro-batch's always does, and the other threads' gradients for it wait meanwhile) */
    if (f->synced && f->initialized) {
        if (f->microbatch)
            return AXC_GRAD_UNSYNC;
        if (f->accumulates < 0)
            return AXC_GRAD_ASK_ACCUMULATES;
        if (f->accumulates)
            return AXC_GRAD_UNSYNC;
    }
    if (f->microbatch) /* autograd accumulates it; run_concurrent's reducer or sync sums */
        return AXC_GRAD_CHECK_UNSYNCED;
    if (!f->initialized)
        return AXC_GRAD_NOTHING;
    if (f->accumulates < 0)
        return AXC_GRAD_ASK_ACCUMULATES;
    if (!f->accumulates) /* torch.autograd.grad hands it back: nothing to defer or sum */
        return AXC_GRAD_NOTHING;
    if (!f->abandoned_checked) /* a pass that raised left half gradients behind */
        return AXC_GRAD_DROP_ABANDONED;
    /* A gradient of this pass is pending (a Linear's deferred dW, or an earlier gradient of a
     * reentrant checkpoint). When that record replaces .grad (what autograd accumulates there is
     * dropped), this one becomes a record of its own, reduced like it and added after it: nothing
     * waits now (a regulariser on every weight would otherwise complete all pending work once
     * per weight). Else (the record adds to a .grad summed in an earlier pass, an unusual
     * gradient, or create_graph=True, where autograd accumulates out of place, replacing the
     * scratch) the pending work completes first. */
    if (f->pending)
        return !f->create_graph && f->last_replace && f->plain ? AXC_GRAD_ADD_AFTER
                                                                : AXC_GRAD_FINISH_FIRST;
    /* no sums now (no_grad_sync, the overlap off), nothing to sum, or an unusual gradient:
     * autograd adds an unsummed gradient and sync_gradients sums the total */
    if (!f->sync || !f->overlap || !f->groups || !f->plain)
        return AXC_GRAD_UNREDUCE;
    return AXC_GRAD_RECORD;
}

axc_dw_plan axc_grad_plan_deferred(int data_size, int overlap_data, int sync, int summed_data,
                                   int has_grad)
{
    axc_dw_plan p;
    p.reduce = data_size > 1 && ((overlap_data && sync) || summed_data);
    p.fold = has_grad && !summed_data;
    p.replace = !summed_data;
    return p;
}

long axc_grad_copies(const axc_grid *grid, const axc_groups *summed)
{
    long copies = 1;
    for (int i = 0; summed && i < summed->n; i++)
        copies *= axc_grid_group_size(grid, summed->g[i]);
    return copies;
}

void axc_grad_groups_to_sum(const axc_grid *grid, const axc_groups *groups, axc_groups *out)
{
    out->n = 0;
    for (int i = 0; groups && i < groups->n; i++)
        if (axc_grid_group_size(grid, groups->g[i]) > 1)
            out->g[out->n++] = groups->g[i];
}
