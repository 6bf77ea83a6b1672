"""Concurrent micro-batches (axonn_c.run_concurrent) against serial PyTorch: training steps on
several grids, 2 and 3 micro-batches of unequal sizes, overlap on and off; proof
that the micro-batches really run at once (a barrier inside fn that only concurrent threads
pass); the caller's autocast in the threads; the refusal of gradients already summed by an
overlapped backward."""
import os
import sys
import threading

import torch
from torch import nn

import axonn_c
from linear_worker import shard_of
from sched_worker import H, close, tokens


class Net(nn.Module):
    """Expert-layout pair (normal, transposed) twice; the biases take the gradient-hook path
    (registered at construction) that run_concurrent must bypass."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([
            axonn_c.Linear(H, 2 * H, expert_mode=True),
            axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True),
            axonn_c.Linear(H, 2 * H, expert_mode=True),
            axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True)])

    def forward(self, x, hook=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i % 2 == 0:
                x = torch.tanh(x)
            if i == 1 and hook is not None:
                hook()
        return x


def serial_copy(model):
    refs = [nn.Linear(m.in_features, m.out_features) for m in model.layers]
    with torch.no_grad():
        for r, m in zip(refs, model.layers):
            r.weight.copy_(m.full_weight())
            r.bias.copy_(m.full_bias())
    return refs


def serial_forward(refs, x):
    for i, r in enumerate(refs):
        x = r(x)
        if i % 2 == 0:
            x = torch.tanh(x)
    return x


def check_training(g, n, overlap, with_model):
    """Three SGD steps against serial PyTorch. with_model: run_concurrent(model=...) sums the
    gradients while the micro-batches run: every .grad is final when it returns, and
    sync_gradients changes nothing."""
    what = (f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} n={n} "
            f"overlap={overlap} model={with_model} rank {g.rank}")
    torch.manual_seed(5)
    model = Net()
    refs = serial_copy(model)
    ref_params = [p for r in refs for p in r.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref_params, lr=0.05)
    s = model.layers[0]._shapes
    kin = slice(s["gin_rank"] * s["k_local"], (s["gin_rank"] + 1) * s["k_local"])
    shards = g.G_data * g.G_intra_d
    gen = torch.Generator().manual_seed(9)
    for it in range(3):
        # 2n+1 tokens per shard: micro-batches of unequal size
        X, dY, tok = tokens(g, (2 * n + 1) * shards, gen)
        x, dy = X[tok][:, kin].clone(), dY[tok][:, kin].clone()
        inside = []

        def fn(xb, dyb):
            inside.append(threading.current_thread().name)
            y = model(xb)
            (y * dyb).sum().backward()
            return y.detach()

        ys = axonn_c.run_concurrent(fn, x, dy, model=model if with_model else None)
        assert len(ys) == n and len(set(inside)) == n, f"{what}: {len(set(inside))} threads"
        if with_model:
            before = [p.grad.clone() for p in model.parameters()]
            summed = [axonn_c.grads.summed_over(p) for p in model.parameters()]
        axonn_c.sync_gradients(model)
        if with_model:
            for b, p, done in zip(before, model.parameters(), summed):
                assert torch.equal(b, p.grad), f"{what}: sync_gradients changed a gradient"
                want = tuple(n for n in p._axonn_grad_groups if axonn_c.state.group_size(n) > 1)
                assert done == want, f"{what}: summed over {done}, expected {want}"
        (serial_forward(refs, X) * dY).sum().backward()
        with torch.no_grad():
            Y = serial_forward(refs, X)
        close(torch.cat(ys), Y[tok][:, kin], torch.float32, f"{what} step {it} output")
        for m, r in zip(model.layers, refs):
            close(m.weight.grad, shard_of(r.weight.grad, m), torch.float32, f"{what} step {it} dW")
            rows, _ = m._block_slices()
            close(m.bias.grad, r.bias.grad[rows], torch.float32, f"{what} step {it} db")
        opt.step()
        ref_opt.step()
        if it != 0:  # (step 1 accumulates onto step 0's synced gradients, as the serial one)
            opt.zero_grad()
            ref_opt.zero_grad()


def check_really_concurrent(g, n):
    """Each micro-batch waits between its layers until all n have reached that point: only
    micro-batches that run at once get past it (one after the other, the first would wait for
    ever, here: the barrier's timeout)."""
    torch.manual_seed(6)
    model = Net()
    barrier = threading.Barrier(n, timeout=60)
    x = torch.randn(2 * n, model.layers[0]._shapes["k_local"])
    axonn_c.timeline.start()
    axonn_c.run_concurrent(lambda xb: model(xb, hook=barrier.wait).sum().backward(), x)
    axonn_c.timeline.stop()
    axonn_c.sync_gradients(model)
    # the timeline tells the micro-batches apart: micro-batch i's GEMMs are on channel i + 1
    spans = axonn_c.timeline.spans()
    axonn_c.timeline.clear()
    gemm_channels = {s[6] for s in spans if s[0] == 0}
    assert gemm_channels == set(range(1, n + 1)), f"rank {g.rank}: {gemm_channels}"
    assert {s[6] for s in spans if s[0] == 1} <= set(range(n + 3)), spans


def check_shared_gathers(g, n):
    """The micro-batches share each depth all-gather (one per layer and phase; without sharing:
    n) and each dW reduce-scatter (one per layer, of the summed blocks; without: n); from the
    second call on, each gather is started one ahead in the learned order."""
    torch.manual_seed(8)
    model = Net()
    x = torch.randn(2 * n, model.layers[0]._shapes["k_local"])
    axonn_c.reset_comm_stats()
    axonn_c.run_concurrent(lambda xb: model(xb).sum().backward(), x)
    calls = axonn_c.comm_stats()["depth"]["calls"]
    want = 3 * len(model.layers)
    assert calls == want, f"rank {g.rank}: {calls} depth collectives, expected {want}"
    axonn_c.sync_gradients(model)
    # the next call prefetches along the learned order: every gather but the first is started
    # before any micro-batch asks for it
    axonn_c.run_concurrent(lambda xb: model(xb).sum().backward(), x)
    st = axonn_c.microbatches.last_gathers()
    assert st == {"gathers": 2 * len(model.layers), "prefetched": 2 * len(model.layers) - 1}, \
        f"rank {g.rank}: {st}"
    axonn_c.sync_gradients(model)


def fresh(g, label, seed):
    """A model (seeded), its serial copy, this rank's input columns, a data generator, and a
    label for messages."""
    what = f"{label} grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(seed)
    model = Net()
    s = model.layers[0]._shapes
    kin = slice(s["gin_rank"] * s["k_local"], (s["gin_rank"] + 1) * s["k_local"])
    return what, model, serial_copy(model), kin, torch.Generator().manual_seed(seed + 1)


def check_accumulation(g, n):
    """Gradient accumulation over two run_concurrent calls: the first inside no_sync() (nothing
    summed over ranks), the second with model= (its reducer sums the accumulated .grad once):
    the serial gradient of both batches."""
    what, model, refs, kin, gen = fresh(g, "accumulation", 12)

    def fn(xb, dyb):
        (model(xb) * dyb).sum().backward()

    for call in range(2):
        X, dY, tok = tokens(g, (2 * n + 1) * g.G_data * g.G_intra_d, gen)
        if call == 0:
            with axonn_c.no_sync():
                axonn_c.run_concurrent(fn, X[tok][:, kin], dY[tok][:, kin], model=model)
                axonn_c.sync_gradients(model)  # does nothing inside no_sync
        else:
            axonn_c.run_concurrent(fn, X[tok][:, kin], dY[tok][:, kin], model=model)
            axonn_c.sync_gradients(model)
        (serial_forward(refs, X) * dY).sum().backward()
    for m, r in zip(model.layers, refs):
        close(m.weight.grad, shard_of(r.weight.grad, m), torch.float32, f"{what} dW")
        rows, _ = m._block_slices()
        close(m.bias.grad, r.bias.grad[rows], torch.float32, f"{what} db")


def check_then_plain_backward(g, n, overlap):
    """A fresh model's first step: run_concurrent(model=) (its reducer sums and marks every
    .grad), then an ordinary backward into the same .grads, then sync_gradients: the serial
    gradient of both batches, replicated parameters included (was: a LayerNorm had no gradient
    hook before its first sync_gradients, so the plain backward's unsummed part was skipped,
    ~0.6x the gradient). A frozen parameter in the model is left alone (was: the reducer's hook
    registration raised on it)."""
    what = f"then-plain overlap={overlap} rank {g.rank}"
    W = g.world_size
    torch.manual_seed(5)
    ref = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    torch.manual_seed(5)
    par = torch.nn.Sequential(torch.nn.LayerNorm(8), axonn_c.Linear(8, 8), torch.nn.LayerNorm(8))
    for m in (ref, par):
        m[2].weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(6)
    xa, xb = torch.randn(W * 2 * n, 8, generator=gen), torch.randn(W * 2 * n, 8, generator=gen)
    mine = slice(g.rank * 2 * n, (g.rank + 1) * 2 * n)
    (ref(xa) ** 2).sum().backward()
    (ref(xb) ** 2).sum().backward()
    axonn_c.run_concurrent(lambda x: (par(x) ** 2).sum().backward(), xa[mine], model=par)
    (par(xb[mine]) ** 2).sum().backward()
    axonn_c.sync_gradients(par)
    got, want = dict(par.named_parameters()), dict(ref.named_parameters())
    assert got["2.weight"].grad is None, f"{what}: the frozen weight has a gradient"
    for name in ("0.weight", "0.bias", "1.weight", "1.bias", "2.bias"):
        close(got[name].grad, want[name].grad.reshape(got[name].grad.shape), torch.float32,
              f"{what} {name}")


def check_scatter_blocks_bounded(sizes, n):
    """Each shared dW reduce-scatter holds a summed, unsharded dW block. A finished one releases
    it at the next reduce-scatter of the call (not at the end of the call, which would hold the
    model's whole unsharded gradient), and past SCATTER_BLOCKS_IN_FLIGHT the oldest is waited
    for. Here the bound is 1 and every collective is padded to 20 ms: when layer i's
    reduce-scatter is issued, layer i + 1's is still in flight (a layer's backward takes far
    less), so the bound has to wait for it."""
    os.environ["AXONN_C_SIM_US"] = "20000"  # read by the shm backend at init
    try:
        g = axonn_c.init(*sizes, concurrent_microbatches=n)
    finally:
        del os.environ["AXONN_C_SIM_US"]
    torch.manual_seed(8)
    model = Net()
    x = torch.randn(2 * n, model.layers[0]._shapes["k_local"])
    cc = axonn_c.microbatches
    default, cc.SCATTER_BLOCKS_IN_FLIGHT = cc.SCATTER_BLOCKS_IN_FLIGHT, 1
    try:
        axonn_c.run_concurrent(lambda xb: model(xb).sum().backward(), x)
    finally:
        cc.SCATTER_BLOCKS_IN_FLIGHT = default
    axonn_c.sync_gradients(model)
    st = cc.last_scatters()
    assert st == {"reduce_scatters": len(model.layers), "peak_blocks": 1}, \
        f"rank {g.rank}: {st}, expected {len(model.layers)} reduce-scatters, 1 block held"
    axonn_c.finalize()


def check_autocast(g, n):
    """The caller's autocast reaches the micro-batch threads (autocast state is per thread): bf16
    outputs, and gradients (two calls: the second prefetches along the learned order, whose
    per-call casts are other tensors) within bf16 rounding of serial fp32 PyTorch."""
    what, model, refs, kin, gen = fresh(g, "autocast", 10)
    X, dY, tok = tokens(g, 2 * n * g.G_data * g.G_intra_d, gen)

    def fn(xb, dyb):
        y = model(xb)
        (y.float() * dyb).sum().backward()
        return y.detach()

    for _ in range(2):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys = axonn_c.run_concurrent(fn, X[tok][:, kin], dY[tok][:, kin], model=model)
        axonn_c.sync_gradients(model)
    assert all(y.dtype == torch.bfloat16 for y in ys), f"{what}: {[y.dtype for y in ys]}"
    # the learned gather order does not keep the calls' bf16 weight copies alive
    kept = axonn_c.microbatches.learned_weights()
    assert all(w is None or w.is_leaf for w in kept), f"{what}: per-call casts kept alive"
    (serial_forward(refs, X) * dY).sum().backward()
    for m, r in zip(model.layers, refs):
        want = shard_of(r.weight.grad, m)
        err = ((m.weight.grad.float() - want).norm() / want.norm()).item()
        assert err < 2e-2, f"{what}: dW off by {err:.3e} (relative) from serial fp32"


def check_after_depth_sync(g, n):
    """Micro-batches accumulating into .grads that sync_gradients_depth_parallel summed (expert
    layout, G_data = 1: that sync is the whole sum), mean=False and True, no zero_grad between,
    then a plain backward: each .grad is turned back into
    this rank's share as its first gradient comes (was, with mean=False: refused as "already
    summed"), and each depth sync gives the serial gradient of the steps so far. Also with
    run_concurrent(model=, expert_mode=True), whose reducer then sums over depth only, as the
    depth sync does (was: no expert_mode=, and a plain model's sums were the easy layout's, over
    every rank: on a grid with columns, each column's copy summed in)."""
    from axonn_c.parallel import sync_gradients_depth_parallel

    D = g.G_intra_d
    for mean, with_model in ((False, False), (True, False), (True, True)):
        what = f"after a depth sync (mean={mean}, model={with_model}) rank {g.rank}"
        torch.manual_seed(8)
        ref, par = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        par.load_state_dict(ref.state_dict())
        gen = torch.Generator().manual_seed(9)
        xs = [torch.randn(D * 2 * n, 8, generator=gen) for _ in range(3)]
        mine = slice(g.depth_rank * 2 * n, (g.depth_rank + 1) * 2 * n)
        for step, x in enumerate(xs):
            (ref(x) ** 2).sum().backward()
            if step == 1:
                axonn_c.run_concurrent(lambda xb: (par(xb) ** 2).sum().backward(), x[mine],
                                       **({"model": par, "expert_mode": True} if with_model
                                          else {}))
            else:
                (par(x[mine]) ** 2).sum().backward()
            sync_gradients_depth_parallel(par, mean=mean, expert_mode=True)
            for name, p in par.named_parameters():
                want = dict(ref.named_parameters())[name].grad / (D if mean else 1)
                close(p.grad, want, torch.float32, f"{what} step {step} {name}")


def check_random_sequences(g, n):
    """training_utils_worker's random sequences of backward passes, syncs, depth syncs,
    zero_grad and autograd.grad probes, with run_concurrent steps among them (without and with
    model=, whose reducer sums during the call): after every sync the serial sum times the last
    sync's scale. A run_concurrent is refused because .grad was already summed (an overlapped
    backward or a model= call, no sync or zero_grad(set_to_none=True) since) only then, and on
    every rank alike; both models then start over from zero_grad (what ran of the micro-batches
    is not the serial model's). init(overlap=True)'s overlaps stay on (overlap_data toggled)."""
    import random

    import training_utils_worker as tu

    ops = tu.RANDOM_OPS + ("concurrent", "concurrent_model", "concurrent_model")
    calls, refused = 0, 0
    for layout in ("easy", "expert"):
        for overlap in (False, True):
            for seed in range(2):
                rng = random.Random(7 + 100 * seed + 10 * overlap + (layout == "expert"))
                ser, par, shards, data = tu.random_sequence_models(g, layout, seed)
                seq = [rng.choice(ops) for _ in range(12)] + ["sync_mean"]
                what = f"random sequence {seq} ({layout}, overlap={overlap}, n={n})"
                may_refuse = False  # (a .grad summed over ranks and not synced since)
                with axonn_c.optimize_communication(
                        overlap_all_reduce=True, overlap_reduce_scatter=True,
                        overlap_all_gather=True, overlap_data=overlap):
                    for k, op in enumerate(seq):
                        batch_k = data(k)
                        if not op.startswith("concurrent"):
                            tu.random_sequence_op(g, op, ser, par, shards, batch_k,
                                                  f"{what}: op {k}")
                            if op in ("sync_sum", "sync_mean", "zero_none"):
                                may_refuse = False
                            elif op == "backward" and overlap:
                                may_refuse = True
                            continue
                        ser_loss, x, t, total = batch_k
                        kw = {"model": par, "expert_mode": layout == "expert"} \
                            if op == "concurrent_model" else {}
                        calls += 1
                        refusal = None
                        try:
                            axonn_c.run_concurrent(
                                lambda xb, tb: tu.loss_fn(par(xb), tb, False, total).backward(),
                                x, t, **kw)
                        except RuntimeError as e:
                            if "already summed" not in str(e):
                                raise
                            refusal = str(e)
                        everywhere = torch.tensor([float(refusal is not None)])
                        axonn_c.comm.all_reduce(everywhere)
                        if everywhere.item() not in (0.0, float(g.world_size)):
                            raise AssertionError(f"{what}: op {k} ({op}) refused on "
                                                 f"{int(everywhere.item())} ranks only")
                        if refusal is not None:
                            if not may_refuse:
                                raise AssertionError(f"{what}: op {k} ({op}) refused, no .grad "
                                                     f"summed since the last sync: {refusal}")
                            refused += 1
                            for m in (par, ser):
                                m.zero_grad(set_to_none=True)
                            may_refuse = False
                            continue
                        ser_loss().backward()
                        may_refuse = may_refuse or op == "concurrent_model"
    if g.rank == 0:
        print(f"random sequences on {g.G_data},{g.G_intra_r},{g.G_intra_c},{g.G_intra_d}: "
              f"{calls} run_concurrent calls, {refused} refused", flush=True)


def check_refuses_summed(g):
    """With overlap on, a plain backward sums .grad over data (or depth) during backward; adding
    unsummed micro-batch gradients to it would be wrong: refused until sync_gradients."""
    torch.manual_seed(7)
    model = Net()
    x = torch.randn(4, model.layers[0]._shapes["k_local"])
    model(x).sum().backward()
    try:
        axonn_c.run_concurrent(lambda xb: model(xb).sum().backward(), x)
    except RuntimeError as e:
        assert "sync_gradients" in str(e), str(e)
    else:
        raise AssertionError("run_concurrent accepted gradients already summed over ranks")
    axonn_c.sync_gradients(model)
    model.zero_grad()
    axonn_c.run_concurrent(lambda xb: model(xb).sum().backward(), x)  # fine afterwards
    axonn_c.sync_gradients(model)


def main():
    world = int(os.environ["WORLD_SIZE"])
    grids = [(1, 1, world, 1), (1, world, 1, 1), (1, 1, 1, world), (world, 1, 1, 1)]
    if world == 4:
        grids += [(1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 2, 2)]
    if world == 8:
        grids = [(2, 1, 2, 2), (1, 2, 2, 2)]
    for sizes in grids:
        for n, overlap, with_model in ((2, True, True), (3, False, False), (2, False, True)):
            g = axonn_c.init(*sizes, overlap=overlap, concurrent_microbatches=n)
            check_training(g, n, overlap, with_model)
            if g.G_intra_d > 1:
                check_shared_gathers(g, n)
            if n == 2 and not overlap:
                check_autocast(g, n)
            if n == 2 and g.G_data == g.world_size:
                check_then_plain_backward(g, n, overlap)
            if n == 2 and overlap:
                check_accumulation(g, n)
            if n == 2 and g.G_intra_d > 1 and g.G_data == 1:
                check_after_depth_sync(g, n)
            if overlap:
                check_really_concurrent(g, n)
            if n == 2 and overlap and with_model:
                check_random_sequences(g, n)
                if g.G_data > 1 or g.G_intra_d > 1:
                    check_refuses_summed(g)
            axonn_c.finalize()
        if sizes[3] > 1:
            check_scatter_blocks_bounded(sizes, 2)
    if int(os.environ["RANK"]) == 0:
        print(f"world {world}: concurrent micro-batch checks pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
