"""Shared helpers: launching ranks with torchrun and checking /dev/shm stays clean."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def shm_leftovers():
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("axonn_c."))
    except FileNotFoundError:
        return []


@pytest.fixture
def world_of_one(monkeypatch):
    """A single process outside torchrun, with axonn_c finalised before and after the test."""
    import axonn_c

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    axonn_c.finalize()
    yield
    axonn_c.finalize()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, script, *args, timeout=900, env=None):
    """Runs `script` on `nproc` ranks; fails the test with the output if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(WORKERS / script), *map(str, args)]
    full_env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
                    TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    full_env.update(env or {})
    before = set(shm_leftovers())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errors = [ln for ln in out.splitlines() if "Error" in ln and "Traceback" not in ln]
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}); error lines:\n"
                    + "\n".join(errors[:20]) + f"\n--- output tail ---\n{out[-6000:]}")
    leaked = set(shm_leftovers()) - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
    return proc.stdout


@pytest.fixture(autouse=True, scope="session")
def no_shm_leftovers():
    before = set(shm_leftovers())
    yield
    leaked = set(shm_leftovers()) - before
    assert not leaked, f"shared-memory segments left behind by the suite: {sorted(leaked)}"
