"""Compressed data-parallel gradients in training: convergence and step time per setting.

    python benchmarks/bench_grad_compression.py --out benchmarks/results/grad_compression_cpu

Trains the demo GPT (examples/train_gpt.py) on a data-parallel grid (default 4 ranks,
G_data=4, torchrun, shm) once per setting: none, bf16, int8, int4 (error feedback on) and int4
without error feedback, the same data and seed. On a grid with tensor parallelism (--grid
2,2,1,1) also "hybrid" (int8 data gradients, bf16 tensor-parallel traffic) and "naive" (int4 on
every dimension, the setting the hybrid-compression paper warns about). The shm link is slowed down to
`--sim-gbps` (AXONN_C_SIM_GBPS) so that the gradient all-reduce is what a step waits for, as
on a real network. Writes <out>.json (per-step losses, seconds per step, data-group wire and
logical bytes) and <out>.png (loss curves), and prints a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = [("none", None), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int4"),
            ("int4, no error feedback", "int4-noef"),
            ("hybrid: int8 data, bf16 tensor-parallel", "hybrid"),
            ("naive: int4 on every dimension", "naive")]
# the policies of the last two (on a grid with tensor parallelism, --grid): the hybrid one the
# paper recommends and the one-codec-everywhere one it warns about
POLICIES = {"hybrid": {"data": "int8", "row": "bf16", "col": "bf16", "depth": "bf16"},
            "naive": {"data": "int4", "row": "int4", "col": "int4", "depth": "int4"}}


def run_one(args, compression, out_json):
    """Inside torchrun: one training run; rank 0 writes its record."""
    sys.path.insert(0, str(ROOT / "examples"))
    import axonn_c
    import train_gpt

    spec = {"codec": "int4", "error_feedback": False} if compression == "int4-noef" else \
        compression
    if compression and ":" in compression:  # CODEC:BLOCK (--settings), error feedback default
        codec, block = compression.split(":")
        spec = {"codec": codec, "block": int(block)}
    spec = POLICIES.get(compression, spec)
    real_init = axonn_c.init

    def init(*a, **kw):  # the demo's init, with this setting (the CLI takes codec names only)
        kw["compression"] = spec
        return real_init(*a, **kw)
    axonn_c.init = init
    stats = {}
    real_finalize = axonn_c.finalize

    def finalize():  # the byte counters, read before the demo releases the communicator
        stats.update(axonn_c.comm_stats()["data"])
        real_finalize()
    axonn_c.finalize = finalize
    ticks = []  # one per step: the demo calls sync_gradients once per step
    real_sync = axonn_c.sync_gradients

    def sync_gradients(*a, **kw):
        out = real_sync(*a, **kw)
        ticks.append(time.perf_counter())
        return out
    axonn_c.sync_gradients = sync_gradients
    t0 = time.perf_counter()
    grid = [int(v) for v in args.grid.split(",")] if args.grid else [args.ranks, 1, 1, 1]
    losses = train_gpt.main(["--G-data", str(grid[0]), "--G-intra-r", str(grid[1]),
                             "--G-intra-c", str(grid[2]), "--G-intra-d", str(grid[3]),
                             "--steps", str(args.steps),
                             "--log-every", str(max(args.steps // 4, 1)), "--sample-chars", "0",
                             "--no-overlap" if not args.overlap else "--overlap"])
    seconds = time.perf_counter() - t0
    if int(os.environ.get("RANK", "0")) == 0:
        steps = [b - a for a, b in zip(ticks, ticks[1:])]
        Path(out_json).write_text(json.dumps({"losses": losses, "seconds": seconds,
                                              "step_seconds": steps,
                                              "data_bytes_sent": stats.get("bytes_sent", 0),
                                              "data_logical_bytes_sent":
                                                  stats.get("logical_bytes_sent", 0)}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sim-gbps", type=float, default=0.02,
                   help="simulated link bandwidth in GB/s (0: the real shm speed)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="overlap the gradient sums with backward (off: the sums are exposed)")
    p.add_argument("--settings", default=",".join(s or "none" for _, s in SETTINGS[:5]),
                   help="comma-separated settings: none, bf16, int8, int4, int4-noef, hybrid, "
                   "naive, or CODEC:BLOCK (e.g. int4:64, to measure a block size)")
    p.add_argument("--grid", default="",
                   help="G_data,G_intra_r,G_intra_c,G_intra_d (default: RANKS,1,1,1); the "
                   "hybrid and naive settings differ from int8/int4 only with tensor parallelism")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each setting, interleaved; the step time is the lowest median")
    p.add_argument("--out", default="")
    p.add_argument("--one", nargs=2, metavar=("SETTING", "JSON"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 7 or args.repeat < 1:  # (the median skips 5 warm-up steps)
        p.error(f"--steps must be at least 7 and --repeat at least 1, got {args.steps}, "
                f"{args.repeat}")
    if args.one:
        run_one(args, None if args.one[0] == "none" else args.one[0], args.one[1])
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if args.sim_gbps > 0:
        env["AXONN_C_SIM_GBPS"] = str(args.sim_gbps)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        named = {s or "none": n for n, s in SETTINGS}
        port = 29400
        for round_ in range(args.repeat):  # settings interleaved: a load change hits them all
            for setting in args.settings.split(","):
                name = named.get(setting, setting)
                setting = None if setting == "none" else setting
                out = Path(tmp) / "one.json"
                port += 1
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                       str(args.ranks), "--master_addr", "127.0.0.1", "--master_port",
                       str(port), __file__, "--ranks", str(args.ranks), "--steps",
                       str(args.steps), "--overlap" if args.overlap else "--no-overlap",
                       *(["--grid", args.grid] if args.grid else []),
                       "--one", setting or "none", str(out)]
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                r = json.loads(out.read_text())
                if name in results:  # (the runs are deterministic: the same losses and bytes)
                    results[name]["repeats"].append(r["step_seconds"])
                else:
                    r["repeats"] = [r["step_seconds"]]
                    results[name] = r
    def step_time(r):  # the median step (the first steps warm up; a loaded machine's stalls
        # hit a few steps, not the median), the lowest over the repeats
        return min(statistics.median(steps[5:]) for steps in r["repeats"])
    base = step_time(results["none"])
    final = {k: sum(r["losses"][-20:]) / len(r["losses"][-20:]) for k, r in results.items()}
    print(f"{args.ranks} ranks, grid {args.grid or f'{args.ranks},1,1,1'} (G_data,r,c,d), "
          f"{args.steps} steps, simulated link "
          f"{args.sim_gbps} GB/s, overlap {'on' if args.overlap else 'off'}; s/step: median "
          f"step, lowest of {args.repeat} interleaved run(s)")
    wide = max(26, *(len(n) for n in results))
    print(f"{'setting':{wide}s} {'final loss':>10s} {'vs none':>8s} {'s/step':>8s} {'speedup':>8s} "
          f"{'bytes /':>8s}")
    for name, r in results.items():
        ratio = r["data_logical_bytes_sent"] / max(r["data_bytes_sent"], 1)
        print(f"{name:{wide}s} {final[name]:10.4f} {final[name] / final['none'] - 1:+8.2%} "
              f"{step_time(r):8.4f} {base / step_time(r):7.2f}x "
              f"{ratio:7.2f}x")
    if args.out:
        meta = {"ranks": args.ranks, "grid": args.grid or f"{args.ranks},1,1,1",
                "steps": args.steps, "sim_gbps": args.sim_gbps,
                "repeat": args.repeat, "load_average": os.getloadavg(),
                "overlap": args.overlap, "date": time.strftime("%Y-%m-%d"),
                "command": " ".join(sys.argv)}
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "results": results},
                                                       indent=1))
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in results.items():
            ax.plot(r["losses"], label=f"{name} ({final[name]:.3f})", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (global batch)")
        ax.set_title(f"demo GPT, {args.ranks} ranks, grid {meta['grid']} (data,row,col,depth): "
                     "compressed collectives", fontsize=10)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)
        print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
