"""Host cost of one axonn_c.Linear forward + backward next to nn.Linear's, at tiny shapes where
the time is all host overhead (4 tokens, 16 -> 16, fp32 by default).

    python benchmarks/bench_host.py [--json OUT.json] [--device cuda]       # world of one
    python benchmarks/bench_host.py --ranks 2 [--json OUT.json]            # 2 ranks (torchrun)
    python benchmarks/bench_host.py --ranks 2 --layers 8                   # per layer of 8

Both layers run in the same process, interleaved round by round (the best round of each is
kept), with overlap off and on. The breakdown of axonn_c's time per call:
- `c_us`: inside the C extension's calls (every axonn_c._C function the call makes, timed);
- `gemm_us`: what the GEMMs cost (the step timed again with AXONN_C_BENCH_SKIP=compute, which
  makes every GEMM return at once: the difference);
- `python_us`: the rest (autograd's Function and hooks, the Python glue);
- `comm_us` (2 ranks): what the collectives cost (the step timed again with
  AXONN_C_BENCH_SKIP=comm, which makes every collective but a barrier return at once, the ranks
  switching together at a barrier: the difference). With overlap on it is the data-parallel sum
  of the gradients; `extra_us - comm_us` is the host cost without it.
At 2 ranks the grid is data-parallel (G_data=2): with overlap on, backward also sums the
gradients; nn.Linear does no communication (its row is the floor), so the `DDP` column is
torch's DistributedDataParallel(nn.Linear) on gloo, which sums the gradients every step: the
baseline for the overlap-on row.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import time

# switchable per step only when the variable exists at start (csrc/core/bench_skip.c)
os.environ.setdefault("AXONN_C_BENCH_SKIP", "none")

import torch  # noqa: E402

import axonn_c  # noqa: E402
from axonn_c import _C  # noqa: E402


class CTimer:
    """Wraps every function of axonn_c._C so the time spent inside them is summed."""

    def __init__(self):
        self.total = 0.0
        self.on = False
        self.saved = {}

    def install(self):
        for name in dir(_C):
            fn = getattr(_C, name)
            if callable(fn) and type(fn).__name__ == "builtin_function_or_method":
                self.saved[name] = fn
                setattr(_C, name, self._wrap(fn))

    def uninstall(self):
        for name, fn in self.saved.items():
            setattr(_C, name, fn)

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += clock() - t0
        return timed


class TimedCall:
    """Stands for a layer's _C.LinearCall handle, timing its two methods into the CTimer (the
    rest of the handle: read through)."""

    def __init__(self, call, timer: CTimer):
        self.call, self.timer = call, timer

    def __getattr__(self, name):
        return getattr(self.call, name)

    def __setattr__(self, name, value):  # (the layer's scheduler id: set on the handle)
        if name in ("call", "timer"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.call, name, value)

    def _timed(self, fn, args):
        t0 = clock()
        try:
            return fn(*args)
        finally:
            self.timer.total += clock() - t0

    def forward(self, *args):
        return self._timed(self.call.forward, args)

    def backward(self, *args):
        return self._timed(self.call.backward, args)


# the clock of the timed rounds: the process's CPU time by default (host cost is CPU work, and
# it is steadier than wall time on a machine other jobs share), wall time with --clock wall
clock = time.process_time


def per_call(layer, x, g, iters: int) -> float:
    t0 = clock()
    for _ in range(iters):
        layer(x).backward(g)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (clock() - t0) / iters


def stack(make, fin: int, fout: int, layers: int):
    """One layer, or `layers` of them in an nn.Sequential (fin -> fout, then fout -> fout)."""
    if layers == 1:
        return make(fin, fout)
    return torch.nn.Sequential(*[make(fin if i == 0 else fout, fout) for i in range(layers)])


def measure(tokens: int, fin: int, fout: int, device: str, overlap: bool, rounds: int,
            iters: int, layers: int = 1) -> dict:
    torch.manual_seed(0)
    ours = stack(lambda i, o: axonn_c.Linear(i, o, device=device), fin, fout, layers)
    ref = stack(lambda i, o: torch.nn.Linear(i, o, device=device), fin, fout, layers)
    x = torch.randn(tokens, fin, device=device, requires_grad=True)
    g = torch.randn(tokens, fout, device=device)
    for _ in range(3):  # warm-up: allocations, the learned order, BLAS threads
        per_call(ours, x, g, 50)
        per_call(ref, x, g, 50)
    t_ours, t_ref, t_nogemm, t_nocomm, t_ddp = [], [], [], [], []
    peers = axonn_c.grid().world_size > 1
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(ref)) if peers else None
    if ddp is not None:
        per_call(ddp, x, g, 50)
    for _ in range(rounds):
        t_ours.append(per_call(ours, x, g, iters))
        t_ref.append(per_call(ref, x, g, iters))
        if ddp is not None:
            t_ddp.append(per_call(ddp, x, g, iters))
        os.environ["AXONN_C_BENCH_SKIP"] = "compute"
        t_nogemm.append(per_call(ours, x, g, iters))
        os.environ["AXONN_C_BENCH_SKIP"] = "none"
        if peers:
            # every rank skips together: a rank still summing would wait for one that skips
            axonn_c.comm.barrier()
            os.environ["AXONN_C_BENCH_SKIP"] = "comm"
            t_nocomm.append(per_call(ours, x, g, iters))
            axonn_c.comm.barrier()
            os.environ["AXONN_C_BENCH_SKIP"] = "none"
    timer = CTimer()
    timer.install()
    saved = []
    for layer in ([ours] if layers == 1 else list(ours)):
        memo = getattr(layer, "_plain_memo", None)  # its C handle, when its calls take a shortcut
        if memo is not None:
            layer._plain_memo = (*memo[:3], TimedCall(memo[3], timer), *memo[4:])
        calls = getattr(layer, "_calls", None)  # its C handles by knob setting (general path)
        if calls is not None:
            layer._calls = (calls[0], {k: TimedCall(c, timer) for k, c in calls[1].items()})
        saved.append((layer, memo, calls))
    try:
        timer.on = True
        c_time = min(_c_round(timer, ours, x, g, iters) for _ in range(rounds))
    finally:
        timer.uninstall()
        for layer, memo, calls in saved:
            layer._plain_memo = memo
            if calls is not None:
                layer._calls = calls
    # per layer: the stack's times divided by its layers
    t_ours, t_ref, t_nogemm, t_nocomm, t_ddp = ([t / layers for t in ts] for ts in
                                                (t_ours, t_ref, t_nogemm, t_nocomm, t_ddp))
    c_time /= layers
    best, floor = min(t_ours), min(t_ref)
    gemm = max(best - min(t_nogemm), 0.0)
    us = 1e6
    return {"device": device, "overlap": overlap, "tokens": tokens, "in": fin, "out": fout,
            "axonn_us": best * us, "nn_linear_us": floor * us, "extra_us": (best - floor) * us,
            "c_us": c_time * us, "gemm_us": gemm * us,
            "python_us": max(best - c_time, 0.0) * us,
            "comm_us": max(best - min(t_nocomm), 0.0) * us if t_nocomm else 0.0,
            "ddp_us": min(t_ddp) * us if t_ddp else None, "layers": layers}


def _c_round(timer: CTimer, layer, x, g, iters: int) -> float:
    timer.total = 0.0
    per_call(layer, x, g, iters)
    return timer.total / iters


def _spin(name: str, layer, x, g, seconds: float) -> None:
    print(f"spinning {name}", flush=True)  # (a profiler attaches once it reads this)
    t0 = time.perf_counter()
    calls = 0
    while time.perf_counter() < t0 + seconds:
        per_call(layer, x, g, 100)
        calls += 100
    print(f"{name}: {calls} calls, {1e6 * (time.perf_counter() - t0) / calls:.1f} us each "
          "(wall, under the profiler)", flush=True)


# one loop per layer and overlap setting: a profiler's stacks name the loop they sampled
def spin_axonn_c_overlap_off(layer, x, g, seconds: float) -> None:
    _spin("spin_axonn_c_overlap_off", layer, x, g, seconds)


def spin_axonn_c_overlap_on(layer, x, g, seconds: float) -> None:
    _spin("spin_axonn_c_overlap_on", layer, x, g, seconds)


def spin_nn_linear(layer, x, g, seconds: float) -> None:
    _spin("spin_nn_linear", layer, x, g, seconds)


SPIN_LOOPS = ("axonn_c_off", "axonn_c_on", "nn_linear")


def spin(args) -> None:
    """Only the calls, no timing: `seconds` of each loop (--spin-loop: all, or one of them) for a
    sampling profiler (py-spy record --native; benchmarks/profile_host.sh profiles one loop per
    process, all its threads: on CUDA the backward runs on autograd's device thread)."""
    loops = SPIN_LOOPS if args.spin_loop == "all" else (args.spin_loop,)
    for overlap in (False, True):  # (nn.Linear's loop: under either)
        mine = [lp for lp in loops if lp in (("axonn_c_on", "nn_linear") if overlap
                                            else ("axonn_c_off",))]
        if not mine:
            continue
        axonn_c.init(overlap=overlap)
        torch.manual_seed(0)
        ours = stack(lambda i, o: axonn_c.Linear(i, o, device=args.device), args.fin, args.fout,
                     args.layers)
        ref = stack(lambda i, o: torch.nn.Linear(i, o, device=args.device), args.fin, args.fout,
                    args.layers)
        x = torch.randn(args.tokens, args.fin, device=args.device, requires_grad=True)
        g = torch.randn(args.tokens, args.fout, device=args.device)
        for _ in range(3):
            per_call(ours, x, g, 50)
            per_call(ref, x, g, 50)
        for lp in mine:
            if lp == "nn_linear":
                spin_nn_linear(ref, x, g, args.spin)
            elif overlap:
                spin_axonn_c_overlap_on(ours, x, g, args.spin)
            else:
                spin_axonn_c_overlap_off(ours, x, g, args.spin)
        axonn_c.finalize()


def run_here(args) -> list:
    rows = []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (the DDP baseline; axonn_c uses its store)
        torch.distributed.init_process_group("gloo")
    for overlap in (False, True):
        axonn_c.init(G_data=int(os.environ.get("WORLD_SIZE", "1")), overlap=overlap)
        rows.append(measure(args.tokens, args.fin, args.fout, args.device, overlap, args.rounds,
                            args.iters, args.layers))
        axonn_c.finalize()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return rows


def free_port() -> int:
    """A port nothing listens on now (another job on the machine may use a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1, help="1, or 2 (launched with torchrun)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--fin", type=int, default=16)
    ap.add_argument("--fout", type=int, default=16)
    # many short rounds, each variant's best kept: on a machine other jobs share, some rounds
    # of each variant fall in a quiet moment (the estimate of the floor cost is steadier than
    # with a few long rounds)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--iters", type=int, default=100, help="calls per timed round")
    ap.add_argument("--layers", type=int, default=1,
                    help="a stack of this many layers per call; every figure is per layer (a "
                         "step's fixed work, e.g. closing its gradient buckets, is then shared)")
    ap.add_argument("--json", help="write the rows here (rank 0)")
    ap.add_argument("--clock", default=None, choices=("process", "wall"),
                    help="CPU time of this process, or wall time (default: process on CPU, "
                         "wall on CUDA, whose driver threads would count in the process's time)")
    ap.add_argument("--spin", type=float, default=0.0,
                    help="only run the calls for this many seconds per loop, untimed, for a "
                         "sampling profiler (world of one)")
    ap.add_argument("--spin-loop", default="all", choices=("all",) + SPIN_LOOPS,
                    help="with --spin: the loop to run")
    args = ap.parse_args()
    if args.spin > 0 and args.ranks != 1:
        ap.error("--spin runs at a world of one: leave --ranks at 1")
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: expected at least 1")
    global clock
    if args.clock is None:
        args.clock = "wall" if args.device == "cuda" else "process"
    clock = time.process_time if args.clock == "process" else time.perf_counter
    if args.spin > 0:
        spin(args)
        return
    if args.ranks > 1 and "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(args.ranks), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               __file__, *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        sys.exit(subprocess.call(cmd, env=env))
    rows = run_here(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per = f"per layer of a stack of {args.layers}" if args.layers > 1 else "per"
    print(f"world {world}, {args.device}, {args.tokens} tokens, {args.fin} -> {args.fout}: "
          f"microseconds {per} forward + backward")
    print(f"{'overlap':>8} {'nn.Linear':>10} {'axonn_c':>9} {'extra':>8} {'python':>8} "
          f"{'C':>8} {'GEMM':>8} {'comm':>8}" + (f" {'DDP':>8}" if world > 1 else ""))
    for r in rows:
        r["world"] = world
        print(f"{str(r['overlap']):>8} {r['nn_linear_us']:10.1f} {r['axonn_us']:9.1f} "
              f"{r['extra_us']:8.1f} {r['python_us']:8.1f} {r['c_us']:8.1f} {r['gemm_us']:8.1f} {r['comm_us']:8.1f}"
              + (f" {r['ddp_us']:8.1f}" if r["ddp_us"] is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
