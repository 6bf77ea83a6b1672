/* The communication model, the memory model and the grid planner
 * (docs/ARCHITECTURE.md#the-communication-model-and-planner, docs/model.md).
 *
 * Bytes are exact: every collective a layer issues is listed (axc_model_layer_colls) and its
 * per-rank ring volume is taken from axc_coll_volume(), the same function that feeds the
 * transport's byte counters. Times are an estimate: volume / beta(group) + hops * alpha(group)
 * with beta and alpha from a machine profile (axc_machine). */
#ifndef AXC_MODEL_H
#define AXC_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "axc/comm.h"
#include "axc/grid.h"
#include "axc/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The communicating groups, indexed like axc_group_kind (col, row, depth, data, intra, world):
 * the easy Linear's token counts go over intra, replicated gradients (easy layout) over world. */
#define AXC_MODEL_NGROUPS 6

/* What a layer description describes (axc_layer_desc.kind). */
typedef enum axc_layer_kind {
    AXC_LAYER_LINEAR = 0,     /* axonn_c.Linear W[out_features, in_features] */
    AXC_LAYER_REPLICATED = 1, /* parameters every rank holds whole (`params` elements): their
                                 gradients are summed once per step, over world (easy) or
                                 depth then data (expert) */
    AXC_LAYER_EMBEDDING = 2,  /* axonn_c.Embedding(in_features words, out_features hidden),
                                 expert layout; `tied`: also its logits + cross_entropy */
    AXC_LAYER_NORM = 3,       /* axonn_c.LayerNorm (stats 2) / RMSNorm (stats 1) over
                                 out_features, expert layout; `params`: its full parameter
                                 elements (weight, bias) */
} axc_layer_kind;

/* One layer; `count` identical copies of it run per step (e.g. per block). */
typedef struct axc_layer_desc {
    int64_t in_features, out_features;
    int transpose;     /* 1: input features split over the row group, output over col
                          (embedding, norm: the hidden dimension over row instead of col) */
    int bias;          /* 1: a bias whose gradient is reduced over depth and data (per step) */
    int cache_weights; /* 1: the gathered weight is kept from the first forward to backward */
    int64_t count;     /* how many such layers (>= 1) */
    int easy;          /* 1: easy layout (every rank its own tokens, full features; the layer
                          redistributes over the row x col plane), 0: expert layout */
    int kind;          /* axc_layer_kind (0: a Linear) */
    int tied;          /* embedding: its logits and cross_entropy run too (the tied output) */
    int stats;         /* norm: all-reduced statistics per call (LayerNorm 2, RMSNorm 1) */
    int64_t params;    /* replicated: elements; norm: full parameter elements (H or 2H) */
    int64_t rows;      /* embedding, not tied: ids looked up per rank per micro-batch when > 0
                          (a positional table: the sequence length), else the rank's tokens */
    int64_t seq;       /* tied embedding: > 0 when the loss drops the last token of each
                          sequence of `seq` tokens (the shifted causal-LM loss) */
    /* A Linear's own codecs (Linear.compression): for each group with own_codec set (col, row
     * or depth), codec/block replace the step's for this layer's collectives */
    int own_codec[AXC_MODEL_NGROUPS];
    axc_codec codec[AXC_MODEL_NGROUPS];
    int block[AXC_MODEL_NGROUPS];
} axc_layer_desc;

/* How one optimizer step runs. */
typedef struct axc_step_desc {
    int64_t tokens;        /* tokens (rows of X) of the whole job in one optimizer step */
    int grad_acc;          /* micro-batches per step (>= 1); tensor-parallel traffic per micro */
    int recompute;         /* 1: full activation recompute, the forward runs twice */
    axc_dtype dtype;       /* weights and activations on the wire */
    axc_dtype grad_dtype;  /* data-parallel gradient reduction (and bias reductions) */
    int fwd_chunks;        /* over-decomposition: forward all-reduce in this many row chunks */
    double ratio[AXC_MODEL_NGROUPS]; /* compressed/uncompressed bytes per group; 0 or 1 = none */
    /* Compressed collectives per group (init(compression=...); AXC_CODEC_NONE: exact; block 0:
     * the codec's default): col/row/depth compress a Linear's own float32 all-reduces,
     * reduce-scatters and all-gathers (axc_comm_apply_layer_codec), data the float32 gradient
     * buckets, whose wire bytes depend on the packing (axc_model_data_buckets). Exact: the
     * ratio of a group with a codec is ignored. */
    axc_codec codec[AXC_MODEL_NGROUPS];
    int block[AXC_MODEL_NGROUPS];
    int64_t bucket_bytes; /* gradient bucket size (init(bucket_size=); sync_gradients: 32 MiB) */
    int bucket_reverse;   /* 1: gradients enter the buckets last layer first (backward's
                             overlapped sums), 0: in layer order (sync_gradients) */
} axc_step_desc;

/* Fills the defaults: grad_acc 1, recompute 1, bf16, fp32 gradients, 1 chunk, no compression,
 * data gradients packed as init()'s default packs them (overlap on: 4 MiB, last layer first). */
void axc_step_desc_default(axc_step_desc *s);

/* One collective of a layer's step: `repeat` identical calls on group `group`. */
typedef struct axc_model_coll {
    axc_group_kind group;
    axc_coll_kind kind;
    size_t count; /* as in axc_coll: elements of one rank's piece */
    axc_dtype dtype;
    int64_t repeat;
    const char *what; /* static label, e.g. "fwd all-gather W" */
} axc_model_coll;

#define AXC_MODEL_MAX_COLLS 16

/* Lists the collectives one layer issues in one step on `grid` (one copy, count ignored).
 * Collectives on groups of size 1 are listed too (their volume is 0). Fails with a message
 * naming the values when the shapes or tokens do not divide over the grid. */
axc_status axc_model_layer_colls(const axc_grid *grid, const axc_layer_desc *layer,
                                 const axc_step_desc *step, axc_model_coll *out, int cap,
                                 int *n);

/* Bytes and calls per group for one rank. Arrays are indexed by axc_group_kind (0..3). */
typedef struct axc_volume {
    uint64_t sent[AXC_MODEL_NGROUPS], recv[AXC_MODEL_NGROUPS];
    uint64_t calls[AXC_MODEL_NGROUPS]; /* collectives on groups of size > 1 */
    uint64_t hops[AXC_MODEL_NGROUPS];  /* latency steps of the ring algorithms */
} axc_volume;

/* Adds to `vol` what global rank `rank` sends/receives for `layer` (times layer->count) in one
 * step. Exact (ratio 1) — compression ratios scale the sent/recv bytes of their group. */
axc_status axc_model_layer_volume(const axc_grid *grid, int rank, const axc_layer_desc *layer,
                                  const axc_step_desc *step, axc_volume *vol);

/* Replaces vol's data-group entries by the compressed data-parallel gradient sums of one step
 * of `layers` (in model order) when step->codec[data] is set and the gradients are float32:
 * every data all-reduce the layers list is a piece of a gradient bucket (with the depth
 * all-reduce before it of the same length: of the depth-then-data bucket), packed as
 * csrc/grads/buckets.c packs them (a bucket of max(piece, bucket_bytes / 4) elements per set of
 * groups, retired when the next piece does not fit), each bucket one compressed all-reduce of
 * the elements it holds. No-op otherwise (data sums are then additive per layer). */
axc_status axc_model_data_buckets(const axc_grid *grid, int rank, const axc_layer_desc *layers,
                                  int n_layers, const axc_step_desc *step, axc_volume *vol);

/* ---- machine profiles ---- */

#define AXC_MACHINE_MAX_ENTRIES 32

/* A measured bandwidth for a group of `size` members `stride` ranks apart inside one node. */
typedef struct axc_bw_entry {
    int stride, size;
    double gbps; /* GB/s (1e9 bytes/s) of ring volume per rank */
} axc_bw_entry;

typedef struct axc_machine {
    char name[64];
    int gpus_per_node;
    double mem_gib;          /* memory per GPU */
    double mem_reserve_gib;  /* not available to the model (context, NCCL, fragmentation) */
    double intra_gbps;       /* intra-node groups without a table entry */
    double inter_node_gbps;  /* injection bandwidth of one node, shared by its GPUs' groups */
    double alpha_intra_us, alpha_inter_us; /* latency per ring step */
    int n_entries;
    axc_bw_entry entries[AXC_MACHINE_MAX_ENTRIES];
} axc_machine;

/* Built-in profiles: "perlmutter", "frontier", "dgx-h100". AXC_ERR_INVALID names the known
 * ones when `name` is not one of them. */
axc_status axc_machine_builtin(const char *name, axc_machine *out);
/* i-th built-in name, NULL past the end. */
const char *axc_machine_builtin_name(int i);
/* Checks a (user) profile; the message names the offending field. */
axc_status axc_machine_validate(const axc_machine *m);

/* Bandwidth (bytes/s) and per-step latency (s) of a group of `size` ranks `stride` apart;
 * *inter set to 1 when the group spans nodes. */
void axc_machine_link(const axc_machine *m, int stride, int size, double *beta, double *alpha,
                      int *inter);

/* ---- whole models, memory, planner ---- */

typedef struct axc_model_desc {
    /* The linear layers (with counts). For a transformer, fill the transformer fields and call
     * axc_model_transformer(), which sets `layers`. */
    const axc_layer_desc *layers;
    int n_layers;
    /* batch */
    int64_t seq;          /* tokens per sample */
    int64_t global_batch; /* samples per optimizer step */
    int grad_acc;         /* micro-batches per step; 0 -> derived from micro_batch */
    int64_t micro_batch;  /* samples per data-parallel replica per micro-batch; 0 = unused */
    /* transformer shape (0 when the model is a plain list of layers) */
    int64_t blocks, hidden, heads, ffn, vocab;
    /* how a step runs (tokens and grad_acc in it are ignored: derived per grid) */
    axc_step_desc step;
    int optimizer_states; /* fp32 states per parameter: 2 for Adam (default), 0 for SGD */
} axc_model_desc;

/* Default description: Adam, axc_step_desc_default, grad_acc 1. */
void axc_model_desc_default(axc_model_desc *d);

#define AXC_TRANSFORMER_MAX_LAYERS 5
/* Sets d->layers to the block's QKV, out-proj (transposed), FC1, FC2 (transposed) with
 * count = blocks, plus the vocabulary projection when vocab > 0, stored in `storage`. */
axc_status axc_model_transformer(axc_model_desc *d,
                                 axc_layer_desc storage[AXC_TRANSFORMER_MAX_LAYERS]);

/* Memory per GPU, bytes. */
typedef struct axc_memory {
    double weights, grads, optimizer, gathered, activations, total;
} axc_memory;

/* One evaluated grid. */
typedef struct axc_plan_entry {
    int G_data, G_r, G_c, G_d;
    int grad_acc;
    int valid;  /* shapes and batch divide over the grid */
    int fits;   /* valid and memory.total <= usable memory */
    char reason[160]; /* why not valid / not fitting; "" otherwise */
    axc_volume vol;   /* of the rank with the most bytes (the last rank) */
    double time[AXC_MODEL_NGROUPS];
    double comm_time; /* sum of time[] (seconds per step); NaN-free, 0 when !valid */
    axc_memory mem;
} axc_plan_entry;

/* Evaluates `d` on one grid (entry->valid = 0 with a reason when it does not divide). */
axc_status axc_model_evaluate(const axc_model_desc *d, const axc_machine *m, const axc_grid *grid,
                              axc_plan_entry *entry);

/* Enumerates every (G_data, G_r, G_c, G_d) with product world_size, evaluates each and sorts:
 * fitting grids by time, then valid grids that do not fit, then invalid ones. *out is
 * malloc'd (free with axc_plan_free). Fails naming the values on bad input. */
axc_status axc_plan(const axc_model_desc *d, const axc_machine *m, int world_size,
                    axc_plan_entry **out, size_t *n);
void axc_plan_free(axc_plan_entry *entries);

#ifdef __cplusplus
}
#endif
#endif
