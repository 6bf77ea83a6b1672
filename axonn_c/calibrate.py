"""Measures this machine's link constants with the running axonn_c backend and writes a
machine profile for the planner (`python -m axonn_c.plan --machine PROFILE.json`):

    torchrun --nproc_per_node 4 -m axonn_c.calibrate --out machine.json

(`python -m axonn_c.plan --calibrate --out ...` runs this program.)"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from . import _C, comm, runtime


def calibrate(out_path: str, sizes_mib: float = 64.0, iters: int = 5) -> dict:
    """Measures beta per (stride, size) with the active axonn_c backend; run under torchrun on
    the cluster (all ranks). Rank 0 writes the profile to `out_path` and returns it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world < 2:
        raise SystemExit("--calibrate needs at least 2 ranks: run it under torchrun, e.g. "
                         "torchrun --nproc_per_node 4 -m axonn_c.calibrate --out m.json")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    elems = max(1024, int(sizes_mib * 2**20) // 4)

    def measure(stride: int, size: int, n: int) -> tuple[float, int, int]:
        runtime.init(G_data=world // (stride * size), G_intra_r=size, G_intra_c=stride,
                     G_intra_d=1)
        try:
            t = torch.ones(n, dtype=torch.float32, device=dev)
            comm.all_reduce(t, group="row")  # warm-up
            comm.barrier()
            runtime.reset_comm_stats()
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(t, group="row")
            if dev == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / iters
            st = runtime.comm_stats()["row"]
            return dt, st["bytes_sent"] // iters, st["calls"] // iters
        finally:
            runtime.finalize()

    entries, inter = [], []
    alphas_intra, alphas_inter = [], []
    stride = 1
    while stride < world:
        size = 2
        while stride * size <= world:
            if world % (stride * size) == 0:
                dt, sent, _ = measure(stride, size, elems)
                dt_small, _, _ = measure(stride, size, 256)
                gbps = sent / dt / 1e9
                hop_s = dt_small / (2 * (size - 1))
                intra = stride * size <= gpn and gpn % (stride * size) == 0
                if intra:
                    entries.append([stride, size, round(gbps, 2)])
                    alphas_intra.append(hop_s * 1e6)
                else:
                    inter.append(gbps * min(stride, gpn))
                    alphas_inter.append(hop_s * 1e6)
                if rank == 0:
                    print(f"  stride {stride:>4} size {size:>4}: {gbps:8.2f} GB/s "
                          f"({'intra' if intra else 'inter'}-node), {hop_s * 1e6:.1f} us/step",
                          flush=True)
            size *= 2
        stride *= 2

    def med(xs, default):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else default

    if dev == "cuda":
        mem_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / gpn
    intra_gbps = med([e[2] for e in entries], 10.0)
    prof = {
        "name": os.path.splitext(os.path.basename(out_path))[0],
        "gpus_per_node": gpn,
        "mem_gib": round(mem_gib, 2),
        "mem_reserve_gib": round(min(4.0, mem_gib * 0.1), 2),
        "intra_gbps": intra_gbps,
        "inter_node_gbps": round(med(inter, intra_gbps), 2),
        "alpha_intra_us": round(med(alphas_intra, 5.0), 2),
        "alpha_inter_us": round(med(alphas_inter, med(alphas_intra, 5.0)), 2),
        "entries": entries[:32],
        "source": f"axonn_c.calibrate, {world} ranks, {gpn} per node, {dev}, "
                  f"{time.strftime('%Y-%m-%d')}",
    }
    _C.model_machine(prof)  # validate
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(prof, f, indent=1)
            f.write("\n")
        print(f"axonn_c: wrote machine profile {out_path}", flush=True)
    return prof


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m axonn_c.calibrate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="machine.json", help="the profile to write")
    p.add_argument("--size-mib", type=float, default=64.0, help="message size measured")
    p.add_argument("--iters", type=int, default=5, help="repetitions per measurement")
    args = p.parse_args(argv)
    calibrate(args.out, args.size_mib, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
