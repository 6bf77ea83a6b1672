"""axonn_c.Sequential (cross-layer chunk pipelining, axonn_c/chunking.py) on several ranks
against serial PyTorch, over a slow simulated link so that an unawaited reduction shows."""
import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world", [2, 4, 8])
def test_pipeline_on_several_grids(world):
    out = torchrun(world, "pipeline_worker.py", env={"AXONN_C_SIM_US": "1500"})
    assert f"world {world}: pipeline checks pass" in out
