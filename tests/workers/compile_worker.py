"""torch._dynamo.explain on a model of axonn_c.Linear layers at 2 ranks (grid 1x1x2x1): no
graph break from our layer, and the compiled model computes what the eager one does."""
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


if __name__ == "__main__":
    main()
