"""Multi-rank check of the compressed collectives (shm), launched by torchrun.

Every rank builds every member's input from a seed, so each result is checked against a serial
emulation of the algorithm with the same C codecs (bitwise: one-shot encode, owner decodes and
sums in group-rank order, all-gather of the encoded sum) and against the exact fp32 reduction
within the codecs' bounds; every rank's result must be bitwise identical to the others', and the
byte counters must equal the closed form (docs/compression.md).
Usage: torchrun --nproc_per_node N compress_worker.py [--grid D,R,C,Z] [--sizes 1,7,1000]
"""
import argparse
import sys

import torch

import axonn_c
from axonn_c import _C

CODECS = ("bf16", "fp8", "int8", "int4")
QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}


def make_input(n, seed, rank):
    """Gradient-like: per-64-element magnitudes over 3 decades, rare 20x outliers, some zeros."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(n, generator=gen)
    mags = 10.0 ** (-3 * torch.rand((n + 63) // 64, generator=gen))
    x *= mags.repeat_interleave(64)[:n]
    x[torch.rand(n, generator=gen) < 0.001] *= 20
    x[torch.rand(n, generator=gen) < 0.01] = 0
    return x


def encode(codec, block, x, residual=None):
    out = torch.empty(_C.codec_encoded_bytes(codec, x.numel(), block), dtype=torch.uint8)
    _C.codec_encode(codec, block, x, out, residual)
    return out


def decode_into(codec, block, enc, out, accumulate=False):
    _C.codec_decode(codec, block, enc, out, accumulate)
    return out


def one_shot_bound(codec, block, x):
    """Per-element bound of one encoding of x (blocks from x's start), from the stated bounds."""
    n = x.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    xd = x.double().abs()
    if codec == "bf16":
        return xd * 2.0 ** -8
    nb = (n + block - 1) // block
    pad = torch.zeros(nb * block, dtype=torch.float64)
    pad[:n] = xd
    amax = pad.view(nb, block).max(dim=1).values.repeat_interleave(block)[:n]
    s = amax / QMAX[codec]
    ulps = amax * 2.0 ** -22 + 2.0 ** -149
    if codec == "fp8":
        return xd * 2.0 ** -4 + s * 2.0 ** -10 + ulps
    return s / 2 + ulps


def feedback(codec, block, x, decoded, mult, residual):
    """residual += mult * (x - decoded) on x's finite blocks (axc_codec_feedback), in fp32."""
    for lo in range(0, x.numel(), block):
        hi = min(x.numel(), lo + block)
        if bool(torch.isfinite(x[lo:hi]).all()):
            residual[lo:hi] += (x[lo:hi] - decoded[lo:hi]) * mult


def pieces(n, G):
    piece = (n + G - 1) // G
    return piece, [(min(k * piece, n), min(n, (k + 1) * piece)) for k in range(G)]


def emulate(coll, codec, block, xs, op, residuals=None):
    """(result on every rank, error bound) of the compressed collective, serially."""
    G = len(xs)
    if coll == "all_gather":
        dec = [decode_into(codec, block, encode(codec, block, x, None if residuals is None
                                                else residuals[r]), torch.empty_like(x))
               for r, x in enumerate(xs)]
        bound = torch.cat([one_shot_bound(codec, block, x) for x in xs])
        return torch.cat(dec), bound
    n = xs[0].numel()
    if coll == "reduce_scatter":
        piece, bounds = n // G, [(k * (n // G), (k + 1) * (n // G)) for k in range(G)]
    else:
        piece, bounds = pieces(n, G)
    contrib = [x.clone() if residuals is None else x + residuals[r] for r, x in enumerate(xs)]
    encs = [[encode(codec, block, xs[r][lo:hi], None if residuals is None
                    else residuals[r][lo:hi]) for lo, hi in bounds] for r in range(G)]
    sums, bound = [], torch.zeros(n, dtype=torch.float64)
    for k, (lo, hi) in enumerate(bounds):
        s = torch.empty(hi - lo)
        for r in range(G):
            decode_into(codec, block, encs[r][k], s, accumulate=r > 0)
            bound[lo:hi] += one_shot_bound(codec, block, contrib[r][lo:hi])
        if op == "avg":
            s = s / G
            bound[lo:hi] /= G
        sums.append(s)
    if coll == "reduce_scatter":
        return sums, bound
    outs = [decode_into(codec, block, encode(codec, block, s), torch.empty_like(s)) for s in sums]
    if residuals is not None:  # the owner feeds back what encoding its sum lost
        for k, (lo, hi) in enumerate(bounds):
            feedback(codec, block, sums[k], outs[k], G if op == "avg" else 1,
                     residuals[k][lo:hi])
    out = torch.cat(outs)
    bound += torch.cat([one_shot_bound(codec, block, s) for s in sums])
    return out, bound


def exact(coll, xs, op):
    if coll == "all_gather":
        return torch.cat(xs).double()
    total = torch.stack([x.double() for x in xs]).sum(0)
    if op == "avg":
        total /= len(xs)
    return total


def expected_bytes(coll, codec, block, n, G, me):
    """(wire sent, logical sent) of one call: the closed form of docs/compression.md."""
    if G == 1:
        return 0, 0
    piece = (n + G - 1) // G if coll == "all_reduce" else n
    E = _C.codec_encoded_bytes(codec, piece, block)
    if coll == "all_reduce":
        mine = n // G + (1 if me < n % G else 0)
        return 2 * (G - 1) * E, 2 * (n - mine) * 4
    return (G - 1) * E, (G - 1) * n * 4


def bitwise_same_on_all(t, group, G):
    """Every member holds the same bits (compared through an exact uncompressed all_gather)."""
    bits = t.contiguous().view(torch.int32)
    out = torch.empty(G * bits.numel(), dtype=torch.int32)
    axonn_c.comm.all_gather(out, bits, group=group)
    return all(torch.equal(out.view(G, -1)[k], bits) for k in range(G))


def run_case(g, group, coll, codec, block, n, op, seed, ef_steps):
    members = g.members(group)
    G, me = len(members), members.index(g.rank)
    count = n * G if coll == "reduce_scatter" else n
    residuals = [torch.zeros(count) for _ in members] if ef_steps else None
    what = f"{coll}({op}) {codec}/{block} n={n} on {group} (G={G}) ef_steps={ef_steps}"
    spec = {"codec": codec, "block": block}
    block = block or _C.codec_default_block(codec)
    for step in range(max(1, ef_steps)):
        xs = [make_input(count, seed + step, r) for r in members]
        want_res = [r.clone() for r in residuals] if residuals is not None else None
        want, bound = emulate(coll, codec, block, xs, op, want_res)
        if residuals is not None:
            spec["error_feedback"] = residuals[me]
        axonn_c.reset_comm_stats()
        mine = xs[me].clone()
        if coll == "all_reduce":
            got = mine
            axonn_c.comm.all_reduce(got, group=group, op=op, compression=spec)
        elif coll == "reduce_scatter":
            got = torch.empty(n)
            axonn_c.comm.reduce_scatter(got, mine, group=group, op=op, compression=spec)
            want = want[me]
            lo = me * n
            bound = bound[lo:lo + n]
            xs_exact = [x[lo:lo + n] for x in xs]
        else:
            got = torch.empty(n * G)
            axonn_c.comm.all_gather(got, mine, group=group, compression=spec)
        stats = axonn_c.comm_stats()[group]
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            d = (got - want).abs()
            raise AssertionError(f"{what}: differs from the serial emulation, max |diff| "
                                 f"{d.max().item()} at {d.argmax().item()}")
        parts = xs_exact if coll == "reduce_scatter" else xs
        ref = exact(coll, parts, op)
        err = (got.double() - ref).abs()
        # fp32 summation of G decoded values, and roundings of the bounds themselves
        slack = 2.0 ** -21 * G * exact(coll, [x.abs() for x in parts], "sum") + 2.0 ** -20 * bound
        if residuals is None and not bool((err <= bound + slack).all()):
            i = int((err - bound).argmax())
            raise AssertionError(f"{what}: error {err[i].item()} above the bound "
                                 f"{bound[i].item()} at {i}")
        if residuals is not None:
            residuals[me].copy_(spec["error_feedback"])
            for r in range(G):
                if r != me:
                    residuals[r].copy_(want_res[r])
            if not torch.equal(residuals[me], want_res[me]):
                raise AssertionError(f"{what}: residual differs from the emulation")
        if G > 1 and coll != "reduce_scatter" and not bitwise_same_on_all(got, group, G):
            raise AssertionError(f"{what}: ranks hold different results")
        wire, logical = expected_bytes(coll, codec, block, n, G, me)
        if (stats["bytes_sent"], stats["bytes_recv"], stats["logical_bytes_sent"],
                stats["compressed_calls"]) != (wire, wire, logical, 1):
            raise AssertionError(f"{what}: counters {stats}, expected wire {wire}, "
                                 f"logical {logical}")


def run_non_finite(g, group):
    """An inf on one rank reaches every rank (its block decodes non-finite everywhere)."""
    members = g.members(group)
    G = len(members)
    for codec in CODECS:
        x = make_input(1000, 3, g.rank)
        if g.rank == members[-1]:
            x[5] = float("inf")
        axonn_c.comm.all_reduce(x, group=group, compression=codec)
        if G > 1 and not bool(torch.isinf(x[5]) or torch.isnan(x[5])):
            raise AssertionError(f"{codec}: inf on one rank became {x[5].item()}")
        if G > 1 and codec != "bf16" and not bool((~torch.isfinite(x[:32])).all()):
            raise AssertionError(f"{codec}: the inf's block was not marked non-finite")
        if not bool(torch.isfinite(x[600:]).all()):
            raise AssertionError(f"{codec}: non-finite values outside the inf's block")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grid", default="")
    p.add_argument("--sizes", default="1,7,1000")
    p.add_argument("--blocks", default="0")
    p.add_argument("--codecs", default=",".join(CODECS))
    a = p.parse_args()
    world = int(__import__("os").environ["WORLD_SIZE"])
    dims = [int(v) for v in a.grid.split(",")] if a.grid else [world, 1, 1, 1]
    g = axonn_c.init(G_data=dims[0], G_intra_r=dims[1], G_intra_c=dims[2], G_intra_d=dims[3],
                     backend="shm")
    groups = [k for k in ("data", "row", "col", "depth", "world")
              if k == "world" or len(g.members(k)) > 1]
    sizes = [int(v) for v in a.sizes.split(",")]
    blocks = [int(v) for v in a.blocks.split(",")]
    cases = 0
    for group in groups:
        for codec in a.codecs.split(","):
            for block in blocks:
                for n in sizes:
                    for coll, op in (("all_reduce", "sum"), ("all_reduce", "avg"),
                                     ("reduce_scatter", "sum"), ("all_gather", "sum")):
                        run_case(g, group, coll, codec, block, n, op, seed=n + block, ef_steps=0)
                        cases += 1
                run_case(g, group, "all_reduce", codec, block, sizes[-1], "sum", seed=5,
                         ef_steps=3)
                run_case(g, group, "reduce_scatter", codec, block, sizes[-1], "avg", seed=6,
                         ef_steps=2)
                cases += 2
        run_non_finite(g, group)
    axonn_c.finalize()
    print(f"world {world} grid {dims}: {cases} compressed cases match the emulation, "
          f"bounds, counters and are identical on every rank")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
