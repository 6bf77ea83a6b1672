"""A deferred Linear backward that fails after its work was queued (AXONN_C_TEST_FAULT=
backward_keep: the keep-alive / record step, as out of memory there would): the call raises
its error, and the queued work (a deferred dW GEMM task, a deferred depth reduce-scatter) has
completed by then, so nothing is left reading or writing the tensors the failed call let go.
Before, the queued work stayed queued with its inputs freed (a use-after-free). A clean pass
afterwards gives the serial gradients."""
import os

import torch
from torch import nn

import axonn_c

# read once by C: present from the start, so the backward below can switch it on
os.environ["AXONN_C_TEST_FAULT"] = "none"
from linear_worker import shard_of
from sched_worker import H, close, tokens


class FailNext(torch.autograd.Function):
    """Identity; its backward turns the fault on, so the backward of the layer before it (in
    forward order) fails."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        os.environ["AXONN_C_TEST_FAULT"] = "backward_keep"
        return g


def check(g, sizes):
    what = f"grid {sizes} rank {g.rank}"
    torch.manual_seed(3)
    model = nn.ModuleList([axonn_c.Linear(H, 2 * H, expert_mode=True),
                           axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True)])
    ref = nn.ModuleList(nn.Linear(m.in_features, m.out_features) for m in model)
    with torch.no_grad():
        for r, m in zip(ref, model):
            r.weight.copy_(m.full_weight())
            r.bias.copy_(m.full_bias())
    # the layer whose backward leaves work queued: a dW GEMM task (G_d == 1: a layer without
    # dX reduction) or its depth reduce-scatter (G_d > 1: the last layer)
    target = 1 if g.G_intra_d > 1 else next(
        (i for i, m in enumerate(model) if m._shapes["gout_size"] == 1), None)
    assert target is not None, f"{what}: no layer defers its dW GEMM on this grid"
    s0, s1 = model[0]._shapes, model[1]._shapes
    kin = slice(s0["gin_rank"] * s0["k_local"], (s0["gin_rank"] + 1) * s0["k_local"])
    kout = slice(s1["gout_rank"] * s1["n_local"], (s1["gout_rank"] + 1) * s1["n_local"])
    X, dY, tok = tokens(g, 2 * g.G_data * g.G_intra_d, torch.Generator().manual_seed(5))
    x, dy = X[tok][:, kin].clone().requires_grad_(), dY[tok][:, kout].clone()

    before = axonn_c.scheduler_stats()
    h = x
    for i, layer in enumerate(model):
        h = layer(h)
        if i == target:
            h = FailNext.apply(h)
        h = torch.tanh(h)
    try:
        h.backward(dy)
        raise AssertionError(f"{what}: the backward did not raise")
    except MemoryError as e:
        assert "backward_keep" in str(e), e
    finally:
        del os.environ["AXONN_C_TEST_FAULT"]
    st = axonn_c.scheduler_stats()
    queued = st["tasks"] - before["tasks"] + st["deferred"] - before["deferred"]
    assert queued > 0, f"{what}: the failing backward queued nothing: {st}"
    assert st["tasks"] == st["tasks_run"], f"{what}: a queued dW GEMM outlived its call: {st}"
    assert st["pending"] == 0, f"{what}: a deferred collective outlived its call: {st}"
    assert st["results_held"] == st["results_done"], f"{what}: a held result is left: {st}"

    # the next pass drops the failed one's deferred gradients and matches serial PyTorch
    for m in model:
        m.weight.grad = m.bias.grad = None
    h = x
    for layer in model:
        h = torch.tanh(layer(h))
    h.backward(dy)
    h = X
    for r in ref:
        h = torch.tanh(r(h))
    h.backward(dY)
    for m, r in zip(model, ref):
        close(m.weight.grad, shard_of(r.weight.grad, m), torch.float32, f"{what} dW")
    st = axonn_c.scheduler_stats()
    assert st["tasks"] == st["tasks_run"] and not st["kept_tasks"], f"{what}: {st}"


def main():
    world = int(os.environ["WORLD_SIZE"])
    for sizes in [(1, world, 1, 1), (1, 1, 1, world)]:
        g = axonn_c.init(*sizes, overlap=True)
        check(g, sizes)
        axonn_c.finalize()
    print(f"world {world}: backward fault checks pass", flush=True)


if __name__ == "__main__":
    main()
