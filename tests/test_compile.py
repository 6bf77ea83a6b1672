"""torch.compile of a model using axonn_c.Linear: the layer's custom ops are opaque graph nodes,
so dynamo reports no graph break caused by our layer, and the compiled model computes what the
eager one does (world of one in-process; two ranks through torchrun)."""
import pytest
import torch
from torch import nn

import axonn_c
from conftest import torchrun


@pytest.fixture
def world1(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    axonn_c.finalize()
    yield axonn_c.init()
    axonn_c.finalize()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(16), axonn_c.Linear(16, 32), nn.GELU(),
                         axonn_c.Linear(32, 8, transpose=True))


def test_explain_reports_no_graph_break(world1):
    torch._dynamo.reset()
    model = _model()
    x = torch.randn(2, 5, 16)
    explanation = torch._dynamo.explain(model)(x)
    reasons = [str(r) for r in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    assert explanation.graph_count == 1, reasons
    assert explanation.op_count >= 2


def test_compiled_forward_backward_matches_eager(world1):
    torch._dynamo.reset()
    model = _model()
    x = torch.randn(3, 16, requires_grad=True)
    y_eager = model(x)
    y_eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    gx = x.grad.clone()
    for p in model.parameters():
        p.grad = None
    x.grad = None
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.square().sum().backward()
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, gx, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


@pytest.mark.multiproc
def test_explain_two_ranks():
    out = torchrun(2, "compile_worker.py")
    assert out.count("NO GRAPH BREAK") == 1, out


@pytest.mark.multiproc
def test_refusals_raise_when_the_graph_runs():
    # (in torchrun's processes: dynamo once crashed (SIGSEGV) running the refused layer eagerly)
    out = torchrun(2, "compile_worker.py", "--refusals")
    assert out.count("REFUSALS RAISED") == 1, out
