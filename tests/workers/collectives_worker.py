"""Multi-rank check of the transport against torch.distributed (gloo), launched by torchrun.

For every grid factorisation of the world size, every group, collective, dtype and length, the
axonn_c result must equal gloo's on the same group, and the byte counters must equal the closed
-form ring volumes (computed here independently of the C code).
"""
import argparse
import sys
import warnings

import torch
import torch.distributed as dist

import axonn_c
from common import DTYPES, GROUPS, grids

warnings.filterwarnings("ignore", category=FutureWarning)
COLLECTIVES = ("all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_gather",
               "reduce_scatter", "all_to_all", "broadcast")


_gloo_groups = {}


def make_gloo_groups(g, world):
    """Gloo subgroups for every group of grid `g`: new_group is collective over the world, so
    every rank creates every group, in the same order."""
    for group in GROUPS:
        for r in range(world):
            key = tuple(axonn_c._C.grid_members(g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d,
                                                r, group))
            if key not in _gloo_groups:
                _gloo_groups[key] = dist.new_group(list(key), backend="gloo")


def gloo_group(members):
    return _gloo_groups[tuple(members)]


def make_input(dtype, n, gen):
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    lo, hi = (-10, 10) if dtype == torch.int8 else (0, 30)
    return torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64).to(dtype)


def ring_volume(coll, nbytes_piece, elems, esize, G, me, root=0):
    """Bytes (sent, recv) of one collective, ring algorithm, as documented in docs/transport.md."""
    if G == 1:
        return 0, 0
    if coll.startswith("all_reduce"):
        piece = elems // G + (1 if me < elems % G else 0)
        v = 2 * (elems - piece) * esize
        return v, v
    if coll in ("all_gather", "reduce_scatter", "all_to_all"):
        v = (G - 1) * nbytes_piece
        return v, v
    if coll == "broadcast":
        pos = (me - root) % G
        return (0 if pos == G - 1 else nbytes_piece), (0 if pos == 0 else nbytes_piece)
    return 0, 0


def check_equal(got, want, dtype, what):
    if dtype in (torch.bfloat16, torch.float16):
        ok = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    elif dtype.is_floating_point:
        ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        ok = torch.equal(got, want)
    if not ok:
        diff = (got.double() - want.double()).abs()
        raise AssertionError(f"{what}: mismatch, max |diff| {diff.max().item()} at "
                             f"{diff.argmax().item()} (got {got.flatten()[:4].tolist()}, "
                             f"want {want.flatten()[:4].tolist()})")


def run_case(g, group, coll, dtype, n, seed, async_op):
    members = g.members(group)
    G, me = len(members), members.index(g.rank)
    pg = gloo_group(members)
    gen = torch.Generator().manual_seed(seed * 1000 + g.rank)
    esize = torch.empty(0, dtype=dtype).element_size()
    before = axonn_c.comm_stats()[group]
    root = G - 1
    if coll.startswith("all_reduce"):
        op = coll.split("_")[-1]
        x = make_input(dtype, n, gen)
        ours = x.clone()
        w = axonn_c.comm.all_reduce(ours, group=group, op=op, async_op=async_op)
        ref = x.clone()
        dist.all_reduce(ref, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=pg)
        if op == "avg":
            if dtype.is_floating_point:
                ref = (x.float() if dtype != torch.float32 else x).clone()
                dist.all_reduce(ref, group=pg)
                ref = (ref / G).to(dtype)
            else:
                wide = x.to(torch.int64)
                dist.all_reduce(wide, group=pg)
                ref = torch.div(wide, G, rounding_mode="trunc").to(dtype)
        piece_bytes = n * esize
    elif coll == "all_gather":
        x = make_input(dtype, n, gen)
        ours = torch.empty(G * n, dtype=dtype)
        w = axonn_c.comm.all_gather(ours, x, group=group, async_op=async_op)
        ref = torch.empty(G * n, dtype=dtype)
        dist.all_gather_into_tensor(ref, x, group=pg)
        piece_bytes = n * esize
    elif coll == "reduce_scatter":
        x = make_input(dtype, G * n, gen)
        ours = torch.empty(n, dtype=dtype)
        w = axonn_c.comm.reduce_scatter(ours, x, group=group, async_op=async_op)
        ref = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(ref, x, group=pg)
        piece_bytes = n * esize
    elif coll == "all_to_all":
        x = make_input(dtype, G * n, gen)
        ours = torch.empty(G * n, dtype=dtype)
        w = axonn_c.comm.all_to_all(ours, x, group=group, async_op=async_op)
        ref = torch.empty(G * n, dtype=dtype)
        dist.all_to_all_single(ref, x, group=pg)
        piece_bytes = n * esize
    elif coll == "broadcast":
        x = make_input(dtype, n, gen)
        ours = x.clone()
        w = axonn_c.comm.broadcast(ours, src=root, group=group, async_op=async_op)
        ref = x.clone()
        dist.broadcast(ref, src=members[root], group=pg)
        piece_bytes = n * esize
    if async_op:
        w.wait()
        assert w.is_completed()
    what = f"rank {g.rank} grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} " \
           f"{coll} {group} {dtype} n={n}"
    if dtype in (torch.bfloat16, torch.float16) and coll in ("all_reduce_sum", "all_reduce_avg",
                                                              "reduce_scatter"):
        # gloo sums 16-bit values with a rounding per step; ours accumulates in fp32 and rounds
        # once, so hold ours to the exact sum (of the inputs gathered by gloo) within one ulp
        every = torch.empty(G * x.numel(), dtype=dtype)
        dist.all_gather_into_tensor(every, x, group=pg)
        exact = every.double().view(G, -1).sum(0)
        if coll == "reduce_scatter":
            exact = exact.view(G, -1)[me]
        if coll == "all_reduce_avg":
            exact = exact / G
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        err = (ours.double() - exact).abs()
        bound = ulp * exact.abs() + 1e-6
        assert bool((err <= bound).all()), \
            f"{what}: not within one ulp of the exact sum, worst {err.max().item()}"
    else:
        check_equal(ours, ref, dtype, what)
    after = axonn_c.comm_stats()[group]
    sent, recv = ring_volume(coll, piece_bytes, n, esize, G, me, root)
    got = (after["bytes_sent"] - before["bytes_sent"], after["bytes_recv"] - before["bytes_recv"])
    assert got == (sent, recv), f"{what}: counters {got}, ring volume {(sent, recv)}"
    assert after["calls"] == before["calls"] + 1, what


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,7,1000")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--grids", default="all", help="all, or the first N grids")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [int(s) for s in args.sizes.split(",")]
    all_grids = list(grids(world))
    if args.grids != "all":
        all_grids = all_grids[-int(args.grids):]  # the last ones have the most TP dimensions
    cases = 0
    for gi, sizes4 in enumerate(all_grids):
        g = axonn_c.init(G_data=sizes4[0], G_intra_r=sizes4[1], G_intra_c=sizes4[2],
                         G_intra_d=sizes4[3], timeout=120)
        assert (g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d) == sizes4
        make_gloo_groups(g, world)
        for group in GROUPS:
            for coll in args.collectives.split(","):
                for dname in args.dtypes.split(","):
                    for n in sizes:
                        seed = hash((gi, group, coll, dname, n)) % 100000
                        run_case(g, group, coll, DTYPES[dname], n, seed, async_op=(cases % 2 == 1))
                        cases += 1
            axonn_c.comm.barrier(group=group)
        axonn_c.finalize()
    dist.barrier()
    if rank == 0:
        print(f"world {world}: {len(all_grids)} grids, {cases} cases per rank: all equal to gloo")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
