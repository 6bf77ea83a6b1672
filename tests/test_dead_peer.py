"""A peer that dies mid-collective or never arrives makes every other rank raise in time."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import WORKERS, assert_no_shm_leftovers, free_port, job_tag

pytestmark = pytest.mark.multiproc


def launch(world, mode, timeout, tag=None):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONWARNINGS="ignore")
        if tag:
            env["AXONN_C_SHM_TAG"] = tag
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKERS / "dead_peer_worker.py"), mode, str(timeout)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    return procs


@pytest.mark.parametrize("mode,world", [("kill", 3), ("kill", 4), ("absent", 3),
                                        ("kill_concurrent", 4)])
def test_peer_failure_raises_on_every_rank(mode, world):
    timeout = 6.0
    tag = job_tag()
    procs = launch(world, mode, timeout, tag)
    victim = procs[-1]
    line = victim.stdout.readline()
    assert "VICTIM READY" in line, line + victim.stdout.read()
    t0 = time.monotonic()
    if mode.startswith("kill"):
        time.sleep(0.5)  # survivors are inside all_reduce loops by now
        victim.send_signal(signal.SIGKILL)
    outputs = []
    for p in procs[:-1]:
        out, _ = p.communicate(timeout=timeout + 30)
        outputs.append(out)
        assert p.returncode == 0, out
    elapsed = time.monotonic() - t0
    if mode == "absent":
        victim.kill()
    victim.wait()
    for out in outputs:
        m = re.search(r"RAISED (\w+) after ([\d.]+)s: (.*)", out)
        assert m, out
        assert "SECOND CALL DID NOT RAISE" not in out
        if mode.startswith("kill"):
            assert m.group(1) == "CommError" and "died" in m.group(3), out
        else:
            assert m.group(1) == "CommTimeoutError", out
        assert float(m.group(2)) <= timeout + 2.0
    assert elapsed < timeout + 20
    assert_no_shm_leftovers(tag, f"the {mode} job")


def comm_errors(mode):
    """Runs `mode` on 2 ranks (a timeout of 300 s, which must not be what fires) and returns
    each rank's CommError message."""
    messages = []
    for p in launch(2, mode, 300.0):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        m = re.search(r"RAISED (\w+): (.*)", out)
        assert m and m.group(1) == "CommError", out
        messages.append(m.group(2))
    return messages


def test_ranks_out_of_step_raise_at_once():
    """Ranks whose collectives differ (here a layer's forward all-reduce, 4 tokens on rank 0 and
    6 on rank 1) raise CommError on every rank, naming both calls, long before the timeout."""
    for msg in comm_errors("out_of_step"):
        assert "out of step on the col group" in msg, msg
        assert re.search(r"all_reduce of \d+ float32", msg), msg


def test_ranks_summing_other_models_gradients_in_backward_raise_at_once():
    """The same across two models synced separately: the names of their parameters in
    backward's buckets do not collide (was: each sync named its parameters by their position in
    its list, and one model's gradients were summed into the other's without an error)."""
    for msg in comm_errors("other_models_overlap"):
        assert "out of step on the world group" in msg, msg
        assert "packed different gradients into one sum" in msg, msg


def test_same_ranks_other_group_raise_at_once():
    """Issue 28 item 11: a collective over the col group on one rank and over the world group
    (the same two ranks) on the other raises CommError on both, naming both calls and groups,
    long before the timeout."""
    for msg in comm_errors("other_group"):
        assert "which have the same ranks" in msg, msg
        assert "all_reduce of 16 float32 (sum) as its collective 1 on the col group" in msg, msg
        assert "all_reduce of 16 float32 (sum) as its collective 2 on the world group" in msg, msg


def test_ranks_summing_other_gradients_raise_at_once():
    """Ranks with gradients for different parameters of the same total size (sync_gradients
    packs them into buckets of equal length) raise CommError on every rank, saying so, instead
    of summing one parameter's gradient into another's."""
    for msg in comm_errors("other_grads"):
        assert "out of step on the world group" in msg, msg
        assert "packed different gradients into one sum" in msg, msg


def test_ranks_summing_other_gradients_in_backward_raise_at_once():
    """The same with the data overlap on: backward's bucketed sums, filled by the gradient
    hooks, also carry what each rank packed (was: the same length on both ranks, summed)."""
    for msg in comm_errors("other_grads_overlap"):
        assert "out of step on the world group" in msg, msg
        assert "packed different gradients into one sum" in msg, msg
