"""The cross-layer scheduler (docs/ARCHITECTURE.md#one-training-step) on several ranks, against
serial PyTorch: learned-order prefetch for a model whose execution order differs from its
registration order, re-learning,
at most two layers' gathered weights alive with prefetch k=1, the memory budget, and deferred
reduce-scatters / data-parallel buckets complete when backward returns (with accumulation)."""
import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world", [2, 4, 8])
def test_scheduler_on_several_grids(world):
    out = torchrun(world, "sched_worker.py")
    assert f"world {world}: scheduler checks pass" in out


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_suite_overlap_worker_on_cpu(world):
    """The GPU suite's overlap worker (CUDA tensors on a GPU machine) with CPU tensors: its
    checks (serial gradients after every backward, prefetches, deferrals, deferred dW GEMMs)
    must hold here too, so that a GPU run fails only on what the GPU does differently."""
    out = torchrun(world, "gpu_overlap_worker.py", env={"AXONN_C_TEST_DEVICE": "cpu"})
    assert f"world {world}: overlap with cpu tensors matches serial PyTorch" in out


def test_failed_backward_completes_its_queued_work():
    """A deferred backward that fails after queueing work (a test fault in its keep-alive step)
    completes that work before its tensors go (tests/workers/backward_fault_worker.py)."""
    out = torchrun(2, "backward_fault_worker.py")
    assert "world 2: backward fault checks pass" in out


def test_swapped_weight_storage_under_the_prefetch():
    """A parameter given new storage between steps (`p.data = ...`) while its depth gather is
    prefetched: the old storage stays alive until the prefetch is dropped, and every step
    equals serial PyTorch (tests/workers/shard_swap_worker.py; under ASan in
    tests/run_asan_workers.sh)."""
    out = torchrun(2, "shard_swap_worker.py")
    assert "world 2: shard swap checks pass" in out
