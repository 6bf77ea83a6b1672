"""axonn_c.Embedding (tied output layer and loss included), parallel_cross_entropy, LayerNorm and
RMSNorm equal the serial torch layers on every grid of 1, 2 and 4 ranks and two 8-rank grids
(tests/workers/layers_worker.py)."""
import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world,grids", [(1, "all"), (2, "all"), (4, "all"),
                                         (8, "1x2x2x2,2x1x4x1")])
def test_layers_match_torch(world, grids):
    out = torchrun(world, "layers_worker.py", "--grids", grids)
    assert f"world {world}:" in out and "layer cases match torch" in out


def test_layers_match_torch_with_overlap_on():
    """init(overlap=True): the data-parallel sums of these layers' gradients run in backward."""
    out = torchrun(4, "layers_worker.py", "--grids", "2x1x2x1,2x1x1x2", "--overlap")
    assert "world 4:" in out and "with overlap on" in out
