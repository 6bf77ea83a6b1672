"""Multi-rank checks of the training utilities around axonn_c.Linear, launched by torchrun.

For every grid given: sync_gradients (sum and mean, easy and expert layout) against the serial
model's gradients, clip_grad_norm_ against torch's on the serial model, full_state_dict against
the serial state dict, load_state_dict of a serial and of a sharded state dict,
auto_parallelize's swap/keep/warn behaviour, and copies of a model (deepcopy, torch.save/load)
that train like the original. Every comparison is float32, rtol 1e-5, atol 1e-6.
"""
import argparse
import copy
import io
import itertools
import math
import random
import warnings

import torch
from torch import nn
from torch.nn import functional as F

import axonn_c
from axonn_c import comm
from axonn_c.parallel import sync_gradients_depth_parallel

RTOL, ATOL = 1e-5, 1e-6


def close(a, b, what):
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != {list(b.shape)}")
    if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
        err = (a - b).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err:.3e}, max |ref| "
                             f"{b.abs().max().item():.3e} (rank {axonn_c.grid().rank})")


def shard_weight(layer, full):
    """This rank's depth shard of the full [out, in] tensor, by docs/linear.md's layout."""
    s = layer._shapes
    rows = slice(s["gout_rank"] * s["n_local"], (s["gout_rank"] + 1) * s["n_local"])
    cols = slice(s["gin_rank"] * s["k_local"], (s["gin_rank"] + 1) * s["k_local"])
    flat = full[rows, cols].reshape(-1)
    padded = flat.new_zeros(s["shard"] * s["depth_size"])
    padded[: flat.numel()] = flat
    d = axonn_c.grid().depth_rank
    return padded[d * s["shard"]:(d + 1) * s["shard"]]


def shard_bias(layer, full):
    s = layer._shapes
    return full[s["gout_rank"] * s["n_local"]:(s["gout_rank"] + 1) * s["n_local"]]


# ------------------------------------------------------------------------- models

class EasyMLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear(transpose) -> LayerNorm -> Linear(no bias)."""

    def __init__(self, lin):
        super().__init__()
        self.ln_in = nn.LayerNorm(16)
        self.fc1 = lin(16, 32)
        self.fc2 = lin(32, 24, transpose=True)
        self.ln_out = nn.LayerNorm(24)
        self.head = lin(24, 8, bias=False)

    def forward(self, x):
        return self.head(self.ln_out(self.fc2(F.gelu(self.fc1(self.ln_in(x))))))


class _GatherCols(torch.autograd.Function):
    """Expert layout -> full features: all-gather the feature blocks over a group; the gradient
    downstream is the same on every member, so backward keeps this member's block."""

    @staticmethod
    def forward(ctx, x, group, index, size):
        ctx.index, ctx.f = index, x.shape[-1]
        out = x.new_empty((size,) + tuple(x.shape))
        comm.all_gather(out, x.contiguous(), group=group)
        return out.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.index * ctx.f:(ctx.index + 1) * ctx.f], None, None, None


class ExpertMLP(nn.Module):
    """Linear -> GELU -> Linear(transpose) in the expert layout, then the features gathered and
    a replicated LayerNorm (input: [tokens / (G_data G_d), 16 / G_c])."""

    def __init__(self, lin, parallel):
        super().__init__()
        kw = {"expert_mode": True} if parallel else {}
        self.parallel = parallel
        self.fc1 = lin(16, 32, **kw)
        self.fc2 = lin(32, 24, transpose=True, **kw)
        self.ln = nn.LayerNorm(24)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        if self.parallel:
            g = axonn_c.grid()
            y = _GatherCols.apply(y, "col", g.col_rank, g.G_intra_c)
        return self.ln(y)


def serial_lin(i, o, bias=True, transpose=False):
    return nn.Linear(i, o, bias=bias)


def parallel_lin(i, o, bias=True, transpose=False, expert_mode=False):
    return axonn_c.Linear(i, o, bias=bias, transpose=transpose, expert_mode=expert_mode)


def randomize_norms(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=gen))


def compare_grads(par, ser, what):
    pmods = dict(par.named_modules())
    for name, p in ser.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        layer = pmods[mod_name]
        got = getattr(layer, pname).grad
        want = p.grad
        if got is None or want is None:  # (a parameter frozen since a zero_grad: in both)
            if got is not None or want is not None:
                raise AssertionError(f"{what}: grad of {name} is None in one model only")
            continue
        if isinstance(layer, axonn_c.Linear):
            want = shard_weight(layer, want) if pname == "weight" else shard_bias(layer, want)
        close(got, want, f"{what}: grad of {name}")


def compare_full(par, ser, what):
    full = axonn_c.full_state_dict(par)
    ref = ser.state_dict()
    if list(full) != list(ref):
        raise AssertionError(f"{what}: keys {list(full)} != serial {list(ref)}")
    for k in ref:
        close(full[k], ref[k], f"{what}: {k}")


# ------------------------------------------------------------------------- checks

def loss_fn(out, target, mean, n_global):
    """mean: the per-rank mean (sync_gradients(mean=True) turns it into the global mean);
    else a per-rank sum scaled by a constant so the gradients stay O(1) (summed by
    sync_gradients(mean=False) into the gradient of the global sum)."""
    if mean:
        return F.mse_loss(out, target)
    return F.mse_loss(out, target, reduction="sum") / n_global


def easy_pair(seed, norm_seed):
    """The serial EasyMLP and the parallel one with the same weights."""
    models = []
    for lin in (serial_lin, parallel_lin):
        torch.manual_seed(seed)
        models.append(EasyMLP(lin))
        randomize_norms(models[-1], norm_seed)
    return models


def check_easy(g, mean):
    world = g.world_size
    ser, par = easy_pair(11, 5)
    compare_full(par, ser, "easy: seeded construction")
    # loading the serial state dict must give the same model too
    with torch.no_grad():
        for p in par.parameters():
            p.zero_()
    par.load_state_dict(ser.state_dict())
    compare_full(par, ser, "easy: load of the serial state dict")

    gen = torch.Generator().manual_seed(7)
    b = 3
    x = torch.randn(world * b, 2, 16, generator=gen)
    t = torch.randn(world * b, 2, 8, generator=gen)
    loss_fn(ser(x), t, mean, t.numel()).backward()
    mine = slice(g.rank * b, (g.rank + 1) * b)
    out = par(x[mine])
    close(out, ser(x)[mine], "easy: output")
    loss_fn(out, t[mine], mean, t.numel()).backward()
    axonn_c.sync_gradients(par, mean=mean)
    compare_grads(par, ser, f"easy sync_gradients(mean={mean})")
    return par, ser


def check_clip(par, ser):
    for norm_type in (1.0, math.inf, 2.0):
        max_norm = 1e9 if norm_type != 2.0 else 0.05  # clip only at the last, 2-norm check
        got = axonn_c.clip_grad_norm_(par.parameters(), max_norm, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(ser.parameters(), max_norm, norm_type=norm_type)
        close(got, want, f"clip_grad_norm_ total norm (p={norm_type})")
    if not float(want) > 0.05:
        raise AssertionError(f"test setup: norm {float(want)} would not clip")
    compare_grads(par, ser, "after clip_grad_norm_")


def check_clip_missing_grads(par, ser, g):
    """Gradients missing on some ranks only (None on even ranks, zeros on odd ones; None in the
    serial model) count as zeros: every rank takes part in the same collectives (was: a rank
    without them skipped their groups' sums, a mismatched collective until the timeout)."""
    missing = ("fc2.weight", "fc2.bias", "head.weight", "ln_out.weight")
    for name, p in par.named_parameters():
        if name in missing:
            p.grad = None if g.rank % 2 == 0 else torch.zeros_like(p)
    for name, p in ser.named_parameters():
        if name in missing:
            p.grad = None
    for norm_type in (2.0, math.inf):
        got = axonn_c.clip_grad_norm_(par.parameters(), 1e9, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(ser.parameters(), 1e9, norm_type=norm_type)
        close(got, want, f"clip_grad_norm_ with gradients missing on some ranks (p={norm_type})")


def check_expert(g, mean, depth_mean=None):
    """The expert layout against the serial model; with `depth_mean` (True/False), after
    sync_gradients_depth_parallel(mean=depth_mean) first: the later sync_gradients(mean=mean)
    gives the same gradients (a mean divided once in all, whatever the depth sync divided by)."""
    shards = g.G_data * g.G_intra_d
    torch.manual_seed(21)
    ser = ExpertMLP(serial_lin, False)
    randomize_norms(ser, 6)
    torch.manual_seed(21)
    par = ExpertMLP(parallel_lin, True)
    randomize_norms(par, 6)
    compare_full(par, ser, "expert: seeded construction")

    gen = torch.Generator().manual_seed(9)
    b = 4
    x = torch.randn(shards * b, 16, generator=gen)
    t = torch.randn(shards * b, 24, generator=gen)
    loss_fn(ser(x), t, mean, t.numel()).backward()
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    tok = slice(blk * b, (blk + 1) * b)
    k = 16 // g.G_intra_c
    xl = x[tok, g.col_rank * k:(g.col_rank + 1) * k]
    out = par(xl)
    close(out, ser(x)[tok], "expert: output")
    loss_fn(out, t[tok], mean, t.numel()).backward()
    what = f"expert sync_gradients(mean={mean})"
    if depth_mean is not None:
        sync_gradients_depth_parallel(par, mean=depth_mean)
        sync_gradients_depth_parallel(par, mean=depth_mean)  # (a repeat: nothing)
        what = f"expert sync_gradients_depth_parallel(mean={depth_mean}), then {what}"
        check_depth_mean_changed(par, lambda: loss_fn(par(xl), t[tok], mean, t.numel()),
                                 depth_mean)
    axonn_c.sync_gradients(par, mean=mean)  # layout read from the model: expert
    compare_grads(par, ser, what)
    if depth_mean is not None:
        # a backward into gradients the depth sync summed and scaled (no zero_grad, no
        # sync_gradients between), then both syncs: the serial sum of both backward passes
        for _ in range(2):
            loss_fn(ser(x), t, mean, t.numel()).backward()
            loss_fn(par(xl), t[tok], mean, t.numel()).backward()
            sync_gradients_depth_parallel(par, mean=depth_mean)
        axonn_c.sync_gradients(par, mean=mean)
        compare_grads(par, ser, f"{what}, with backward passes between")
    got = axonn_c.clip_grad_norm_(par.parameters(), 1e9)
    want = torch.nn.utils.clip_grad_norm_(ser.parameters(), 1e9)
    close(got, want, "expert: clip_grad_norm_ total norm")


def check_depth_mean_changed(par, loss, depth_mean):
    """After sync_gradients_depth_parallel(mean=depth_mean), another call with the other mean=
    and no backward between: the gradients a single call with that mean= gives (was: left as
    they were, so mean=True after mean=False kept the sum); and back again."""
    def grads():
        return {n: p.grad.clone() for n, p in par.named_parameters() if p.grad is not None}

    def fresh(m):
        par.zero_grad()
        loss().backward()
        sync_gradients_depth_parallel(par, mean=m)
        return grads()

    def same(a, b, what):
        if list(a) != list(b):
            raise AssertionError(f"{what}: gradients of {sorted(set(a) ^ set(b))} differ")
        for n in a:
            close(a[n], b[n], f"{what}: grad of {n}")

    first = grads()
    sync_gradients_depth_parallel(par, mean=not depth_mean)
    other = grads()
    sync_gradients_depth_parallel(par, mean=depth_mean)
    same(grads(), first, f"depth sync mean={depth_mean}, {not depth_mean}, {depth_mean}")
    same(other, fresh(not depth_mean),
         f"depth sync mean={depth_mean} then mean={not depth_mean} against mean="
         f"{not depth_mean} alone")
    same(fresh(depth_mean), first, f"a fresh depth sync mean={depth_mean}")


def check_sharded_state_dict(g):
    torch.manual_seed(31)
    ser = EasyMLP(serial_lin)
    torch.manual_seed(31)
    par = EasyMLP(parallel_lin)
    sd = copy.deepcopy(par.state_dict())
    fc1 = par.fc1
    if tuple(sd["fc1.weight"].shape) != tuple(fc1.weight.shape):
        raise AssertionError("state_dict() of axonn_c.Linear must be sharded")
    with torch.no_grad():
        for p in par.parameters():
            p.add_(1.0)
    par.load_state_dict(sd)
    compare_full(par, ser, "load of the sharded state dict")


def check_auto_parallelize(g):
    torch.manual_seed(41)
    ser = nn.Sequential(nn.Linear(16, 32), nn.Linear(15, 32), nn.Linear(32, 7), nn.Linear(8, 8))
    torch.manual_seed(41)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with axonn_c.auto_parallelize():
            par = nn.Sequential(nn.Linear(16, 32), nn.Linear(15, 32), nn.Linear(32, 7),
                                torch.nn.modules.linear.Linear(8, 8))
            if not all(isinstance(m, nn.Linear) for m in par):
                raise AssertionError("inside auto_parallelize isinstance(m, nn.Linear) must hold")

            class Mine(nn.Linear):  # a subclass defined inside the context builds normally
                pass

            mine = Mine(4, 5)
            if type(mine) is not Mine or mine.weight.shape != (5, 4):
                raise AssertionError(f"subclass of nn.Linear built as {type(mine)}")
    if nn.Linear is not torch.nn.modules.linear.Linear or nn.Linear.__name__ != "Linear" or \
            nn.Linear.__module__ != "torch.nn.modules.linear":
        raise AssertionError("nn.Linear was not restored")
    fits = [16 % g.G_intra_c == 0 and 32 % g.G_intra_r == 0,
            15 % g.G_intra_c == 0 and 32 % g.G_intra_r == 0,
            32 % g.G_intra_c == 0 and 7 % g.G_intra_r == 0,
            True]
    for i, (m, fit) in enumerate(zip(par, fits)):
        want = axonn_c.Linear if fit else nn.Linear
        if type(m) is not want:
            raise AssertionError(f"layer {i}: {type(m).__name__}, expected {want.__name__}")
    ours = [w for w in caught if "auto_parallelize" in str(w.message)]
    kept = [s for s, fit in zip(("15->32", "32->7"), fits[1:3]) if not fit]
    if g.rank == 0 and kept:
        if len(ours) != 1 or not all(s in str(ours[0].message) for s in kept):
            raise AssertionError(f"expected one warning naming {kept}, got "
                                 f"{[str(w.message) for w in ours]}")
    elif ours:
        raise AssertionError(f"unexpected warning: {[str(w.message) for w in ours]}")
    compare_full(par, ser, "auto_parallelize: seeded construction")


def batch(g, seed):
    """All ranks' inputs and targets, and this rank's slice of them (2 samples per rank)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g.world_size * 2, 3, 16, generator=gen)
    t = torch.randn(g.world_size * 2, 3, 8, generator=gen)
    return x, t, slice(g.rank * 2, (g.rank + 1) * 2)


def backward_both(par, ser, g, seed):
    """Fresh gradients: the serial model's over all ranks' tokens, par's over this rank's."""
    x, t, mine = batch(g, seed)
    for m in (par, ser):
        m.zero_grad(set_to_none=True)
    loss_fn(ser(x), t, False, t.numel()).backward()
    loss_fn(par(x[mine]), t[mine], False, t.numel()).backward()


def step_both(par, ser, g, seed, what):
    """backward_both, then sync_gradients(mean=False): par's gradients must be the serial
    ones."""
    backward_both(par, ser, g, seed)
    axonn_c.sync_gradients(par, mean=False)
    compare_grads(par, ser, what)


def check_sync_twice_and_accumulate(g):
    """sync_gradients is idempotent until the next backward: a second call sums nothing again
    (a depth-sharded Linear weight was halved by mean=True, a sum doubled by mean=False) and one
    with another mean= only rescales; a backward that accumulates into synced gradients (no
    zero_grad between steps) gives the serial sum of both steps' gradients, overlap on and
    off. A torch.autograd.grad on one data-parallel replica between the two calls is no
    backward into .grad (was: its ranks alone read their synced gradients as stale and summed
    them again, and the ranks' sums went out of step)."""
    shards = g.world_size  # (easy layout: every rank holds other tokens)
    for overlap in (True, False):
        for mean in (False, True):
            what = f"sync twice (overlap={overlap}, mean={mean})"
            ser, par = easy_pair(21, 6)
            for m in par.modules():
                if isinstance(m, axonn_c.Linear):
                    m.overlap_data = m.defer_wgrad = overlap
            mine = None
            for step, seed in enumerate((31, 32)):
                x, t, mine = batch(g, seed)
                # the serial model accumulates both steps; par is never zeroed either
                loss_fn(ser(x), t, mean, t.numel()).backward()
                loss_fn(par(x[mine]), t[mine], mean, t.numel()).backward()
                axonn_c.sync_gradients(par, mean=mean)
                # a torch.autograd.grad between (a diagnostic) on one data-parallel replica
                # only (its tensor-parallel ranks together: the layers' own collectives)
                if g.data_rank == 0:
                    params = [p for p in par.parameters() if p.requires_grad]
                    torch.autograd.grad(loss_fn(par(x[mine]), t[mine], mean, t.numel()), params)
                axonn_c.sync_gradients(par, mean=mean)
                compare_grads(par, ser, f"{what}: step {step}")
            # another mean= rescales what was synced, and back
            axonn_c.sync_gradients(par, mean=not mean)
            factor = 1.0 / shards if not mean else float(shards)
            with torch.no_grad():
                for p in ser.parameters():
                    p.grad.mul_(factor)
            compare_grads(par, ser, f"{what}: then mean={not mean}")
            axonn_c.sync_gradients(par, mean=mean)
            with torch.no_grad():
                for p in ser.parameters():
                    p.grad.div_(factor)
            compare_grads(par, ser, f"{what}: then mean={mean} again")


RANDOM_OPS = ("backward", "backward", "no_sync_backward", "sync_sum", "sync_mean", "zero_none",
              "zero_in_place", "probe", "depth_sum", "depth_mean")


def random_sequence_models(g, layout, seed):
    """(serial model, parallel model, shards, data) of check_random_sequences: the easy layout's
    EasyMLP, or the expert layout's ExpertMLP (tokens split over data x depth, the input's
    features over columns). data(k) -> (serial loss fn, this rank's input, target, n) of the
    k-th op: the parallel loss is loss_fn(par(input), target, False, n)."""
    if layout == "easy":
        ser, par = easy_pair(71 + seed, 13)

        def data(k):
            x, t, mine = batch(g, 1000 * seed + k)
            return lambda: loss_fn(ser(x), t, False, t.numel()), x[mine], t[mine], t.numel()
        return ser, par, g.world_size, data
    shards = g.G_data * g.G_intra_d
    models = []
    for lin, expert in ((serial_lin, False), (parallel_lin, True)):
        torch.manual_seed(71 + seed)
        models.append(ExpertMLP(lin, expert))
        randomize_norms(models[-1], 13)
    ser, par = models
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    k_in = 16 // g.G_intra_c

    def data(k):
        gen = torch.Generator().manual_seed(1000 * seed + k)
        x = torch.randn(shards * 2, 16, generator=gen)
        t = torch.randn(shards * 2, 24, generator=gen)
        tok = slice(blk * 2, (blk + 1) * 2)
        return (lambda: loss_fn(ser(x), t, False, t.numel()),
                x[tok, g.col_rank * k_in:(g.col_rank + 1) * k_in], t[tok], t.numel())
    return ser, par, shards, data


def check_random_sequences(g):
    """Random sequences (the same on every rank) of backward passes, backward passes under
    no_grad_sync, sync_gradients(mean=False/True) (repeated too), sync_gradients_depth_parallel,
    zero_grad (to None and in place) and a torch.autograd.grad probe on one data-parallel
    replica, easy and expert layout, overlap off and on: after every sync, par's gradients are
    the serial model's sum of every backward since the last zero_grad, times the last sync's
    scale (1/shards for a mean). A model of what the marks must add up to, whatever order the
    calls come in."""
    for layout in ("easy", "expert"):
        for overlap in (False, True):
            for seed in range(3):
                rng = random.Random(100 * seed + 10 * overlap + (layout == "expert"))
                ser, par, shards, data = random_sequence_models(g, layout, seed)
                seq = [rng.choice(RANDOM_OPS + ("freeze",)) for _ in range(12)] + ["sync_mean"]
                what = f"random sequence {seq} ({layout}, overlap={overlap})"
                with axonn_c.optimize_communication(overlap_data=overlap):
                    for k, op in enumerate(seq):
                        random_sequence_op(g, op, ser, par, shards, data(k), f"{what}: op {k}",
                                           k=k)
                    for m in (par, ser):
                        m.requires_grad_(True)
                    random_sequence_op(g, "sync_mean", ser, par, shards, None,
                                       f"{what}: every parameter unfrozen")


def random_sequence_op(g, op, ser, par, shards, batch_k, what, k=0):
    """One op of check_random_sequences on batch_k (data(k) of random_sequence_models); k picks
    the parameter "freeze" freezes or unfreezes (in both models)."""
    ser_loss, x, t, n = batch_k if batch_k is not None else (None,) * 4
    if op in ("backward", "no_sync_backward"):
        ser_loss().backward()
        if op == "backward":
            loss_fn(par(x), t, False, n).backward()
        else:
            with axonn_c.no_grad_sync():
                loss_fn(par(x), t, False, n).backward()
    elif op in ("sync_sum", "sync_mean"):
        mean = op == "sync_mean"
        axonn_c.sync_gradients(par, mean=mean)
        if any(p.grad is not None for p in ser.parameters()):
            factor = 1.0 / shards if mean else 1.0  # (a power of two: exact both ways)
            with torch.no_grad():
                for p in ser.parameters():
                    if p.grad is not None:
                        p.grad.mul_(factor)
            compare_grads(par, ser, f"{what} ({op})")
            with torch.no_grad():
                for p in ser.parameters():
                    if p.grad is not None:
                        p.grad.div_(factor)
    elif op in ("depth_sum", "depth_mean"):  # (compared at the next sync)
        sync_gradients_depth_parallel(par, mean=op == "depth_mean")
    elif op in ("zero_none", "zero_in_place"):
        for m in (par, ser):
            m.zero_grad(set_to_none=op == "zero_none")
    elif op == "freeze":  # (summed like the others while frozen; its hook set all the same)
        names = sorted(name for name, _ in ser.named_parameters())
        for m in (par, ser):
            p = dict(m.named_parameters())[names[k % len(names)]]
            p.requires_grad_(not p.requires_grad)
    elif op == "probe":  # no backward into .grad (on one data-parallel replica)
        if g.data_rank == 0:
            params = [p for p in par.parameters() if p.requires_grad]
            torch.autograd.grad(loss_fn(par(x), t, False, n), params)
    else:
        raise ValueError(f"unknown op {op}")


def unused_branch_steps(blocks, mine, steps, sync):
    """Steps of a model of two nn.Linear, "a" then "b", on `blocks` token blocks (this rank's:
    `mine`), with zero_grad(set_to_none=False): from the second step on, odd blocks leave "b"
    unused. Yields (step, parallel model, serial model) after sync(parallel model)."""
    xs = torch.randn(blocks, 3, 4, generator=torch.Generator().manual_seed(41))

    def model():
        torch.manual_seed(5)
        return nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

    def loss(m, b, step):
        y = m["a"](xs[b])
        return (m["b"](y) if step == 0 or b % 2 == 0 else y).pow(2).sum()

    par, ser = model(), model()
    for step in range(steps):
        par.zero_grad(set_to_none=False)
        ser.zero_grad(set_to_none=False)
        loss(par, mine, step).backward()
        for b in range(blocks):
            loss(ser, b, step).backward()
        sync(par)
        yield step, par, ser


def check_unused_after_zero_in_place(g):
    """zero_grad(set_to_none=False) keeps the synced .grads (zeroed in place); a step that uses
    a parameter on some ranks only (an unused branch) must still sum it on every rank (no rank
    skips it as synced), also when the model is synced in two calls (the first must not make
    the second look like a repeat): the sums are the serial ones, no rank raises or waits."""
    def sync(par):
        axonn_c.sync_gradients(par["a"])
        axonn_c.sync_gradients(par["b"])

    for step, par, ser in unused_branch_steps(g.world_size, g.rank, 2, sync):
        for name, p in ser.named_parameters():
            close(dict(par.named_parameters())[name].grad, p.grad,
                  f"unused after zero_grad(set_to_none=False), step {step}: {name}")


def check_unused_after_depth_sync(g):
    """As check_unused_after_zero_in_place, synced by sync_gradients_depth_parallel (expert
    layout, means; all there is to sum when G_data = 1, as AxoNN's tests do, else followed by
    sync_gradients): a parameter a rank's step did not use keeps the depth sync's mark of the
    step before, which must not make that rank skip a depth sum the others make (was: its zeroed
    .grad still read as summed over depth, and the ranks' sums went out of step). The sums are
    the serial ones."""
    blocks = g.G_data * g.G_intra_d  # (the expert layout's token blocks)

    def sync(par):
        sync_gradients_depth_parallel(par, mean=True, expert_mode=True)
        if g.G_data > 1:
            axonn_c.sync_gradients(par, mean=True, expert_mode=True)

    for step, par, ser in unused_branch_steps(blocks, g.data_rank * g.G_intra_d + g.depth_rank,
                                              3, sync):
        for name, p in ser.named_parameters():
            close(dict(par.named_parameters())[name].grad, p.grad / blocks,
                  f"unused after a depth sync, step {step}: {name}")


def check_main_grad(g):
    """sync_gradients(gradient_attr_name="main_grad") on copies of .grad made after an
    overlapped backward (AxoNN's pattern): the copies carry the sums .grad got during
    backward, which are not done again."""
    ser, par = easy_pair(57, 10)
    step_both(par, ser, g, 1, "main_grad: the first step")  # (hooks every parameter)
    with axonn_c.optimize_communication(overlap_data=True):
        backward_both(par, ser, g, 4)
    for p in par.parameters():
        p.main_grad = p.grad.clone()
    axonn_c.sync_gradients(par, gradient_attr_name="main_grad")
    for p in par.parameters():
        p.grad = p.main_grad
    compare_grads(par, ser, "main_grad")
    # the same with .grad dropped after the copy (Megatron's and AxoNN's pattern: the copy
    # is the gradient from then on; was: a dropped .grad counted as not summed, so the copy
    # was summed a second time), and a next step after it sums what its backward did not
    for step, seed in enumerate((5, 6)):
        for m in (par, ser):
            m.zero_grad(set_to_none=True)
        with axonn_c.optimize_communication(overlap_data=True):
            backward_both(par, ser, g, seed)
        for p in par.parameters():
            p.main_grad, p.grad = p.grad.clone(), None
        axonn_c.sync_gradients(par, gradient_attr_name="main_grad")
        for p in par.parameters():
            p.grad = p.main_grad
        compare_grads(par, ser, f"main_grad with .grad dropped (step {step})")
    # an overlapped backward thrown away (no sync_gradients), its .grads dropped, then a step
    # whose backward sums nothing (overlap off): its copies are summed by the sync (was: the
    # thrown-away pass's marks outlived their .grads and were taken for the copies')
    for m in (par, ser):
        m.zero_grad(set_to_none=True)
    with axonn_c.optimize_communication(overlap_data=True):
        backward_both(par, ser, g, 7)
    for m in (par, ser):
        m.zero_grad(set_to_none=True)
    with axonn_c.optimize_communication(overlap_data=False):
        backward_both(par, ser, g, 8)
    for p in par.parameters():
        p.main_grad, p.grad = p.grad.clone(), None
    axonn_c.sync_gradients(par, gradient_attr_name="main_grad")
    for p in par.parameters():
        p.grad = p.main_grad
    compare_grads(par, ser, "main_grad after a thrown-away overlapped backward")
    # copies of .grads synced already (sync_gradients(mean=True), then main_grad = .grad): summed
    # and scaled already, only rescaled to this call's mean= (was: read as summed but not
    # scaled, so the copies kept mean=True's scale), and .grad's sums count as over
    backward_both(par, ser, g, 9)
    axonn_c.sync_gradients(par, mean=True)
    for p in par.parameters():
        p.main_grad = p.grad.clone()
    axonn_c.sync_gradients(par, gradient_attr_name="main_grad", mean=False)
    for p in par.parameters():
        p.grad = p.main_grad
    compare_grads(par, ser, "main_grad copied from synced .grads")


def check_unfrozen_copy(g):
    """A Linear frozen when its hooks were set (here: a deep copy of a frozen layer), unfrozen
    later, trains with the data overlap like one never frozen, a second use of its weight (an
    L2 term: summed by its gradient hook) included (was: the weight never got its hook)."""
    results = []
    for freeze in (False, True):
        torch.manual_seed(0)
        base = axonn_c.Linear(16, 16, bias=False)
        base.weight.requires_grad_(not freeze)
        lin = copy.deepcopy(base)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + g.rank))
        with torch.no_grad():
            lin(x)
        lin.weight.requires_grad_(True)
        lin.zero_grad(set_to_none=True)
        with axonn_c.optimize_communication(overlap_data=True):
            (lin(x).square().sum() + 3.0 * lin.weight.square().sum()).backward()
        axonn_c.sync_gradients(lin)
        results.append(lin.weight.grad.clone())
    close(results[1], results[0], "an unfrozen copy's weight gradient vs a never-frozen one's")


FROZEN_NAMES = ("ln_in.weight", "fc1.weight", "fc1.bias")  # a norm's, a Linear's weight, bias


def frozen_pair(seed, norm_seed, name, overlap):
    """easy_pair with the Linears' overlap knobs set, and parameter `name` of both (par's, ser's)
    to freeze."""
    ser, par = easy_pair(seed, norm_seed)
    for m in par.modules():
        if isinstance(m, axonn_c.Linear):
            m.overlap_data = m.defer_wgrad = overlap
    return ser, par, [dict(m.named_parameters())[name] for m in (par, ser)]


def check_frozen_at_sync(g):
    """A parameter frozen when sync_gradients runs is summed like the others (the replicas stay
    alike); unfrozen later, a backward without zero_grad adds to it and the next sync gives the
    serial sum (or mean) of both steps, for a parameter frozen at its first sync (its gradient
    hook registered while frozen), a Linear weight and a Linear bias, overlap on and off (was:
    autograd added to the synced .grad without the hook, torch setting none on a frozen tensor,
    and the next sync summed the synced part again)."""
    for overlap, mean in itertools.product((True, False), (False, True)):
        for name in FROZEN_NAMES:
            what = f"frozen at sync ({name}, overlap={overlap}, mean={mean})"
            ser, par, frozen = frozen_pair(23, 7, name, overlap)
            for step, seed in enumerate((41, 42)):
                x, t, mine = batch(g, seed)
                loss_fn(ser(x), t, mean, t.numel()).backward()
                loss_fn(par(x[mine]), t[mine], mean, t.numel()).backward()
                if step == 0:
                    for p in frozen:
                        p.requires_grad_(False)
                axonn_c.sync_gradients(par, mean=mean)
                if step == 0:
                    compare_grads(par, ser, f"{what}: synced while frozen")
                    for p in frozen:
                        p.requires_grad_(True)
            compare_grads(par, ser, f"{what}: unfrozen, two steps")


def check_frozen_in_backward(g):
    """A parameter frozen between its forward and its backward gets no gradient, as in torch
    (autograd's accumulation skips it; its gradient hook, registered at the step before, still
    fires): overlap on and off, a Linear weight, a Linear bias and a norm's weight (was: the
    hook bucketed the gradient and the end of the pass gave the frozen parameter a .grad)."""
    for overlap in (True, False):
        for name in FROZEN_NAMES:
            what = f"frozen in backward ({name}, overlap={overlap})"
            ser, par, frozen = frozen_pair(29, 9, name, overlap)
            step_both(par, ser, g, 43, f"{what}: the step before")
            x, t, mine = batch(g, 44)
            for m in (par, ser):
                m.zero_grad(set_to_none=True)
            losses = (loss_fn(ser(x), t, False, t.numel()),
                      loss_fn(par(x[mine]), t[mine], False, t.numel()))
            for p in frozen:
                p.requires_grad_(False)
            for loss in losses:
                loss.backward()
            axonn_c.sync_gradients(par, mean=False)
            compare_grads(par, ser, what)
            for p in frozen:
                p.requires_grad_(True)


def check_carried_names(g):
    """Names that parameters carry into this process (a model pickled by another process and
    torch.load-ed on some ranks only, a value a user set) are no names here: the first sync
    names them alike on every rank, and overlapped steps train like the serial model (was: a
    carried name was kept on the ranks that had it, so the ranks named the parameters, and every
    model synced after them, differently, and the transport raised "packed different
    gradients")."""
    # (a value that is no name anywhere, -5, would leave its bucket unchecked: each case alone)
    carried = (lambda i: i + 100, lambda i: (12345, i + 1), lambda i: True, lambda i: -5)
    for case, name_of in enumerate(carried):
        ser, par = easy_pair(67, 13)
        if g.rank == 0:
            for i, p in enumerate(par.parameters()):
                p._axonn_grad_ident = name_of(i)
        with axonn_c.optimize_communication(overlap_data=True):
            for seed in (1, 2, 3):
                step_both(par, ser, g, seed, f"carried names ({case}), step {seed}")


def check_rank_local_copy(g):
    """A copy of the model made on one rank only (an EMA, say) gets gradient hooks on that rank
    alone: backward's overlapped sums must still name the model's parameters alike on every
    rank (their transport compares what each rank packed) and train like the serial model."""
    ser, par = easy_pair(61, 12)
    if g.rank == 0:
        copy.deepcopy(par)
    with axonn_c.optimize_communication(overlap_data=True):
        for seed in (1, 2, 3):
            step_both(par, ser, g, seed, f"a copy made on rank 0 only, step {seed}")


def check_copies(g):
    """A deepcopy and a torch.save/torch.load round trip of a model that has trained once (so
    sync_gradients has hooked all its parameters) train like the serial model: the copies'
    parameters are new objects, which need the layer's tags and gradient hooks again."""
    ser, orig = easy_pair(51, 8)
    step_both(orig, ser, g, 1, "copies: the original")
    for overlap in (False, True):
        buf = io.BytesIO()
        torch.save(orig, buf)
        buf.seek(0)
        copies = {"deepcopy": copy.deepcopy(orig),
                  "torch.load": torch.load(buf, weights_only=False)}
        with axonn_c.optimize_communication(overlap_data=overlap):
            for name, par in copies.items():
                compare_full(par, ser, f"{name} (overlap_data={overlap}): weights")
                step_both(par, ser, g, 2, f"{name} (overlap_data={overlap})")
                step_both(par, ser, g, 3, f"{name} (overlap_data={overlap}), second step")
                # the sums during backward need the hooks (without, sync_gradients sums alone)
                unhooked = [n for n, p in par.named_parameters() if len(p._backward_hooks) != 1]
                if unhooked:
                    raise AssertionError(f"{name}: parameters without exactly one gradient "
                                         f"hook: {unhooked}")


def check_saved_mid_step(g):
    """torch.save between backward and sync_gradients (a checkpoint taken mid-step, with the
    gradients already summed during backward): the loaded copy has no .grad, so none of its
    parameters may count as summed; its first step must sum everything, overlap on or off."""
    ser, orig = easy_pair(53, 9)
    step_both(orig, ser, g, 1, "saved mid-step: the original")  # (hooks every parameter)
    x, t, mine = batch(g, 2)
    orig.zero_grad(set_to_none=True)
    with axonn_c.optimize_communication(overlap_data=True):
        loss_fn(orig(x[mine]), t[mine], False, t.numel()).backward()
    if not any(axonn_c.grads.summed_over(p) for p in orig.parameters()):
        raise AssertionError("saved mid-step: nothing was summed during backward (the case "
                             "this check is about did not arise)")
    buf = io.BytesIO()
    torch.save(orig, buf)
    axonn_c.sync_gradients(orig)
    for overlap in (False, True):
        buf.seek(0)
        par = torch.load(buf, weights_only=False)
        with axonn_c.optimize_communication(overlap_data=overlap):
            step_both(par, ser, g, 3, f"saved mid-step, loaded (overlap_data={overlap})")


def stale_layer():
    """A layer, its torch.compile'd form (compiled now) and where it was built."""
    g = axonn_c.grid()
    layer = axonn_c.Linear(16, 8)
    compiled = torch.compile(layer)
    compiled(torch.randn(3, 16))
    return layer, compiled, (g.G_intra_r, g.G_intra_c, g.G_intra_d, g.row_rank, g.col_rank,
                             g.depth_rank)


def check_stale_layer(layer, compiled, placed_on):
    """A layer built under an earlier init(): usable when this rank holds the same shards on the
    new grid, refused with the two placements named otherwise (never a silent wrong shard),
    also in the form torch.compile'd under the earlier grid (a shard of the same size, on
    another place, included)."""
    g = axonn_c.grid()
    now = (g.G_intra_r, g.G_intra_c, g.G_intra_d, g.row_rank, g.col_rank, g.depth_rank)
    x = torch.randn(3, 16)
    if now == placed_on:
        torch.testing.assert_close(compiled(x), layer(x))
        return
    for what, call in (("compiled forward", lambda: compiled(x)), ("forward", lambda: layer(x)),
                       ("full_weight", layer.full_weight)):
        try:
            call()
        except RuntimeError as e:
            if "holds the shards of" not in str(e) or f"G_intra_r={g.G_intra_r}" not in str(e):
                raise AssertionError(f"stale layer, {what}: unclear error {e}") from e
        else:
            raise AssertionError(f"stale layer, {what}: no error after the grid changed")


def check_compat():
    from axonn_c import axonn as ax
    from axonn_c.intra_layer import (Linear, auto_parallelize, clip_grad_norm_,
                                     optimize_communication, sync_gradients)

    assert Linear is axonn_c.Linear and sync_gradients is axonn_c.sync_gradients
    assert auto_parallelize is axonn_c.auto_parallelize
    assert clip_grad_norm_ is axonn_c.clip_grad_norm_
    with optimize_communication(True, True, True, cache_weights=True):
        pass
    g = axonn_c.grid()
    assert ax.config.G_intra_r == g.G_intra_r and ax.config.G_data == g.G_data


def check_sync_memory(g):
    """sync_gradients packs a small model's gradients into buckets no larger than those
    gradients (was: a bucket of 16 MiB per dtype, whatever the model's size, so a small model's
    sum took many times its gradients' memory)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))  # (replicated: summed)
    model(torch.randn(8, 64)).sum().backward()
    grad_bytes = sum(p.grad.nbytes for p in model.parameters())
    mt = MemTracker()
    mt.track_external(model)
    with mt:
        axonn_c.sync_gradients(model)
    peak = max(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    extra = peak - 2 * grad_bytes  # (the parameters and their gradients)
    assert extra <= 2 * grad_bytes, (f"rank {g.rank}: sync_gradients of {grad_bytes} gradient "
                                     f"bytes took {extra} bytes more")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grids", required=True, help="G_data,Gr,Gc,Gd;...")
    args = ap.parse_args()
    stale = None
    for spec in args.grids.split(";"):
        sizes = [int(v) for v in spec.split(",")]
        from axonn_c import axonn as ax

        g = ax.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3])
        for mean in (False, True):
            par, ser = check_easy(g, mean)
        check_clip(par, ser)
        check_clip_missing_grads(par, ser, g)
        for mean in (False, True):
            check_expert(g, mean)
        for depth_mean, mean in ((True, True), (True, False), (False, True)):
            check_expert(g, mean, depth_mean)
        check_sharded_state_dict(g)
        check_auto_parallelize(g)
        check_copies(g)
        check_rank_local_copy(g)
        check_carried_names(g)
        check_saved_mid_step(g)
        check_main_grad(g)
        check_sync_twice_and_accumulate(g)
        check_random_sequences(g)
        check_unused_after_zero_in_place(g)
        check_unused_after_depth_sync(g)
        check_unfrozen_copy(g)
        check_frozen_at_sync(g)
        check_frozen_in_backward(g)
        check_sync_memory(g)
        if stale is not None:
            check_stale_layer(*stale)
        stale = stale_layer()
        check_compat()
        if g.rank == 0:
            print(f"grid {spec}: ok", flush=True)
        axonn_c.finalize()
    print("ALL OK", flush=True)


if __name__ == "__main__":
    main()
