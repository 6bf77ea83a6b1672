"""Concurrent micro-batches (axonn_c.run_concurrent): training steps on 2-8 ranks against serial
PyTorch (tests/workers/concurrent_worker.py), and the single-process API: splitting, results in
order, errors that say what is wrong."""
import threading

import pytest
import torch

import axonn_c
from conftest import torchrun


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4, 8])
def test_concurrent_microbatches_match_serial(world):
    out = torchrun(world, "concurrent_worker.py")
    assert f"world {world}: concurrent micro-batch checks pass" in out


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", [None, "model", "reducer_sum"])
def test_interrupt_ends_a_hung_call_on_every_rank(mode):
    # a KeyboardInterrupt while the micro-batch threads wait in a collective aborts it (every
    # rank's waits fail, naming the interrupt); the call ends once its threads have; "model":
    # the main thread waits in the reducer for a bucket and sees the interrupt there;
    # "reducer_sum": the reducer waits in its own gradient sum, and sees it there
    out = torchrun(2, "mb_interrupt_worker.py", *([mode] if mode else []))
    assert "rank 0: interrupt ok" in out and "rank 1: interrupt ok" in out, out


def test_splits_inputs_and_keeps_order(world_of_one):
    axonn_c.init(concurrent_microbatches=3)
    x = torch.arange(7.0)
    got = axonn_c.run_concurrent(lambda a, k: (a.tolist(), k), x, "same")
    assert got == [([0.0, 1.0, 2.0], "same"), ([3.0, 4.0], "same"), ([5.0, 6.0], "same")]
    # along another dim, and the caller's grad mode reaches every micro-batch
    with torch.no_grad():
        modes = axonn_c.run_concurrent(lambda a: (a.shape[1], torch.is_grad_enabled()),
                                       torch.zeros(2, 6), dim=1)
    assert modes == [(2, False)] * 3


@pytest.mark.parametrize("n", [2, 8])  # 8, the most: n + 3 channels must fit the C limit
def test_gradients_accumulate_over_microbatches(world_of_one, n):
    axonn_c.init(concurrent_microbatches=n)
    torch.manual_seed(0)
    layer = axonn_c.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    with torch.no_grad():
        ref.weight.copy_(layer.full_weight())
        ref.bias.copy_(layer.full_bias())
    x = torch.randn(9, 8)
    threads = axonn_c.run_concurrent(lambda a: layer(a).pow(2).sum().backward() or
                                     threading.current_thread().name, x, model=layer)
    assert len(set(threads)) == n
    axonn_c.sync_gradients(layer)
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(layer.weight.grad.view(4, 8), ref.weight.grad)  # (world 1: one shard)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)


def test_caller_autocast_reaches_microbatches(world_of_one):
    axonn_c.init(concurrent_microbatches=2)
    layer = axonn_c.Linear(8, 4)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = axonn_c.run_concurrent(
            lambda a: (layer(a).dtype, torch.is_autocast_enabled("cpu")), x)
    assert inside == [(torch.bfloat16, True)] * 2
    assert axonn_c.run_concurrent(lambda a: layer(a).dtype, x) == [torch.float32] * 2


def test_errors_name_the_problem(world_of_one):
    with pytest.raises(RuntimeError, match="not initialised"):
        axonn_c.run_concurrent(lambda a: a, torch.zeros(2))
    with pytest.raises(ValueError, match=r"concurrent_microbatches must be an int in \[1, 8\]"):
        axonn_c.init(concurrent_microbatches=0)
    with pytest.raises(ValueError, match=r"concurrent_microbatches must be an int in \[1, 8\]"):
        axonn_c.init(concurrent_microbatches=9)
    axonn_c.init(concurrent_microbatches=2)
    with pytest.raises(RuntimeError, match=r"already initialised .*\(5 comm channels\)"):
        axonn_c.init(concurrent_microbatches=3)
    with pytest.raises(ValueError, match=r"into 2 micro-batches along dim 0, but got an input "
                                         r"of shape \[1\]"):
        axonn_c.run_concurrent(lambda a: a, torch.zeros(1))
    with pytest.raises(ValueError, match="at least one Tensor"):
        axonn_c.run_concurrent(lambda a: a, 3)
    with pytest.raises(TypeError, match=r"run_concurrent: expert_mode must be a bool or None, "
                                        r"got 'yes'"):
        axonn_c.run_concurrent(lambda a: a, torch.zeros(4), expert_mode="yes")
    with pytest.raises(RuntimeError, match="cannot be nested"):
        axonn_c.run_concurrent(lambda a: axonn_c.run_concurrent(lambda b: b, a), torch.zeros(4))
    with pytest.raises(ZeroDivisionError):  # fn's own error reaches the caller
        axonn_c.run_concurrent(lambda a: 1 / 0, torch.zeros(4))
    # a channel per micro-batch, the caller's, the shared gathers' and reduce-scatters'
    with pytest.raises(ValueError, match=r"channel 5 does not exist: this communicator has 5 "
                                         r"channels"):
        axonn_c._C.set_thread_channel(5)


def test_failed_thread_start_leaves_run_concurrent_usable(world_of_one, monkeypatch):
    # the 2nd micro-batch thread fails to start: the call ends (was: joining the never-started
    # thread raised before the call was ended, and every later call was "already running")
    axonn_c.init(concurrent_microbatches=2)
    real_start = threading.Thread.start
    starts = []

    def start(self):
        starts.append(self.name)
        if len(starts) == 2:
            raise RuntimeError("can't start new thread (test)")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match=r"can't start new thread \(test\)"):
        axonn_c.run_concurrent(lambda a: a.sum(), torch.ones(4))
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert axonn_c.run_concurrent(lambda a: a.sum().item(), torch.ones(4)) == [2.0, 2.0]


class _Late(Exception):
    pass


@pytest.mark.parametrize("late", [KeyboardInterrupt, _Late])
def test_exception_as_the_call_opens_leaves_run_concurrent_usable(world_of_one, monkeypatch,
                                                                   late):
    # an exception taken as microbatch_begin returns (an interrupt, or any asynchronous one,
    # e.g. from a signal handler: it looks raised by the call): the call is ended (was: a
    # KeyboardInterrupt left it open before the try that ends it; later, any other exception
    # did; every later call was then refused)
    axonn_c.init(concurrent_microbatches=2)
    real_begin = axonn_c._C.microbatch_begin

    def begin(*args):
        real_begin(*args)
        raise late("raised as begin returned (test)")

    monkeypatch.setattr(axonn_c._C, "microbatch_begin", begin)
    with pytest.raises(late):
        axonn_c.run_concurrent(lambda a: a.sum(), torch.ones(4))
    monkeypatch.setattr(axonn_c._C, "microbatch_begin", real_begin)
    assert not axonn_c._C.microbatch_running()
    assert axonn_c.run_concurrent(lambda a: a.sum().item(), torch.ones(4)) == [2.0, 2.0]


def test_interrupt_as_the_call_ends_leaves_finalize_possible(world_of_one, monkeypatch):
    # an interrupt taken as microbatch_end returns (the call ended in C): the session no
    # longer counts the call as running, so finalize() is not refused (was: the session's
    # record was cleared only after microbatch_end returned normally)
    axonn_c.init(concurrent_microbatches=2)
    real_end = axonn_c._C.microbatch_end

    def end(owner):
        real_end(owner)
        raise KeyboardInterrupt

    monkeypatch.setattr(axonn_c._C, "microbatch_end", end)
    with pytest.raises(KeyboardInterrupt):
        axonn_c.run_concurrent(lambda a: a.sum(), torch.ones(4))
    monkeypatch.setattr(axonn_c._C, "microbatch_end", real_end)
    assert not axonn_c._C.microbatch_running()
    axonn_c.finalize()  # (refused while the session records a running call)
    assert not axonn_c.is_initialized()


def test_refused_call_leaves_the_running_one_open(world_of_one):
    # a call refused because another runs does not end that one (its owner's alone)
    axonn_c.init(concurrent_microbatches=2)
    first = object()
    axonn_c._C.microbatch_begin(first, 2, (), (), 1 << 20, 2)
    try:
        with pytest.raises(RuntimeError, match="already running"):
            axonn_c.run_concurrent(lambda a: a.sum(), torch.ones(4))
        assert axonn_c._C.microbatch_running()
        assert not axonn_c._C.microbatch_end(object())
        assert axonn_c._C.microbatch_running()
    finally:
        assert axonn_c._C.microbatch_end(first)
    assert not axonn_c._C.microbatch_running()


def test_failed_arrivals_hook_is_registered_next_call(world_of_one, monkeypatch):
    # registering a summed parameter's arrivals hook fails once: the next call registers it
    # (was: recorded as hooked before registering, and never counted again)
    from axonn_c import microbatches

    axonn_c.init(concurrent_microbatches=2)
    p = torch.nn.Parameter(torch.ones(3))
    real_begin = axonn_c._C.microbatch_begin
    monkeypatch.setattr(axonn_c._C, "microbatch_begin", lambda *a: (real_begin(*a), (p,))[1])

    def refuse(hook):
        raise RuntimeError("no hooks today (test)")

    p.register_post_accumulate_grad_hook = refuse
    owner = object()
    with pytest.raises(RuntimeError, match=r"no hooks today \(test\)"):
        microbatches._open_call(None, 2, owner)
    assert axonn_c._C.microbatch_end(owner)  # (the call was open)
    del p.register_post_accumulate_grad_hook
    assert microbatches._open_call(None, 2, owner) == (p,)
    assert axonn_c._C.microbatch_end(owner)
    assert p._post_accumulate_grad_hooks, "the arrivals hook was never registered"


def test_finalize_inside_fn_is_refused(world_of_one):
    # finalize() while a call runs would destroy the communicator its collectives use: refused
    # (by axonn_c.finalize before it resets anything, and by the C runtime behind it)
    axonn_c.init(concurrent_microbatches=2)

    def fn(a, finalize):
        try:
            finalize()
        except RuntimeError as e:
            return str(e)
        return "not refused"

    for finalize in (axonn_c.finalize, axonn_c._C.finalize):
        got = axonn_c.run_concurrent(fn, torch.ones(4), finalize)
        assert all("finalize() while run_concurrent runs" in m for m in got), got
        assert axonn_c.is_initialized()
    # finalize asks C: open only during a call
    assert axonn_c.run_concurrent(lambda a: axonn_c._C.microbatch_running(),
                                  torch.ones(4)) == [True, True]
    assert not axonn_c._C.microbatch_running()
    layer = axonn_c.Linear(8, 4)  # the process goes on: the runtime is whole
    x = torch.randn(4, 8)
    axonn_c.run_concurrent(lambda a: layer(a).sum().backward(), x, model=layer)
    axonn_c.sync_gradients(layer)
    assert layer.weight.grad is not None
    axonn_c.finalize()
    assert not axonn_c.is_initialized()


def test_scatter_block_must_match_the_weight(world_of_one):
    # a dW block is summed and reduce-scattered as the weight's dtype: another dtype is refused
    axonn_c.init(concurrent_microbatches=2)
    w = torch.zeros(8)

    def fn(a):
        with pytest.raises(ValueError, match=r"the dW block of layer 3 is .* on device -1, "
                                             r"expected the weight's .* on device -1"):
            axonn_c._C.microbatch_scatter(3, w, torch.zeros(8, dtype=torch.float64))
        return True

    assert axonn_c.run_concurrent(fn, torch.ones(2)) == [True, True]
