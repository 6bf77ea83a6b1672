"""Error feedback on the depth dW reduce-scatters of axonn_c.Linear (issue 22 item 3): 4-rank
grids with G_intra_d 2 and 4, overlap off and on (tests/workers/depth_ef_worker.py)."""
import pytest
import torch

from conftest import torchrun

import axonn_c


@pytest.mark.multiproc
def test_depth_error_feedback_telescopes():
    # with error feedback the summed gradients plus the held residuals equal the exact sum;
    # without it (error_feedback=False: no residual) they miss it by int4's error
    out = torchrun(4, "depth_ef_worker.py", "--mode", "identity", timeout=900)
    assert "depth_ef identity: 3 grids ok" in out, out


@pytest.mark.multiproc
def test_depth_residuals_in_checkpoints(tmp_path):
    # compression_state(model) round trip, errors, and a checkpoint save/load that restores the
    # residuals bitwise and continues training bitwise like the uninterrupted run
    out = torchrun(4, "depth_ef_worker.py", "--mode", "checkpoint", "--dir", tmp_path,
                   timeout=900)
    assert "depth_ef checkpoint: ok" in out, out


def test_depth_residuals_without_model_and_world_of_one(world_of_one):
    # a world of one has no depth group: no residual, compression_state needs no model
    axonn_c.init(compression={"depth": "int4"})
    try:
        layer = axonn_c.Linear(8, 4)
        layer(torch.randn(3, 8)).sum().backward()
        assert axonn_c.compression_state(torch.nn.Sequential(layer)) == {"residuals": {},
                                                                         "depth": {}}
        assert axonn_c.compression_state() == {"residuals": {}}
        with pytest.raises(ValueError, match="pass model="):
            axonn_c.load_compression_state({"residuals": {}, "depth": {"0": torch.zeros(2)}})
        with pytest.raises(ValueError, match="no axonn_c.Linear of that name"):
            axonn_c.load_compression_state({"residuals": {}, "depth": {"x": torch.zeros(2)}},
                                           torch.nn.Sequential(layer))
        with pytest.raises(ValueError, match="non-negative int"):  # (before any change)
            axonn_c.load_compression_state({"residuals": {-1: torch.zeros(2)}})
        with pytest.raises(TypeError, match="must be a float32 tensor"):
            axonn_c.load_compression_state({"residuals": {}, "depth": {"0": torch.zeros(2).int()}},
                                           torch.nn.Sequential(layer))
    finally:
        axonn_c.finalize()
