"""The GPU suite's benchmarks (benchmarks/gpu_suite.sh: stages host and train) run on the CPU at
tiny sizes, so that the GPU machine's few minutes are never lost to a script broken by a change
made without a GPU. What they compute is checked, not how fast: the bf16 GPT trained through
axonn_c reaches the same loss as plain PyTorch's, and the host-cost rows carry every column."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = ROOT / "benchmarks"
HOST_KEYS = ("overlap", "nn_linear_us", "axonn_us", "extra_us", "python_us", "c_us", "gemm_us",
             "comm_us", "ddp_us")


def run(args, timeout=600):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("AXONN_C_BENCH_SKIP", None)
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_train_stage_on_cpu(tmp_path):
    # bench_train_gpu.py: the same GPT, bf16 autocast, trained through axonn_c and in plain
    # PyTorch from the same initial weights: the same loss after the same steps (a step moves
    # it by about 0.04 here, so a lost or wrong update shows)
    out = tmp_path / "train.json"
    run([BENCH / "bench_train_gpu.py", "--preset", "tiny", "--device", "cpu", "--steps", "2",
         "--warmup", "1", "--rounds", "1", "--variants", "torch,axonn_c", "--json", out])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"torch", "axonn_c"}, rows
    for r in rows.values():
        assert "error" not in r, r
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0, r
    assert rows["axonn_c"]["loss"] == pytest.approx(rows["torch"]["loss"], abs=1e-3), rows


@pytest.mark.multiproc
@pytest.mark.parametrize("ranks,layers", [(1, 1), (2, 1), (2, 3)])
def test_host_stage_on_cpu(tmp_path, ranks, layers):
    # bench_host.py: a row per overlap setting with every column (at 2 ranks DDP's too), per
    # layer of a stack with --layers
    out = tmp_path / "host.json"
    run([BENCH / "bench_host.py", "--ranks", ranks, "--rounds", "1", "--iters", "3",
         "--layers", layers, "--json", out])
    rows = json.loads(out.read_text())
    assert [r["overlap"] for r in rows] == [False, True], rows
    for r in rows:
        assert set(HOST_KEYS) <= set(r), r
        assert r["world"] == ranks and r["axonn_us"] > 0 and r["nn_linear_us"] > 0, r
        assert (r["ddp_us"] is not None) == (ranks > 1), r
        assert r["layers"] == layers, r


def test_suite_refuses_an_unknown_stage(tmp_path):
    # a typo in a stage name ends the call at once (exit 2), before any device time is spent
    proc = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), "hots"], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, OUT=str(tmp_path)))
    assert proc.returncode == 2 and "unknown stage 'hots'" in proc.stderr, proc.stderr


def test_profile_stage_tools_on_cpu(tmp_path):
    # the profile stage's pieces: bench_host.py --spin runs one loop and says when it starts (the
    # profiler attaches then), and profile_summary.py reads py-spy's raw stacks, one loop per file
    out = run([BENCH / "bench_host.py", "--spin", "0.2", "--spin-loop", "axonn_c_on"])
    assert out.splitlines()[0] == "spinning spin_axonn_c_overlap_on", out
    assert "spin_axonn_c_overlap_on:" in out and "spin_nn_linear" not in out, out
    raw = tmp_path / "host_profile_axonn_c_on.txt"
    raw.write_text("main (a.py:1);spin_axonn_c_overlap_on (b.py:2);call_forward (c.c:3) 3\n"
                   "main (a.py:1);spin_axonn_c_overlap_on (b.py:2);gemm (g.c:9) 1\n"
                   "thread_main (libtorch_cpu.so);PyNode::apply (libtorch_python.so) 4\n")
    summary = run([BENCH / "profile_summary.py", raw, "--top", "10"])
    assert "host_profile_axonn_c_on.txt: 8 samples" in summary, summary
    lines = summary.splitlines()
    assert "50.0  main (a.py)" in [line.strip() for line in lines], summary
    assert "37.5  call_forward (c.c)" in [line.strip() for line in lines], summary
