"""Multi-rank check that the communication model's bytes equal the transport's byte counters.

For every grid of the world size and a set of layers (normal and transposed, in != out, bias,
recompute, gradient accumulation, over-decomposition, cached weights), this rank issues exactly
the collectives the model lists for one step (axonn_c._C.model_layer_colls) through the
transport, then compares axonn_c.comm_stats() per group with the model's prediction for this
rank (axonn_c._C.model_volume). Launched by tests/test_plan.py under torchrun.
"""
import itertools
import os

import torch

import axonn_c
from common import assert_bytes_equal, grids
from axonn_c import _C, comm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64}

LAYERS = [
    dict(in_features=12, out_features=24),
    dict(in_features=24, out_features=12, transpose=1),
    dict(in_features=36, out_features=12, transpose=1, bias=1),
    dict(in_features=12, out_features=60, bias=1, cache_weights=1),
    dict(in_features=12, out_features=24, easy=1),
    dict(in_features=24, out_features=36, transpose=1, bias=1, easy=1),
    dict(kind="replicated", params=10, easy=1),
    dict(kind="replicated", params=10),
    dict(kind="embedding", in_features=10, out_features=12, tied=1),
    dict(kind="embedding", in_features=7, out_features=12, transpose=1),
    dict(kind="norm", out_features=12, params=24, stats=2),
    dict(kind="norm", out_features=12, params=12, stats=1, transpose=1),
]
STEPS = [
    dict(tokens=48, grad_acc=1, recompute=0),
    dict(tokens=96, grad_acc=2, recompute=1, grad_dtype="bfloat16"),
    dict(tokens=72, grad_acc=1, recompute=1, fwd_chunks=5),
]


def run_coll(c, G):
    dt = DTYPES[c["dtype"]]
    n = c["count"]
    for _ in range(c["repeat"]):
        if c["kind"] == "all_reduce":
            comm.all_reduce(torch.ones(n, dtype=dt), group=c["group"])
        elif c["kind"] == "all_gather":
            comm.all_gather(torch.empty(n * G, dtype=dt), torch.ones(n, dtype=dt),
                            group=c["group"])
        elif c["kind"] == "reduce_scatter":
            comm.reduce_scatter(torch.empty(n, dtype=dt), torch.ones(n * G, dtype=dt),
                                group=c["group"])
        elif c["kind"] == "all_to_all":
            comm.all_to_all(torch.empty(n * G, dtype=dt), torch.ones(n * G, dtype=dt),
                            group=c["group"])
        else:
            raise AssertionError(f"unexpected collective {c}")


def main():
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    checked = 0
    for grid in grids(world):
        g = axonn_c.init(G_data=grid[0], G_intra_r=grid[1], G_intra_c=grid[2], G_intra_d=grid[3])
        sizes = {"col": g.G_intra_c, "row": g.G_intra_r, "depth": g.G_intra_d,
                 "data": g.G_data, "intra": g.G_intra, "world": g.world_size}
        try:
            for layer, step in itertools.product(LAYERS, STEPS):
                try:
                    colls = _C.model_layer_colls(grid, layer, step)
                except ValueError:
                    continue  # shapes do not divide over this grid: same on every rank
                axonn_c.reset_comm_stats()
                for c in colls:
                    run_coll(c, sizes[c["group"]])
                stats = axonn_c.comm_stats()
                pred = _C.model_volume(grid, rank, [layer], step)
                assert_bytes_equal(stats, pred,
                                   f"rank {rank} grid {grid} layer {layer} step {step}")
                checked += 1
        finally:
            axonn_c.finalize()
    if rank == 0:
        print(f"model_worker: {checked} layer/step/grid cases equal on world {world}", flush=True)


if __name__ == "__main__":
    main()
