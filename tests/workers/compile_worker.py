"""torch._dynamo.explain on a model of axonn_c.Linear layers at 2 ranks (grid 1x1x2x1): no
graph break from our layer, and the compiled model computes what the eager one does.
`--refusals` (grid 1x1x1x2, depth int4): what a compiled graph does not do (depth error
feedback, a layer's own codecs) raises NotImplementedError naming it when the graph runs,
rather than dynamo running the layer eagerly (it once crashed doing so); error_feedback=False
compiles and computes what eager mode does."""
import sys

import torch
from torch import nn

import axonn_c


def main():
    g = axonn_c.init(G_intra_r=1, G_intra_c=2)
    torch.manual_seed(0)
    model = nn.Sequential(axonn_c.Linear(16, 32), nn.GELU(), axonn_c.Linear(32, 8, transpose=True))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(g.rank))
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    if g.rank == 0:
        print("NO GRAPH BREAK", flush=True)
    axonn_c.finalize()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(16), axonn_c.Linear(16, 32), nn.GELU(),
                         axonn_c.Linear(32, 8, transpose=True))


def _expect_refusal(model, x, fullgraph: bool, words: str):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    try:
        compiled(x).sum().backward()
    except NotImplementedError as e:
        assert words in str(e), f"unclear refusal: {e}"
        return
    raise AssertionError(f"compiled (fullgraph={fullgraph}) ran without the refusal of {words}")


def refusals():
    g = axonn_c.init(G_intra_d=2, compression={"depth": "int4"})
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(g.rank))
    model = _model()
    for fullgraph in (False, True):
        _expect_refusal(model, x, fullgraph,
                        "pass compression={'depth': {'codec': 'int4', 'error_feedback': False}}")
    model[3].compression = {"depth": "bf16"}  # a layer's own codecs (this layer's error feedback
    model[1].requires_grad_(False)            # off: bf16 keeps none; the other layer frozen)
    _expect_refusal(model, x, False, "Linear.compression (a layer's own codecs)")
    axonn_c.finalize()

    axonn_c.init(G_intra_d=2, compression={"depth": {"codec": "int4", "error_feedback": False}})
    model = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    y_eager = model(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-6)
    for p, gr in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, gr, rtol=1e-5, atol=1e-6)
    if g.rank == 0:
        print("REFUSALS RAISED", flush=True)
    axonn_c.finalize()


if __name__ == "__main__":
    refusals() if "--refusals" in sys.argv else main()
