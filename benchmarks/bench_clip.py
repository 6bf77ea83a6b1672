"""axonn_c.clip_grad_norm_ next to torch.nn.utils.clip_grad_norm_ at a world of one, on the
gradients of a stack of transformer-like blocks (LayerNorm, Linear up, Linear down) built under
auto_parallelize: the time is the per-parameter host work and kernel launches.

    python benchmarks/bench_clip.py [--blocks 24] [--width 64] [--device cuda] [--json OUT]

Both run in the same process, interleaved round by round; the best round of each is kept.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn

import axonn_c


def _best_us(fn, sync, rounds: int, calls: int) -> float:
    best = math.inf
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is not None:  # ("cuda": the current device)
        torch.cuda.set_device(dev)
    axonn_c.init()
    torch.manual_seed(0)
    h = args.width
    with axonn_c.auto_parallelize():
        model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.GELU(),
                                              nn.Linear(4 * h, h))
                                for _ in range(args.blocks)]).to(dev)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for norm_type in (2.0, math.inf):
        ours = theirs = math.inf
        for _ in range(3):  # (interleaved: the same machine state for both)
            ours = min(ours, _best_us(lambda: axonn_c.clip_grad_norm_(params, 1e9, norm_type),
                                      sync, args.rounds, args.calls))
            theirs = min(theirs, _best_us(
                lambda: torch.nn.utils.clip_grad_norm_(params, 1e9, norm_type), sync,
                args.rounds, args.calls))
        rows.append({"norm_type": norm_type, "params": len(params), "device": str(dev),
                     "axonn_c_us": round(ours, 1), "torch_us": round(theirs, 1),
                     "ratio": round(ours / theirs, 3)})
        print(f"clip_grad_norm_ p={norm_type}: {len(params)} gradients on {dev}: axonn_c "
              f"{ours:.0f} us, torch {theirs:.0f} us ({ours / theirs:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    axonn_c.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
