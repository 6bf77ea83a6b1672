/* The 3D tensor-parallel linear layer: shapes, and forward/backward over the grid
 * (docs/ARCHITECTURE.md#the-sharded-linear-layer).
 *
 * Weight W[out, in]. The group that splits the input features ("gin") is col, the one that splits
 * the output features ("gout") is row; transpose=1 swaps them. Rank (d, r, c) owns the block
 * [n_local x k_local] at (gout index, gin index), flattened row-major, padded to shard * Gd and
 * split over depth: piece d (shard elements) is the parameter. The bias [n_local] is the gout
 * block, replicated over gin and depth.
 *
 * Expert layout: X [m, k_local] (tokens split over data x depth, replicated over gin/gout),
 * Y [m, n_local]. Easy layout: X [t, in] (this rank's own tokens), Y [t, out]; the layer
 * redistributes inside, padding every rank of the gin x gout plane to the plane's largest t.
 */
#ifndef AXC_LINEAR_H
#define AXC_LINEAR_H

#include <stdint.h>

#include "axc/comm.h"
#include "axc/sched.h"

typedef enum axc_layout { AXC_LAYOUT_EASY = 0, AXC_LAYOUT_EXPERT = 1 } axc_layout;

typedef struct axc_linear_desc {
    int64_t in_features, out_features;
    int transpose;
    int has_bias;
    axc_layout layout;
    axc_dtype dtype;
    /* overlap inside the layer (docs/ARCHITECTURE.md#one-training-step); results do not
     * depend on these except that fwd_chunks > 1 runs the forward GEMM on row chunks */
    int overlap_all_reduce;     /* backward: dX's reduction runs while the dW GEMM computes */
    int overlap_reduce_scatter; /* backward: dW's depth reduce-scatter runs asynchronously */
    int fwd_chunks;             /* expert forward: row chunks whose all-reduce overlaps the next
                                   chunk's GEMM (1 = off, 0 = chosen by the output's size) */
    int scheduled;              /* the depth all-gather goes through io->sched (prefetched, no
                                   gathered weight in the workspace) */
    int defer_dw_gemm;          /* backward with io->defer, overlap_all_reduce, Gd == 1 and
                                   gin x gout > 1: the dW GEMM becomes a task of io->sched, run
                                   when a later layer waits for its dX reduction (or at the
                                   end), so that it hides that reduction; see
                                   axc_linear_io.task_number. (With Gd > 1 the GEMM runs in the
                                   call: its reduce-scatter should start early.) */
    int overlap_data;           /* backward: dW's data-parallel reduction runs in a gradient
                                   bucket during backward (axonn_c/grads.py), so dW is handed
                                   to the caller's deferred completion (axc_linear_defers) */
    int own_codecs;             /* 1: the layer's own compression (Linear(compression=...))
                                   replaces the communicator's policy for its collectives */
    axc_codec codec[AXC_GROUP_COUNT]; /* by group (used: col, row, depth), with own_codecs */
    int block[AXC_GROUP_COUNT];
    int depth_error_feedback;   /* with own_codecs: error feedback on dW's depth reduce-scatter
                                   (without: the communicator's, axc_comm_set_layer_codec) */
} axc_linear_desc;

/* Everything a caller needs to allocate for one call. Element counts, in `dtype`. */
typedef struct axc_linear_shapes {
    axc_group_kind gin, gout;
    int gin_size, gout_size, gin_rank, gout_rank, depth_size;
    int64_t k_local, n_local; /* block of W this rank's gin/gout coordinates select */
    int64_t block;            /* k_local * n_local */
    int64_t shard;            /* ceil(block / Gd): the parameter's length */
    /* per call, for `rows` = the tokens (expert: m; easy: the plane's largest t) */
    int64_t saved_rows;       /* rows of the activation saved for backward (expert: m) */
    int64_t saved_cols;       /* its columns (k_local) */
    int64_t workspace_elems;  /* scratch for forward or backward */
} axc_linear_shapes;

/* Validates the layer against the grid (divisibility, dtypes) with messages naming numbers. */
axc_status axc_linear_check(const axc_comm *comm, const axc_linear_desc *d);

/* Shapes for a call with `rows` rows (expert: m; easy: the padded t). */
axc_status axc_linear_shapes_for(const axc_comm *comm, const axc_linear_desc *d, int64_t rows,
                                 axc_linear_shapes *s);

/* Easy layout: exchanges token counts over the gin x gout plane. Writes the plane's largest
 * count to *t_max. A host collective; on a job without one (NCCL only) with CUDA tensors
 * (device >= 0) the counts go through a small device buffer on `stream` instead. */
axc_status axc_linear_plane_tokens(axc_comm *comm, const axc_linear_desc *d, int64_t t,
                                   int device, void *stream, int64_t *t_max);

typedef struct axc_linear_io {
    int device;      /* -1 CPU, >= 0 CUDA */
    void *stream;
    int64_t rows;    /* expert: m; easy: this rank's t */
    int64_t t_max;   /* easy: from axc_linear_plane_tokens (== rows when equal); expert: rows */
    const void *x;   /* forward input */
    const void *w;   /* weight shard [shard] */
    const void *bias;/* [n_local] or NULL */
    void *y;         /* forward output */
    void *saved;     /* forward: filled with the activation backward needs (easy: the gathered
                        [saved_rows, k_local] input; expert: unused, backward reads x) */
    const void *dy;  /* backward input */
    void *dx;        /* backward outputs (dx: NULL where it has no rows, or with skip_dx) */
    void *dw;        /* [shard] */
    void *db;        /* [n_local] or NULL */
    void *workspace; /* workspace_elems elements */
    int skip_dx;     /* 1: the input needs no gradient (a first layer): no dX GEMM, no dX
                        collectives, dx unused. The same on every rank of the layer's groups:
                        not inferred from dx, which a rank without tokens may pass NULL while
                        its peers' dX collectives need it */
    /* the scheduler (desc->scheduled) */
    axc_sched *sched;
    int layer;           /* the layer's scheduler id */
    int64_t w_version;   /* the shard's version (torch's _version of the weight) */
    int prefetch_ok;     /* the shard pointer is the parameter's own (not a per-call copy) */
    /* backward with deferred completion: dW's depth reduce-scatter is handed to io->sched (the
     * caller keeps dw and the workspace alive until axc_sched_finish), and dw_prev (the
     * gradient accumulated so far, [shard], or NULL) is added in first, so dw receives the
     * new total */
    int defer;
    const void *dw_prev;
    /* unscheduled calls: W's block already gathered over depth ([shard * depth_size] elements,
     * e.g. one gather shared by concurrent micro-batches), or NULL: the call gathers it */
    const void *w_full;
    /* out (backward, desc->defer_dw_gemm, or NULL): the number of the scheduler task that
     * computes dW (0: computed in the call). Until the task has run (axc_sched_stats.tasks_run),
     * the caller keeps dy, x (or saved), dw, dw_prev and the workspace alive. When the call
     * fails, the queue has been run before it returns (*task_number is 0). */
    uint64_t *task_number;
    /* backward, Gd > 1, not deferred: dW's unreduced block ([shard * depth_size], padding
     * zeroed) goes here and the depth reduce-scatter is left to the caller (io->dw untouched),
     * or NULL: reduce-scattered into io->dw */
    void *dw_full;
    /* backward, Gd > 1: the error-feedback residual of dW's depth reduce-scatter (fp32,
     * axc_linear_dw_residual_elems elements, zeros at first), kept across steps by the
     * caller (the runtime's table by layer id, axc/layer_residuals.h) and updated in place
     * when the reduce-scatter runs (also when deferred: the caller keeps it alive and passes
     * it to no other collective in flight). Required when
     * axc_linear_dw_residual_elems is > 0 and this call reduce-scatters dW itself (not with
     * dw_full); ignored otherwise. */
    float *dw_residual;
    /* expert layout, cross-layer chunk pipelining (axonn_c.Sequential): the forward all-reduce of
     * y, and with overlap_all_reduce the backward all-reduce of dx, are started and handed to
     * io->sched as held results (axc_sched_hold_result) instead of being waited for: the
     * caller awaits them before anything reads y / dx, and keeps them alive until then. The
     * dW GEMM is then never deferred (the chunks of other layers hide the reduction). */
    int hold_result;
} axc_linear_io;

/* The elements of the error-feedback residual dW's depth reduce-scatter needs for a call on
 * `device` (-1: host): shard * Gd when the reduce-scatter is compressed (the layer's own depth
 * codec, else the communicator's, on a transport that compresses it) with error feedback on;
 * 0 otherwise (Gd == 1, not float32, exact, or error feedback off). */
axc_status axc_linear_dw_residual_elems(const axc_comm *comm, const axc_linear_desc *d,
                                        int device, int64_t *elems);

/* Per-call facts of a backward that decide whether its dW completes later (deferred): */
enum {
    AXC_LINEAR_HOLD = 1,       /* a chunk call of cross-layer chunk pipelining (the chunks
                                  accumulate into one gradient completed after the pass) */
    AXC_LINEAR_MICROBATCH = 2, /* a concurrent micro-batch's call (autograd sums the
                                  micro-batches' dW: never deferred) */
};

/* Whether a backward of the layer on grid `g` hands its dW to the caller's deferred completion
 * (io->defer): with `facts` AXC_LINEAR_HOLD always, with AXC_LINEAR_MICROBATCH never, else when
 * something runs after the call: dW's depth reduce-scatter (overlap_reduce_scatter, Gd > 1),
 * its data-parallel bucket (overlap_data, G_data > 1) or its dW GEMM as a scheduler task
 * (defer_dw_gemm under overlap_all_reduce on a tensor-parallel grid with Gd == 1, as the
 * backward decides it). The caller adds what only it knows: that dW goes to the parameter's
 * .grad (not torch.autograd.grad, not a per-call cast). */
int axc_linear_defers(const axc_grid *g, const axc_linear_desc *d, int facts);

/* Whether every call of the layer on `device` (-1: host) outside chunk pipelining and
 * concurrent micro-batches is self-contained: nothing deferred (axc_linear_defers), no
 * scheduled depth gather (scheduled, Gd > 1), no error-feedback residual kept across steps
 * (axc_linear_dw_residual_elems of a float32 layer), no codecs of its own. Such calls need none
 * of the caller's cross-layer bookkeeping. */
int axc_linear_self_contained(const axc_comm *comm, const axc_linear_desc *d, int device);

axc_status axc_linear_forward(axc_comm *comm, const axc_linear_desc *d, const axc_linear_io *io);
/* Backward for expert: reads io->x; easy: reads io->saved. Writes dx, dw, db. */
axc_status axc_linear_backward(axc_comm *comm, const axc_linear_desc *d, const axc_linear_io *io);

#endif
