"""Two ranks on a simulated link (AXONN_C_SIM_GBPS / AXONN_C_SIM_US): asynchronous row
all-reduces hidden behind a matmul loop on the main thread, then synchronous world all-reduces
with no compute around them. Prints one JSON line per rank with the spans' facts and the summary,
and exports the trace to argv[1] (which may contain "{rank}")."""
import json
import os
import sys

import torch

import axonn_c
from axonn_c import timeline

N = 1 << 16  # floats per all-reduce


def main():
    path = sys.argv[1]
    g = axonn_c.init(G_intra_r=2, timeout=120)
    assert g.G_intra_r == 2
    torch.manual_seed(g.rank)
    a = torch.randn(128, 128)
    bufs = [torch.full((N,), float(g.rank + i)) for i in range(3)]
    axonn_c.comm.barrier()

    timeline.start()
    # overlapped: the compute span covers the collectives from before their issue to their end
    t0 = timeline.now_ns()
    works = [axonn_c.comm.all_reduce(b, group="row", async_op=True) for b in bufs]
    c = a
    iters = 0
    while not all(w.is_completed() for w in works) or iters < 3:
        c = torch.tanh(c @ a)
        iters += 1
    timeline.record_compute("matmul_loop", t0, timeline.now_ns())
    for w in works:
        w.wait()
    for i, b in enumerate(bufs):
        assert torch.equal(b, torch.full((N,), float(2 * i + 1))), i
    # synchronous, nothing to hide them: exposed
    for i in range(3):
        x = torch.ones(N)
        axonn_c.comm.all_reduce(x, group="world")
        assert torch.equal(x, torch.full((N,), 2.0))
    # a group of one: no span
    axonn_c.comm.all_reduce(torch.ones(8), group="data")
    timeline.stop()
    # not recorded once stopped
    axonn_c.comm.all_reduce(torch.ones(8), group="world")

    spans = timeline.spans()
    summ = timeline.summary()
    out = timeline.export(path)
    axonn_c.finalize()
    comm = [s for s in spans if s[0] == 1]
    # one file per rank (two ranks printing long lines at once can interleave them)
    with open(os.path.join(os.path.dirname(os.path.abspath(path)),
                           f"result.{g.rank}.json"), "w") as f:
        json.dump({
            "rank": g.rank, "file": out, "summary": summ, "iters": iters,
            "comm": [[s[1], s[2], s[4] - s[3], s[5]] for s in comm],
            "compute": [[s[1], s[4] - s[3]] for s in spans if s[0] == 0],
        }, f)


if __name__ == "__main__":
    main()
