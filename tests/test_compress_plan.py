"""The communication model and planner with a compression policy (issue 22 item 5): hand-computed
wire bytes, the CLI's --compression, and its errors. The multi-rank check (predicted == counted
on every grid) is test_compress_multiproc.py::test_compressed_step_wire_bytes_equal_model."""
import json

import pytest

from axonn_c import _C, grads, plan

LAYER = dict(in_features=64, out_features=96, bias=1)


def entry(grid, **kw):
    return next(e for e in plan.plan(4, layers=[LAYER], seq=8, global_batch=8, dtype="fp32",
                                     **kw) if e["grid"] == grid)


def test_data_codec_bytes_by_hand():
    # one bucket of 64*96 + 96 = 6240 gradients over 4 data ranks: piece 1560
    plain = entry((4, 1, 1, 1))
    assert plain["bytes"]["data"] == 2 * (6240 - 1560) * 4
    # int4, default block 64: 25 fp32 scales + 780 B per piece, 3 peers, reduce-scatter +
    # all-gather
    assert entry((4, 1, 1, 1), compression={"data": "int4"})["bytes"]["data"] == \
        2 * 3 * (25 * 4 + 780)
    # int8 with blocks of 64: 25 scales + 1560 B; a codec name alone is data's
    assert entry((4, 1, 1, 1), compression={"codec": "int8", "block": 64})["bytes"]["data"] == \
        2 * 3 * (25 * 4 + 1560)
    # buckets of 4096 B (1024 gradients): the weight alone (6144 > 1024 takes its own), the bias
    two = entry((4, 1, 1, 1), compression="int8", bucket_bytes=4096)
    assert two["calls"]["data"] == 2
    assert two["bytes"]["data"] == 2 * 3 * ((6 * 4 + 1536) + (1 * 4 + 24))


def test_layer_codecs_by_hand():
    # G_intra_d = 4: bf16 halves the weight's depth all-gathers and dW reduce-scatters; the
    # bias's depth all-reduce (a gradient bucket's: 2 * (96 - 24) * 4 B) stays exact
    e = entry((1, 1, 1, 4), compression={"depth": "bf16"})
    plain = entry((1, 1, 1, 4))["bytes"]["depth"]
    assert e["bytes"]["depth"] == 576 + (plain - 576) // 2 and (plain - 576) % (3 * 1536 * 4) == 0
    # bf16 activations are not float32: the runtime and the model leave them exact
    bf = [x for x in plan.plan(4, layers=[LAYER], seq=8, global_batch=8, dtype="bf16",
                               compression={"depth": "int4", "row": "int4", "col": "int4"})
          if x["grid"] == (1, 1, 1, 4)][0]
    assert bf["bytes"] == [x for x in plan.plan(4, layers=[LAYER], seq=8, global_batch=8,
                                                dtype="bf16") if x["grid"] == (1, 1, 1, 4)
                           ][0]["bytes"]


def test_step_volume_uses_the_policy():
    layers = [dict(LAYER, easy=0)]
    kw = dict(layers=layers, dtype="float32", grad_dtype="float32", recompute=0)
    plain = plan.step_volume(None, (4, 1, 1, 1), 0, 8, **kw)
    int8 = plan.step_volume(None, (4, 1, 1, 1), 0, 8, compression="int8", **kw)
    assert plain["sent"]["data"] == 2 * (6240 - 1560) * 4
    assert int8["sent"]["data"] == 2 * 3 * (7 * 4 + 1560)  # (block 256: 7 scales)
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        plan.step_volume(None, (4, 1, 1, 1), 0, 8, compression="int3", **kw)
    with pytest.raises(ValueError, match="unknown group 'dp' in 'compression'"):
        _C.model_volume((4, 1, 1, 1), 0, layers,
                        dict(tokens=8, compression={"dp": ("int8", 0)}))
    with pytest.raises(TypeError, match=r"\(codec name, block\)"):
        _C.model_volume((4, 1, 1, 1), 0, layers, dict(tokens=8, compression={"data": "int8"}))
    with pytest.raises(ValueError, match="only col, row, depth and data"):
        _C.model_volume((4, 1, 1, 1), 0, layers,
                        dict(tokens=8, compression={"world": ("int8", 0)}))


def test_cli_compression(tmp_path, capsys):
    argv = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "64",
            "--global-batch", "16", "--gpus", "8", "--dtype", "fp32"]
    plain, packed = tmp_path / "plain.json", tmp_path / "int4.json"
    assert plan.main(argv + ["--json", str(plain)]) == 0
    assert plan.main(argv + ["--compression", "data=int4", "depth=bf16,row=int8:64",
                             "--json", str(packed)]) == 0
    assert "compression data=int4 depth=bf16,row=int8:64" in capsys.readouterr().out
    by_grid = {tuple(e["grid"]): e for e in json.loads(plain.read_text())}
    for e in json.loads(packed.read_text()):
        p = by_grid[tuple(e["grid"])]
        for group, g in (("data", e["G_data"]), ("depth", e["G_intra_d"]),
                         ("row", e["G_intra_r"])):
            if e["valid"] and g > 1:
                assert e["bytes"][group] < p["bytes"][group], (e["grid"], group)
        assert e["bytes"]["col"] == p["bytes"]["col"]
    for bad, msg in ((["data"], "expected DIM=CODEC[:BLOCK]"),
                     (["data=int3"], "unknown codec 'int3'"),
                     (["data=int4:48"], "power of two"),
                     (["data=int4:x"], "block size 'x' is not an integer"),
                     (["dp=int4"], "unknown dimensions ['dp']")):
        assert plan.main(argv + ["--compression", *bad]) == 2
        assert msg in capsys.readouterr().err
    assert plan.main(argv + ["--bucket-size", "2"]) == 2
    assert "--bucket-size must be >= 4" in capsys.readouterr().err


def test_cli_sync_bucket_size_is_sync_gradients(monkeypatch, capsys):
    """Without --bucket-size the CLI packs as sync_gradients does: grads.SYNC_BUCKET_BYTES,
    read when it runs (one constant, not a copy)."""
    seen = {}

    def fake_plan(*args, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(plan, "plan", fake_plan)
    monkeypatch.setattr(grads, "SYNC_BUCKET_BYTES", 12345)
    argv = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "64",
            "--global-batch", "16", "--gpus", "8"]
    assert plan.main(argv) == 2 and "stop here" in capsys.readouterr().err
    assert seen["bucket_bytes"] == 12345
    assert plan.main(argv + ["--bucket-size", "4096"]) == 2
    assert seen["bucket_bytes"] == 4096
