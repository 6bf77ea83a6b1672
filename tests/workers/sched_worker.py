"""The cross-layer scheduler against serial PyTorch: prefetch in the learned order (a model whose
execution order differs from its registration order), re-learning when the order changes, the
gathered-weight memory bound, the prefetch budget, deferred reduce-scatters and data-parallel
buckets completed by the end of backward, gradient accumulation with no_sync, shared weights,
and deferred dW GEMMs (defer_wgrad)."""
import argparse
import itertools
import os
import sys
import time

import torch
import torch.utils.checkpoint
from torch import nn

import axonn_c
from common import CallCount
from linear_worker import shard_of



def close(got, want, dtype, what):
    """Several optimizer steps on 8 ranks drift by a few ulps from the serial run; a stale
    prefetched weight (one learning-rate step old) would be off by ~1e-2."""
    del dtype
    got, want = got.double(), want.double()
    scale = want.abs().max().clamp_min(1e-12)
    if not torch.allclose(got / scale, want / scale, rtol=1e-4, atol=2e-5):
        raise AssertionError(f"{what}: max |diff| {(got - want).abs().max().item():.3e}, "
                             f"scale {scale.item():.3e}")

H = 32
NL = 4


class Pause(torch.autograd.Function):
    """Compute stand-in between layers (forward and backward): long enough for any prefetched
    gather of these small weights to finish, so the hit counts are deterministic."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(0.02)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.02)
        return g


class Permuted(nn.Module):
    """NL square layers registered 0..NL-1, run in `order` (G_r = G_c = 1: any order chains)."""

    def __init__(self, order, shared=False):
        super().__init__()
        self.layers = nn.ModuleList(axonn_c.Linear(H, H, expert_mode=True) for _ in range(NL))
        self.order = list(order)

    def forward(self, x):
        for i in self.order:
            x = Pause.apply(torch.tanh(self.layers[i](x)))
        return x


def serial_copy(model):
    refs = nn.ModuleList(nn.Linear(H, H) for _ in range(NL))
    with torch.no_grad():
        for ref, layer in zip(refs, model.layers):
            ref.weight.copy_(layer.full_weight())
            ref.bias.copy_(layer.full_bias())
    return refs


def serial_forward(refs, order, x):
    for i in order:
        x = torch.tanh(refs[i](x))
    return x


def tokens(g, T, gen):
    X = torch.randn(T, H, generator=gen)
    dY = torch.randn(T, H, generator=gen)
    shards = g.G_data * g.G_intra_d
    m = T // shards
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    return X, dY, slice(blk * m, (blk + 1) * m)


def compare_grads(model, refs, what):
    for layer, ref in zip(model.layers, refs):
        close(layer.weight.grad, shard_of(ref.weight.grad, layer), torch.float32, what + " dW")
        close(layer.bias.grad, ref.bias.grad, torch.float32, what + " db")


def step(g, model, refs, opt, ref_opt, order, seed, what):
    """One training step on both models; checks output, dX and every gradient."""
    gen = torch.Generator().manual_seed(seed)
    X, dY, tok = tokens(g, 4 * g.G_data * g.G_intra_d, gen)
    model.order = order
    x = X[tok].clone().requires_grad_()
    y = model(x)
    y.backward(dY[tok])
    axonn_c.sync_gradients(model)
    Xr = X.clone().requires_grad_()
    serial_forward(refs, order, Xr).backward(dY)
    close(y, serial_forward(refs, order, X).detach()[tok], torch.float32, what + " output")
    close(x.grad, Xr.grad[tok], torch.float32, what + " dX")
    compare_grads(model, refs, what)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()


def expected_prefetches(model, order):
    """(layer id, phase) of every gather issued ahead with k=1: each visit's successor, except
    the backward of the last forward layer (its forward gather is kept)."""
    ids = [model.layers[i]._sched_id for i in order]
    visits = [(i, "fwd") for i in ids] + [(i, "bwd") for i in reversed(ids)]
    return [v for prev, v in zip(visits, visits[1:]) if v[0] != prev[0]]


def check_prefetch_order(g):
    what = f"grid {g.G_data}x1x1x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(5)
    model = Permuted(order=[2, 0, 3, 1])
    refs = serial_copy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(refs.parameters(), lr=0.05)
    order = [2, 0, 3, 1]
    assert order != sorted(order)
    step(g, model, refs, opt, ref_opt, order, 1, what + " step 1 (learning)")
    axonn_c.scheduler_stats(reset=True)
    axonn_c._C.sched_log()
    # step 2: the learned order; the optimizer changed every weight in between
    step(g, model, refs, opt, ref_opt, order, 2, what + " step 2")
    st = axonn_c.scheduler_stats(reset=True)
    log = axonn_c._C.sched_log()
    issued = [(layer, phase) for ev, layer, phase in log if ev == "prefetch"]
    want = expected_prefetches(model, order)
    assert issued == want, f"{what}: prefetches issued {issued}, learned order implies {want}"
    visits = [(ev, layer, phase) for ev, layer, phase in log if ev != "prefetch"]
    first = (model.layers[order[0]]._sched_id, "fwd")
    assert [(v[1], v[2]) for v in visits if v[0] == "miss"] == [first], \
        f"{what}: only the step's first gather may miss, got {visits}"
    # every visit but the first was prefetched: complete when it started (a hit) or still in
    # flight (a wait) is timing, which another job on the machine changes
    assert st["hits"] + st["waits"] == 2 * NL - 1 and st["misses"] == 1, f"{what}: {st}"
    assert st["visits"] == 2 * NL, f"{what}: {st}"
    assert st["order_len"] == 2 * NL and st["stale"] == 0, f"{what}: {st}"
    assert st["peak_buffers"] <= 2, f"{what}: {st['peak_buffers']} gathered weights alive"
    layer_bytes = H * H * 4
    assert st["peak_bytes"] <= 2 * layer_bytes, f"{what}: peak {st['peak_bytes']} bytes"
    assert st["alive_buffers"] == 0, f"{what}: gathered weights outlive the step: {st}"
    # step 3: a different order is served correctly, then learned (step 4 prefetches it)
    new = [1, 3, 0, 2]
    step(g, model, refs, opt, ref_opt, new, 3, what + " step 3 (new order)")
    st = axonn_c.scheduler_stats(reset=True)
    assert st["off_order"] >= 1 and st["relearned"] == 1, f"{what}: {st}"
    axonn_c._C.sched_log()
    step(g, model, refs, opt, ref_opt, new, 4, what + " step 4")
    st = axonn_c.scheduler_stats(reset=True)
    issued = [(layer, phase) for ev, layer, phase in axonn_c._C.sched_log() if ev == "prefetch"]
    assert issued == expected_prefetches(model, new), f"{what}: {issued}"
    assert st["hits"] + st["waits"] == 2 * NL - 1 and st["misses"] == 1, f"{what}: {st}"
    assert st["off_order"] == 0, f"{what}: {st}"
    # caching keeps every forward gather for the backward: the counter sees all of them
    with axonn_c.optimize_communication(overlap_all_reduce=True, overlap_reduce_scatter=True,
                                        overlap_all_gather=True, cache_weights=True):
        step(g, model, refs, opt, ref_opt, new, 5, what + " cached")
        st = axonn_c.scheduler_stats(reset=True)
    assert st["peak_buffers"] == NL, f"{what}: cache_weights kept {st['peak_buffers']}"
    # a budget of one layer's gather: prefetches are refused, results unchanged
    axonn_c.state.configure_scheduler(1, layer_bytes, False)
    step(g, model, refs, opt, ref_opt, new, 6, what + " budget")
    st = axonn_c.scheduler_stats(reset=True)
    assert st["budget_skips"] > 0 and st["peak_buffers"] == 1, f"{what}: {st}"
    axonn_c.state.configure_scheduler(1, 0, False)


class MLP(nn.Module):
    """Expert-layout MLP (the paper's pair: normal then transposed), optionally applied twice
    (shared weights: each layer has two backward visits in one pass)."""

    def __init__(self, twice=False):
        super().__init__()
        self.fc1 = axonn_c.Linear(H, 2 * H, expert_mode=True)
        self.fc2 = axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True)
        self.twice = twice

    def forward(self, x):
        for _ in range(2 if self.twice else 1):
            x = self.fc2(torch.tanh(self.fc1(x)))
        return x


def serial_mlp(model):
    ref = nn.Sequential(nn.Linear(H, 2 * H), nn.Tanh(), nn.Linear(2 * H, H))
    with torch.no_grad():
        for r, layer in ((ref[0], model.fc1), (ref[2], model.fc2)):
            r.weight.copy_(layer.full_weight())
            r.bias.copy_(layer.full_bias())
    return ref


def check_accumulation(g, mode, twice=False):
    """Two micro-batches accumulated (`mode`: "no_sync" around the first, or "plain": both
    outside), then sync_gradients(mean=True): the serial mean gradient over all tokens."""
    what = (f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} {mode} twice={twice} "
            f"rank {g.rank}")
    torch.manual_seed(11)
    model = MLP(twice)
    ref = serial_mlp(model)
    shards = g.G_data * g.G_intra_d
    s1 = model.fc1._shapes
    kin = slice(s1["gin_rank"] * s1["k_local"], (s1["gin_rank"] + 1) * s1["k_local"])
    gen = torch.Generator().manual_seed(3)
    for micro in range(2):
        X, dY, tok = tokens(g, 3 * shards, gen)
        x = X[tok][:, kin].clone()
        y = model(x)
        if micro == 0 and mode == "no_sync":
            with axonn_c.no_sync():
                y.backward(dY[tok][:, kin])
        else:
            y.backward(dY[tok][:, kin])
        r = ref if not twice else (lambda t: ref(ref(t)))
        r(X).backward(dY)
    st = axonn_c.scheduler_stats()
    if g.G_data > 1 or g.G_intra_d > 1:
        assert st["deferred"] > 0, f"{what}: nothing was deferred: {st}"
    axonn_c.sync_gradients(model, mean=True)
    for layer, r in ((model.fc1, ref[0]), (model.fc2, ref[2])):  # mean: / token shards
        close(layer.weight.grad, shard_of(r.weight.grad, layer) / shards, torch.float32,
              what + " dW")
        rows, _ = layer._block_slices()
        close(layer.bias.grad, r.bias.grad[rows] / shards, torch.float32, what + " db")


def mlp_case(g, seed, data_seed):
    """An MLP, its serial copy, the global X/dY (2 tokens per shard) and this rank's x/dy."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(seed)
    model = MLP()
    ref = serial_mlp(model)
    s1 = model.fc1._shapes
    kin = slice(s1["gin_rank"] * s1["k_local"], (s1["gin_rank"] + 1) * s1["k_local"])
    X, dY, tok = tokens(g, 2 * g.G_data * g.G_intra_d, torch.Generator().manual_seed(data_seed))
    return what, model, ref, X, dY, X[tok][:, kin].clone(), dY[tok][:, kin]


def check_backward_completes(g):
    """With overlap on, .grad is final when backward() returns: summed over data already (the
    bucket all-reduce ran during backward) and sync_gradients does not sum it twice."""
    what, model, ref, X, dY, x, dy = mlp_case(g, 13, 4)
    model(x).backward(dy)
    ref(X).backward(dY)
    before = model.fc1.weight.grad.clone()
    close(before, shard_of(ref[0].weight.grad, model.fc1), torch.float32,
          what + " dW straight after backward")
    # the biases (a gradient hook's bucket, summed over depth and data during backward) too
    rows, _ = model.fc2._block_slices()
    db = model.fc2.bias.grad.clone()
    close(db, ref[2].bias.grad[rows], torch.float32, what + " db straight after backward")
    axonn_c.sync_gradients(model)
    assert torch.equal(model.fc1.weight.grad, before), f"{what}: sync_gradients changed dW"
    assert torch.equal(model.fc2.bias.grad, db), f"{what}: sync_gradients changed db"


def check_autograd_grad(g):
    """torch.autograd.grad on parameters with overlap on hands their gradients back (the same as
    with the gradient overlap off) and leaves .grad alone; a later backward is still complete."""
    what, model, ref, X, dY, x, dy = mlp_case(g, 19, 6)
    params = [model.fc1.weight, model.fc2.bias]
    got = torch.autograd.grad(model(x), params, grad_outputs=dy)
    with axonn_c.optimize_communication(overlap_reduce_scatter=False, overlap_data=False):
        want = torch.autograd.grad(model(x), params, grad_outputs=dy)
    for a, b, name in zip(got, want, ("dW", "db")):
        assert a is not None, f"{what}: autograd.grad returned no {name}"
        assert torch.equal(a, b), f"{what}: autograd.grad {name} differs with overlap on"
    assert all(p.grad is None for p in params), f"{what}: autograd.grad set .grad"
    model(x).backward(dy)
    ref(X).backward(dY)
    close(model.fc1.weight.grad, shard_of(ref[0].weight.grad, model.fc1), torch.float32,
          what + " dW after autograd.grad")


def check_checkpoint(g):
    """Under torch.utils.checkpoint(use_reentrant=False) the backward's saved weight is a
    recomputed alias of the Parameter: the deferred gradient must still land in the
    Parameter's .grad."""
    what, model, ref, X, dY, x, dy = mlp_case(g, 29, 11)
    y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    (y * dy).sum().backward()
    axonn_c.sync_gradients(model)
    (ref(X) * dY).sum().backward()
    for layer, r in ((model.fc1, ref[0]), (model.fc2, ref[2])):
        assert layer.weight.grad is not None, f"{what}: checkpoint: no dW"
        close(layer.weight.grad, shard_of(r.weight.grad, layer), torch.float32,
              what + " checkpoint dW")


class Boom(torch.autograd.Function):
    """Identity whose backward raises: a pass that fails halfway."""

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g_):
        raise RuntimeError("boom")


def check_weight_other_use(g):
    """A deferred Linear weight that also gets a gradient through autograd in the same pass (a
    regulariser on it, the same as a tied use): that gradient is added, not overwritten by the
    deferred one, and summed over data like the rest. The regulariser is taken before or after
    the forward, with a no_sync micro-batch or not, with the layer's overlap_data on or off;
    against serial PyTorch, where it is sum(W * R) on the full weight (each data rank takes its
    share). The first micro-batch's autograd part is added after the pending deferred one,
    without completing the pass's pending work early: finish() runs once, at the end."""
    what, model, ref, X, dY, x, dy = mlp_case(g, 23, 9)
    gen = torch.Generator().manual_seed(5)
    R1 = torch.randn(ref[0].weight.shape, generator=gen)
    R2 = torch.randn(ref[2].weight.shape, generator=gen)
    r1, r2 = shard_of(R1, model.fc1), shard_of(R2, model.fc2)

    def regulariser():
        return ((model.fc1.weight * r1).sum() + (model.fc2.weight * r2).sum()) / g.G_data

    finishes = CallCount(axonn_c._C.grad_finishes)  # (the gradient hooks and the end of backward)
    try:
        for when, mode, ov_data in itertools.product(("before", "after"), ("no_sync", "plain"),
                                                     (True, False)):
            case = f"{what} regulariser {when} forward, {mode}, overlap_data={ov_data}"
            model.fc1.overlap_data = ov_data
            for m in (model.fc1, model.fc2, ref[0], ref[2]):
                m.weight.grad = m.bias.grad = None
            for micro in range(2):
                reg = regulariser() if when == "before" else None
                loss = (model(x) * dy).sum()
                loss = loss + (reg if reg is not None else regulariser())
                finishes.clear()
                if micro == 0 and mode == "no_sync":
                    with axonn_c.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                if micro == 0:
                    assert len(finishes) == 1, f"{case}: finish() ran {len(finishes)} times"
                if micro == 1 and not ov_data and g.G_data > 1:  # the layer's knob holds
                    w = model.fc1.weight
                    assert not axonn_c.grads.summed_over(w), \
                        f"{case}: fc1's dW was summed during backward"
                ((ref(X) * dY).sum() + (ref[0].weight * R1).sum()
                 + (ref[2].weight * R2).sum()).backward()
            axonn_c.sync_gradients(model)
            for layer, r in ((model.fc1, ref[0]), (model.fc2, ref[2])):
                close(layer.weight.grad, shard_of(r.weight.grad, layer), torch.float32,
                      case + " dW")
    finally:
        model.fc1.overlap_data = None

    # a pass that raises after the regulariser's gradients arrived: the half pass is dropped,
    # each weight's .grad is the one from before the pass (or what the caller set meanwhile)
    for caller_clears in (False, True):  # (then fc1 had no .grad before the pass)
        before = [torch.full_like(model.fc1.weight, 0.5) if caller_clears else None,
                  torch.full_like(model.fc2.weight, 0.5)]
        model.fc1.weight.grad, model.fc2.weight.grad = before
        loss = (model(Boom.apply(x.clone().requires_grad_())) * dy).sum() + regulariser()
        try:
            loss.backward()
            raise AssertionError(f"{what}: the backward did not raise")
        except RuntimeError as e:
            assert "boom" in str(e), e
        if caller_clears:
            model.fc1.weight.grad = None  # the caller's choice stays
        axonn_c.grads.drop_if_abandoned()
        assert model.fc1.weight.grad is None, f"{what}: a dropped pass left fc1 a .grad"
        assert model.fc2.weight.grad is before[1], f"{what}: fc2's .grad from before the pass lost"
    model.fc2.weight.grad = None


class Scaled(nn.Module):
    """Easy layout with a replicated parameter of its own (summed over "world")."""

    def __init__(self, twice=False):
        super().__init__()
        self.twice = twice
        self.boom = False  # a Boom in front of everything: the pass raises at its very end
        self.alpha = nn.Parameter(torch.tensor([0.7]))
        self.fc1 = axonn_c.Linear(H, 2 * H)
        self.fc2 = axonn_c.Linear(2 * H, H, transpose=True)

    def forward(self, x):
        if self.twice:  # alpha also inside a reentrant checkpoint: two gradients in one pass
            x = torch.utils.checkpoint.checkpoint(lambda t: self.alpha * t,
                                                  x.requires_grad_(), use_reentrant=True)
        if self.boom:
            x = Boom.apply(x)
        return self.fc2(torch.tanh(self.fc1(self.alpha * x)))


def check_replicated_hooks(g, twice=False):
    """A model's other parameters are summed during backward from the second step on (the first
    sync_gradients registers them): .grad of the replicated `alpha` is final straight after
    backward, and each step equals serial PyTorch with or without accumulation (`twice`: alpha
    gets two gradients per pass, one from a reentrant checkpoint's inner backward)."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} twice={twice} rank {g.rank}"
    torch.manual_seed(17)
    model = Scaled(twice)
    ref_fc = serial_mlp(model)
    alpha_ref = nn.Parameter(torch.tensor([0.7]))
    gen = torch.Generator().manual_seed(5)
    per = 2
    sl = slice(g.rank * per, (g.rank + 1) * per)
    for it, micro in enumerate((1, 1, 2)):  # the last step accumulates two micro-batches
        for p in list(model.parameters()) + list(ref_fc.parameters()) + [alpha_ref]:
            p.grad = None
        for m in range(micro):
            X = torch.randn(g.world_size * per, H, generator=gen)
            dY = torch.randn(g.world_size * per, H, generator=gen)
            if m + 1 < micro:
                with axonn_c.no_sync():
                    model(X[sl]).backward(dY[sl])
            else:
                model(X[sl]).backward(dY[sl])
            ref_fc(alpha_ref * (alpha_ref * X if twice else X)).backward(dY)
        if it > 0 and g.world_size > 1:
            close(model.alpha.grad, alpha_ref.grad, torch.float32,
                  f"{what} step {it}: alpha straight after backward")
        axonn_c.sync_gradients(model)
        close(model.alpha.grad, alpha_ref.grad, torch.float32, f"{what} step {it}: alpha")
        close(model.fc1.bias.grad, ref_fc[0].bias.grad, torch.float32, f"{what} step {it}: db")


def check_abandoned_summed_hook(g):
    """A pass that raises after the replicated parameters' gradients were accumulated into
    .grad tensors summed during the previous backward (no sync_gradients between): the summed
    .grad must not be taken for the total. sync_gradients then sums the failed pass's part too,
    as with the overlap off."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(17)
    model = Scaled()
    ref_fc = serial_mlp(model)
    alpha_ref = nn.Parameter(torch.tensor([0.7]))
    gen = torch.Generator().manual_seed(6)
    per = 2
    sl = slice(g.rank * per, (g.rank + 1) * per)
    for it in range(3):  # 0 registers the hooks; 1 sums during backward; 2 raises
        X = torch.randn(g.world_size * per, H, generator=gen)
        dY = torch.randn(g.world_size * per, H, generator=gen)
        model.boom = it == 2
        try:
            model(X[sl].clone().requires_grad_()).backward(dY[sl])
            assert it < 2, f"{what}: the backward did not raise"
        except RuntimeError as e:
            assert it == 2 and "boom" in str(e), e
        ref_fc(alpha_ref * X).backward(dY)
        if it == 0:
            axonn_c.sync_gradients(model)
            for p in list(model.parameters()) + list(ref_fc.parameters()) + [alpha_ref]:
                p.grad = None
    model.boom = False
    if g.world_size > 1:
        assert axonn_c.grads.summed_over(model.alpha) == (), \
            f"{what}: alpha's .grad holds the failed pass's unsummed part but is marked summed"
    axonn_c.sync_gradients(model)  # (drops the failed pass's deferred weight gradients)
    close(model.alpha.grad, alpha_ref.grad, torch.float32, f"{what} abandoned pass: alpha")
    close(model.fc1.bias.grad, ref_fc[0].bias.grad, torch.float32,
          f"{what} abandoned pass: fc1 bias")


class Probe(torch.autograd.Function):
    """Identity; its backward notes the scheduler's deferred-task counts (tasks queued, run) and
    the tensors still kept for them, at that point of the backward pass."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        st = axonn_c.scheduler_stats()
        ctx.log.append((st["tasks"], st["tasks_run"], st["kept_tasks"]))
        return g, None


def check_deferred_wgrad(g):
    """defer_wgrad (on with overlap=True): a layer whose backward has no dX reduction (its
    output group has one rank) hands its dW GEMM on, and the next layer that reduces dX runs
    the queued GEMMs, its own included, while that reduction is in flight. Checked after each
    layer's backward: how many dW GEMMs are still queued. Gradients: serial PyTorch, and
    bitwise those of the same model with defer_wgrad off; all tasks done (and their tensors
    let go) when backward returns; a second backward accumulates. With G_d > 1 nothing is
    deferred (dW's reduce-scatter should start early)."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"

    def build():
        torch.manual_seed(21)
        return nn.ModuleList([axonn_c.Linear(H, 2 * H, expert_mode=True),
                              axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True),
                              axonn_c.Linear(H, 2 * H, expert_mode=True),
                              axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True)])

    def run(layers, x, dy, log):
        h = x
        for layer in layers:
            h = torch.tanh(layer(Probe.apply(h, log)))
        h.backward(dy)

    model, plain = build(), build()
    for layer in plain:
        layer.defer_wgrad = False
    ref = nn.ModuleList(nn.Linear(m.in_features, m.out_features) for m in model)
    with torch.no_grad():
        for r, m in zip(ref, model):
            r.weight.copy_(m.full_weight())
            r.bias.copy_(m.full_bias())
    s0 = model[0]._shapes
    kin = slice(s0["gin_rank"] * s0["k_local"], (s0["gin_rank"] + 1) * s0["k_local"])
    s3 = model[3]._shapes
    kout = slice(s3["gout_rank"] * s3["n_local"], (s3["gout_rank"] + 1) * s3["n_local"])
    shards = g.G_data * g.G_intra_d
    X, dY, tok = tokens(g, 3 * shards, torch.Generator().manual_seed(8))
    x, dy = X[tok][:, kin].clone().requires_grad_(), dY[tok][:, kout].clone()
    for rnd in range(2):  # the second accumulates into .grad
        log = []
        t0 = axonn_c.scheduler_stats()["tasks"]
        run(model, x, dy, log)
        t1 = axonn_c.scheduler_stats()["tasks"]
        run(plain, x, dy, [])
        assert axonn_c.scheduler_stats()["tasks"] == t1, f"{what}: defer_wgrad=False deferred"
        h = X
        for r in ref:
            h = torch.tanh(r(h))
        h.backward(dY)
        # log[i]: after the backward of layers[3 - i] (the probes fire in reverse order)
        queued = [tasks - done for tasks, done, _ in log]
        want, expect = [], 0
        for layer in reversed(model):  # a layer whose dX is all-reduced runs the queue
            expect = 0 if layer._shapes["gout_size"] > 1 else expect + 1
            want.append(expect)
        n_tasks = 4
        if g.G_intra_d > 1:  # a dW followed by a depth reduce-scatter is never deferred
            want, n_tasks = [0] * 4, 0
        assert queued == want, f"{what}: dW GEMMs queued after each layer {queued}, want {want}"
        assert log[-1][0] - t0 == n_tasks, \
            f"{what}: {log[-1][0] - t0} dW GEMMs deferred, want {n_tasks}"
        assert all(keeps <= 2 for *_, keeps in log), f"{what}: tensors kept piled up: {log}"
        st = axonn_c.scheduler_stats()
        assert st["tasks"] == st["tasks_run"], f"{what}: tasks left after backward: {st}"
        assert not st["kept_tasks"], f"{what}: tensors still kept after backward"
        if any(m._shapes["gout_size"] == 1 for m in model) and g.G_intra_d == 1:
            assert max(want) >= 1, f"{what}: the model defers nothing on this grid"
        for m, p, r in zip(model, plain, ref):
            if rnd == 0:  # (accumulating, the deferred GEMM folds .grad in with beta = 1)
                assert torch.equal(m.weight.grad, p.weight.grad), \
                    f"{what}: dW with defer_wgrad differs from without"
                assert torch.equal(m.bias.grad, p.bias.grad), f"{what}: db differs"
            close(m.weight.grad, shard_of(r.weight.grad, m), torch.float32,
                  f"{what} round {rnd} dW")
            rows, _ = m._block_slices()
            close(m.bias.grad, r.bias.grad[rows], torch.float32, f"{what} round {rnd} db")
    # the context turns it off for the layers run inside it
    t0 = axonn_c.scheduler_stats()["tasks"]
    with axonn_c.optimize_communication(overlap_all_reduce=True, defer_wgrad=False):
        run(model, x, dy, [])
    assert axonn_c.scheduler_stats()["tasks"] == t0, f"{what}: deferred inside the context"

    # a backward that raises halfway (after a layer queued its dW GEMM), then a clean step: the
    # clean step's gradients are the serial ones (the aborted pass's are dropped, its queued
    # GEMMs run before their tensors go)
    h = torch.tanh(model[0](Probe.apply(x, [])))
    h = torch.tanh(model[1](Boom.apply(h)))
    for layer in model[2:]:
        h = torch.tanh(layer(h))
    try:
        h.backward(dy)
        raise AssertionError(f"{what}: the backward did not raise")
    except RuntimeError as e:
        assert "boom" in str(e), e
    for m, r in zip(model, ref):
        m.weight.grad = m.bias.grad = r.weight.grad = r.bias.grad = None
    # sync_gradients straight after (a micro-batch loop that caught the error): the half
    # pass's deferred weight gradients are dropped, not set
    axonn_c.sync_gradients(model)
    assert all(m.weight.grad is None for m in model), f"{what}: stale dW after sync_gradients"
    run(model, x, dy, [])
    h = X
    for r in ref:
        h = torch.tanh(r(h))
    h.backward(dY)
    st = axonn_c.scheduler_stats()
    assert st["tasks"] == st["tasks_run"] and not st["kept_tasks"], f"{what}: {st}"
    for m, r in zip(model, ref):
        close(m.weight.grad, shard_of(r.weight.grad, m), torch.float32, f"{what} after abort dW")


def main():
    p = argparse.ArgumentParser()
    p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    grids = [(1, 1, 1, world)]
    if world % 2 == 0 and world > 2:
        grids.append((2, 1, 1, world // 2))
    for sizes in grids:
        g = axonn_c.init(*sizes, overlap=True)
        check_prefetch_order(g)
        axonn_c.finalize()
    mlp_grids = [(world, 1, 1, 1), (1, 1, 1, world)]
    if world % 2 == 0 and world > 2:
        mlp_grids += [(2, 1, 1, world // 2), (2, 1, world // 2, 1), (1, 2, 1, world // 2)]
    for sizes in mlp_grids:
        g = axonn_c.init(*sizes, overlap=True, bucket_size=H * H * 4)  # several buckets
        for mode in ("no_sync", "plain"):
            check_accumulation(g, mode)
        check_accumulation(g, "no_sync", twice=True)
        check_backward_completes(g)
        check_autograd_grad(g)
        check_weight_other_use(g)
        check_checkpoint(g)
        axonn_c.finalize()
    defer_grids = [(1, world, 1, 1), (1, 1, world, 1)]
    if world % 2 == 0 and world > 2:
        defer_grids += [(1, 2, world // 2, 1), (2, world // 2, 1, 1), (1, world // 2, 1, 2)]
    for sizes in defer_grids:
        g = axonn_c.init(*sizes, overlap=True)
        check_deferred_wgrad(g)
        check_weight_other_use(g)
        axonn_c.finalize()
    for sizes in [(world, 1, 1, 1), (1, 1, world, 1)]:  # easy layout, summed over "world"
        g = axonn_c.init(*sizes, overlap=True)
        check_replicated_hooks(g)
        check_replicated_hooks(g, twice=True)
        check_abandoned_summed_hook(g)
        axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print(f"world {world}: scheduler checks pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
