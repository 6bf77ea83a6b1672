/* What a parameter's gradient hook does with the gradient of a backward pass
 * (docs/ARCHITECTURE.md#one-training-step): the decision alone, from facts the caller gathers;
 * the caller (csrc/python/py_grad_hook.c) carries it out on torch tensors.
 *
 * Facts that cost something to learn start unknown (-1): the decision asks for them only when
 * it needs them (AXC_GRAD_ASK_ACCUMULATES), and asks to drop an abandoned pass once
 * (AXC_GRAD_DROP_ABANDONED) before it reads anything pending; the caller then fills the fact in
 * (re-reading what is pending) and decides again. */
#ifndef AXC_GRAD_POLICY_H
#define AXC_GRAD_POLICY_H

#include "axc/grid.h"
#include "axc/records.h"

typedef struct axc_grad_facts {
    int microbatch;      /* the calling thread runs a run_concurrent micro-batch */
    int initialized;     /* a communicator is open */
    int accumulates;     /* the pass accumulates into .grad (not autograd.grad); -1: unknown */
    int abandoned_checked; /* an abandoned pass was dropped already */
    int pending;         /* the parameter has a record in this pass */
    int last_replace;    /* its last record replaces .grad */
    int create_graph;    /* backward builds a graph (autograd accumulates out of place) */
    int sync;            /* backward starts sums (0 inside no_grad_sync) */
    int overlap;         /* the data overlap knob in force for the parameter */
    int groups;          /* how many of its groups have more than one rank */
    int plain;           /* the gradient is strided and of the parameter's dtype */
    int synced;          /* .grad carries a mark a sync made (sync_gradients or
                          * sync_gradients_depth_parallel ran, no backward since; the caller
                          * learns it before deciding) */
} axc_grad_facts;

typedef enum axc_grad_action {
    AXC_GRAD_NOTHING,         /* autograd takes the gradient untouched */
    AXC_GRAD_ASK_ACCUMULATES, /* fill in `accumulates`, decide again */
    AXC_GRAD_DROP_ABANDONED,  /* drop an abandoned pass, set abandoned_checked, decide again */
    AXC_GRAD_UNSYNC,          /* a synced .grad (any sync's mark) becomes this rank's unscaled
                               * share; decide again */
    AXC_GRAD_CHECK_UNSYNCED,  /* a micro-batch thread: a .grad summed already is an error */
    AXC_GRAD_ADD_AFTER,       /* a record of its own, added after the pending one */
    AXC_GRAD_FINISH_FIRST,    /* complete the pending work, then decide again */
    AXC_GRAD_UNREDUCE,        /* a summed .grad takes its share; autograd adds the gradient */
    AXC_GRAD_RECORD,          /* into a bucket over the groups, .grad folded in */
} axc_grad_action;

axc_grad_action axc_grad_decide(const axc_grad_facts *f);

/* A Linear's deferred weight gradient (dW written by the layer's backward, completed at the
 * end of the pass): whether it is summed over the data group during backward (`reduce`: into
 * a data bucket), whether the .grad so far is folded into it (`fold`), and whether it replaces
 * .grad at the end of the pass (else it is added). A .grad already summed over data (a
 * backward outside no_grad_sync, no sync_gradients since: `summed_data`) cannot absorb an
 * unreduced gradient: the new part is then reduced too, and added. */
typedef struct axc_dw_plan {
    int reduce, fold, replace;
} axc_dw_plan;

axc_dw_plan axc_grad_plan_deferred(int data_size, int overlap_data, int sync, int summed_data,
                                   int has_grad);

/* How many ranks hold a .grad summed over `summed` as one sum: the product of the groups'
 * sizes (1 for none). */
long axc_grad_copies(const axc_grid *grid, const axc_groups *summed);

/* `groups` less the groups of one rank. */
void axc_grad_groups_to_sum(const axc_grid *grid, const axc_groups *groups, axc_groups *out);

#endif
