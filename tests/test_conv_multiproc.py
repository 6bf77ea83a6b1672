"""axonn_c.Conv2d equals torch's nn.Conv2d (forward, dX, dW, db; both layouts, transpose, a
conv -> conv chain), and a UNet-style CNN under auto_parallelize trains as serial, on every grid
of 1, 2 and 4 ranks and four 8-rank grids (tests/workers/conv_worker.py); a transformers GPT-2
and Llama under auto_parallelize train as serial at 1, 4 and 8 ranks
(tests/workers/gpt2_worker.py)."""
from pathlib import Path

import pytest

from conftest import torchrun

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world,grids", [(1, "all"), (2, "all"), (4, "all"),
                                         (8, "1x2x2x2,2x1x4x1,1x8x1x1,1x1x1x8")])
def test_conv2d_matches_torch(world, grids):
    out = torchrun(world, "conv_worker.py", "--grids", grids)
    assert f"world {world}:" in out and "conv cases match torch" in out


@pytest.mark.parametrize("world,grids", [(1, "1x1x1x1"),
                                         (4, "1x2x2x1,1x1x2x2,2x2x1x1,1x4x1x1"),
                                         (8, "1x2x2x2,2x2x2x1,1x1x8x1")])
def test_transformers_gpt2_and_llama_under_auto_parallelize_train_as_serial(world, grids):
    pytest.importorskip("transformers")
    out = torchrun(world, "gpt2_worker.py", "--grids", grids)
    assert f"world {world}:" in out and "GPT-2 and Llama train as serial" in out


def test_train_cnn_example_runs():
    out = torchrun(4, ROOT / "examples" / "train_cnn.py", "--steps", "3", "--size", "16",
                   "--channels", "8", "--log-every", "1")
    assert "grid 1x2x2x1: 11 of 13 convolutions parallel" in out and "step     2  loss" in out
