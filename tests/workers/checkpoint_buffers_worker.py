"""Buffers that differ between data-parallel ranks (BatchNorm's running statistics, which
nothing sums) are saved as rank 0 holds them, every buffer of a module from that one rank,
whichever rank writes the replicated parameters."""
import sys

import torch

import axonn_c
import axonn_c.checkpoint as ckpt


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(axonn_c.Linear(3, 3), torch.nn.BatchNorm1d(3),
                               torch.nn.BatchNorm1d(3))


def main():
    g = axonn_c.init(G_data=2)
    m = model()
    with torch.no_grad():
        for i, bn in enumerate(m[1:]):
            bn.running_mean.fill_(10 * (g.rank + 1) + i)
            bn.running_var.fill_(20 * (g.rank + 1) + i)
            bn.num_batches_tracked.fill_(g.rank + 7)
    path = sys.argv[1] + "/c"  # (a directory every rank sees)
    ckpt.save(path, m)
    fresh = model()
    ckpt.load(path, fresh)
    for i, bn in enumerate(fresh[1:]):
        assert torch.equal(bn.running_mean, torch.full((3,), 10.0 + i)), bn.running_mean
        assert torch.equal(bn.running_var, torch.full((3,), 20.0 + i)), bn.running_var
        assert int(bn.num_batches_tracked) == 7
    axonn_c.finalize()
    if g.rank == 0:
        print("buffers as rank 0 holds them")


if __name__ == "__main__":
    main()
