"""axonn_c.Linear equals nn.Linear on every grid of world sizes 1-8 (both layouts, transpose,
bias, float32 and bfloat16), an expert-mode MLP equals the serial MLP, and the bytes it moves
equal the communication model's prediction."""
import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_linear_matches_serial_on_every_grid(world):
    out = torchrun(world, "linear_worker.py", "--dtypes", "float32,bfloat16")
    assert f"world {world}:" in out and "match nn.Linear" in out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_linear_matches_serial_with_every_overlap_on(world):
    """The same matrix with init(overlap=True): chunked forward all-reduces, prefetched depth
    all-gathers, deferred reduce-scatters and data-parallel buckets during backward."""
    out = torchrun(world, "linear_worker.py", "--dtypes", "float32,bfloat16", "--overlap")
    assert f"world {world}:" in out and "with every overlap on" in out


@pytest.mark.parametrize("world,grids", [(2, ("2,1,1,1", "1,1,1,2", "1,2,1,1")),
                                         (4, ("2,2,1,1", "1,2,2,1", "2,1,1,2"))])
def test_deferring_shortcut_equals_the_general_path(world, grids):
    """Forward's shortcut for a layer whose gradients are its only cross-layer work (overlap on:
    data-parallel sums, deferred dW) gives bitwise what the general path gives."""
    out = torchrun(world, "deferring_worker.py", *grids)
    for grid in grids:
        assert f"grid [{grid.replace(',', ', ')}]: the deferring shortcut equals" in out
        assert f"grid [{grid.replace(',', ', ')}]: across micro-batch threads as the" in out
