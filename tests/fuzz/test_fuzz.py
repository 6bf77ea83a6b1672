"""The fuzz harness (fuzz_api.py) in CI: a few thousand randomized malformed public-API calls at
1 and 2 ranks: 0 crashes, 0 hangs, 0 findings (every call returns or is refused by name).
A longer run: see the README's Reliability section (e.g. --calls 10000)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_no_shm_leftovers, free_port, job_tag

HARNESS = Path(__file__).resolve().parent / "fuzz_api.py"


def fuzz(nproc, calls, seed, tmp_path, timeout=300):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    tag = job_tag()  # the leak check looks at this run's segments only
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR",
               AXONN_C_SHM_TAG=tag)
    trace = tmp_path / "call"
    args = [str(HARNESS), "--calls", str(calls), "--seed", str(seed), "--trace", str(trace)]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
                "127.0.0.1", "--master_port", str(free_port())] + args
    try:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        calls_now = [p.read_text() for p in tmp_path.glob("call.rank*")]
        pytest.fail(f"HANG: the fuzz run did not end in {timeout} s; calls in progress: "
                    f"{calls_now}")
    out = proc.stdout + proc.stderr
    calls_now = [p.read_text() for p in tmp_path.glob("call.rank*")]
    assert "Fatal Python error" not in out and proc.returncode >= 0, \
        f"CRASH (rc {proc.returncode}) at {calls_now}:\n{out[-4000:]}"
    # (the ranks share one pipe: one rank's line can land in the middle of the other's)
    summaries = re.findall(r"FUZZ rank=\d+ calls=\d+ ok=\d+ refused=\d+ findings=\d+ ", out)
    assert proc.returncode == 0 and len(summaries) == nproc, \
        f"rc {proc.returncode}, calls in progress {calls_now}:\n{out[-4000:]}"
    assert all(" findings=0 " in s for s in summaries), out[-4000:]
    assert_no_shm_leftovers(tag, "the fuzz run")
    return summaries


@pytest.mark.parametrize("seed", [11, 12])
def test_fuzz_world_of_one(tmp_path, seed):
    fuzz(1, 1500, seed, tmp_path)


@pytest.mark.multiproc
def test_fuzz_two_ranks(tmp_path):
    fuzz(2, 1500, 13, tmp_path)
