"""The per-parameter gradient hook decided and carried out in C (axonn_c._C.GradHook,
csrc/python/py_grad_hook.c, the decision csrc/grads/grad_policy.c): it holds its parameter
weakly, goes past its fast path (axc_runtime_grad_needs_work; counted by _C.grad_hook_works)
only when there is something to do (something pending, a .grad marked summed, a run_concurrent
micro-batch thread, or a sum to start now), asks its `accumulates` callable only when the
decision needs it, and reads the flags that decide it (no_grad_sync, the data overlap knob, the
micro-batch thread) from the C runtime. One process
here; the 2-rank worker checks the sums themselves (groups changed after registration,
no_grad_sync, the overlap knobs, a re-init on another grid)."""
import threading
import weakref

import pytest
import torch

import axonn_c
from axonn_c import _C, grads
from conftest import torchrun


def _hooked(calls):
    p = torch.nn.Parameter(torch.ones(3))
    p._axonn_hook_groups = ("data",)
    p.register_hook(_C.GradHook(p, lambda q: calls.append(q) or True))
    return p


def test_hook_holds_its_parameter_weakly():
    calls = []
    p = _hooked(calls)
    hook = next(iter(p._backward_hooks.values()))
    ref = weakref.ref(p)
    del p
    assert ref() is None  # freed by its reference count: no cycle through the hook
    p2 = torch.nn.Parameter(torch.zeros(2))
    p2.grad = torch.ones(2)
    grads.mark_summed(p2, ("data",))  # (something that would otherwise need the Python code)
    try:
        assert hook(torch.ones(3)) is None and calls == []  # its parameter gone: nothing to do
    finally:
        grads.mark_summed(p2, ())


def test_gradient_goes_to_autograd_untouched_when_nothing_is_to_do():
    calls = []
    p = _hooked(calls)
    assert not axonn_c.is_initialized() and grads.idle() and not _C.grad_marks()
    (p * 2).sum().backward()
    assert calls == [] and torch.equal(p.grad, torch.full((3,), 2.0))


def test_a_marked_grad_or_a_microbatch_thread_calls_the_gradient_code():
    calls = []
    p = _hooked(calls)
    other = torch.nn.Parameter(torch.zeros(2))
    other.grad = torch.ones(2)
    works = _C.grad_hook_works()
    grads.mark_summed(other, ("data",))  # another parameter's mark changes nothing for p
    try:
        (p * 2).sum().backward()
    finally:
        grads.mark_summed(other, ())
    assert _C.grad_hook_works() == works
    p.grad = torch.zeros(3)
    grads.mark_summed(p, ("data",))  # its own does
    try:
        (p * 2).sum().backward()
        hook = next(iter(p._backward_hooks.values()))
        assert hook(None) is None  # (a deferred Linear weight: nothing reached autograd)
    finally:
        grads.mark_summed(p, ())
    # past the fast path; not initialised: nothing more to ask (accumulates is not called)
    assert _C.grad_hook_works() == works + 1 and calls == []
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    seen, errors = [], []

    def microbatch():  # what run_concurrent's threads set (and only theirs)
        seen.append(_C.microbatch_thread(True))
        try:
            (p * 3).sum().backward()
            grads.mark_summed(p, ("data",))  # a .grad summed already refuses micro-batches
            try:
                (p * 3).sum().backward()
            except RuntimeError as e:
                errors.append(str(e))
        finally:
            grads.mark_summed(p, ())
            seen.append(_C.microbatch_thread(False))

    thread = threading.Thread(target=microbatch)
    thread.start()
    thread.join()
    assert seen == [False, True] and _C.grad_hook_works() == works + 3
    assert not _C.microbatch_thread() and calls == []
    assert len(errors) == 1 and "sync_gradients" in errors[0], errors
    with pytest.raises(RuntimeError, match="already summed"):
        p.grad = torch.ones(3)
        grads.mark_summed(p, ("data",))
        try:
            grads.check_unsynced(p)
        finally:
            grads.mark_summed(p, ())
    grads.check_unsynced(p)  # (no mark: nothing to say)
    (p * 2).sum().backward()
    assert _C.grad_hook_works() == works + 3


def test_a_parameter_frozen_after_its_forward_is_left_alone():
    """Frozen between forward and backward: autograd accumulates nothing into it, and the hook
    (which autograd still calls) does nothing either, even with work pending for it."""
    calls = []
    p = _hooked(calls)
    p.grad = torch.zeros(3)
    works = _C.grad_hook_works()
    grads.mark_summed(p, ("data",))  # (work for it: past the fast path when it requires grad)
    try:
        y = (p * 2).sum()
        p.requires_grad_(False)
        y.backward()
    finally:
        grads.mark_summed(p, ())
    assert _C.grad_hook_works() == works and calls == []
    assert torch.equal(p.grad, torch.zeros(3))


def test_no_grad_sync_sets_the_runtime_flag_and_restores_it():
    assert _C.grad_sync_enabled()
    with axonn_c.no_grad_sync():
        assert not _C.grad_sync_enabled()
        with pytest.raises(ZeroDivisionError):
            with axonn_c.no_grad_sync():
                1 / 0
        assert not _C.grad_sync_enabled()
    assert _C.grad_sync_enabled()


def test_bad_hook_arguments_are_named():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="callable"):
        _C.GradHook(p, 3)
    with pytest.raises(TypeError):
        _C.GradHook(3, print)  # an int cannot be referenced weakly
    with pytest.raises(TypeError, match="keyword"):
        _C.GradHook(p, print)(torch.ones(2), x=1)
    p._axonn_hook_groups = ("data", "nowhere")
    with pytest.raises(ValueError, match="_axonn_hook_groups"):
        _C.GradHook(p, print)(torch.ones(2))
    # any sequence of group names (the groups may be changed after the hook was registered)
    p._axonn_hook_groups = ["data"]
    assert _C.GradHook(p, print)(torch.ones(2)) is None
    with pytest.raises(ValueError, match="positive"):
        _C.grad_bucket_bytes(0)


def test_hook_decides_from_the_runtime_on_two_ranks():
    out = torchrun(2, "grad_hook_worker.py")
    assert out.count("grad hook ok") == 2


def test_accumulates_finds_the_node_without_a_view(monkeypatch):
    """grads.accumulates in a parameter's hook and in a custom Function's backward finds the
    AccumulateGrad node from the node the engine runs (no get_gradient_edge, which builds a view
    and costs tens of microseconds per call), and gives torch's answer: True for backward()
    (also with inputs= naming the parameter), False where torch.autograd.grad hands the gradient
    back or backward(inputs=) leaves the parameter out."""
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    seen = []

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            seen.append(("fn", grads.accumulates(q)))
            return g, g

    p.register_hook(lambda g: seen.append(("hook", grads.accumulates(p))))
    slow = grads.get_gradient_edge

    def refuse(t):  # the fast path found no node where it should have
        if t is p or t is q:
            raise AssertionError("accumulates built a gradient edge")
        return slow(t)

    monkeypatch.setattr(grads, "get_gradient_edge", refuse)
    Mul.apply(p, q).sum().backward()
    assert seen == [("fn", True), ("hook", True)]
    seen.clear()
    Mul.apply(p, q).sum().backward(inputs=[p])
    assert seen == [("fn", False), ("hook", True)]
    seen.clear()
    torch.autograd.grad(Mul.apply(p, q).sum(), [p])
    assert seen == [("fn", False), ("hook", False)]
    monkeypatch.setattr(grads, "get_gradient_edge", slow)
    assert grads.accumulates(p)  # (outside a backward pass: True)


def test_a_hook_whose_callable_holds_its_parameter_is_collected():
    """An `accumulates` callable that refers to its parameter makes a cycle through the hook: the cycle
    collector sees it (GradHook is GC-tracked) and frees the parameter."""
    import gc
    p = torch.nn.Parameter(torch.ones(3))
    p.register_hook(_C.GradHook(p, lambda q, held=p: held.numel() > 0))
    ref = weakref.ref(p)
    del p
    gc.collect()
    assert ref() is None
