"""Save and load throughput of axonn_c.checkpoint against the naive alternative, same run.

    python benchmarks/bench_checkpoint.py [--ranks 4] [--mb 256] [--dir DIR] [--json OUT.json]

A stack of axonn_c.Linear layers of about --mb MiB (float32 weights; AdamW state triples it
when --optimizer is given) on a --grid of --ranks ranks (launched with torchrun). Timed, each the
best of --repeats, with a barrier before and after:
- `axonn_c save`: checkpoint.save (every rank writes its own shards, in parallel);
- `axonn_c load`: checkpoint.load on the same grid (every rank reads its boxes);
- `naive save`: full_state_dict (the gather onto every rank) and torch.save on rank 0;
- `naive load`: torch.load of that file on every rank and load_state_dict (each rank slices
  its shard).
GB/s is the serial bytes saved or loaded (the model's, and with --optimizer the AdamW state's
in the axonn_c rows; the naive rows never include it) over the time. The files go to --dir (default: a
temporary directory, removed at the end); its filesystem decides much of the result.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks (torchrun) when not launched")
    ap.add_argument("--grid", default="1,1,2,2", help="G_data,G_intra_r,G_intra_c,G_intra_d")
    ap.add_argument("--mb", type=float, default=256, help="model size in MiB (float32)")
    ap.add_argument("--width", type=int, default=2048, help="features of each layer")
    ap.add_argument("--optimizer", action="store_true", help="also save and load AdamW state")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (same path on every rank)")
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    return ap.parse_args(argv)


def launch(args, argv) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.ranks), os.path.abspath(__file__), *argv]
    return subprocess.call(cmd)


def timed(fn, repeats: int) -> float:
    import axonn_c

    best = float("inf")
    for _ in range(repeats):
        axonn_c.comm.barrier()
        t0 = time.perf_counter()
        fn()
        axonn_c.comm.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "WORLD_SIZE" not in os.environ and args.ranks > 1:
        sys.exit(launch(args, argv))
    import axonn_c
    import axonn_c.checkpoint as ckpt

    sizes = [int(v) for v in args.grid.split(",")]
    if "WORLD_SIZE" not in os.environ:
        sizes = [1, 1, 1, 1]
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3])
    w = args.width
    layers = max(1, round(args.mb * 2**20 / (4 * w * w)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(axonn_c.Linear(w, w, bias=True) for _ in range(layers)))
    opt = None
    if args.optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, w)).sum().backward()
        axonn_c.sync_gradients(model)
        opt.step()
    model_bytes = layers * (w * w + w) * 4
    ckpt_bytes = model_bytes * (3 if opt else 1)  # (+ exp_avg, exp_avg_sq)
    root = args.dir
    made = root is None
    if made:  # one directory for all ranks: rank 0 makes it, the others learn its name
        name = tempfile.mkdtemp(prefix="axonn_c_bench_ckpt_") if g.rank == 0 else ""
        buf = torch.zeros(256, dtype=torch.uint8)
        buf[: len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
        axonn_c.comm.broadcast(buf, src=0)
        root = bytes(buf.tolist()).rstrip(b"\0").decode()
    path, naive = os.path.join(root, "ckpt"), os.path.join(root, "naive.pt")

    def naive_save():
        sd = axonn_c.full_state_dict(model)
        if g.rank == 0:
            torch.save(sd, naive)

    def naive_load():
        model.load_state_dict(torch.load(naive, weights_only=True))

    results = {
        "axonn_c save": timed(lambda: ckpt.save(path, model, opt), args.repeats),
        "axonn_c load": timed(lambda: ckpt.load(path, model, opt), args.repeats),
        "naive save": timed(naive_save, args.repeats),
        "naive load": timed(naive_load, args.repeats),
    }
    if g.rank == 0:
        print(f"{layers} x axonn_c.Linear({w}, {w}), grid {args.grid} ({g.world_size} ranks), "
              f"{model_bytes / 2**20:.0f} MiB serial model"
              f"{' (+ AdamW state in the axonn_c rows only)' if opt else ''}; "
              f"best of {args.repeats}")
        gbps = {}
        for k, t in results.items():
            n = ckpt_bytes if k.startswith("axonn_c") else model_bytes
            gbps[k] = n / t / 1e9
            print(f"  {k:14s} {t * 1e3:9.1f} ms  {gbps[k]:7.3f} GB/s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"grid": args.grid, "world": g.world_size, "layers": layers,
                           "width": w, "model_bytes": model_bytes, "checkpoint_bytes": ckpt_bytes,
                           "seconds": results, "GB/s": gbps}, f, indent=1)
        if made:
            shutil.rmtree(root)
    axonn_c.finalize()


if __name__ == "__main__":
    main()
