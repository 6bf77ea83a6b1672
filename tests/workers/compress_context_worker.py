"""optimize_communication(compression=...): the policy inside the context replaces init()'s for
the dimensions it names and is restored on exit. Launched by torchrun on 2 data-parallel ranks.

Checks the data group's compressed-sum counter around each step: none outside a context of an
uncompressed init, some inside compression="int8" (gradients identical on both ranks and
within int8's error of the exact mean), none inside compression={"data": None} of an init with
compression="int4", and the init's policy back after each context.
"""
import torch
from torch import nn

import axonn_c


def step(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).square().mean().backward()
    axonn_c.sync_gradients(model, mean=True)
    return [p.grad.clone() for p in model.parameters()]


def compressed_calls():
    return axonn_c.comm_stats()["data"]["compressed_calls"]


def exact_mean(grads):
    out = []
    for g in grads:
        t = g.clone()
        axonn_c.comm.all_reduce(t, group="data", op="avg")
        out.append(t)
    return out


def main():
    axonn_c.init(G_data=2)
    rank = axonn_c.grid().rank
    torch.manual_seed(0)
    model = nn.Sequential(axonn_c.Linear(16, 32), nn.GELU(), axonn_c.Linear(32, 8))
    torch.manual_seed(1 + rank)  # every rank its own data
    x = torch.randn(8, 16)

    before = compressed_calls()
    step(model, x)
    assert compressed_calls() == before, "an uncompressed init compressed a sum"
    with axonn_c.optimize_communication(compression="int8"):
        assert axonn_c.compression.session.compression["data"][0] == "int8"
        before = compressed_calls()
        for p in model.parameters():
            p.grad = None
        model(x).square().mean().backward()
        local = [p.grad.clone() for p in model.parameters()]
        got = step(model, x)
        assert compressed_calls() > before, "optimize_communication(compression='int8') did not compress"
        want = exact_mean(local)
        for g, w in zip(got, want):
            other = g.clone()
            axonn_c.comm.broadcast(other, src=0, group="data")
            assert torch.equal(g, other), "the replicas differ"
            bound = w.abs().max().item() / 127 * 2 + 1e-7
            assert (g - w).abs().max().item() <= bound, ((g - w).abs().max().item(), bound)
    assert axonn_c.compression.session.compression == {}, "the context did not restore the policy"
    before = compressed_calls()
    step(model, x)
    assert compressed_calls() == before, "compression stayed on after the context"
    axonn_c.finalize()

    axonn_c.init(G_data=2, compression="int4")
    before = compressed_calls()
    step(model, x)
    assert compressed_calls() > before, "init(compression='int4') did not compress"
    with axonn_c.optimize_communication(compression={"data": None}):
        before = compressed_calls()
        step(model, x)
        assert compressed_calls() == before, "compression={'data': None} did not turn it off"
    assert axonn_c.compression.session.compression["data"][0] == "int4"
    before = compressed_calls()
    step(model, x)
    assert compressed_calls() > before, "the init's int4 did not come back after the context"
    axonn_c.finalize()
    print(f"rank {rank}: compression context OK")


if __name__ == "__main__":
    main()
