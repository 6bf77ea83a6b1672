"""Multi-rank check with CUDA tensors, launched by torchrun (several ranks may share one GPU).

Every rank builds every member's input from a seed, so the expected result of each collective is
computed serially in this process (float64/int64 on the CPU) and compared with what the transport
returns for CUDA tensors. Usage: torchrun --standalone --nproc_per_node N gpu_shm_worker.py
[--backend shm] [--sizes 1,7,1000].
"""
import argparse
import os
import sys

import torch

import axonn_c
from common import DTYPES, GROUPS, grids

COLLECTIVES = ("all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_gather",
               "reduce_scatter", "all_to_all", "broadcast")


def make_input(dtype, n, seed, rank):
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    lo, hi = (-10, 10) if dtype == torch.int8 else (0, 30)
    return torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64).to(dtype)


def reduce(xs, op, dtype):
    """Serial reduction of the members' inputs, in a wide type, rounded to dtype at the end."""
    wide = [x.double() if dtype.is_floating_point else x.long() for x in xs]
    if op == "max":
        out = torch.stack(wide).max(dim=0).values
    else:
        out = torch.stack(wide).sum(dim=0)
        if op == "avg":
            out = out / len(xs) if dtype.is_floating_point else torch.div(
                out, len(xs), rounding_mode="trunc")
    return out.to(dtype)


def check(got, want, dtype, what):
    got = got.cpu()
    if dtype in (torch.bfloat16, torch.float16):
        ok = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    elif dtype.is_floating_point:
        ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        ok = torch.equal(got, want)
    if not ok:
        diff = (got.double() - want.double()).abs()
        raise AssertionError(f"{what}: mismatch, max |diff| {diff.max().item()} at "
                             f"{diff.argmax().item()} (got {got[:4].tolist()}, "
                             f"want {want[:4].tolist()})")


def run_case(g, dev, group, coll, dtype, n, seed, async_op):
    members = g.members(group)
    G, me = len(members), members.index(g.rank)
    big = coll in ("reduce_scatter", "all_to_all")
    xs = [make_input(dtype, G * n if big else n, seed, r) for r in members]
    x = xs[me].to(dev)
    root = G - 1
    if coll.startswith("all_reduce"):
        op = coll.split("_")[-1]
        ours = x.clone()
        w = axonn_c.comm.all_reduce(ours, group=group, op=op, async_op=async_op)
        want = reduce(xs, op, dtype)
    elif coll == "all_gather":
        ours = torch.empty(G * n, dtype=dtype, device=dev)
        w = axonn_c.comm.all_gather(ours, x, group=group, async_op=async_op)
        want = torch.cat(xs)
    elif coll == "reduce_scatter":
        ours = torch.empty(n, dtype=dtype, device=dev)
        w = axonn_c.comm.reduce_scatter(ours, x, group=group, async_op=async_op)
        want = reduce([v[me * n:(me + 1) * n] for v in xs], "sum", dtype)
    elif coll == "all_to_all":
        ours = torch.empty(G * n, dtype=dtype, device=dev)
        w = axonn_c.comm.all_to_all(ours, x, group=group, async_op=async_op)
        want = torch.cat([v[me * n:(me + 1) * n] for v in xs])
    elif coll == "broadcast":
        ours = x.clone()
        w = axonn_c.comm.broadcast(ours, src=root, group=group, async_op=async_op)
        want = xs[root]
    else:
        raise ValueError(coll)
    if async_op:
        w.wait()
        assert w.is_completed()
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    what = (f"rank {g.rank} grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} {coll} "
            f"{group} {dtype} n={n} async={async_op}")
    check(ours, want, dtype, what)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="shm")
    p.add_argument("--sizes", default="1,7,1000")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--device", default="cuda", help="cuda, or cpu to dry-run the checks")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_shm_worker: CUDA is not available", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = 0
    for gi, (gdata, gr, gc, gd) in enumerate(grids(world)):
        g = axonn_c.init(G_data=gdata, G_intra_r=gr, G_intra_c=gc, G_intra_d=gd,
                         backend=args.backend, timeout=args.timeout)
        dev = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
               else torch.device("cpu"))
        for group in GROUPS:
            for coll in args.collectives.split(","):
                for dname in args.dtypes.split(","):
                    for n in sizes:
                        seed = (gi * 7919 + GROUPS.index(group) * 131 +
                                COLLECTIVES.index(coll) * 17 + list(DTYPES).index(dname)) * 1000 + n
                        run_case(g, dev, group, coll, DTYPES[dname], n, seed,
                                 async_op=cases % 2 == 1)
                        cases += 1
            axonn_c.comm.barrier(group=group)
        axonn_c.finalize()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"gpu_shm_worker: world {world}, backend {args.backend}, {cases} cases per rank "
              f"on {args.device} tensors: all equal to the serial result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
