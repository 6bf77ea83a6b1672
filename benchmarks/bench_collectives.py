"""Bus bandwidth of axonn_c's shm transport vs torch.distributed gloo, same run, same ranks.

    python benchmarks/bench_collectives.py --json benchmarks/results/collectives.json

launches itself with torchrun at 2 and 4 ranks, times all_reduce / all_gather / reduce_scatter
from 4 KiB to 64 MiB (float32), prints a table and writes a JSON list of rows
{op, ranks, bytes, busbw_shm_GBps, busbw_gloo_GBps}. Bus bandwidth follows nccl-tests:
algbw = bytes / time, busbw = algbw * 2(n-1)/n for all_reduce and (n-1)/n for the others,
where `bytes` is the size of the full (gathered / unscattered) buffer.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(op, n):
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def worker(out_path, sizes):
    import torch
    import torch.distributed as dist

    import axonn_c

    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    axonn_c.init(G_data=n)
    rows = []
    for op in OPS:
        for nbytes in sizes:
            elems = nbytes // 4
            full = torch.randn(elems)
            piece = torch.randn(elems // n)
            iters = max(3, min(50, (64 << 20) // nbytes))

            def ours():
                if op == "all_reduce":
                    axonn_c.comm.all_reduce(full)
                elif op == "all_gather":
                    axonn_c.comm.all_gather(full, piece)
                else:
                    axonn_c.comm.reduce_scatter(piece, full)

            def gloo():
                if op == "all_reduce":
                    dist.all_reduce(full)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(full, piece)
                else:
                    dist.reduce_scatter_tensor(piece, full)

            times = {}
            for name, fn in (("shm", ours), ("gloo", gloo)):
                fn()  # warm-up
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                dt = torch.tensor([(time.perf_counter() - t0) / iters])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank defines the time
                times[name] = dt.item()
            f = bus_factor(op, n)
            rows.append({"op": op, "ranks": n, "bytes": nbytes,
                         "busbw_shm_GBps": nbytes / times["shm"] * f / 1e9,
                         "busbw_gloo_GBps": nbytes / times["gloo"] * f / 1e9})
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    axonn_c.finalize()
    dist.destroy_process_group()


def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [s for s in SIZES if s <= args.max_bytes]
    if args.worker:
        return worker(args.worker, sizes)
    rows = []
    for n in map(int, args.ranks.split(",")):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            path = tmp.name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(n), os.path.abspath(__file__), "--worker", path, "--max-bytes",
               str(args.max_bytes)]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                 PYTHONWARNINGS="ignore"))
        with open(path) as fh:
            rows += json.load(fh)
        os.unlink(path)
    print(f"\n{'op':<15}{'ranks':>6}{'bytes':>10}{'shm GB/s':>11}{'gloo GB/s':>11}{'shm/gloo':>10}")
    for r in rows:
        print(f"{r['op']:<15}{r['ranks']:>6}{human(r['bytes']):>10}{r['busbw_shm_GBps']:>11.2f}"
              f"{r['busbw_gloo_GBps']:>11.2f}{r['busbw_shm_GBps'] / r['busbw_gloo_GBps']:>9.1f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
