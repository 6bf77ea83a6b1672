"""Training utilities around axonn_c.Linear: sync_gradients, clip_grad_norm_, full_state_dict,
load_state_dict, auto_parallelize, optimize_communication, AxoNN-compatible import paths.

Multi-process checks (tests/workers/training_utils_worker.py) compare every gradient, norm and
state dict with the serial model's at several grids, easy and expert layouts; the single-process
tests below cover the world of one and the API surface."""
import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import axonn_c
from conftest import torchrun


@pytest.fixture
def world1(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    axonn_c.finalize()
    yield axonn_c.init()
    axonn_c.finalize()


# ------------------------------------------------------------------------- multi-process

@pytest.mark.multiproc
@pytest.mark.parametrize("world,grids", [
    (4, "1,2,2,1;2,1,1,2;1,1,2,2;1,2,1,2"),
    (8, "1,2,2,2;2,2,2,1"),
])
def test_against_serial_at_grids(world, grids):
    out = torchrun(world, "training_utils_worker.py", "--grids", grids)
    for spec in grids.split(";"):
        assert f"grid {spec}: ok" in out
    assert "ALL OK" in out


# ------------------------------------------------------------------------- world of one

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 4, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


def test_world1_matches_serial(world1):
    torch.manual_seed(0)
    ser = Net()
    torch.manual_seed(0)
    with axonn_c.auto_parallelize():
        par = Net()
    assert isinstance(par.fc1, axonn_c.Linear) and isinstance(par.fc2, axonn_c.Linear)
    assert type(par.ln) is nn.LayerNorm
    full = axonn_c.full_state_dict(par)
    assert list(full) == list(ser.state_dict())
    for k, v in ser.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)
    x = torch.randn(5, 8)
    F.mse_loss(ser(x), torch.ones(5, 4)).backward()
    F.mse_loss(par(x), torch.ones(5, 4)).backward()
    axonn_c.sync_gradients(par, mean=True)
    torch.testing.assert_close(par.fc1.weight.grad, ser.fc1.weight.grad.reshape(-1))
    torch.testing.assert_close(par.ln.weight.grad, ser.ln.weight.grad)
    got = axonn_c.clip_grad_norm_(par.parameters(), 0.01)
    want = torch.nn.utils.clip_grad_norm_(ser.parameters(), 0.01)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(par.fc2.weight.grad, ser.fc2.weight.grad.reshape(-1))


def test_saved_model_loads_and_survives_reinit(world1, tmp_path):
    """torch.save of a whole model after sync_gradients (which hooks every parameter), then
    torch.load: the copy carries the layers' tags, gets its own hooks, and trains like the
    original; a layer kept across finalize()/init() on the same grid stays usable."""
    torch.manual_seed(0)
    with axonn_c.auto_parallelize():
        par = Net()
    x = torch.randn(5, 8)
    F.mse_loss(par(x), torch.ones(5, 4)).backward()
    axonn_c.sync_gradients(par)
    torch.save(par, tmp_path / "model.pt")
    copy = torch.load(tmp_path / "model.pt", weights_only=False)
    assert copy.fc1.weight._axonn_deferred and copy.fc1.weight._axonn_norm_groups == ("intra",)
    for m in (par, copy):
        m.zero_grad()
        F.mse_loss(m(x), torch.ones(5, 4)).backward()
    for (name, p), q in zip(par.named_parameters(), copy.parameters()):
        # a world of one registers no gradient hook (they would have nothing to do; the
        # multi-rank copies check counts exactly one, its own)
        assert not q._backward_hooks, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    axonn_c.finalize()
    axonn_c.init()
    # torch.compile of the copy, called first after the re-init (the placement check is eager);
    # aot_eager traces the layer's custom ops as inductor would, without importing inductor,
    # whose import of torch.utils.mkldnn warned 14 times that torch.jit.script_method is
    # deprecated
    torch._dynamo.reset()
    compiled = torch.compile(copy, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), par(x))
    torch.testing.assert_close(copy(x), par(x), rtol=0, atol=0)
    axonn_c.finalize()
    assert "shard=96" in repr(copy.fc1)  # printable without a grid


def test_load_state_dict_assign_tags_new_parameters(world1):
    """load_state_dict(assign=True) puts new Parameter objects into the layer: they get the
    layer's tags and gradient hook (else sync_gradients would sum the shard as replicated)."""
    lin = axonn_c.Linear(8, 4)
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    lin.load_state_dict(sd, assign=True)
    assert lin.weight is not None and lin.weight._axonn_deferred
    assert lin.weight._axonn_grad_groups == ("data",) and lin.bias._axonn_norm_groups == ("row",)
    # (their gradient hooks come with a larger world: training_utils_worker's copies)
    assert not lin.weight._backward_hooks and not lin.bias._backward_hooks


def test_clip_grad_norm_edge_cases(world1):
    lin = axonn_c.Linear(4, 4)
    assert float(axonn_c.clip_grad_norm_(lin.parameters(), 1.0)) == 0.0  # no grads
    lin.weight.grad = torch.full_like(lin.weight, float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        axonn_c.clip_grad_norm_(lin.parameters(), 1.0, error_if_nonfinite=True)
    lin.weight.grad = torch.full_like(lin.weight, 2.0)
    total = axonn_c.clip_grad_norm_(lin.weight, 1.0, norm_type=math.inf)
    assert float(total) == 2.0


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_clip_grad_norm_mixed_gradients(world1, norm_type):
    """Gradients of several dtypes, a sparse one (nn.Embedding(sparse=True)), an empty one and
    a missing one (the foreach norms group them by device and dtype): the total norm and the
    clipped gradients of torch's clip_grad_norm_ computed in float64 on dense copies (torch's
    own takes no sparse gradient and sums a bfloat16 one's norm in bfloat16)."""
    torch.manual_seed(3)
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 3, 3])).sum().backward()
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7).bfloat16()),
              nn.Parameter(torch.randn(2, 2).double()), nn.Parameter(torch.randn(0)),
              nn.Parameter(torch.randn(3)), emb.weight]
    for p in params[:4]:
        p.grad = torch.randn_like(p) * 3
    dense = [None if p.grad is None else p.grad.to_dense().double().clone() for p in params]
    present = torch.cat([g.flatten() for g in dense if g is not None])
    want = torch.linalg.vector_norm(present, norm_type)
    got = axonn_c.clip_grad_norm_(params, 0.5, norm_type=norm_type)
    assert torch.allclose(got.double(), want, rtol=1e-5), (got, want)
    coef = min(1.0, 0.5 / (float(want) + 1e-6))
    for p, g in zip(params, dense):
        if g is None:
            assert p.grad is None
            continue
        tol = 1e-2 if p.dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(p.grad.to_dense().double(), g * coef, rtol=tol, atol=tol), p.shape


def test_no_grad_sync_and_mixed_layouts(world1):
    m = nn.Sequential(axonn_c.Linear(4, 4), axonn_c.Linear(4, 4, expert_mode=True))
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with axonn_c.no_grad_sync():
        axonn_c.sync_gradients(m)  # does nothing, so no layout question either
    with pytest.raises(ValueError, match="mixes expert_mode"):
        axonn_c.sync_gradients(m)
    axonn_c.sync_gradients(m, expert_mode=True, mean=True)  # forced: fine
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in m.parameters())


def test_auto_parallelize_restores_on_error(world1):
    orig = nn.Linear
    with pytest.raises(KeyError):
        with axonn_c.auto_parallelize():
            assert nn.Linear is not orig
            raise KeyError("boom")
    assert nn.Linear is orig and torch.nn.modules.linear.Linear is orig
    # outside the context nn.Linear builds torch's layer
    assert type(nn.Linear(2, 3)) is orig


def test_auto_parallelize_passes_device_dtype_and_nests(world1):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left alone at world 1: no warning
        with axonn_c.auto_parallelize():
            with axonn_c.auto_parallelize():
                a = nn.Linear(3, 5, bias=False, dtype=torch.bfloat16)
            b = nn.Linear(in_features=6, out_features=2, device="cpu")
    assert isinstance(a, axonn_c.Linear) and a.weight.dtype == torch.bfloat16 and a.bias is None
    assert isinstance(b, axonn_c.Linear) and (b.in_features, b.out_features) == (6, 2)
    # a layer axonn_c.Linear refuses (float64) stays nn.Linear, named once with the reason
    with pytest.warns(UserWarning, match=r"kept torch nn.Linear.*3->5 \(.*float64"):
        with axonn_c.auto_parallelize():
            c = nn.Linear(3, 5, dtype=torch.float64)
            c2 = nn.Linear(3, 5, dtype=torch.float64)
    assert type(c) is nn.Linear and type(c2) is nn.Linear and c.weight.dtype == torch.float64


def test_auto_parallelize_needs_init(monkeypatch):
    axonn_c.finalize()
    with pytest.raises(Exception):
        with axonn_c.auto_parallelize():
            pass


def test_compat_import_paths(world1):
    from axonn_c import axonn as ax
    from axonn_c.intra_layer import (Linear, auto_parallelize, clip_grad_norm_,
                                     optimize_communication, sync_gradients)

    assert Linear is axonn_c.Linear
    assert sync_gradients is axonn_c.sync_gradients
    assert clip_grad_norm_ is axonn_c.clip_grad_norm_
    assert auto_parallelize is axonn_c.auto_parallelize
    axonn_c.finalize()
    g = ax.init(G_inter=1, G_data=1, G_intra_r=1, G_intra_c=1, G_intra_d=1, gpus_per_node=1)
    assert g.world_size == 1 and ax.config.G_intra == 1 and ax.config.data_parallel_rank == 0
    with pytest.raises(ValueError, match="G_inter=2"):
        axonn_c.finalize()
        ax.init(G_inter=2)
    axonn_c.init()
    lin = Linear(4, 6)
    with optimize_communication(overlap_all_reduce=True, overlap_reduce_scatter=True,
                                overlap_all_gather=True, cache_weights=True):
        y = lin(torch.randn(2, 4))
    assert y.shape == (2, 6)
    with pytest.raises(TypeError, match="overlap_all_reduce"):
        with optimize_communication(overlap_all_reduce="yes"):
            pass
