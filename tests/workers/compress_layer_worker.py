"""A layer's own compression (Linear.compression), launched by torchrun on 4 ranks over several
grids, overlap off and on (the scheduler's prefetched depth gathers):

- init without compression, the first layer compressing its depth/row/col collectives with int8:
  its outputs and gradients are within int8's error of the exact ones but not equal to them,
  its groups count compressed calls, and the data replicas of every parameter stay identical;
- init compressing every layer dimension with int4, the first layer turning all of them off and
  the second following init: the first layer's results are bitwise those of an uncompressed run
  (so its gathers, prefetched or not, and its activation collectives were exact), the second's
  are not.
"""
import os

import torch
from torch import nn

import axonn_c

GRIDS = [(1, 2, 1, 2), (1, 1, 2, 2), (2, 2, 1, 1)]
ALL_INT8 = {"depth": "int8", "row": "int8", "col": "int8"}
ALL_INT4 = {"depth": "int4", "row": "int4", "col": "int4"}
OFF = {"depth": None, "row": "none", "col": None}


def run(grid, overlap, init_policy, own):
    """Two steps of Linear -> tanh -> Linear on this rank's tokens; the outputs, input
    gradient and both layers' weight gradient shards of the second step, and comm_stats."""
    g = axonn_c.init(*grid, overlap=overlap, compression=init_policy)
    try:
        torch.manual_seed(0)
        l1, l2 = axonn_c.Linear(32, 64), axonn_c.Linear(64, 16)
        l1.compression = own
        gen = torch.Generator().manual_seed(100 + g.data_rank)
        out = None
        for _ in range(2):
            x = torch.randn(8, 32, generator=gen, requires_grad=True)
            h = torch.tanh(l1(x))
            y = l2(h)
            axonn_c.reset_comm_stats()
            (y.square().sum() + h.sum()).backward()
            axonn_c.sync_gradients(nn.ModuleList([l1, l2]))
            out = (h.detach(), y.detach(), x.grad, l1.weight.grad.clone(), l2.weight.grad.clone())
            for p in (*l1.parameters(), *l2.parameters()):  # replicas identical over data
                mine = p.grad.reshape(-1).contiguous()
                every = torch.empty(g.G_data * mine.numel())
                axonn_c.comm.all_gather(every, mine, group="data")
                assert all(torch.equal(o, mine) for o in every.view(g.G_data, -1)), grid
            l1.zero_grad(set_to_none=True)
            l2.zero_grad(set_to_none=True)
        return out, axonn_c.comm_stats(), g
    finally:
        axonn_c.finalize()


def close(a, b, rel):
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-6)


def main():
    for grid in GRIDS:
        for overlap in (False, True):
            what = f"grid {grid} overlap {overlap}"
            exact, _, _ = run(grid, overlap, None, None)
            h, y, dx, dw1, dw2 = exact
            own, stats, g = run(grid, overlap, None, ALL_INT8)
            groups = [n for n, size in (("row", g.G_intra_r), ("col", g.G_intra_c),
                                        ("depth", g.G_intra_d)) if size > 1]
            for n in groups:
                assert stats[n]["compressed_calls"] > 0, (what, n, stats[n])
            assert not torch.equal(own[0], h), f"{what}: layer 1's int8 changed nothing"
            for got, want, name in zip(own, exact, ("h", "y", "dx", "dw1", "dw2")):
                assert close(got, want, 0.05), f"{what}: {name} beyond int8's error"
            # init int4 everywhere, layer 1 off: layer 1 exact (h), layer 2 not (y)
            mixed, stats, _ = run(grid, overlap, ALL_INT4, OFF)
            assert torch.equal(mixed[0], h), f"{what}: layer 1's own 'off' was not exact"
            assert not torch.equal(mixed[1], y), f"{what}: layer 2 did not follow init's int4"
    if int(os.environ["RANK"]) == 0:
        print(f"compress_layer_worker: {len(GRIDS)} grids ok", flush=True)


if __name__ == "__main__":
    main()
