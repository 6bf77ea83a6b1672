"""Shared helpers: launching ranks with torchrun and checking /dev/shm stays clean.

Other jobs (another test run, a training job) may create and remove axonn_c segments in /dev/shm
at any time, so the leak checks look only at segments of this session: every job it starts runs
with AXONN_C_SHM_TAG set to a tag of its own (nested in the session's tag, itself nested in an
outer tag such as .ci/run's), which csrc/comm/shm.c puts at the end of the segment name.
"""
import itertools
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
SESSION_TAG = "-".join(filter(None, [os.environ.get("AXONN_C_SHM_TAG"),
                                     f"py{secrets.token_hex(4)}"]))
_job_numbers = itertools.count()
# AxoNN's own test files (run under torchrun by test_axonn_compat.py, not collected directly)
collect_ignore = ["third_party"]


def job_tag():
    """A fresh tag for one job of this session (a torchrun call, a set of launched ranks)."""
    return f"{SESSION_TAG}-{next(_job_numbers)}"


def segment_has_tag(name, tag):
    """Whether /dev/shm entry `name` is an axonn_c segment of the job tagged `tag`, or of a job
    nested in it (tag-...). Segments of untagged or other jobs never match."""
    last = name.rsplit(".", 1)[-1]
    return name.startswith("axonn_c.") and (last == tag or last.startswith(tag + "-"))


def shm_leftovers(tag):
    """The axonn_c segments in /dev/shm that belong to the job tagged `tag`."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if segment_has_tag(n, tag))
    except FileNotFoundError:
        return []


def assert_no_shm_leftovers(tag, what):
    leaked = shm_leftovers(tag)
    assert not leaked, f"shared-memory segments left behind by {what}: {leaked}"


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
    tag = job_tag()
    full_env.update(env or {})
    full_env["AXONN_C_SHM_TAG"] = tag
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errors = [ln for ln in out.splitlines() if "Error" in ln and "Traceback" not in ln]
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}); error lines:\n"
                    + "\n".join(errors[:20]) + f"\n--- output tail ---\n{out[-6000:]}")
    assert_no_shm_leftovers(tag, f"torchrun {script}")
    return proc.stdout


@pytest.fixture(autouse=True, scope="session")
def no_shm_leftovers():
    """Tags every job of the session (the processes it starts inherit the variable) and fails
    the session if any of them left a segment behind."""
    outer = os.environ.get("AXONN_C_SHM_TAG")
    os.environ["AXONN_C_SHM_TAG"] = SESSION_TAG
    yield
    if outer is None:
        del os.environ["AXONN_C_SHM_TAG"]
    else:
        os.environ["AXONN_C_SHM_TAG"] = outer
    assert_no_shm_leftovers(SESSION_TAG, "the suite")
