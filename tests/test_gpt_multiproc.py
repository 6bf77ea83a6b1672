"""The example GPT (examples/gpt.py) wrapped in auto_parallelize trains 20 steps on 4 CPU ranks;
its per-step losses equal a single-process run of the same model on the same global batches
within 1e-4 relative (float32), also as concurrent micro-batches. Also runs
examples/train_gpt.py end to end."""
import re

import pytest

from conftest import ROOT, torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("grid", ["1,2,2,1", "2,1,1,2", "1,1,2,2"])
def test_gpt_losses_match_single_process(grid, overlap):
    out = torchrun(4, "gpt_worker.py", "--grid", grid, "--steps", "20",
                   *(["--overlap"] if overlap else []))
    assert "LOSSES MATCH" in out, out
    assert len(re.findall(r"^step +\d+ parallel", out, re.M)) == 20


@pytest.mark.parametrize("grid", ["1,2,2,1", "2,1,1,2"])
def test_gpt_concurrent_microbatches_match_single_process(grid):
    """Each rank's batch as two concurrent micro-batches (embedding, norms, attention, the
    easy layout): still the serial losses."""
    out = torchrun(4, "gpt_worker.py", "--grid", grid, "--steps", "20", "--overlap",
                   "--concurrent", "2")
    assert "LOSSES MATCH" in out, out


@pytest.mark.parametrize("concurrent", [1, 2])
def test_train_gpt_example_runs(concurrent):
    out = torchrun(4, ROOT / "examples" / "train_gpt.py", "--steps", "6", "--log-every", "5",
                   "--sample-chars", "10", "--concurrent", str(concurrent))
    assert "G_intra_r=2 G_intra_c=2" in out and "9/9 linear layers sharded" in out
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses), out
    assert "done: 6 steps" in out and "sample: " in out
