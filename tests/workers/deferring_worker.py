"""Forward's shortcut for a Linear whose only cross-layer work is its gradients (data-parallel
sums during backward, a deferred dW GEMM: linear.py's _DeferringLinear) gives exactly what the
general path gives (_EagerLinear): the same layers, one of them kept off the shortcut, run side
by side on the same inputs, and every output and gradient compared bitwise, through
accumulation, sync_gradients, skip_bias_add, no bias, a frozen weight, torch.autograd.grad, an
input without a gradient, a __dict__ copy of a layer that shares its C handle, and an output of
the main thread back-propagated on run_concurrent's micro-batch threads."""
import os
import sys

import torch

import axonn_c

H = 12
shortcut_calls = [0]  # forward calls that took the deferring shortcut


def _counted(apply):
    def counted(*args):
        shortcut_calls[0] += 1
        return apply(*args)
    return counted


axonn_c.linear._deferring_apply = _counted(axonn_c.linear._deferring_apply)


def make(seed, **kw):
    torch.manual_seed(seed)
    return axonn_c.Linear(H, H, **kw)


def general_only(layer):
    """Keeps `layer` off forward's shortcut: it never remembers a handle for it."""
    layer._remember_plain = lambda *a, **k: None
    return layer


def output(y):
    return y[0] + y[1] if isinstance(y, tuple) else y  # (skip_bias_add: add the bias back)


def check(what, fast, ref, x, dy, grad_of=None):
    """Forward + backward of both layers on the same input; outputs and gradients equal."""
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for _ in range(2)]
    ys = [output(layer(xi)) for layer, xi in zip((fast, ref), xs)]
    assert torch.equal(ys[0], ys[1]), f"{what}: outputs differ"
    if grad_of is not None:  # torch.autograd.grad: nothing accumulated, the gradients returned
        got = [torch.autograd.grad((y * dy).sum(), [xi, grad_of(layer)])
               for y, xi, layer in zip(ys, xs, (fast, ref))]
        for a, b in zip(*got):
            assert torch.equal(a, b), f"{what}: autograd.grad differs"
        return
    for y in ys:
        (y * dy).sum().backward()
    if x.requires_grad:
        assert torch.equal(xs[0].grad, xs[1].grad), f"{what}: dX differs"
    for name in ("weight", "bias"):
        a, b = getattr(fast, name), getattr(ref, name)
        if a is None or a.grad is None:
            assert b is None or b.grad is None, f"{what}: {name}.grad only on one"
            continue
        assert torch.equal(a.grad, b.grad), f"{what}: {name}.grad differs"


def on_grid(sizes):
    world = int(os.environ["WORLD_SIZE"])
    axonn_c.init(*sizes, overlap=True)
    g = axonn_c.grid()
    gen = torch.Generator().manual_seed(100 + g.data_rank)  # (the same on a tensor group)
    rows = 5

    def data():
        return torch.randn(rows, H, generator=gen), torch.randn(rows, H, generator=gen)

    kinds = {"bias": {}, "no bias": {"bias": False}, "skip_bias_add": {"skip_bias_add": True}}
    for kind, kw in kinds.items():
        fast, ref = make(1, **kw), general_only(make(1, **kw))
        for step in range(3):  # the first call makes the memo; the second accumulates
            for call in range(2):
                x, dy = data()
                before = shortcut_calls[0]
                check(f"{kind} step {step}", fast, ref, x.requires_grad_(), dy)
                took = shortcut_calls[0] - before
                assert took == (1 if step or call else 0), f"{kind} step {step}: {took} shortcut calls"
            axonn_c.sync_gradients(fast)
            axonn_c.sync_gradients(ref)
            for a, b in zip(fast.parameters(), ref.parameters()):
                assert torch.equal(a.grad, b.grad), f"{kind} step {step}: synced grads differ"
                a.grad = b.grad = None
        x, dy = data()
        check(f"{kind}, input without grad", fast, ref, x, dy)
        for layer in (fast, ref):
            layer.weight.requires_grad_(False)
        check(f"{kind}, frozen weight", fast, ref, x.requires_grad_(), dy)
        for layer in (fast, ref):
            layer.weight.requires_grad_(True)
        check(f"{kind}, autograd.grad", fast, ref, x, dy, grad_of=lambda m: m.weight)
        axonn_c.sync_gradients(fast)
        axonn_c.sync_gradients(ref)
        for a, b in zip(fast.parameters(), ref.parameters()):
            if a.grad is not None or b.grad is not None:
                assert torch.equal(a.grad, b.grad), f"{kind}: synced grads differ"
            a.grad = b.grad = None

    # a __dict__ copy of a layer that ran shares its handle (and memo): the copy's first call
    # takes the general path with a scheduler id of its own (then a memo of its own, with the
    # same handle), the original the shortcut with its id, and both train as the general path
    fast, ref = make(2), general_only(make(2))
    x, dy = data()
    check("before the copy", fast, ref, x.requires_grad_(), dy)
    twin = torch.nn.Module.__new__(axonn_c.Linear)
    twin.__dict__.update(fast.__dict__)
    twin_ref = torch.nn.Module.__new__(axonn_c.Linear)
    twin_ref.__dict__.update(ref.__dict__)
    for step in range(2):
        x, dy = data()
        before = shortcut_calls[0]
        check(f"copy step {step}: original", fast, ref, x.requires_grad_(), dy)
        check(f"copy step {step}: copy", twin, twin_ref, x, dy)
        assert shortcut_calls[0] - before == 1 + step, f"copy step {step}: shortcut calls"
        if step == 0:  # (the copy's own memo is made in its first call)
            shared = twin._plain_memo[3] is fast._plain_memo[3]
            assert shared, "copy: the handle is not shared"
            assert twin._plain_memo[8][1] != fast._plain_memo[8][1], "copy: one scheduler id"
        axonn_c.sync_gradients(fast)
        axonn_c.sync_gradients(ref)
        for a, b in zip(fast.parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad), f"copy step {step}: synced grads differ"
            a.grad = b.grad = None
    assert axonn_c.grads.idle(), "gradient state left pending"
    axonn_c.finalize()
    if g.rank == 0:
        print(f"world {world} grid {sizes}: the deferring shortcut equals the general path")


def across_threads(sizes):
    """A shortcut call's output back-propagated on run_concurrent's micro-batch threads (its
    backward takes the general path's per-call decisions there): the same gradients as the
    general path's; with a depth group (scheduled depth collectives, the main thread's) both
    refuse it on every rank, and the next steps train as before."""
    axonn_c.init(*sizes, overlap=True, concurrent_microbatches=2)
    g = axonn_c.grid()
    gen = torch.Generator().manual_seed(200 + g.data_rank)
    fast, ref = make(3), general_only(make(3))
    x, dy = torch.randn(4, H, generator=gen), torch.randn(4, H, generator=gen)
    check("threads: warm-up", fast, ref, x.requires_grad_(), dy)  # (makes fast's memo)
    for layer in (fast, ref):
        layer.zero_grad()
    dys = torch.randn(2, 4, H, generator=gen)  # one output gradient per micro-batch
    grads = []
    for layer in (fast, ref):
        xi = x.detach().clone().requires_grad_()
        before = shortcut_calls[0]
        h = layer(xi)  # main thread
        took = shortcut_calls[0] - before
        assert took == (1 if layer is fast else 0), f"threads: {took} shortcut calls"
        try:
            axonn_c.run_concurrent(lambda d: (h * d[0]).sum().backward(retain_graph=True), dys)
            refused = False
        except RuntimeError as e:
            assert "computed outside run_concurrent" in str(e), e
            refused = True
        assert refused == (sizes[3] > 1), f"threads: refused {refused} on grid {sizes}"
        if refused:  # the next steps, on the main thread
            del h
            layer.zero_grad()
            xi.grad = None
            for _ in range(2):
                (layer(xi) * dys[0]).sum().backward()
        axonn_c.sync_gradients(layer)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        assert a is not None and torch.equal(a, b), "threads: gradients differ"
    assert axonn_c.grads.idle(), "threads: gradient state left pending"
    axonn_c.finalize()
    if g.rank == 0:
        print(f"grid {sizes}: across micro-batch threads as the general path")


def main():
    for arg in sys.argv[1:]:  # grids, e.g. 2,1,1,1
        sizes = [int(v) for v in arg.split(",")]
        on_grid(sizes)
        across_threads(sizes)


if __name__ == "__main__":
    main()
