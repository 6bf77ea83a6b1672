"""Regression tests of issue 28 (hardening): one per numbered item; multi-rank where the bug is
(tests/workers/hardening_worker.py runs the ranks)."""
import os
import subprocess
import sys
import time

import pytest

from conftest import WORKERS, assert_no_shm_leftovers, free_port, job_tag, torchrun


def run(nproc, scenario, *args, **kw):
    out = torchrun(nproc, "hardening_worker.py", scenario, *args, timeout=kw.pop("timeout", 300),
                   **kw)
    assert out.count(f"OK {scenario}") == nproc, out
    return out


@pytest.mark.multiproc
def test_item1_nonsense_timeout_refused_on_every_rank_with_process_group():
    run(2, "bad_timeout_with_pg")


@pytest.mark.multiproc
def test_item1_init_failure_on_one_rank_fails_init_everywhere():
    run(2, "one_rank_fails_init")


@pytest.mark.multiproc
def test_item4_resize_during_async_collective_is_safe():
    run(2, "resize_during_async")


@pytest.mark.multiproc
def test_item6_nested_and_overlapping_refused():
    run(2, "nested_and_overlapping")


def by_hand(world, scenario, *args, timeout=600):
    """Ranks started without torchrun: the store is rank 0's own TCP store server at
    MASTER_ADDR/MASTER_PORT (no agent store). No segment of theirs may be left behind."""
    port = free_port()
    tag = job_tag()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", AXONN_C_SHM_TAG=tag)
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKERS / "hardening_worker.py"), scenario, *map(str, args)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {scenario}" in out, f"rank {rank}:\n{out[-4000:]}"
    assert_no_shm_leftovers(tag, f"hardening_worker.py {scenario} by hand")
    return outs


@pytest.mark.multiproc
def test_item10_many_init_finalize_cycles_without_process_group():
    by_hand(2, "init_cycles", 120)  # (both check that no segment of theirs is left)
    torchrun(2, "hardening_worker.py", "init_cycles", 40)  # the agent store too


@pytest.mark.multiproc
def test_item13_bench_skip_comm_on_the_easy_layout():
    run(2, "bench_skip_comm", env={"AXONN_C_BENCH_SKIP": "comm"})


@pytest.mark.multiproc
def test_item12_stale_segment_of_a_dead_process_removed_at_next_init():
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process now
    name = f"axonn_c.{dead.pid}.0.deadbeef"
    live = f"axonn_c.{os.getpid()}.0.livebeef"  # this process is alive: kept
    old = time.time() - 3600  # (the sweep leaves segments younger than two minutes alone)
    for n in (name, live):
        with open(f"/dev/shm/{n}", "wb") as f:
            f.write(b"\0" * 4096)
        os.utime(f"/dev/shm/{n}", (old, old))
    try:
        run(2, "stale_segment_swept", name)
        assert os.path.exists(f"/dev/shm/{live}")
    finally:
        for n in (name, live):
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


@pytest.mark.multiproc
def test_item5_replicated_state_identical_without_a_common_seed():
    run(2, "no_common_seed")
