"""axonn_c.Linear at grid 1x1x1 vs nn.Linear, forward + backward, measured in the same run.

    python benchmarks/bench_linear.py --json benchmarks/results/linear_cpu.json [--device cuda]

GPT shapes (the attention/MLP projections of a block: h->h, h->4h, 4h->h) and tiny shapes whose
time is host overhead (reported in microseconds per call). Prints a table; the JSON is a list of
rows {device, dtype, tokens, in, out, t_axonn_s, t_torch_s, ratio}.
"""
import argparse
import json
import os
import sys
import time

import torch

import axonn_c


def timeit(fn, device, min_time=0.5, max_iters=2000):
    fn()  # warm-up (allocations, BLAS threads)
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    n, total = 0, 0.0
    best = float("inf")
    while total < min_time and n < max_iters:
        reps = max(1, min(50, int(0.05 / best))) if best < float("inf") else 1
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        best = min(best, dt / reps)
        total += dt
        n += reps
    return best


def bench(tokens, fin, fout, dtype, device):
    torch.manual_seed(0)
    ours = axonn_c.Linear(fin, fout, dtype=dtype, device=device)
    ref = torch.nn.Linear(fin, fout, dtype=dtype, device=device)
    x = torch.randn(tokens, fin, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(tokens, fout, dtype=dtype, device=device)

    def step(layer):
        def run():
            layer(x).backward(g)
        return run

    # interleave the two so both see the same machine state; keep the best of 3 rounds
    t_ours, t_ref = [], []
    for _ in range(3):
        t_ours.append(timeit(step(ours), device))
        t_ref.append(timeit(step(ref), device))
    return min(t_ours), min(t_ref)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    a = p.parse_args()
    device = a.device
    dtype = getattr(torch, a.dtype or ("bfloat16" if device == "cuda" else "float32"))
    axonn_c.init()
    if device == "cuda":
        tokens_list, hiddens = [2048, 8192], [1024, 4096, 8192]
    else:
        tokens_list, hiddens = [512, 2048], [512, 1024, 2048]
    if a.quick:
        tokens_list, hiddens = tokens_list[:1], hiddens[:2]
    shapes = []
    for t in tokens_list:
        for h in hiddens:
            shapes += [(t, h, h), (t, h, 4 * h), (t, 4 * h, h)]
    tiny = [(1, 8, 8), (4, 16, 16), (16, 64, 64)]
    rows = []
    print(f"{'device':<7}{'dtype':<10}{'tokens':>7}{'in':>7}{'out':>7}{'axonn_c':>13}"
          f"{'nn.Linear':>13}{'ratio':>8}")
    for t, fin, fout in tiny + shapes:
        t_ours, t_ref = bench(t, fin, fout, dtype, device)
        row = {"device": device, "dtype": str(dtype)[6:], "tokens": t, "in": fin, "out": fout,
               "t_axonn_s": t_ours, "t_torch_s": t_ref, "ratio": t_ours / t_ref}
        rows.append(row)
        unit, scale = ("us", 1e6) if (t, fin, fout) in tiny else ("ms", 1e3)
        print(f"{device:<7}{row['dtype']:<10}{t:>7}{fin:>7}{fout:>7}"
              f"{t_ours * scale:>10.1f} {unit}{t_ref * scale:>10.1f} {unit}{row['ratio']:>8.3f}",
              flush=True)
    over = [r["t_axonn_s"] - r["t_torch_s"] for r in rows if (r["tokens"], r["in"], r["out"]) in tiny]
    print(f"\nhost overhead vs nn.Linear (fwd+bwd, tiny shapes): "
          f"{min(over) * 1e6:.1f} to {max(over) * 1e6:.1f} us per call")
    big = [r["ratio"] for r in rows if (r["tokens"], r["in"], r["out"]) not in tiny]
    print(f"large shapes: ratio {min(big):.3f} to {max(big):.3f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)) or ".", exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    axonn_c.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
