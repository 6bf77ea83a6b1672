"""Reproduces the reliability figures of issue 28 (README "Reliability"): ranks killed or
stalled during training, and a long soak.

    python benchmarks/reliability.py --kills 20 --stalls 5 --soak-steps 1000 --world 4

(the trials and the soak can run as separate invocations: --kills 0 --stalls 0, or
--soak-steps 0)

- kill: a training job of --world ranks (launched by hand, shm backend); after a random delay
  one random rank gets SIGKILL; every survivor must raise CommError; reported: the time from
  the kill to each survivor's raise.
- stall: one rank gets SIGSTOP (alive, silent); every survivor must raise CommTimeoutError at
  the --timeout; reported: the time from the stall to each raise.
- soak: --soak-steps training steps at 2 ranks; reported: RSS (MiB), open fds and threads,
  sampled every 50 steps, and segments left in /dev/shm.
- exit (issue 28 item 14): --exits jobs of --exit-world ranks (8) that train 3 steps, call
  finalize and end normally, with no torch process group, a gloo one destroyed first
  (--exit-pg destroy) or one left to the interpreter's teardown (--exit-pg leave); reported:
  the ranks that did not exit with status 0 or printed "terminate called".
Prints one JSON object per experiment and a summary; exits 1 when an expectation fails."""
import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import torch

import axonn_c


def _train_forever(steps=None, sample=None):
    """A small tensor-parallel model's training steps (col group of the whole world)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(axonn_c.Linear(240, 480), torch.nn.GELU(),
                                axonn_c.Linear(480, 240, transpose=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 240)  # (240 divides by 1-6, 8, 10, 12, 15, 16 ranks)
    step = 0
    while steps is None or step < steps:
        model(x).square().mean().backward()
        axonn_c.sync_gradients(model)
        opt.step()
        opt.zero_grad()
        if sample and step % 50 == 0:
            sample(step)
        step += 1


def _proc_stats():
    status = open("/proc/self/status").read().split("\n")
    rss = next(int(ln.split()[1]) for ln in status if ln.startswith("VmRSS:")) / 1024
    threads = next(int(ln.split()[1]) for ln in status if ln.startswith("Threads:"))
    return rss, len(os.listdir("/proc/self/fd")), threads


def worker(mode, timeout, steps):
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    world = int(os.environ["WORLD_SIZE"])
    import torch._dynamo  # noqa: F401  (the first step's lazy import: seconds on a busy machine)

    if mode in ("exit_destroy", "exit_leave"):
        import torch.distributed as dist
        dist.init_process_group("gloo")
    axonn_c.init(G_intra_c=world, timeout=timeout)
    if mode == "train":  # the first steps import torch's lazy modules (seconds, not training)
        _train_forever(3)
    print("READY", flush=True)
    if mode.startswith("exit"):
        _train_forever(3)
        axonn_c.finalize()
        if mode == "exit_destroy":  # the order that leaves torch no thread to tear down
            torch.distributed.destroy_process_group()
        return 0
    if mode == "soak":
        samples = []
        _train_forever(steps, lambda s: samples.append((s, *_proc_stats())))
        axonn_c.comm.barrier()
        print("SOAK " + json.dumps(samples), flush=True)
        axonn_c.finalize()
        return 0
    try:
        _train_forever()
    except axonn_c.CommError as e:
        print(f"RAISED {type(e).__name__} {time.monotonic():.6f} {str(e)[:200]}", flush=True)
        axonn_c.finalize()
        return 0
    return 1


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHED = []  # pids of every worker started (their segments are the ones to account for)


def launch(world, mode, timeout, steps=0):
    port = _port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", mode, "--timeout", str(timeout),
             "--soak-steps", str(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    LAUNCHED.extend(p.pid for p in procs)
    for p in procs:
        line = p.stdout.readline()
        assert "READY" in line, line + p.stdout.read()
    return procs


def failure_trial(world, timeout, sig, rng):
    """One kill (SIGKILL) or stall (SIGSTOP) trial: seconds from the signal to each survivor's
    raise, and the exception names."""
    procs = launch(world, "train", timeout)
    time.sleep(rng.uniform(0.3, 1.5))  # inside training steps by now
    victim = rng.randrange(world)
    t_sig = time.monotonic()
    os.kill(procs[victim].pid, sig)
    if sig == signal.SIGKILL:
        procs[victim].wait()  # reaped at once, as a launcher does (a zombie still has its pid)
    raised = []
    for r, p in enumerate(procs):
        if r == victim:
            continue
        try:
            out = p.communicate(timeout=timeout + 60)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0]
            raised.append(("HANG", None, ""))
            continue
        line = next((ln for ln in out.splitlines() if ln.startswith("RAISED")), None)
        if line is None:
            raised.append(("NONE", None, out[-300:]))
        else:
            _, kind, t, msg = line.split(" ", 3)
            raised.append((kind, float(t) - t_sig, msg[:120]))
    if sig != signal.SIGKILL:
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
    return victim, raised


def soak(steps, timeout):
    procs = launch(2, "soak", timeout, steps)
    outs = [p.communicate(timeout=steps * 5 + 120)[0] for p in procs]
    samples = [json.loads(next(ln for ln in o.splitlines() if ln.startswith("SOAK "))[5:])
               for o in outs]
    return samples


def exit_trial(world, timeout, pg):
    """One job that ends normally: the ranks that aborted (status, or "terminate called")."""
    procs = launch(world, "exit" if pg == "none" else f"exit_{pg}", timeout)
    bad = []
    for r, p in enumerate(procs):
        try:
            out = p.communicate(timeout=timeout + 120)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out, p.returncode = p.communicate()[0], "HANG"
        if p.returncode != 0 or "terminate called" in out:
            bad.append({"rank": r, "status": p.returncode, "tail": out[-200:]})
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--stalls", type=int, default=2)
    ap.add_argument("--soak-steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--exits", type=int, default=0)
    ap.add_argument("--exit-world", type=int, default=8)
    ap.add_argument("--exit-pg", choices=("none", "destroy", "leave"), default="none")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.timeout, a.soak_steps)
    rng = random.Random(a.seed)
    ok = True
    before = {n for n in os.listdir("/dev/shm") if n.startswith("axonn_c.")}
    kill_lat, stall_lat = [], []
    for i in range(a.kills):
        victim, raised = failure_trial(a.world, a.timeout, signal.SIGKILL, rng)
        print(json.dumps({"kill": i, "victim": victim, "survivors": raised}), flush=True)
        ok &= all(k in ("CommError", "CommTimeoutError") for k, _, _ in raised)
        kill_lat += [t for k, t, _ in raised if t is not None]
    for i in range(a.stalls):
        victim, raised = failure_trial(a.world, a.timeout, signal.SIGSTOP, rng)
        print(json.dumps({"stall": i, "victim": victim, "survivors": raised}), flush=True)
        ok &= all(k == "CommTimeoutError" for k, _, _ in raised)
        stall_lat += [t for k, t, _ in raised if t is not None]
    aborted = []
    for i in range(a.exits):
        bad = exit_trial(a.exit_world, a.timeout, a.exit_pg)
        print(json.dumps({"exit": i, "aborted": bad}), flush=True)
        aborted.append(len(bad))
        ok &= not bad
    summary = {"world": a.world, "timeout_s": a.timeout}
    if a.exits:
        summary["exit"] = {"jobs": a.exits, "world": a.exit_world, "process_group": a.exit_pg,
                           "jobs_with_an_abort": sum(1 for n in aborted if n),
                           "ranks_aborted": sum(aborted)}
    if kill_lat:
        summary["kill"] = {"trials": a.kills, "survivors_raised": len(kill_lat),
                           "ms_min": round(min(kill_lat) * 1e3, 1),
                           "ms_max": round(max(kill_lat) * 1e3, 1)}
    if stall_lat:
        summary["stall"] = {"trials": a.stalls, "survivors_raised": len(stall_lat),
                            "s_min": round(min(stall_lat), 2), "s_max": round(max(stall_lat), 2)}
    if a.soak_steps:
        samples = soak(a.soak_steps, max(a.timeout, 60.0))
        rss = [s[1] for rank in samples for s in rank[1:]]  # after the first step's allocations
        # per rank: the set of values seen over the run (one value each: constant)
        fds = [sorted({s[2] for s in rank[1:]}) for rank in samples]
        threads = [sorted({s[3] for s in rank[1:]}) for rank in samples]
        summary["soak"] = {"steps": a.soak_steps, "rss_mib_min": round(min(rss), 1),
                           "rss_mib_max": round(max(rss), 1), "fds_per_rank": fds,
                           "threads_per_rank": threads}
        ok &= all(len(v) == 1 for v in fds + threads)
    left = {n for n in os.listdir("/dev/shm") if n.startswith("axonn_c.")
            and n.split(".")[1] in {str(p) for p in LAUNCHED}} - before  # (other jobs' not)
    summary["segments_left"] = sorted(left)
    ok &= not left
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
