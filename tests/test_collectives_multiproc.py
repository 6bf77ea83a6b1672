"""Every collective on every group of every grid factorisation, world sizes 1-8, against gloo."""
import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_all_grids_small_lengths(world):
    out = torchrun(world, "collectives_worker.py", "--sizes", "1,7,1000")
    assert f"world {world}:" in out and "all equal to gloo" in out


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_large_odd_length(world):
    # 1M+3 elements crosses the shm slot many times; the two grids with the most TP dimensions
    out = torchrun(world, "collectives_worker.py", "--sizes", "1000003", "--grids", "2",
                   "--dtypes", "float32,bfloat16,int8")
    assert "all equal to gloo" in out


def test_simulated_link_and_small_slots():
    # tiny slots force many rounds; a simulated link must not change results
    out = torchrun(4, "collectives_worker.py", "--sizes", "7,5000", "--grids", "3",
                   "--dtypes", "float32,float16,uint8",
                   env={"AXONN_C_SHM_SLOT_KB": "64", "AXONN_C_SIM_GBPS": "50",
                        "AXONN_C_SIM_US": "5"})
    assert "all equal to gloo" in out


def test_gpu_suite_shm_worker_on_cpu():
    """The GPU suite's shm worker (CUDA tensors staged through host memory on a GPU machine)
    with CPU tensors: its checks must hold here, so a GPU run fails only on the staging."""
    out = torchrun(2, "gpu_shm_worker.py", "--backend", "shm", "--sizes", "1,7,1000",
                   "--device", "cpu")
    assert "world 2, backend shm" in out and "all equal to the serial result" in out, out
