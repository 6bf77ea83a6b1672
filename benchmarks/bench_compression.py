"""Codec measurements on the CPU: the block-size choice and the codecs' throughput.

    python benchmarks/bench_compression.py --json benchmarks/results/compression_cpu.json

1. Block sweep (fp8, int8, int4; blocks 32..4096) on gradient-like data (docs/compression.md):
   bits per element on the wire, the rel-L2 error of one encoding, of an 8-rank one-shot
   compressed average (each rank's contribution encoded once, the fp32 sum re-encoded once, as
   the transport does) and of the sum of 20 such averages with error feedback; and the encode
   and decode throughput at that block.
2. Throughput of every codec at the default block: GB/s of fp32 input encoded, decoded, and
   decoded-accumulated, next to a memcpy (torch copy_) of the same fp32 buffer in the same run.
All timings are the best of --repeats runs, one thread (the C reference is single-threaded).
"""
import argparse
import json
import time

import torch

from axonn_c import _C

CODECS = ("bf16", "fp8", "int8", "int4")


def gradient_like(n, ranks, seed=0):
    """Per-rank gradients: 4096-element "layers" with log-uniform scales over ~2.6 decades, a
    signal shared by the ranks (30% of the scale) plus per-rank noise, and 1e-4 of 20x
    outliers."""
    gen = torch.Generator().manual_seed(seed)
    layers = (n + 4095) // 4096
    scale = (10.0 ** (-2.6 * torch.rand(layers, generator=gen))).repeat_interleave(4096)[:n]
    shared = 0.3 * torch.randn(n, generator=gen)
    out = []
    for _ in range(ranks):
        x = (shared + torch.randn(n, generator=gen)) * scale
        spikes = torch.rand(n, generator=gen) < 1e-4
        x[spikes] *= 20
        out.append(x)
    return out


def encode(codec, block, x, residual=None):
    e = torch.empty(_C.codec_encoded_bytes(codec, x.numel(), block), dtype=torch.uint8)
    _C.codec_encode(codec, block, x, e, residual)
    return e


def decode(codec, block, e, n, out=None, acc=False):
    out = torch.empty(n) if out is None else out
    _C.codec_decode(codec, block, e, out, acc)
    return out


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def one_shot_avg(codec, block, xs, residuals=None):
    """The transport's compressed all_reduce(avg), emulated on one process (one owner: the
    pieces only split the work); with residuals, each rank's contribution is fed back and the
    owner feeds back what encoding the average lost (G times, into rank 0's residual here)."""
    n = xs[0].numel()
    s = torch.zeros(n)
    for r, x in enumerate(xs):
        res = None if residuals is None else residuals[r]
        decode(codec, block, encode(codec, block, x, res), n, s, acc=True)
    s /= len(xs)
    out = decode(codec, block, encode(codec, block, s), n)
    if residuals is not None:
        residuals[0] += (s - out) * len(xs)
    return out


def best_time(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def throughput(codec, block, x, repeats):
    n = x.numel()
    e = encode(codec, block, x)
    out = torch.empty(n)
    gb = n * 4 / 1e9
    return {
        "encode_GBps": gb / best_time(lambda: _C.codec_encode(codec, block, x, e, None), repeats),
        "decode_GBps": gb / best_time(lambda: _C.codec_decode(codec, block, e, out, False), repeats),
        "decode_acc_GBps": gb / best_time(lambda: _C.codec_decode(codec, block, e, out, True),
                                          repeats),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elems", type=int, default=1 << 22, help="elements timed (fp32)")
    p.add_argument("--sweep-elems", type=int, default=1 << 18, help="elements per rank, sweep")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="error-feedback steps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="")
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []

    print(f"block sweep: {a.ranks} ranks x {a.sweep_elems} elements; EF over {a.steps} steps")
    print(f"{'codec':5} {'block':>5} {'bits/el':>7} {'one enc':>9} {'avg P':>9} {'EF sum':>9} "
          f"{'noEF sum':>9} {'enc GB/s':>8} {'dec GB/s':>8}")
    xs = gradient_like(a.sweep_elems, a.ranks)
    exact = torch.stack([x.double() for x in xs]).mean(0)
    steps = [gradient_like(a.sweep_elems, a.ranks, seed=1 + t) for t in range(a.steps)]
    exact_sum = sum(torch.stack([x.double() for x in st]).mean(0) for st in steps)
    timing_x = gradient_like(a.elems, 1, seed=99)[0]
    for codec in ("fp8", "int8", "int4"):
        block = 32
        while block <= 4096:
            bits = 8 * _C.codec_encoded_bytes(codec, a.sweep_elems, block) / a.sweep_elems
            one = rel_l2(decode(codec, block, encode(codec, block, xs[0]), a.sweep_elems), xs[0])
            avg = rel_l2(one_shot_avg(codec, block, xs), exact)
            res = [torch.zeros(a.sweep_elems) for _ in range(a.ranks)]
            ef = sum(one_shot_avg(codec, block, st, res).double() for st in steps)
            noef = sum(one_shot_avg(codec, block, st).double() for st in steps)
            tp = throughput(codec, block, timing_x, a.repeats)
            row = {"kind": "sweep", "codec": codec, "block": block, "bits_per_elem": bits,
                   "rel_l2_one": one, "rel_l2_avg": avg, "rel_l2_ef_sum": rel_l2(ef, exact_sum),
                   "rel_l2_noef_sum": rel_l2(noef, exact_sum), **tp}
            rows.append(row)
            print(f"{codec:5} {block:5d} {bits:7.3f} {one:9.2e} {avg:9.2e} "
                  f"{row['rel_l2_ef_sum']:9.2e} {row['rel_l2_noef_sum']:9.2e} "
                  f"{tp['encode_GBps']:8.2f} {tp['decode_GBps']:8.2f}")
            block *= 2

    print(f"\nthroughput at each codec's default block, {a.elems} fp32 elements "
          f"({a.elems * 4 >> 20} MiB), best of {a.repeats}")
    dst = torch.empty_like(timing_x)
    memcpy = a.elems * 4 / 1e9 / best_time(lambda: dst.copy_(timing_x), a.repeats)
    rows.append({"kind": "memcpy", "GBps": memcpy})
    print(f"memcpy (torch copy_): {memcpy:.2f} GB/s")
    print(f"{'codec':5} {'block':>5} {'enc GB/s':>8} {'dec GB/s':>8} {'dec+acc':>8} {'ratio':>6}")
    for codec in ("none",) + CODECS:
        default = _C.codec_default_block(codec)
        tp = throughput(codec, default, timing_x, a.repeats)
        ratio = a.elems * 4 / _C.codec_encoded_bytes(codec, a.elems, default)
        rows.append({"kind": "throughput", "codec": codec, "block": default,
                     "ratio_vs_fp32": ratio, **tp})
        print(f"{codec:5} {default:5d} {tp['encode_GBps']:8.2f} {tp['decode_GBps']:8.2f} "
              f"{tp['decode_acc_GBps']:8.2f} {ratio:6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
