"""Overlap of communication with compute in a training step, on the shm backend with a simulated link.

    python benchmarks/bench_overlap.py --json benchmarks/results/overlap.json \\
        --trace benchmarks/results/overlap_trace.json

launches itself with torchrun at 2 and 4 ranks (`--ranks 2,4`) and, for several grids per rank
count, times a full training step of a stack of GPT-block-shaped layers in the expert layout
(per block: qkv Linear(h, 3h), proj Linear(3h, h, transpose=True), fc1 Linear(h, 4h), fc2
Linear(4h, h, transpose=True); bias=False; loss = sum of the output; each step is forward,
backward and axonn_c.sync_gradients(model)). One thread per rank (torch.set_num_threads(1)).

The link is simulated by the shm backend: every collective is padded to
bytes_sent / AXONN_C_SIM_GBPS + AXONN_C_SIM_US (csrc/comm/shm.c, sim_link_sleep). The modes:

- t_compute_s: overlap=False with AXONN_C_BENCH_SKIP=comm, a benchmark-only knob of
  csrc/comm/comm.c: every collective (barriers excepted) returns a work that is already
  complete; nothing moves, no timeline span, the byte counters still count. Compute alone.
- t_comm_s: overlap=False with AXONN_C_BENCH_SKIP=compute, a benchmark-only knob of
  csrc/device/gemm.c: axc_gemm and axc_bias_grad return without computing. Communication alone
  (plus the host work around it: autograd, allocation, Python).
- t_no_overlap_s: overlap=False, nothing skipped (AXONN_C_BENCH_SKIP=none).
- t_overlap_s: overlap=True, nothing skipped. The same steps are recorded with axonn_c.timeline
  (started before and stopped after each timed step); exposed_comm_s is the timeline's exposed
  communication of a step (communication while no GEMM runs).
- t_concurrent_s (with --concurrent N > 1, default 2): overlap=True with
  concurrent_microbatches=N, the step's forward + backward run as
  axonn_c.run_concurrent(fn, x, model=model), N micro-batches at once in threads;
  exposed_concurrent_s is its exposed communication.
- t_pipelined_s (with --pipeline N > 1, default 2): overlap=True with the layer stack in an
  axonn_c.Sequential(chunks=N): the batch runs in N chunks pipelined across the layers (one
  chunk's all-reduce under another chunk's GEMMs, also of the next layers); exposed_pipelined_s
  is its exposed communication. On grids where it does not pipeline (depth, data only) it is
  the overlap step again.
- t_microbatched_s (with --micro-batches M > 1): as pipelined (chunks: --pipeline, at least 2),
  with the step as axonn_c.forward_backward(model, x, loss, micro_batches=M): the batch in M
  micro-batches, each one's forward run inside the previous one's backward (the forward's
  all-reduces under the backward's GEMMs); exposed_microbatched_s is its exposed communication.
- t_compute_overlap_s (with --compute-overlap): the compute alone on the overlap=True code path
  (AXONN_C_BENCH_SKIP=comm): the baseline whose difference to t_overlap_s is what the timeline's
  exposed figure measures (overlap=False's host work differs: its sync_gradients copies).

The C core looks AXONN_C_BENCH_SKIP up once; when it is unset (every real job) it never reads it
again, when it is set (here: the launcher sets it to "none" before the ranks start) it re-reads
the value at each call, so one process switches modes between steps. One torchrun launch per
rank count; per grid: a calibration block (compute alone, 3 steps), then --rounds rounds of the
modes, each mode a block of init(overlap=...), model build, --warmup untimed steps, --steps
timed steps, finalize; the order of the modes rotates every round so that all of them see the
same (shared, drifting) machine. The link is calibrated per grid unless --sim-gbps is given: the
calibration block also counts the bytes this rank sends per step and the collectives (the
counters still count), and the link is set so that n_collectives * sim_us + bytes / sim_gbps =
--comm-ratio * t_compute (slowest rank).

Timing: each timed step between two gloo barriers; a step's time is the maximum over ranks
(all_reduce MAX); the reported time is the median over the rounds * steps steps of a mode.
exposed_comm_s is the median over the overlap steps of the maximum over ranks. The target is
t_overlap <= 1.15 * max(t_compute, t_comm), applicable when min(t_compute, t_comm) >= 0.2 *
max(...); "exp~" says whether exposed_comm_s agrees with t_overlap - t_compute within 10%.
"slow" (gemm_slowdown_s) is the union of GEMM spans of an overlap step minus that of a
compute-alone step (the timeline records both modes): CPU time the progress threads took from the
GEMMs; "+slow~" says whether exposed + slow agrees with t_overlap - t_compute within 10%.
The compute-alone and communication-alone steps also time their forward (Tf, Cf; the rest of
the step is Tb, Cb): phase_bound_s = max(Tf, Cf) + max(Tb, Cb) is the shortest step whose
phases keep their own traffic ("bnd/max" = phase_bound_s / max(t_compute, t_comm)).

Prints a table; --json writes a list of rows with keys ranks, G_data, G_intra_r, G_intra_c,
G_intra_d, t_overlap_s, t_no_overlap_s, t_compute_s, t_comm_s, exposed_comm_s (plus grid,
sim_gbps, sim_us, sizes, the timeline's compute/comm unions, t_compute_fwd_s, t_comm_fwd_s
and phase_bound_s). --trace writes a Chrome trace
(merged across ranks) of one overlap=True step of one grid (--trace-grid, default 1x1x2x2 when
4 ranks run, else the first grid); render it with benchmarks/plot_trace.py. Grids are written
G_data x G_intra_r x G_intra_c x G_intra_d. --quick: tiny sizes, one grid per rank count, two
timed steps (a smoke test; its times mean nothing).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GRIDS = {  # G_data, G_intra_r, G_intra_c, G_intra_d
    2: [(1, 1, 2, 1), (1, 2, 1, 1), (1, 1, 1, 2), (2, 1, 1, 1)],
    4: [(1, 2, 2, 1), (1, 1, 2, 2), (2, 1, 2, 1)],
}
QUICK_GRIDS = {2: [(1, 1, 2, 1)], 4: [(1, 2, 2, 1)]}
KEYS = ("ranks", "G_data", "G_intra_r", "G_intra_c", "G_intra_d", "t_overlap_s",
        "t_no_overlap_s", "t_compute_s", "t_comm_s", "exposed_comm_s")


def grid_name(g):
    return "x".join(map(str, g))


def parse_grid(s):
    g = tuple(int(v) for v in s.split("x"))
    if len(g) != 4:
        raise argparse.ArgumentTypeError(f"grid {s!r}: expected G_data x G_intra_r x G_intra_c x "
                                         "G_intra_d, e.g. 1x1x2x2")
    return g


# ----------------------------------------------------------------------------- worker (per rank)

def build_model(h, blocks, chunks=0, gelu=False):
    """The layer stack; chunks > 1: in an axonn_c.Sequential that pipelines that many chunks
    of the batch across its layers (plain nn.Sequential otherwise); gelu: a GELU between fc1
    and fc2, as in a real MLP."""
    import torch
    import axonn_c

    layers = []
    for _ in range(blocks):
        layers += [axonn_c.Linear(h, 3 * h, bias=False, expert_mode=True),                  # qkv
                   axonn_c.Linear(3 * h, h, bias=False, transpose=True, expert_mode=True),   # proj
                   axonn_c.Linear(h, 4 * h, bias=False, expert_mode=True),                  # fc1
                   *([torch.nn.GELU()] if gelu else []),
                   axonn_c.Linear(4 * h, h, bias=False, transpose=True, expert_mode=True)]  # fc2
    if chunks > 1:
        return axonn_c.Sequential(*layers, chunks=chunks)
    return torch.nn.Sequential(*layers)


# name, AXONN_C_BENCH_SKIP, init(overlap=), concurrent micro-batches (0: a plain step)
BASE_MODES = (("compute", "comm", False, 0), ("comm", "compute", False, 0),
              ("no_overlap", "none", False, 0), ("overlap", "none", True, 0))


def modes(spec):
    """The four modes; overlap with --concurrent micro-batches run at once (> 1); overlap with
    the model in an axonn_c.Sequential of --pipeline chunks (> 1); with --ablate-defer,
    overlap=True with every layer's defer_wgrad off; with --compute-overlap, the compute alone
    on the overlap=True code path."""
    n = spec.get("concurrent", 0)
    return (BASE_MODES + ((("concurrent", "none", True, n),) if n > 1 else ())
            + ((("pipelined", "none", "pipelined", 0),) if spec.get("pipeline", 0) > 1 else ())
            + ((("microbatched", "none", "microbatched", 0),)
               if spec.get("micro_batches", 0) > 1 else ())
            + ((("overlap_nodefer", "none", "nodefer", 0),) if spec.get("ablate_defer") else ())
            + ((("compute_overlap", "comm", True, 0),) if spec.get("compute_overlap") else ()))


def run_block(spec, G, gbps, sim_us, skip, overlap, steps, record=False, concurrent=0):
    """init with this mode, build the model, warm up, time `steps` steps, finalize. Returns per-step
    lists (max over ranks): times, exposed comm, timeline unions; and one step's bytes/calls."""
    import torch
    import torch.distributed as dist

    import axonn_c
    from axonn_c import state, timeline

    os.environ["AXONN_C_BENCH_SKIP"] = skip  # read by the C core at each call (benchmark only)
    os.environ["AXONN_C_SIM_GBPS"] = repr(gbps)  # read at init by the shm backend
    os.environ["AXONN_C_SIM_US"] = repr(sim_us)
    g = axonn_c.init(G_data=G[0], G_intra_r=G[1], G_intra_c=G[2], G_intra_d=G[3],
                     backend="shm", overlap=bool(overlap),
                     concurrent_microbatches=max(concurrent, 1))
    torch.manual_seed(0)
    chunks = {"pipelined": spec.get("pipeline", 0),
              "microbatched": max(spec.get("pipeline", 0), 2)}.get(overlap, 0)
    model = build_model(spec["hidden"], spec["blocks"], chunks, spec.get("gelu", False))
    if overlap == "nodefer":  # the ablation: every overlap but the deferred dW GEMM
        for m in model.modules():
            if isinstance(m, axonn_c.Linear):
                m.defer_wgrad = False
    torch.manual_seed(1000 + g.rank)
    x = torch.randn(spec["tokens"] // (g.G_data * g.G_intra_d), spec["hidden"] // g.G_intra_c,
                    requires_grad=True)

    def step():
        """One training step; returns the time its forward took (0 for concurrent
        micro-batches, whose forwards and backwards interleave)."""
        for p in model.parameters():
            p.grad = None
        x.grad = None
        t_fwd = 0.0
        if concurrent > 1:  # the micro-batches' forward and backward run at once, in threads
            axonn_c.run_concurrent(lambda xb: model(xb).sum().backward(), x, model=model)
        elif overlap == "microbatched":  # each forward inside the previous backward
            axonn_c.forward_backward(model, x, lambda y: y.sum(),
                                     micro_batches=spec["micro_batches"])
        else:
            t0 = time.perf_counter()
            loss = model(x).sum()
            t_fwd = time.perf_counter() - t0
            loss.backward()
        axonn_c.sync_gradients(model)
        return t_fwd

    sizes = {"col": g.G_intra_c, "row": g.G_intra_r, "depth": g.G_intra_d, "data": g.G_data,
             "intra": g.G_intra, "world": g.world_size}
    for _ in range(spec["warmup"]):
        step()
    axonn_c.reset_comm_stats()
    cols = [[] for _ in range(5)]  # step, forward, and with record: exposed, GEMMs, comm
    for i in range(steps):
        dist.barrier()
        if record:
            timeline.start()
        t0 = time.perf_counter()
        cols[1].append(step())
        cols[0].append(time.perf_counter() - t0)
        if record:
            timeline.stop()
            s = timeline.summary()
            cols[2].append(s["exposed_comm_s"])
            cols[3].append(s["compute_s"])
            cols[4].append(s["comm_s"])
        if i == 0:
            stats = axonn_c.comm_stats()
            nbytes = sum(stats[k]["bytes_sent"] for k in state.GROUPS if sizes[k] > 1)
            calls = sum(stats[k]["calls"] for k in state.GROUPS if sizes[k] > 1)
    vec = torch.tensor(sum(cols, []) + [float(nbytes), float(calls)], dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)  # the slowest rank defines each step
    v = vec.tolist()
    out = {"t": v[:steps], "fwd": v[steps:2 * steps], "bytes": int(v[-2]), "calls": int(v[-1])}
    if record:
        out.update(exposed=v[2 * steps:3 * steps], tl_compute=v[3 * steps:4 * steps],
                   tl_comm=v[4 * steps:5 * steps])
    return g, model, out


def worker(spec_path):
    import torch
    import torch.distributed as dist

    import axonn_c
    from axonn_c import timeline

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for row in spec["rows"]:
        G, name = row["grid"], grid_name(row["grid"])
        res = {"grid": G, "sim_us": spec["sim_us"]}
        # calibration: compute alone, and the bytes and collectives of one step
        _, _, cal = run_block(spec, G, 0.0, 0.0, "comm", False, spec["cal_steps"])
        axonn_c.finalize()
        res["step_bytes"], res["step_calls"] = cal["bytes"], cal["calls"]
        gbps = spec["sim_gbps"] or calibrate(statistics.median(cal["t"]), cal["bytes"],
                                             cal["calls"], spec["comm_ratio"], spec["sim_us"])
        res["sim_gbps"] = gbps
        all_modes = modes(spec)
        acc = {m[0]: {} for m in all_modes}
        for rnd in range(spec["rounds"]):
            # the modes in blocks of steps, interleaved, the order rotated every round, so
            # that they all see the same machine (a shared machine drifts over seconds)
            k = rnd % len(all_modes)
            order = all_modes[k:] + all_modes[:k]
            for mode, skip, overlap, conc in order:
                # the timeline also runs in compute-alone mode: its GEMM time there is the
                # reference for how much the overlap run's GEMMs were slowed down
                record = mode in ("overlap", "compute", "concurrent", "pipelined",
                                  "microbatched", "overlap_nodefer")
                _, _, out = run_block(spec, G, gbps, spec["sim_us"], skip, overlap,
                                      spec["steps"], record, conc)
                for k, v in out.items():
                    if isinstance(v, list):
                        acc[mode].setdefault(k, []).extend(v)
                target = row.get({"overlap": "trace", "concurrent": "trace_concurrent",
                                  "pipelined": "trace_pipelined"}.get(mode))
                if target and rnd == spec["rounds"] - 1:
                    # the spans of the last timed step are still there: one file per rank
                    pattern = os.path.join(spec["tmpdir"], "trace.{rank}.json")
                    timeline.export(pattern)
                    dist.barrier()
                    if rank == 0:
                        timeline.merge([pattern.replace("{rank}", str(r))
                                        for r in range(dist.get_world_size())], target)
                axonn_c.finalize()
        for mode, *_ in all_modes:
            res[mode] = {k: statistics.median(v) for k, v in acc[mode].items()}
        if rank == 0:
            print(f"  [{spec['ranks']} ranks, {name}, link {gbps:.3g} GB/s] " + "  ".join(
                f"{m} {res[m]['t'] * 1e3:.1f}" for m, *_ in all_modes) + " ms/step", flush=True)
        results.append(res)
    os.environ.pop("AXONN_C_BENCH_SKIP", None)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- launcher

def launch(n, spec):
    with tempfile.TemporaryDirectory(prefix="bench_overlap.") as tmp:
        spec = dict(spec, ranks=n, tmpdir=tmp, out=os.path.join(tmp, "out.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   TORCH_CPP_LOG_LEVEL="ERROR")
        # set before the ranks start, so the C core keeps reading it (benchmark only)
        env["AXONN_C_BENCH_SKIP"] = "none"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(n), os.path.abspath(__file__), "--worker", spec_path]
        subprocess.run(cmd, check=True, env=env)
        with open(spec["out"]) as f:
            return json.load(f)


def calibrate(t_compute, step_bytes, step_calls, ratio, sim_us):
    """The link speed at which the padded collectives of one step add up to ratio * t_compute."""
    budget = ratio * t_compute - step_calls * sim_us * 1e-6
    budget = max(budget, 0.25 * ratio * t_compute)  # latency alone would exceed it: keep sane
    if step_bytes <= 0:
        return 0.0
    gbps = step_bytes / budget / 1e9
    return float(f"{gbps:.3g}")


def phase_bound(compute, comm):
    """The shortest step in which each phase's traffic stays in its phase: the forward's
    all-reduces finish in the forward (the next layer needs them), and the backward's
    collectives start after their gradients exist. Each phase then takes at least the longer of
    its compute and its communication: max(Tf, Cf) + max(Tb, Cb). Strict for a grid with one
    group kind that is not depth (row, col, data); a depth all-gather for backward may be
    prefetched during the forward, and different group kinds run side by side, so for depth and
    mixed grids it is an estimate."""
    tf, cf = compute["fwd"], comm["fwd"]
    return max(tf, cf) + max(compute["t"] - tf, comm["t"] - cf)


def agrees(exposed, diff, t):
    """The exposed figure within 10% of the time the communication added (diff), or, where it
    added none, under 10% of the step (t)."""
    return abs(exposed - diff) <= 0.1 * abs(diff) if diff > 0 else exposed <= 0.1 * t


def check(r, mode="overlap"):
    """(target applicable, target met, exposed agrees) for mode "overlap", "concurrent" or
    "pipelined"."""
    t, exposed = r[f"t_{mode}_s"], r[f"exposed_{mode}_s" if mode != "overlap" else "exposed_comm_s"]
    hi, lo = max(r["t_compute_s"], r["t_comm_s"]), min(r["t_compute_s"], r["t_comm_s"])
    applicable = lo >= 0.2 * hi
    ok = t <= 1.15 * hi
    return applicable, ok, agrees(exposed, t - r["t_compute_s"], t)


def explained(r):
    """Whether exposed communication plus the GEMMs' slowdown (their time in the overlap run
    minus compute alone: CPU the progress threads took) is within 10% of t_overlap - t_compute."""
    diff = r["t_overlap_s"] - r["t_compute_s"]
    return abs(r["exposed_comm_s"] + r["gemm_slowdown_s"] - diff) <= 0.1 * abs(diff)


def mode_cells(r, hi, mode):
    """time, exposed, /max, target, exp~ of mode "concurrent", "pipelined" or "microbatched"
    (blank: not run)."""
    if f"t_{mode}_s" not in r:
        return f" {'':>8} {'':>7} {'':>8} {'':>8} {'':>6}"
    applicable, ok, agree = check(r, mode)
    target = ("ok" if ok else "MISS") if applicable else "n/a"
    return (f" {r[f't_{mode}_s'] * 1e3:>8.1f} {r[f'exposed_{mode}_s'] * 1e3:>7.1f} "
            f"{r[f't_{mode}_s'] / hi:>8.2f} {target:>8} {'yes' if agree else 'no':>6}")


def covl_cells(r):
    """c-ovl and exp~ovl: the compute alone on the overlap=True path, and whether the exposed
    figure matches t_overlap minus it."""
    t, c = r["t_overlap_s"], r["t_compute_overlap_s"]
    ok = agrees(r["exposed_comm_s"], t - c, t)
    return f" {c * 1e3:>8.1f} {'yes' if ok else 'no':>7}"


def print_table(rows):
    conc = any("t_concurrent_s" in r for r in rows)
    hdr = (f"{'ranks':>5} {'grid':>8} {'GB/s':>6} {'no_ovl':>8} {'overlap':>8} {'compute':>8} "
           f"{'comm':>8} {'exposed':>8} {'slow':>6} {'ovl/no':>7} {'ovl/max':>8} {'target':>7} "
           f"{'exp~':>5} {'+slow~':>6} {'bnd/max':>7}")
    if conc:
        hdr += f" {'conc':>8} {'c-exp':>7} {'conc/max':>8} {'c-target':>8} {'c-exp~':>6}"
    pipe = any("t_pipelined_s" in r for r in rows)
    if pipe:
        hdr += f" {'pipe':>8} {'p-exp':>7} {'pipe/max':>8} {'p-target':>8} {'p-exp~':>6}"
    micro = any("t_microbatched_s" in r for r in rows)
    if micro:
        hdr += f" {'micro':>8} {'m-exp':>7} {'mic/max':>8} {'m-target':>8} {'m-exp~':>6}"
    nodefer = any("t_overlap_nodefer_s" in r for r in rows)
    if nodefer:
        hdr += f" {'nodefer':>8} {'nd-exp':>7} {'nd/max':>7}"
    covl = any("t_compute_overlap_s" in r for r in rows)
    if covl:
        hdr += f" {'c-ovl':>8} {'exp~ovl':>7}"
    print("\ntimes in ms per step (median of steps, slowest rank); grid = "
          "G_data x G_intra_r x G_intra_c x G_intra_d")
    print(hdr)
    for r in rows:
        applicable, ok, agree = check(r)
        hi = max(r["t_compute_s"], r["t_comm_s"])
        target = ("ok" if ok else "MISS") if applicable else "n/a"
        print(f"{r['ranks']:>5} {r['grid']:>8} {r['sim_gbps']:>6.3g} "
              f"{r['t_no_overlap_s'] * 1e3:>8.1f} {r['t_overlap_s'] * 1e3:>8.1f} "
              f"{r['t_compute_s'] * 1e3:>8.1f} {r['t_comm_s'] * 1e3:>8.1f} "
              f"{r['exposed_comm_s'] * 1e3:>8.1f} {r['gemm_slowdown_s'] * 1e3:>6.1f} "
              f"{r['t_overlap_s'] / r['t_no_overlap_s']:>7.2f} "
              f"{r['t_overlap_s'] / hi:>8.2f} {target:>7} {'yes' if agree else 'no':>5} "
              f"{'yes' if explained(r) else 'no':>6} {r['phase_bound_s'] / hi:>7.2f}"
              + (mode_cells(r, hi, "concurrent") if conc else "")
              + (mode_cells(r, hi, "pipelined") if pipe else "")
              + (mode_cells(r, hi, "microbatched") if micro else "")
              + (f" {r['t_overlap_nodefer_s'] * 1e3:>8.1f} {r['exposed_nodefer_s'] * 1e3:>7.1f} "
                 f"{r['t_overlap_nodefer_s'] / hi:>7.2f}" if nodefer else "")
              + (covl_cells(r) if covl else ""))
    print("target: t_overlap <= 1.15 * max(t_compute, t_comm) (n/a when min < 0.2 * max); "
          "exp~: exposed_comm within 10% of t_overlap - t_compute; slow: the GEMMs' time in the "
          "overlap run minus compute alone (timeline); +slow~: exposed + slow within 10% of "
          "t_overlap - t_compute; bnd/max: phase_bound_s / max, the best a step can do when each "
          "phase's traffic stays in its phase (max(Tf, Cf) + max(Tb, Cb); strict for row, col "
          "and data grids)")
    if conc:
        print("conc: overlap=True with the batch split into concurrent micro-batches "
              "(axonn_c.run_concurrent); c-exp: its exposed communication; conc/max, c-target, "
              "c-exp~: as ovl/max, target, exp~ for it")
    if pipe:
        print("pipe: overlap=True with the layer stack in an axonn_c.Sequential that pipelines "
              "--pipeline chunks of the batch across layers (plain where it does not pipeline: "
              "depth or data-only grids); p-exp, pipe/max, p-target, p-exp~: as for conc")
    if micro:
        print("micro: as pipe, with the step as axonn_c.forward_backward in --micro-batches "
              "micro-batches (each forward inside the previous backward); m-exp, mic/max, "
              "m-target, m-exp~: as for conc")
    if nodefer:
        print("nodefer: overlap=True with defer_wgrad=False on every layer (each dW GEMM runs "
              "in its own layer's backward); nd-exp: its exposed communication")
    if covl:
        print("c-ovl: the compute alone on the overlap=True code path (AXONN_C_BENCH_SKIP=comm; "
              "its host work differs from overlap=False's: buckets filled during backward, no "
              "sync_gradients copies, deferred dW GEMMs); exp~ovl: exposed_comm within 10% of "
              "t_overlap - c-ovl")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--trace", help="write a merged Chrome trace of one overlap=True step here")
    p.add_argument("--trace-grid", type=parse_grid, help="grid of the traced row, e.g. 1x1x2x2")
    p.add_argument("--trace-concurrent", help="write a merged Chrome trace of one concurrent "
                   "micro-batch step here (grid: --trace-concurrent-grid, default 1x1x2x1)")
    p.add_argument("--trace-concurrent-grid", type=parse_grid, default=(1, 1, 2, 1))
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--grids", help="comma-separated grids instead of the defaults, e.g. "
                   "1x1x2x1,1x2x1x1 (each must match one of --ranks)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one grid per rank count")
    p.add_argument("--hidden", type=int, help="h (default 512; quick 64)")
    p.add_argument("--tokens", type=int, help="global tokens per step (default 256; quick 32)")
    p.add_argument("--blocks", type=int, help="GPT blocks of 4 layers (default 2; quick 1)")
    p.add_argument("--rounds", type=int, help="rounds over the modes (default 3; quick 1)")
    p.add_argument("--steps", type=int, help="timed steps per mode and round (default 3; quick 2)")
    p.add_argument("--warmup", type=int, help="untimed steps after each init (default 2; quick 1)")
    p.add_argument("--sim-gbps", type=float, help="fixed simulated link (GB/s per rank) instead "
                   "of calibrating it per grid")
    p.add_argument("--sim-us", type=float, default=20.0, help="simulated latency per collective")
    p.add_argument("--comm-ratio", type=float, default=1.0,
                   help="calibrate the link so that communication alone ~ this * compute alone")
    p.add_argument("--concurrent", type=int, default=2,
                   help="also time overlap=True with the batch split into this many micro-batches "
                   "run at once (axonn_c.run_concurrent; 0 or 1: not)")
    p.add_argument("--pipeline", type=int, default=2,
                   help="also time overlap=True with the layers in an axonn_c.Sequential of this "
                   "many chunks (cross-layer chunk pipelining; 0 or 1: not)")
    p.add_argument("--trace-pipelined", help="write a merged Chrome trace of one pipelined step "
                   "here (grid: --trace-pipelined-grid, default 1x1x2x1)")
    p.add_argument("--trace-pipelined-grid", type=parse_grid, default=(1, 1, 2, 1))
    p.add_argument("--micro-batches", type=int, default=0,
                   help="also time overlap=True with the step as axonn_c.forward_backward in this "
                   "many micro-batches, the layers in an axonn_c.Sequential (0 or 1: not)")
    p.add_argument("--gelu", action="store_true",
                   help="a GELU between fc1 and fc2 of every block (default: Linears only)")
    p.add_argument("--ablate-defer", action="store_true",
                   help="also time overlap=True with defer_wgrad off (t_overlap_nodefer_s)")
    p.add_argument("--compute-overlap", action="store_true",
                   help="also time the compute alone on the overlap=True code path "
                   "(t_compute_overlap_s), the baseline the timeline's exposed figure matches")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker)

    t_start = time.perf_counter()
    q = a.quick
    spec = {"hidden": a.hidden or (64 if q else 512), "tokens": a.tokens or (32 if q else 256),
            "blocks": a.blocks or (1 if q else 2), "rounds": a.rounds or (1 if q else 3),
            "steps": a.steps or (2 if q else 3), "warmup": a.warmup if a.warmup is not None
            else (1 if q else 2), "cal_steps": 2 if q else 3, "sim_gbps": a.sim_gbps or 0.0,
            "sim_us": a.sim_us, "comm_ratio": a.comm_ratio, "concurrent": a.concurrent,
            "pipeline": a.pipeline, "micro_batches": a.micro_batches,
            "ablate_defer": a.ablate_defer, "gelu": a.gelu,
            "compute_overlap": a.compute_overlap}
    ranks = [int(v) for v in a.ranks.split(",")]
    grids = {n: list((QUICK_GRIDS if q else GRIDS).get(n, [])) for n in ranks}
    if a.grids:
        grids = {n: [] for n in ranks}
        for s in a.grids.split(","):
            g = parse_grid(s)
            n = g[0] * g[1] * g[2] * g[3]
            if n not in grids:
                p.error(f"grid {s} has {n} ranks, not one of --ranks {a.ranks}")
            grids[n].append(g)
    for n in ranks:
        if not grids[n]:
            p.error(f"no grids for {n} ranks: pass --grids")
        for g in grids[n]:
            if spec["concurrent"] > 1 and spec["tokens"] // (g[0] * g[3]) < spec["concurrent"]:
                p.error(f"grid {grid_name(g)}: fewer tokens per rank than --concurrent")
            if spec["hidden"] % (g[1] * g[2]) or spec["tokens"] % (g[0] * g[3]):
                p.error(f"grid {grid_name(g)}: hidden={spec['hidden']} must divide by "
                        f"G_intra_r * G_intra_c and tokens={spec['tokens']} by G_data * G_intra_d")
    trace_grid = a.trace_grid or ((1, 1, 2, 2) if 4 in ranks and not q else grids[ranks[0]][0])
    if a.trace and not any(trace_grid in grids[n] for n in ranks):
        p.error(f"--trace-grid {grid_name(trace_grid)} is not among the grids run")
    if a.trace_concurrent and (a.concurrent < 2 or not any(
            a.trace_concurrent_grid in grids[n] for n in ranks)):
        p.error(f"--trace-concurrent needs --concurrent >= 2 and the grid "
                f"{grid_name(a.trace_concurrent_grid)} among the grids run")
    if a.trace_pipelined and (a.pipeline < 2 or not any(
            a.trace_pipelined_grid in grids[n] for n in ranks)):
        p.error(f"--trace-pipelined needs --pipeline >= 2 and the grid "
                f"{grid_name(a.trace_pipelined_grid)} among the grids run")
    load = os.getloadavg()[0]
    print(f"load average (1 min) before the run: {load:.2f} on {os.cpu_count()} cores"
          + (" -- something else is running: timings will be noisy" if load > 0.5 else ""))
    print(f"bench_overlap: h={spec['hidden']} tokens={spec['tokens']} blocks={spec['blocks']} "
          f"({4 * spec['blocks']} layers); per mode {spec['rounds']} rounds x {spec['steps']} "
          f"steps (each after {spec['warmup']} warm-up steps); sim_us={a.sim_us}", flush=True)

    rows = []
    for n in ranks:
        spec_rows = [{"grid": list(g), **({"trace": os.path.abspath(a.trace)}
                                          if a.trace and g == trace_grid else {}),
                      **({"trace_concurrent": os.path.abspath(a.trace_concurrent)}
                         if a.trace_concurrent and g == a.trace_concurrent_grid else {}),
                      **({"trace_pipelined": os.path.abspath(a.trace_pipelined)}
                         if a.trace_pipelined and g == a.trace_pipelined_grid else {})}
                     for g in grids[n]]
        for g, r in zip(grids[n], launch(n, dict(spec, rows=spec_rows))):
            ov = r["overlap"]
            rows.append({
                "ranks": n, "G_data": g[0], "G_intra_r": g[1], "G_intra_c": g[2],
                "G_intra_d": g[3], "t_overlap_s": ov["t"], "t_no_overlap_s": r["no_overlap"]["t"],
                "t_compute_s": r["compute"]["t"], "t_comm_s": r["comm"]["t"],
                "exposed_comm_s": ov["exposed"], "grid": grid_name(g),
                "t_compute_fwd_s": r["compute"]["fwd"], "t_comm_fwd_s": r["comm"]["fwd"],
                "phase_bound_s": phase_bound(r["compute"], r["comm"]),
                "sim_gbps": r["sim_gbps"], "sim_us": r["sim_us"],
                "comm_bytes_per_step": r["step_bytes"], "collectives_per_step": r["step_calls"],
                "timeline_compute_s": ov["tl_compute"], "timeline_comm_s": ov["tl_comm"],
                "timeline_compute_alone_s": r["compute"]["tl_compute"],
                "gemm_slowdown_s": ov["tl_compute"] - r["compute"]["tl_compute"],
                **({"t_concurrent_s": r["concurrent"]["t"],
                    "exposed_concurrent_s": r["concurrent"]["exposed"],
                    "concurrent_microbatches": spec["concurrent"]} if "concurrent" in r else {}),
                **({"t_pipelined_s": r["pipelined"]["t"],
                    "exposed_pipelined_s": r["pipelined"]["exposed"],
                    "pipeline_chunks": spec["pipeline"]} if "pipelined" in r else {}),
                **({"t_microbatched_s": r["microbatched"]["t"],
                    "exposed_microbatched_s": r["microbatched"]["exposed"],
                    "micro_batches": spec["micro_batches"]} if "microbatched" in r else {}),
                **({"t_overlap_nodefer_s": r["overlap_nodefer"]["t"],
                    "exposed_nodefer_s": r["overlap_nodefer"]["exposed"]}
                   if "overlap_nodefer" in r else {}),
                **({"t_compute_overlap_s": r["compute_overlap"]["t"]}
                   if "compute_overlap" in r else {}),
                "steps_per_mode": spec["rounds"] * spec["steps"],
                **{k: spec[k] for k in ("hidden", "tokens", "blocks", "rounds", "steps",
                                        "warmup", "gelu")}})
    print_table(rows)
    elapsed = time.perf_counter() - t_start
    print(f"total {elapsed:.0f} s")
    if a.json:
        d = os.path.dirname(os.path.abspath(a.json))
        os.makedirs(d, exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if a.trace:
        print(f"trace of one overlap=True step of {grid_name(trace_grid)}: {a.trace}")
    if a.trace_concurrent:
        print(f"trace of one concurrent micro-batch step of "
              f"{grid_name(a.trace_concurrent_grid)}: {a.trace_concurrent}")
    if a.trace_pipelined:
        print(f"trace of one pipelined step of {grid_name(a.trace_pipelined_grid)}: "
              f"{a.trace_pipelined}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
