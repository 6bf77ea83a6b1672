"""axonn_c.models.GPT on 1, 2, 4 and 8 ranks against the serial GPT-2 (transformers'
GPT2LMHeadModel when installed, else the worker's plain torch one): loss, gradients, AdamW
steps, state dicts, axonn_c.checkpoint across grids, bf16 autocast, dropout masks
(tests/workers/models_worker.py)."""
import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world,grids,extra", [
    (1, "all", ()),
    (2, "all", ()),
    (2, "1x2x1x1,1x1x1x2", ("--serial", "torch")),
    (4, "1x2x2x1,1x1x2x2,2x2x1x1,1x4x1x1,1x1x4x1", ()),
    (4, "1x2x2x1,2x1x2x1,1x1x2x2", ("--overlap", "--checkpoint")),
    (8, "1x2x2x2,2x2x2x1", ()),
])
def test_gpt_matches_serial_gpt2(world, grids, extra, tmp_path):
    out = torchrun(world, "models_worker.py", "--grids", grids, "--dir", tmp_path, *extra)
    assert f"world {world}:" in out and "match the serial GPT-2" in out
