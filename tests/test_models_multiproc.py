"""axonn_c.models.GPT on 1, 2, 4 and 8 ranks against the serial GPT-2 (transformers'
GPT2LMHeadModel when installed, else the worker's plain torch one): loss, gradients, 8 AdamW
steps (the per-step loss, mean over ranks, within 1e-4), state dicts, axonn_c.checkpoint across grids, bf16 autocast, dropout masks
(tests/workers/models_worker.py); examples/train_gpt.py --layout expert; benchmarks/bench_gpt.py
(its byte counts)."""
import json
import re

import pytest

from conftest import ROOT, torchrun

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


@pytest.mark.parametrize("extra", [(), ("--hf-init", "--dropout", "0.1")])
def test_train_gpt_example_expert_layout(extra, tmp_path):
    if "--hf-init" in extra:
        pytest.importorskip("transformers")
    out = torchrun(4, ROOT / "examples" / "train_gpt.py", "--layout", "expert", "--G-intra-r",
                   "2", "--G-intra-d", "2", "--checkpoint-activations", "--steps", "6",
                   "--log-every", "5", "--sample-chars", "10", "--save", tmp_path / "ck", *extra)
    assert "expert layout" in out and "G_intra_r=2 G_intra_c=1 G_intra_d=2" in out
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses), out
    assert "done: 6 steps" in out and "sample: " in out
    # the checkpoint goes on on another grid (2 ranks, the column group)
    out = torchrun(2, ROOT / "examples" / "train_gpt.py", "--layout", "expert", "--G-intra-c",
                   "2", "--batch-size", "16", "--steps", "8", "--log-every", "1",
                   "--sample-chars", "0", "--resume", tmp_path / "ck")
    assert "resumed from" in out and "at step 6" in out and "done: 2 steps" in out


def test_bench_gpt_expert_layout_sends_fewer_bytes_than_easy(tmp_path):
    """benchmarks/bench_gpt.py runs (tiny sizes, on a simulated link); the byte counts are the
    layouts', not timing: the expert layout's equal the communication model's prediction and
    are fewer than the easy layout's; PyTorch's tensor parallelism issues its collectives."""
    js = tmp_path / "gpt.json"
    torchrun(4, ROOT / "benchmarks" / "bench_gpt.py", "--steps", "2", "--warmup", "1",
             "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq", "16", "--batch", "8",
             "--sim-gbps", "10", "--sim-us", "10", "--json", js)
    r = json.loads(js.read_text())["results"]
    assert set(r) == {"expert", "easy", "ddp", "torch_tp"}
    assert 0 < r["expert"]["bytes_sent_per_step"] < r["easy"]["bytes_sent_per_step"]
    assert r["expert"]["bytes_sent_per_step"] == r["expert"]["predicted_bytes_sent_per_step"]
    assert r["expert"]["collectives_per_step"] < r["easy"]["collectives_per_step"]
    # 2 blocks: 2 row-wise all-reduces forward and 2 backward each, the head's input gradient,
    # loss_parallel's 3
    assert r["torch_tp"]["collectives_per_step"] == 12 and r["torch_tp"]["bytes_sent_per_step"] > 0
    assert all(v["peak_mb"] > 0 for v in r.values())
