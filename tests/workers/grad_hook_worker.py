"""The gradient hook decided in C (tests/test_grad_hook.py) on 2 ranks: which gradients go past
the hook's fast path (counted by _C.grad_hook_works) and what .grad is after backward, as the
groups, no_grad_sync, the overlap knobs, a run_concurrent thread and the grid change."""
import os
import weakref

import torch

import axonn_c
from axonn_c import _C, grads
from common import CallCount

RANK = int(os.environ["RANK"])
calls = CallCount(_C.grad_hook_works)  # gradients past the hook's fast path


def step(p, x, expect_calls, expect_grad, summed=()):
    """One backward of (p * x).sum() from no .grad: how often the gradient code ran, .grad."""
    calls.clear()
    p.grad = None
    (p * x).sum().backward()
    assert len(calls) == expect_calls, (len(calls), expect_calls)
    assert torch.equal(p.grad, expect_grad), (p.grad, expect_grad)
    assert grads.summed_over(p) == summed, grads.summed_over(p)
    grads.mark_summed(p, ())  # (a mark sends every later gradient to the gradient code)


def main():
    x = torch.full((4,), float(RANK + 1))
    mine, total = x.clone(), torch.full((4,), 3.0)  # 1 + 2: summed over the two ranks
    axonn_c.init(G_data=2, G_intra_r=1, G_intra_c=1, G_intra_d=1, overlap=True,
                 concurrent_microbatches=2)
    p = torch.nn.Parameter(torch.zeros(4))
    grads.hook(p, ("depth",))  # one rank in its depth group: nothing to sum
    step(p, x, 0, mine)
    grads.hook(p, ("data",))  # the groups changed after the hook was registered
    step(p, x, 1, total, ("data",))
    with axonn_c.no_grad_sync():  # no sums inside; autograd takes it
        step(p, x, 0, mine)
    with axonn_c.optimize_communication(overlap_data=False):
        step(p, x, 0, mine)
        p._axonn_overlap_data = True  # a Linear weight's own knob wins
        step(p, x, 1, total, ("data",))
    p._axonn_overlap_data = False
    step(p, x, 0, mine)
    del p._axonn_overlap_data
    step(p, x, 1, total, ("data",))

    # create_graph=True: the gradient (which has a graph of its own) is summed like any other,
    # without extending its graph; a .grad summed in an earlier pass enters divided by its
    # copies, and the new total is summed again
    c = torch.nn.Parameter(torch.ones(4))
    grads.hook(c, ("data",))
    for before in (None, "summed"):
        calls.clear()
        c.grad = None
        if before:
            (c * x).sum().backward()
            assert torch.equal(c.grad, total) and grads.summed_over(c) == ("data",)
            calls.clear()
        (c * c * x / 2).sum().backward(create_graph=True)
        assert len(calls) == 1, len(calls)
        want = total if before is None else 2 * total
        assert torch.equal(c.grad, want) and not c.grad.requires_grad, (before, c.grad)
        assert grads.summed_over(c) == ("data",), grads.summed_over(c)
    grads.mark_summed(c, ())

    # a run_concurrent micro-batch: its gradient is checked, not summed
    calls.clear()
    p.grad = None
    axonn_c.run_concurrent(lambda xb: (p * xb).sum().backward(), x.repeat(2, 1))
    assert len(calls) == 2 and torch.equal(p.grad, 2 * mine), (len(calls), p.grad)

    # a parameter freed while its hook exists (the hook holds it weakly)
    q = torch.nn.Parameter(torch.zeros(4))
    grads.hook(q, ("data",))
    ref = weakref.ref(q)
    del q
    assert ref() is None

    # another grid: the hook reads the group sizes of the current init
    axonn_c.finalize()
    axonn_c.init(G_data=1, G_intra_r=1, G_intra_c=1, G_intra_d=2, overlap=True)
    step(p, x, 0, mine)  # data has one rank now
    grads.hook(p, ("depth",))
    step(p, x, 1, total, ("depth",))
    axonn_c.finalize()
    print("grad hook ok", flush=True)


if __name__ == "__main__":
    main()
