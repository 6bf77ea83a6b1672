"""axonn_c.Linear in one process: nn.Linear equivalence, autocast, errors, state dicts, and the
custom ops' registration (opcheck)."""
import pytest
import torch

import axonn_c
from axonn_c import linear as axl


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    axonn_c.finalize()
    axonn_c.init()
    yield
    axonn_c.finalize()


def pair(in_f=48, out_f=80, bias=True, seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_f, out_f, bias=bias)
    torch.manual_seed(seed)
    return axonn_c.Linear(in_f, out_f, bias=bias, **kw), ref


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("expert", [False, True])
def test_equals_nn_linear(bias, expert):
    ours, ref = pair(bias=bias, expert_mode=expert)
    assert torch.equal(ours.full_weight(), ref.weight.detach())
    x = torch.randn(3, 5, 48, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = ours(x), ref(xr)
    assert y.shape == (3, 5, 80)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad.reshape(-1), rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_init_method_and_seed_reproducible():
    ours = axonn_c.Linear(16, 8, init_method=lambda w: torch.nn.init.constant_(w, 0.5))
    assert torch.all(ours.full_weight() == 0.5)


def test_bfloat16_and_autocast():
    ours, ref = pair()
    x = torch.randn(7, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x)
        yr = ref(x)
    assert y.dtype == torch.bfloat16
    rel = (y.float() - yr.float()).norm() / yr.float().norm()
    assert rel < 1e-2
    ours16, _ = pair(dtype=torch.bfloat16)
    y16 = ours16(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert ((y16.float() - ref(x)).norm() / ref(x).norm()) < 1e-2


def test_skip_bias_add_returns_bias():
    ours, ref = pair(skip_bias_add=True)
    x = torch.randn(4, 48)
    y, b = ours(x)
    torch.testing.assert_close(y + b, ref(x), rtol=1e-5, atol=1e-6)


def test_errors_name_the_numbers():
    ours, _ = pair()
    with pytest.raises(ValueError, match=r"last input dimension to be 48 .* shape \[4, 47\]"):
        ours(torch.randn(4, 47))
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match"):
        ours(torch.randn(4, 48, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        axonn_c.Linear(4, 4, dtype=torch.float64)
    # one range in every message (was: -1 said [0, ...], then 0 was refused as < 1)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"in_features must be in \[1, 2147483647\], got {bad}"):
            axonn_c.Linear(bad, 4)
        with pytest.raises(ValueError, match=rf"out_features must be in \[1, 2147483647\], got {bad}"):
            axonn_c.Linear(4, bad)
    axonn_c.finalize()
    with pytest.raises(RuntimeError, match="not initialised"):
        axonn_c.Linear(4, 4)
    with pytest.raises(RuntimeError, match="not initialised"):
        ours(torch.randn(2, 48))


def test_fast_path_checks_the_device_type():
    """After a CPU call has made the layer's fast path, an input on another device type with the
    same device index (meta: -1, as CPU) is refused by name, not handed to the C GEMM."""
    ours, _ = pair()
    ours(torch.randn(4, 48)).sum().backward()  # makes the plain-call memo
    assert ours._plain_memo is not None
    with pytest.raises(ValueError, match="input is on meta but the layer's weights are on cpu"):
        ours(torch.empty(4, 48, device="meta"))


def test_non_contiguous_input_is_handled():
    ours, ref = pair()
    x = torch.randn(48, 6).t()  # [6, 48], not contiguous
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)


def test_state_dicts_sharded_and_serial():
    ours, ref = pair(seed=3)
    sd = ours.state_dict()
    assert sd["weight"].shape == (48 * 80,)
    other, _ = pair(seed=4)
    other.load_state_dict(sd)  # sharded
    assert torch.equal(other.weight, ours.weight)
    other.load_state_dict(ref.state_dict())  # the full serial nn.Linear one
    assert torch.equal(other.full_weight(), ref.weight.detach())
    assert torch.equal(other.bias, ref.bias.detach())


def test_custom_ops_pass_opcheck():
    ours, _ = pair(in_f=8, out_f=12)
    x = torch.randn(5, 8)
    place = list(ours._placed_on)
    for layout in (0, 1):
        cfg = [8, 12, 0, 1, layout]
        torch.library.opcheck(torch.ops.axonn_c.linear_fwd.default,
                              (x, ours.weight.detach(), ours.bias.detach(), cfg, place),
                              test_utils=("test_schema", "test_faketensor"))
        y, saved = torch.ops.axonn_c.linear_fwd(x, ours.weight.detach(), ours.bias.detach(), cfg,
                                                place)
        for need_dx in (True, False):  # (no dX: an empty tensor in its place)
            torch.library.opcheck(torch.ops.axonn_c.linear_bwd.default,
                                  (torch.randn_like(y), x, saved, ours.weight.detach(), cfg,
                                   need_dx, place),
                                  test_utils=("test_schema", "test_faketensor"))
    # a graph compiled for another placement is refused when it runs
    with pytest.raises(RuntimeError, match=r"holds the shards of G_intra_r=2, G_intra_c=1"):
        torch.ops.axonn_c.linear_fwd(x, ours.weight.detach(), ours.bias.detach(), cfg,
                                     [2, 1, 1, 0, 0, 0])


def test_defer_wgrad_needs_a_reduction_to_hide_under():
    """defer_wgrad (on with init(overlap=True)) defers a dW GEMM only under a later dX
    all-reduce: in a world of one there is none, so nothing is queued (the tensors it reads
    would only pile up); the knob is validated. Deferral itself: tests/workers/sched_worker.py."""
    axonn_c.finalize()
    axonn_c.init(overlap=True)
    ours, ref = pair()
    x = torch.randn(5, 48)
    before = axonn_c.scheduler_stats()["tasks"]
    ours(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert axonn_c.scheduler_stats()["tasks"] == before
    assert torch.allclose(ours.weight.grad.view_as(ref.weight), ref.weight.grad, atol=1e-5)
    with pytest.raises(TypeError, match="defer_wgrad must be a bool or None"):
        with axonn_c.optimize_communication(defer_wgrad="yes"):
            pass


def test_sequential_is_nn_sequential_where_it_cannot_pipeline():
    """axonn_c.Sequential pipelines chunks across layers only where a row or column group has
    several ranks (tests/workers/pipeline_worker.py); in a world of one it is nn.Sequential:
    same output and gradients, nothing held. chunks is validated."""
    axonn_c.finalize()
    axonn_c.init(overlap=True)
    ours, ref = pair()
    seq = axonn_c.Sequential(ours, torch.nn.GELU(), chunks=2)
    assert "chunks=2" in repr(seq) and isinstance(seq, torch.nn.Sequential)
    x = torch.randn(6, 48)
    assert not seq._pipelines(x)
    held = axonn_c.scheduler_stats()["results_held"]
    seq(x).square().sum().backward()
    torch.nn.functional.gelu(ref(x)).square().sum().backward()
    assert axonn_c.scheduler_stats()["results_held"] == held
    assert torch.allclose(ours.weight.grad.view_as(ref.weight), ref.weight.grad, atol=1e-5)
    with pytest.raises(ValueError, match=r"chunks must be in \[1, 65536\], got 0"):
        axonn_c.Sequential(ours, chunks=0)


def test_forward_backward_equals_one_backward_and_checks_its_inputs():
    """axonn_c.forward_backward in a world of one (no look-ahead: nothing to pipeline): the
    summed loss and the accumulated gradients of its micro-batches equal one backward over the
    whole batch, for any model; its arguments are validated by name."""
    axonn_c.finalize()
    axonn_c.init(overlap=True)
    ours, ref = pair()
    x, t = torch.randn(7, 48), torch.randn(7, 80)

    def loss_fn(y, target):
        return (y - target).square().sum()

    loss = axonn_c.forward_backward(ours, (x, t), loss_fn, micro_batches=3)
    ref_loss = loss_fn(ref(x), t)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss.detach(), rtol=1e-5)
    assert not loss.requires_grad
    assert torch.allclose(ours.weight.grad.view_as(ref.weight), ref.weight.grad, rtol=1e-4,
                          atol=1e-4)
    assert torch.allclose(ours.bias.grad.view_as(ref.bias), ref.bias.grad, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"micro_batches must be in \[1, 65536\], got 0"):
        axonn_c.forward_backward(ours, x, lambda y: y.sum(), micro_batches=0)
    with pytest.raises(ValueError, match=r"same dim 0 \(7\), got \(6, 80\)"):
        axonn_c.forward_backward(ours, (x, t[:6]), loss_fn)
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        axonn_c.forward_backward(ours, (), loss_fn)
    with pytest.raises(TypeError, match="loss_fn must return a one-element tensor"):
        axonn_c.forward_backward(ours, x, lambda y: y)


def test_double_backward_raises_instead_of_detached_gradients():
    # the layer's backward is C: its gradients cannot be differentiated again (a gradient
    # penalty through it would silently lose its term), so torch's once_differentiable error
    ours, ref = pair(in_f=4, out_f=3)
    for layer, raises in ((ref, False), (ours, True)):
        x = torch.randn(2, 4, requires_grad=True)
        y = layer(x)
        (dx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)  # (first order: fine)
        if raises:
            with pytest.raises(RuntimeError, match="once_differentiable"):
                (y.sum() + dx.pow(2).sum()).backward()
        else:
            (y.sum() + dx.pow(2).sum()).backward()
    # a first-order backward is unchanged
    x = torch.randn(2, 4, requires_grad=True)
    ours.zero_grad()
    ref.zero_grad()
    ours(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(ours.full_weight(), ref.weight.detach())
    torch.testing.assert_close(ours.weight.grad.view(3, 4), ref.weight.grad)


def test_serial_state_dict_bias_mismatch_reported_as_nn_linear():
    with_bias = torch.nn.Linear(4, 3).state_dict()
    no_bias = torch.nn.Linear(4, 3, bias=False).state_dict()
    for sd, kw, key in ((with_bias, {"bias": False}, "unexpected"), (no_bias, {}, "missing")):
        ref = torch.nn.Linear(4, 3, **kw)
        ours = axonn_c.Linear(4, 3, **kw)
        for layer in (ref, ours):  # strict: both refuse it
            with pytest.raises(RuntimeError, match=f"{key.capitalize()} key"):
                layer.load_state_dict(sd)
        before = None if ours.bias is None else ours.bias.detach().clone()
        got, exp = ours.load_state_dict(sd, strict=False), ref.load_state_dict(sd, strict=False)
        assert got.missing_keys == exp.missing_keys and got.unexpected_keys == exp.unexpected_keys
        assert torch.equal(ours.full_weight(), sd["weight"])  # the weight is loaded
        if before is not None:  # (the dict had none: the layer's own stays)
            assert torch.equal(ours.bias, before)
