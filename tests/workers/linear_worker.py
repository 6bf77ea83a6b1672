"""axonn_c.Linear against the serial nn.Linear on every grid of the world size: outputs, input
gradients and every parameter's gradient (after the data/depth reductions docs/linear.md
assigns), both layouts, transpose on/off, bias on/off, square and non-square shapes, 3-D inputs."""
import argparse
import itertools
import sys

import torch

import axonn_c
from common import GROUPS, assert_bytes_equal, grids

SHAPES = [(48, 80), (96, 32), (64, 64)]
SHAPES_3 = [(48, 120), (96, 24), (72, 72)]  # for world sizes with a factor 3


def close(got, want, dtype, what):
    got, want = got.double(), want.double()
    if want.numel() == 0:  # (a rank without tokens)
        assert got.shape == want.shape, f"{what}: shape {list(got.shape)}, want {list(want.shape)}"
        return
    scale = want.abs().max().clamp_min(1e-12)
    if dtype == torch.float32:
        ok = torch.allclose(got / scale, want / scale, rtol=1e-5, atol=1e-6)
    else:
        ok = ((got - want).norm() / want.norm().clamp_min(1e-12)).item() < 1e-2
    if not ok:
        raise AssertionError(f"{what}: max |diff| {(got - want).abs().max().item():.3e}, "
                             f"scale {scale.item():.3e}")


def shard_of(full_grad, layer):
    s = layer._shapes
    rows, cols = layer._block_slices()
    flat = full_grad[rows, cols].reshape(-1)
    padded = flat.new_zeros(s["shard"] * s["depth_size"])
    padded[: s["block"]] = flat
    d = axonn_c.grid().depth_rank
    return padded[d * s["shard"]:(d + 1) * s["shard"]]


OVERLAP = False  # --overlap: init(overlap=True), gradients through sync_gradients


def reduce_grads(layer):
    """What sync_gradients does for these two parameters, spelled out (with overlap on the
    data-parallel sums run during backward: sync_gradients knows which are done)."""
    if OVERLAP:
        axonn_c.sync_gradients(torch.nn.ModuleList([layer]))
        return
    for p in (layer.weight, layer.bias):
        if p is not None:
            for group in p._axonn_grad_groups:
                axonn_c.comm.all_reduce(p.grad, group=group)


def check(g, in_f, out_f, expert, transpose, bias, dtype, tokens_per_rank, seed):
    world = g.world_size
    what = (f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} {in_f}->{out_f} "
            f"expert={expert} transpose={transpose} bias={bias} {dtype} rank {g.rank}")
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_f, out_f, bias=bias)
    torch.manual_seed(seed)
    layer = axonn_c.Linear(in_f, out_f, bias=bias, transpose=transpose, expert_mode=expert,
                           dtype=dtype)
    ref = ref.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    s = layer._shapes
    if expert:  # tokens split over data x depth; features over the gin/gout groups
        shards = g.G_data * g.G_intra_d
        T = shards * tokens_per_rank
        X = torch.randn(2, T // 2, in_f, generator=gen).to(dtype)  # 3-D input
        dY = torch.randn(2, T // 2, out_f, generator=gen).to(dtype)
        blk = g.data_rank * g.G_intra_d + g.depth_rank
        tok = slice(blk * tokens_per_rank // 2, (blk + 1) * tokens_per_rank // 2)
        kin = slice(s["gin_rank"] * s["k_local"], (s["gin_rank"] + 1) * s["k_local"])
        nout = slice(s["gout_rank"] * s["n_local"], (s["gout_rank"] + 1) * s["n_local"])
        x = X[:, tok, kin].clone().requires_grad_()
        dy = dY[:, tok, nout]
    else:  # each rank its own tokens, full features; unequal counts on purpose
        counts = [tokens_per_rank + (r % 3) for r in range(world)]
        T = sum(counts)
        X = torch.randn(T, in_f, generator=gen).to(dtype)
        dY = torch.randn(T, out_f, generator=gen).to(dtype)
        start = sum(counts[:g.rank])
        tok = slice(start, start + counts[g.rank])
        kin, nout = slice(None), slice(None)
        x = X[tok].clone().requires_grad_()
        dy = dY[tok]
    Xr = X.clone().requires_grad_()
    Yr = ref(Xr)
    Yr.backward(dY)
    y = layer(x)
    close(y, Yr.detach()[..., tok, nout] if expert else Yr.detach()[tok], dtype, what + " output")
    y.backward(dy)
    reduce_grads(layer)
    close(x.grad, Xr.grad[..., tok, kin] if expert else Xr.grad[tok], dtype, what + " dX")
    close(layer.weight.grad, shard_of(ref.weight.grad, layer), dtype, what + " dW")
    if bias:
        rows, _ = layer._block_slices()
        close(layer.bias.grad, ref.bias.grad[rows], dtype, what + " db")


def check_mlp_and_bytes(g, dtype, seed, chunks=1):
    """Linear -> GELU -> Linear(transpose=True) in expert mode equals the serial MLP, and the
    bytes each group moved in one step equal the communication model's (docs/linear.md's
    expert-layout table: no
    redistribution between the two layers)."""
    hidden, ffn = 24 * 2, 24 * 4
    grid4 = (g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d)
    torch.manual_seed(seed)
    ref1, ref2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    torch.manual_seed(seed)
    l1 = axonn_c.Linear(hidden, ffn, expert_mode=True, dtype=dtype)
    l2 = axonn_c.Linear(ffn, hidden, transpose=True, expert_mode=True, dtype=dtype)
    for layer in (l1, l2):  # over-decomposed forward all-reduces, overlapped backward
        layer.fwd_chunks = chunks
        layer.overlap_all_reduce = layer.overlap_reduce_scatter = chunks > 1
    shards, m = g.G_data * g.G_intra_d, 5
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(shards * m, hidden, generator=gen)
    dY = torch.randn(shards * m, hidden, generator=gen)
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    tok = slice(blk * m, (blk + 1) * m)
    s1 = l1._shapes
    kin = slice(s1["gin_rank"] * s1["k_local"], (s1["gin_rank"] + 1) * s1["k_local"])
    x = X[tok, kin].clone().requires_grad_()
    axonn_c.reset_comm_stats()
    y = l2(torch.nn.functional.gelu(l1(x)))
    y.backward(dY[tok, kin])  # l2's output block is split like l1's input (col group)
    for layer in (l1, l2):
        reduce_grads(layer)
    stats = axonn_c.comm_stats()
    Xr = X.clone().requires_grad_()
    Yr = ref2(torch.nn.functional.gelu(ref1(Xr)))
    Yr.backward(dY)
    what = f"MLP grid {grid4} rank {g.rank}"
    close(y, Yr.detach()[tok, kin], dtype, what + " output")
    close(x.grad, Xr.grad[tok, kin], dtype, what + " dX")
    for layer, ref in ((l1, ref1), (l2, ref2)):
        close(layer.weight.grad, shard_of(ref.weight.grad, layer), dtype, what + " dW")
        rows, _ = layer._block_slices()
        close(layer.bias.grad, ref.bias.grad[rows], dtype, what + " db")
    layers = [dict(in_features=hidden, out_features=ffn, bias=1),
              dict(in_features=ffn, out_features=hidden, transpose=1, bias=1)]
    step = dict(tokens=shards * m, grad_acc=1, recompute=0, dtype="float32",
                grad_dtype="float32", fwd_chunks=chunks)
    pred = axonn_c._C.model_volume(grid4, g.rank, layers, step)
    assert_bytes_equal(stats, pred, what)


def check_easy_bytes(g, seed):
    """Easy layout, equal token counts: the bytes of one step (forward, backward, gradient
    reductions) equal the communication model's for the easy layout."""
    hidden, ffn, t = 24, 48, 3
    grid4 = (g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d)
    torch.manual_seed(seed)
    l1 = axonn_c.Linear(hidden, ffn)
    l2 = axonn_c.Linear(ffn, hidden, transpose=True, bias=False)
    x = torch.randn(t, hidden, requires_grad=True)
    axonn_c.reset_comm_stats()
    l2(torch.relu(l1(x))).sum().backward()
    for layer in (l1, l2):
        reduce_grads(layer)
    stats = axonn_c.comm_stats()
    layers = [dict(in_features=hidden, out_features=ffn, bias=1, easy=1),
              dict(in_features=ffn, out_features=hidden, transpose=1, bias=0, easy=1)]
    step = dict(tokens=g.world_size * t, grad_acc=1, recompute=0, dtype="float32",
                grad_dtype="float32")
    pred = axonn_c._C.model_volume(grid4, g.rank, layers, step)
    assert_bytes_equal(stats, pred, f"easy layout grid {grid4} rank {g.rank}")


def check_overlap_identical(g, seed):
    """With overlap on (and one forward chunk) every result is bitwise the same as with overlap
    off; with several forward chunks (expert layout) it still equals the serial layer."""
    torch.manual_seed(seed)
    results = {}
    for expert in (False, True):
        for knobs in ((False, False, 1), (True, True, 1), (True, True, 3)):
            torch.manual_seed(seed)
            layer = axonn_c.Linear(48, 96, expert_mode=expert)
            layer.overlap_all_reduce, layer.overlap_reduce_scatter, layer.fwd_chunks = knobs
            s = layer._shapes
            gen = torch.Generator().manual_seed(seed + g.data_rank * 10 + g.depth_rank)
            width = s["k_local"] if expert else 48
            x = torch.randn(7, width, generator=gen)
            if not expert:  # easy: every rank its own tokens
                x = x + g.rank
            x.requires_grad_()
            y = layer(x)
            y.backward(torch.ones_like(y))
            results[(expert, knobs)] = [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]
        base = results[(expert, (False, False, 1))]
        for a, b in zip(base, results[(expert, (True, True, 1))]):
            assert torch.equal(a, b), f"rank {g.rank} expert={expert}: overlap changed a result"
        for a, b in zip(base, results[(expert, (True, True, 3))]):
            close(b, a, torch.float32, f"rank {g.rank} expert={expert} fwd_chunks=3")


def check_no_input_grad(g, seed):
    """An input that needs no gradient (a first layer on raw data): the backward skips the dX
    GEMM and dX's collectives, so the step moves fewer bytes wherever dX is reduced or
    redistributed, and dW, db are bitwise those of the same step with the input's gradient."""
    for expert, transpose in itertools.product((False, True), (False, True)):
        what = (f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} expert={expert} "
                f"transpose={transpose} rank {g.rank}")
        got = {}
        for need in (True, False):
            torch.manual_seed(seed)
            layer = axonn_c.Linear(24, 48, expert_mode=expert, transpose=transpose)
            s = layer._shapes
            gen = torch.Generator().manual_seed(seed + g.rank)
            x = torch.randn(5, s["k_local"] if expert else 24, generator=gen)
            x.requires_grad_(need)
            y = layer(x)
            axonn_c.reset_comm_stats()
            y.backward(torch.ones_like(y))
            axonn_c.finish_grads()
            stats = axonn_c.comm_stats()
            sent = sum(stats[k]["bytes_sent"] for k in GROUPS)
            got[need] = (sent, layer.weight.grad.clone(), layer.bias.grad.clone())
            assert (x.grad is not None) == need, f"{what}: x.grad {x.grad is not None}"
        moves_dx = s["gout_size"] > 1 if expert else s["gin_size"] * s["gout_size"] > 1
        if moves_dx:
            assert got[False][0] < got[True][0], f"{what}: bytes {got[False][0]} not below " \
                                                 f"{got[True][0]} without dX"
        else:
            assert got[False][0] == got[True][0], f"{what}: bytes {got}"
        assert torch.equal(got[False][1], got[True][1]), f"{what}: dW differs without dX"
        assert torch.equal(got[False][2], got[True][2]), f"{what}: db differs without dX"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--overlap", action="store_true")
    a = p.parse_args()
    global OVERLAP
    OVERLAP = a.overlap
    import os

    world = int(os.environ["WORLD_SIZE"])
    n = 0
    for sizes in grids(world):
        g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2],
                         G_intra_d=sizes[3], overlap=a.overlap)
        for (in_f, out_f), expert, transpose, bias, dname in itertools.product(
                SHAPES_3 if world % 3 == 0 else SHAPES, (False, True), (False, True), (True, False), a.dtypes.split(",")):
            check(g, in_f, out_f, expert, transpose, bias, getattr(torch, dname), a.tokens,
                  seed=1000 + n)
            n += 1
        for transpose, bias in itertools.product((False, True), (True, False)):
            # easy layout, counts 0, 1, 2, 0, ... (a short last batch): a rank without tokens
            # still takes its part in its peers' dX collectives
            in_f, out_f = (SHAPES_3 if world % 3 == 0 else SHAPES)[0]
            check(g, in_f, out_f, False, transpose, bias, torch.float32, 0, seed=1000 + n)
            n += 1
        check_mlp_and_bytes(g, torch.float32, seed=77 + n)
        check_mlp_and_bytes(g, torch.float32, seed=78 + n, chunks=3)
        check_easy_bytes(g, seed=99 + n)
        check_overlap_identical(g, seed=123 + n)
        check_no_input_grad(g, seed=150 + n)
        axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print(f"world {world}: {n} layer cases match nn.Linear"
              f"{' with every overlap on' if a.overlap else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
