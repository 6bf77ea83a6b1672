"""Messages a newcomer meets first (issue 27 items 4 and 7): each names the cause and the fix."""
import ctypes
import os
import subprocess
import sys

import pytest
import torch

import axonn_c
from axonn_c import plan
from conftest import ROOT


def _driver_loadable():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_build_info_names_a_cpu_only_machine():
    if _driver_loadable():
        pytest.skip("a CUDA driver is installed here")
    rt = axonn_c.build_info()["cuda_runtime"]
    if "cudaGetDeviceCount" not in rt:
        pytest.skip(f"no CUDA runtime library found to ask: {rt}")
    assert "no CUDA driver (CPU-only machine)" in rt, rt
    assert "insufficient" not in rt and "cudaError 35" not in rt, rt


def test_c_tests_build_with_the_installed_nccl_headers():
    """The Makefile compiles the C tests with the CUDA/NCCL header flags setup.py finds (the
    wheels `make setup-test` installs), so test_cuda_rt does not report a build without them."""
    flags = subprocess.run([sys.executable, "setup.py"], cwd=ROOT, capture_output=True,
                           text=True, env=dict(os.environ, AXONN_C_PRINT_CFLAGS="1")).stdout
    if "-DAXC_HAVE_NCCL_HEADERS=1" not in flags:
        pytest.skip("no NCCL headers on this machine (make setup-test installs them)")
    make = subprocess.run(["make", "-s", "build/ctests/plain/test_cuda_rt", f"PY={sys.executable}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert make.returncode == 0, make.stdout + make.stderr
    out = subprocess.run([str(ROOT / "build/ctests/plain/test_cuda_rt")], capture_output=True,
                         text=True, timeout=300).stdout
    assert "built without NCCL headers" not in out, out
    assert "NCCL headers 0" not in out, out


def test_launch_without_torchrun_names_it(world_of_one):
    with pytest.raises(ValueError, match=r"= 4 ranks does not match the world size 1; RANK and "
                                         r"WORLD_SIZE are not set.*torchrun --nproc_per_node 4"):
        axonn_c.init(G_intra_r=2, G_intra_c=2)


def test_launch_with_world_size_set_gets_no_torchrun_hint(world_of_one, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError) as e:
        axonn_c.init(G_intra_r=2)
    assert "torchrun" not in str(e.value)


def test_plan_auto_names_the_machine_profile(capsys, monkeypatch):
    monkeypatch.delenv("AXONN_C_MACHINE", raising=False)
    plan.auto_grid(8, verbose=True, blocks=2, hidden=256, heads=4, seq=128, global_batch=16)
    out = capsys.readouterr().out
    assert "machine profile 'perlmutter' (the default; pick another with init(plan='auto', " \
           "machine=...) or AXONN_C_MACHINE: " in out, out
    assert "dgx-h100" in out and "--calibrate" in out
    plan.auto_grid(8, machine="frontier", verbose=True, blocks=2, hidden=256, heads=4, seq=128,
                   global_batch=16)
    assert "'frontier' (given;" in capsys.readouterr().out
    monkeypatch.setenv("AXONN_C_MACHINE", "dgx-h100")
    plan.auto_grid(8, verbose=True, blocks=2, hidden=256, heads=4, seq=128, global_batch=16)
    assert "'dgx-h100' (from AXONN_C_MACHINE;" in capsys.readouterr().out


def test_sync_gradients_before_init_raises(world_of_one):
    model = torch.nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"not initialised: call axonn_c.init"):
        axonn_c.sync_gradients(model)


PLAN_ARGS = ["--layers", "4", "--hidden", "1024", "--heads", "16", "--seq", "512",
             "--global-batch", "64", "--gpus", "16", "--top", "3"]


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "axonn_c.plan", *args], capture_output=True,
                          text=True, timeout=300)


def test_plan_plot_says_where_and_refuses_a_bad_path(tmp_path):
    pytest.importorskip("matplotlib")
    good = tmp_path / "grids.png"
    r = run_plan(*PLAN_ARGS, "--plot", str(good))
    assert r.returncode == 0, r.stderr
    assert good.is_file() and f"to {good}" in r.stdout, r.stdout
    bad = tmp_path / "no" / "such" / "dir" / "grids.png"
    r = run_plan(*PLAN_ARGS, "--plot", str(bad))
    assert r.returncode != 0
    assert f"--plot: cannot write {bad}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_help_shows_defaults():
    r = run_plan("--help")
    assert "(default: perlmutter)" in r.stdout and "(default: full)" in r.stdout, r.stdout
    assert "(default: None)" not in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "examples/train_gpt.py"), "--help"],
                       capture_output=True, text=True, timeout=300)
    assert "(default: 300)" in r.stdout and "(default: cpu)" in r.stdout, r.stdout
    assert "DESIGN" not in r.stdout


def test_train_example_has_no_progress_bar_in_a_log():
    """stdout and stderr are pipes here, as in a log file: the loss lines, no bar redraws."""
    r = subprocess.run([sys.executable, str(ROOT / "examples/train_gpt.py"), "--steps", "3",
                        "--corpus-chars", "2000", "--sample-chars", "0"],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert "step     2  loss" in r.stdout, r.stdout
    assert "\r" not in r.stdout + r.stderr and "it/s" not in r.stdout + r.stderr, r.stderr
