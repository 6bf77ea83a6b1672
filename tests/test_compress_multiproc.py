"""Compressed collectives on shm (2-8 ranks) and the compression= argument's checks."""
import pytest
import torch

from conftest import torchrun

import axonn_c
from axonn_c import _C, compression


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_compressed_collectives(world):
    out = torchrun(world, "compress_worker.py", "--sizes", "1,7,1000")
    assert f"world {world} grid" in out and "identical on every rank" in out


@pytest.mark.multiproc
def test_sub_groups_blocks_and_small_slots():
    # groups of 2 inside a 2x2 grid, every codec at two block sizes, lengths that need many
    # rounds of 64 KiB slots, and a simulated link (which counts wire bytes)
    out = torchrun(4, "compress_worker.py", "--grid", "2,2,1,1", "--sizes", "5,70001",
                   "--blocks", "32,4096",
                   env={"AXONN_C_SHM_SLOT_KB": "64", "AXONN_C_SIM_GBPS": "50"})
    assert "identical on every rank" in out


@pytest.mark.multiproc
def test_optimize_communication_compression_context():
    out = torchrun(2, "compress_context_worker.py")
    assert out.count("compression context OK") == 2, out


def test_codec_round_trip_in_python():
    x = torch.linspace(-3, 5, 1001)
    for codec in ("bf16", "fp8", "int8", "int4"):
        enc = torch.empty(_C.codec_encoded_bytes(codec, x.numel(), 0), dtype=torch.uint8)
        _C.codec_encode(codec, 0, x, enc, None)
        y = torch.empty_like(x)
        _C.codec_decode(codec, 0, enc, y, False)
        assert (y - x).abs().max().item() <= 5 / 7 / 2 * 1.001


def test_codec_feedback_in_python():
    # residual += mult * (x - decoded), per codec block, left as it was on a block where x or
    # decoded is not finite (the CPU reference the CUDA kernel is compared with)
    x = torch.linspace(-1, 1, 96)
    dec = x + 0.25
    dec[70] = float("nan")  # (the third block of 32)
    res = torch.full((96,), 1.0)
    _C.codec_feedback("int8", 32, x, dec, res, 0.5)
    assert torch.equal(res[:64], torch.full((64,), 1.0 - 0.125))
    assert torch.equal(res[64:], torch.full((32,), 1.0))
    with pytest.raises(ValueError, match="x has 96 elements, decoded 95 and residual 96"):
        _C.codec_feedback("int8", 32, x, dec[:95], res, 0.5)
    with pytest.raises(TypeError, match="residual has dtype float64, expected float32"):
        _C.codec_feedback("int8", 32, x, dec, res.double(), 0.5)


def test_compression_argument_errors(world_of_one):
    axonn_c.init()
    x = torch.ones(10)
    with pytest.raises(ValueError, match=r"unknown compression codec 'int3'.*'int4'"):
        axonn_c.comm.all_reduce(x, compression="int3")
    with pytest.raises(ValueError, match=r"unknown compression keys \['blocks'\]"):
        axonn_c.comm.all_reduce(x, compression={"codec": "int8", "blocks": 64})
    with pytest.raises(ValueError, match="power of two"):
        axonn_c.comm.all_reduce(x, compression={"codec": "int8", "block": 48})
    with pytest.raises(TypeError, match="dtype int64, expected float32"):
        axonn_c.comm.all_reduce(torch.ones(4, dtype=torch.int64), compression="int8")
    with pytest.raises(ValueError, match="sum and avg, not max"):
        axonn_c.comm.all_reduce(x, op="max", compression="int8")
    with pytest.raises(ValueError, match="residual must be a float32 tensor like the input"):
        axonn_c.comm.all_reduce(x, compression={"codec": "int4", "error_feedback": torch.zeros(3)})
    with pytest.raises(TypeError, match="error_feedback must be the float32 residual"):
        axonn_c.comm.all_reduce(x, compression={"codec": "int4", "error_feedback": True})
    # a group of one copies exactly; "none" and None are the uncompressed collective
    y = torch.linspace(0, 1, 10)
    axonn_c.comm.all_reduce(y, compression="int4")
    assert torch.equal(y, torch.linspace(0, 1, 10))
    axonn_c.comm.all_reduce(y, compression={"codec": "none"})
    assert axonn_c.comm_stats()["world"]["compressed_calls"] == 1


@pytest.mark.multiproc
@pytest.mark.parametrize("grid,overlap", [("4,1,1,1", 1), ("2,2,1,1", 0), ("1,1,2,2", 1)])
def test_compressed_data_parallel_gradients(grid, overlap, tmp_path):
    # backward's overlapped bucket sums (overlap 1) and sync_gradients' (overlap 0), each
    # setting trained 150 steps: replicas identical, losses and wire bytes within bounds; on
    # grids with tensor parallelism also the layers' own collectives (row, col, depth)
    out = torchrun(4, "grad_compress_worker.py", "--grid", grid, "--overlap", overlap,
                   "--ckpt-dir", tmp_path)
    assert f"grid {grid} overlap {overlap}: compressed gradients ok" in out
    if grid.split(",")[0] != "1":  # (data residuals: a rollback to a checkpoint without them)
        assert "rollback dropped 0 +" not in out and "rollback dropped" in out
    assert "int4: final loss" in out


def test_compression_policy_errors(world_of_one):
    with pytest.raises(ValueError, match=r"compression\['data'\]: unknown codec 'int3'.*'int4'"):
        axonn_c.init(compression="int3")
    with pytest.raises(ValueError, match=r"unknown dimensions \['dp'\].*'data', 'depth'"):
        axonn_c.init(compression={"dp": "int8"})
    with pytest.raises(ValueError, match=r"compression\['row'\]: error feedback applies to "
                                         r"gradient traffic only.*error_feedback=False for 'row'"):
        axonn_c.init(compression={"data": "int8", "row": {"codec": "int8",
                                                          "error_feedback": True}})
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        axonn_c.init(compression={"codec": "int8", "error_feedback": 1})
    with pytest.raises(ValueError, match="power of two"):
        axonn_c.init(compression={"data": {"codec": "int8", "block": 48}})
    assert not axonn_c.is_initialized() or axonn_c.finalize() is None
    # accepted forms; a world of one compresses nothing and keeps no residual
    for ok in ("int4", {"codec": "bf16"}, {"data": None, "depth": "none"},
               {"data": {"codec": "int8", "block": 64, "error_feedback": False}}):
        axonn_c.init(compression=ok)
        axonn_c.finalize()
    assert axonn_c.compression_state() == {"residuals": {}}
    with pytest.raises(TypeError, match="expected the dict compression_state"):
        axonn_c.load_compression_state({"residual": {}})


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc,n_grids", [(2, 4), (4, 10)])
def test_compressed_step_wire_bytes_equal_model(nproc, n_grids):
    # every grid of the world: a training step's wire bytes per group as counted == predicted
    # by plan.step_volume for data int8/int4 and codecs on depth/row/col, overlap off and on
    out = torchrun(nproc, "compress_bytes_worker.py", timeout=900)
    assert f"compress_bytes_worker: {n_grids} grids equal on world {nproc}" in out, out


@pytest.mark.multiproc
def test_layer_own_compression():
    # Linear.compression over init's policy, overlap off and on, three 4-rank grids: within the
    # codec's error where a layer compresses, bitwise exact where it turns init's codecs off
    out = torchrun(4, "compress_layer_worker.py", timeout=900)
    assert "compress_layer_worker: 3 grids ok" in out, out


def test_layer_compression_errors(world_of_one):
    axonn_c.init()
    layer = axonn_c.Linear(8, 4)
    assert layer.compression is None
    with pytest.raises(ValueError, match=r"name the dimensions.*'depth', 'row', 'col'"):
        layer.compression = "int8"
    with pytest.raises(ValueError, match="'data' cannot be set per layer"):
        layer.compression = {"data": "int8"}
    with pytest.raises(ValueError, match=r"compression\['row'\]: unknown codec 'int3'"):
        layer.compression = {"row": "int3"}
    with pytest.raises(ValueError, match="power of two"):
        layer.compression = {"col": {"codec": "int8", "block": 48}}
    with pytest.raises(ValueError, match="error_feedback=False for 'col'"):
        layer.compression = {"col": {"codec": "int8", "error_feedback": True}}
    with pytest.raises(TypeError, match="compression must be None"):
        layer.compression = 5
    assert layer.compression is None  # (a refused value changes nothing)
    layer.compression = {"depth": "bf16", "row": None}
    assert layer.compression == {"depth": "bf16", "row": None}
    # error feedback on the depth dW reduce-scatters: by default for int8/int4, or asked for
    assert compression.layer_policy({"depth": "int4"})["depth"] == ("int4", 0, True)
    assert compression.layer_policy({"depth": "bf16"})["depth"] == ("bf16", 0, False)
    assert compression.parse_policy({"depth": {"codec": "int8", "error_feedback": False}}) == {
        "depth": ("int8", 0, False)}
    layer.compression = {"depth": {"codec": "bf16", "error_feedback": True}}
    assert compression.layer_codec_ints(layer._own_compression)[-1] == 1
    x = torch.randn(3, 8)
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.full_weight(), layer.bias))


def test_data_codec_without_kernels_refused_at_init(world_of_one, monkeypatch):
    # backend="nccl" alone sums CUDA buckets: without the codec kernels, refused before init
    monkeypatch.setattr(_C, "codec_cuda_compiled", lambda: False)
    with pytest.raises(ValueError, match=r"compression\['data'\] = 'int8' needs the CUDA codec "
                                         r"kernels with backend='nccl'"):
        axonn_c.init(backend="nccl", compression="int8")
    assert not axonn_c.is_initialized()
