"""Regression tests of issue 28 (hardening): one per numbered item; multi-rank where the bug is
(tests/workers/hardening_worker.py runs the ranks)."""
import pytest

from conftest import torchrun


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
