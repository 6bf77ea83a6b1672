"""sync_gradients_depth_parallel whose sum fails (a gradient that cannot be packed, on every
rank) marks nothing as summed, so a retry sums every gradient (2 ranks, G_intra_d=2, expert
layout: a plain parameter is summed over depth). Before, the marks were set before the sums ran:
the failed call left them marked "depth" and the retry skipped them (unsummed .grad)."""
import torch
from torch import nn

import axonn_c
from axonn_c import grads
from axonn_c.parallel import sync_gradients_depth_parallel


class _NoReshape(torch.Tensor):
    def reshape(self, *shape):
        raise RuntimeError("this gradient cannot be reshaped")


def main():
    g = axonn_c.init(G_intra_d=2)
    model = nn.Linear(3, 2)
    v = float(g.rank + 1)  # the depth sum: 1 + 2
    model.weight.grad = torch.full((2, 3), v)
    model.bias.grad = torch.full((2,), v).as_subclass(_NoReshape)
    try:
        sync_gradients_depth_parallel(model, expert_mode=True)
        raise AssertionError("the sum of an unpackable gradient did not raise")
    except RuntimeError as e:
        assert "cannot be reshaped" in str(e), e
    for name, p in model.named_parameters():
        assert grads.summed_over(p) == (), \
            f"rank {g.rank}: {name}'s .grad is marked {grads.summed_over(p)} after a failed sum"
    assert torch.equal(model.weight.grad, torch.full((2, 3), v)), "the failed sum changed .grad"
    model.bias.grad = torch.full((2,), v)
    sync_gradients_depth_parallel(model, expert_mode=True)  # the retry
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, torch.full_like(p.grad, 3.0)), \
            f"rank {g.rank}: the retry did not sum {name}: {p.grad}"
        assert grads.summed_over(p) == ("depth",), grads.summed_over(p)
    axonn_c.sync_gradients(model, expert_mode=True)  # (nothing left over depth: data has 1 rank)
    assert torch.equal(model.weight.grad, torch.full((2, 3), 3.0))
    axonn_c.finalize()
    print(f"rank {g.rank}: sync retry ok", flush=True)


if __name__ == "__main__":
    main()
