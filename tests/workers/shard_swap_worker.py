"""A weight whose storage is swapped between steps while the scheduler prefetches its depth
gather (G_intra_d = 2, overlap on): from step 3 on, the optimizer assigns every parameter a new
tensor (`p.data = p.data - lr * p.grad`, as `model.to()`, `.half()` or a checkpoint load would)
instead of updating it in place. The scheduler's prefetch of a layer's next call reads the
shard of its last call; with only the Parameter kept, the swap freed that storage under the
prefetch (ASan: heap-use-after-free in the gather, tests/run_asan_workers.sh). The runtime now
keeps the storage itself, and a prefetch of the old shard is dropped at the next call: every
step's output, dX and gradients equal serial PyTorch's."""
import os

import torch

import axonn_c
from sched_worker import Permuted, serial_copy, step

LR = 0.05


class SwapSGD:
    """SGD that gives each parameter a new storage per step from `swap_from` on (before it,
    updates in place, which only bumps the version)."""

    def __init__(self, params, swap_from):
        self.params = list(params)
        self.swap_from = swap_from
        self.steps = 0

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if self.steps >= self.swap_from:
                old = p.data.data_ptr()
                p.data = p.data - LR * p.grad
                assert p.data_ptr() != old, "the swap kept the storage"
            else:
                p.sub_(LR * p.grad)
        self.steps += 1

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def main():
    world = int(os.environ["WORLD_SIZE"])
    g = axonn_c.init(1, 1, 1, world, overlap=True)
    what = f"grid 1x1x1x{world} rank {g.rank}"
    torch.manual_seed(11)
    order = [2, 0, 3, 1]
    model = Permuted(order=order)
    refs = serial_copy(model)
    opt = SwapSGD(model.parameters(), swap_from=3)
    ref_opt = torch.optim.SGD(refs.parameters(), lr=LR)
    before = axonn_c.scheduler_stats()
    for i in range(8):
        step(g, model, refs, opt, ref_opt, order, 100 + i, f"{what} step {i}")
    st = axonn_c.scheduler_stats()
    # the learned order must have prefetched across the swaps, or nothing was tested
    assert st["prefetches"] - before["prefetches"] >= 8, f"{what}: no prefetches: {st}"
    axonn_c.finalize()
    print(f"world {world}: shard swap checks pass", flush=True)


if __name__ == "__main__":
    main()
