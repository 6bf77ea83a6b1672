"""Issue 28, single-process items: nonsense arguments are refused with a named error (items 2, 3,
6, 7, 8, 9); the multi-rank items are in test_hardening.py."""
import math

import pytest
import torch

import axonn_c
from axonn_c import plan

pytestmark = pytest.mark.usefixtures("world_of_one")


class FakeTensor:
    """Answers everything a tensor reader asks (item 3: read as a tensor, it crashed)."""
    dtype = torch.float32
    device = torch.device("cpu")
    is_nested = False
    layout = torch.strided

    def is_contiguous(self):
        return True

    def numel(self):
        return 1 << 20

    def data_ptr(self):
        return 8


class LyingTensor(torch.Tensor):
    def data_ptr(self):
        return 8


@pytest.mark.parametrize("call", [
    lambda t: axonn_c.comm.all_reduce(t),
    lambda t: axonn_c.comm.broadcast(t),
    lambda t: axonn_c.comm.all_gather(t, torch.ones(4)),
    lambda t: axonn_c.comm.all_gather(torch.ones(4), t),
    lambda t: axonn_c.comm.reduce_scatter(t, torch.ones(4)),
    lambda t: axonn_c.comm.all_to_all(torch.ones(4), t, async_op=True),
])
def test_item3_non_tensors_refused_by_type(call):
    axonn_c.init()
    for fake in (FakeTensor(), torch.ones(4).as_subclass(LyingTensor), 3, None):
        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            call(fake)


def test_item6_nested_refused_at_one_rank():
    axonn_c.init()
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match="nested tensor"):
        axonn_c.comm.all_reduce(nested)
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match="partially overlap"):
        axonn_c.comm.all_gather(buf[:4], buf[2:6])


@pytest.mark.parametrize("mb", [2**31, 2**17, 0, "2", 1.5, True])
def test_item2_micro_batches_checked(mb):
    axonn_c.init()
    model = torch.nn.Linear(3, 1)
    x, y = torch.ones(4, 3), torch.ones(4, 1)
    with pytest.raises((TypeError, ValueError), match="micro_batches"):
        axonn_c.forward_backward(model, (x, y), torch.nn.functional.mse_loss, micro_batches=mb)
    loss = axonn_c.forward_backward(model, (x, y), torch.nn.functional.mse_loss, micro_batches=4)
    assert math.isfinite(float(loss))


@pytest.mark.parametrize("rows", [4, 3, 1, 0])
def test_item2_more_micro_batches_than_rows(rows):
    """5 pieces of fewer rows (an epoch's short last batch): the empty pieces run (other ranks'
    pieces share their collectives) but have no loss, so the mean-reduced loss is the sum over
    the rows' pieces, not NaN, and the gradients are those of one piece per row."""
    axonn_c.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(rows, 3), torch.randn(rows, 2)
    mse = torch.nn.functional.mse_loss
    loss = axonn_c.forward_backward(model, (x, y), mse, micro_batches=5)
    got = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad()
    want = sum((mse(model(x[i:i + 1]), y[i:i + 1]) for i in range(rows)), torch.zeros(()))
    if rows:
        want.backward()
    assert math.isfinite(float(loss)) and torch.allclose(loss, want.detach()), (loss, want)
    for g, p in zip(got, model.parameters()):
        assert torch.allclose(g, p.grad if p.grad is not None else torch.zeros_like(p))


@pytest.mark.parametrize("args", [("4", 4), (3.7, 4), (4, None), (-1, 4), (4, 2**40)])
def test_item7_linear_features_checked(args):
    axonn_c.init()
    with pytest.raises((TypeError, ValueError), match="features"):
        axonn_c.Linear(*args)


@pytest.mark.parametrize("chunks", ["2", 1.5, 2**70, 0])
def test_item7_sequential_chunks_checked(chunks):
    with pytest.raises((TypeError, ValueError), match="chunks"):
        axonn_c.Sequential(torch.nn.Identity(), chunks=chunks)


@pytest.mark.parametrize("kw,match", [
    (dict(bucket_size=2**80), "bucket_size"), (dict(bucket_size=0), "bucket_size"),
    (dict(timeout=float("nan")), "timeout"), (dict(timeout=float("inf")), "timeout"),
    (dict(timeout=1e300), "timeout"), (dict(timeout=2**63), "timeout"),
    (dict(timeout="5"), "timeout")])
def test_item7_init_arguments_checked_in_a_world_of_one(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        axonn_c.init(**kw)
    assert not axonn_c.is_initialized()


@pytest.mark.parametrize("value", ["nan", "inf", "-3", "abc", "1e300"])
def test_item7_env_timeout_checked(monkeypatch, value):
    monkeypatch.setenv("AXONN_C_TIMEOUT", value)
    with pytest.raises(ValueError, match="AXONN_C_TIMEOUT"):
        axonn_c.init()


def test_item7_sync_gradients_attribute_name_checked():
    axonn_c.init()
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ValueError, match="gradient_attr_name='nope'"):
        axonn_c.sync_gradients(model, gradient_attr_name="nope")
    with pytest.raises(TypeError, match="gradient_attr_name"):
        axonn_c.sync_gradients(model, gradient_attr_name=3)
    axonn_c.sync_gradients(model)


def test_item7_timeline_bounds():
    with pytest.raises(ValueError, match="capacity"):
        axonn_c._C.timeline_set_capacity(2**62)
    axonn_c.timeline.start()  # still works afterwards
    axonn_c.timeline.stop()
    for nbytes in (-1, 2**64):
        with pytest.raises((ValueError, OverflowError), match="nbytes"):
            axonn_c.timeline.record_compute("x", 1, 2, nbytes)
    with pytest.raises(ValueError, match="nbytes"):
        axonn_c._C.timeline_record_compute("x", 1, 2, -1)


@pytest.mark.parametrize("path", ["", "/", "/dev/full", "/tmp/"])
def test_item7_timeline_export_needs_a_file_path(path):
    with pytest.raises(ValueError, match="path must name a file"):
        axonn_c.timeline.export(path)


def test_item8_right_exception_kinds():
    axonn_c.init()
    layer = axonn_c.Linear(4, 4)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        layer(torch.tensor(1.0))
    for junk in (None, "x", 3, [torch.ones(4)]):
        with pytest.raises(TypeError, match="torch.Tensor"):
            layer(junk)
        with pytest.raises(TypeError, match="nn.Module"):
            axonn_c.full_state_dict(junk)
        with pytest.raises(TypeError, match="nn.Module"):
            axonn_c.sync_gradients(junk)
    for junk in (None, 3, [None], ["x"]):
        with pytest.raises(TypeError, match="parameters"):
            axonn_c.clip_grad_norm_(junk, 1.0)
    with pytest.raises(TypeError, match="max_norm"):
        axonn_c.clip_grad_norm_(layer.parameters(), "1")
    with pytest.raises(ValueError, match="max_norm"):
        axonn_c.clip_grad_norm_(layer.parameters(), float("nan"))


@pytest.mark.parametrize("argv,match", [
    (["--ffn", "0"], "--ffn"), (["--gpus", "99999999999999999999"], "--gpus"),
    (["--seq", str(2**63 - 1)], "--seq"), (["--compress-data", "nan"], "--compress-data"),
    (["--json", "/proc/nope/x.json"], "cannot write"), (["--csv", "/"], "cannot write")])
def test_item9_planner_cli_refuses_with_exit_2(capsys, argv, match):
    base = {"--layers": "4", "--hidden": "1024", "--heads": "8", "--seq": "512",
            "--global-batch": "64", "--gpus": "8"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    rc = plan.main([x for kv in base.items() for x in kv])
    assert rc == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("norm_type", [0, -1, float("nan"), "2"])
def test_item8_clip_norm_type_checked(norm_type):
    axonn_c.init()
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    with pytest.raises((TypeError, ValueError), match="norm_type"):
        axonn_c.clip_grad_norm_(layer.parameters(), 1.0, norm_type=norm_type)


class LyingSubclass(torch.Tensor):
    def data_ptr(self):
        return 16


def test_item3_linear_refuses_a_subclass_with_its_own_data_ptr():
    axonn_c.init()
    layer = axonn_c.Linear(8, 8)
    with pytest.raises(TypeError, match="data_ptr"):
        layer(torch.ones(1, 8).as_subclass(LyingSubclass))
