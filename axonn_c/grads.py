"""Deferred gradients: the Python half of the scheduler's backward (where it acts in a step:
docs/ARCHITECTURE.md#one-training-step).

With overlap on, a layer's backward does not wait for its weight gradient: dW's depth
reduce-scatter is handed to the C scheduler, and the gradient lands in a flat bucket whose
data-parallel all-reduce starts (in C, ordered after the reduce-scatters) as soon as the bucket
fills, while the rest of backward computes. At the end of the backward pass (an autograd engine
callback) everything still in flight is waited for and each weight's `.grad` is set. So after
`backward()` returns, `.grad` is complete, as with overlap off; `sync_gradients` then only skips
the data-parallel sums already done and scales.

Accumulation: the gradient accumulated so far is folded into the new one before the reductions
(so the bucket all-reduce sums the total). Inside `no_grad_sync()` no data-parallel reduction
runs; the first backward after it reduces the whole accumulated gradient.

Other parameters (biases, norms, embeddings: everything that is not a deferred Linear weight)
join the same kind of buckets through a gradient hook (`hook`), which fires in backward as soon
as the parameter's gradient for the pass is known; their buckets are summed over the
parameter's groups ("depth" then "data", or "world") while backward goes on. A Linear registers
its bias when it is built; sync_gradients(model) registers the rest of the model on its first
call (so they overlap from the second step on).

A Linear weight is hooked too: what reaches autograd for it (a cast weight's gradient, a
regulariser or a tied use) arrives after the layer's deferred gradient was prepared (the
accumulation node waits for every producer): it becomes a record of its own, reduced like the
deferred one and added after it when backward ends.

What a backward already summed each `.grad` over is remembered in C (summed_over/mark_summed),
not on the Parameter: a Parameter's __dict__ travels with torch.save and copy.copy, where the
copy's .grad is not the one that was summed.

Chunk calls (axonn_c.Sequential) accumulate a weight's gradient over the chunks of a pass in
the dW GEMM: one record per weight and pass, complete after the chunk count the forwards
announced (expect_chunk); its bucket starts its sum only then.

The records of pending gradients, the taken .grads, the chunk records and counts and the
summed-over marks live in C (csrc/grads/records.c, bound by csrc/python/py_records.c), which
also applies them at the end of a pass; every collective is started and waited for by
csrc/sched/sched.c. The gradient hooks decide and act in C (the decision
csrc/grads/grad_policy.c, carried out by csrc/python/py_grad_hook.c), and so does the end of a
pass (csrc/python/py_grad_pass.c: finish, drop_if_abandoned, and queueing the end of a pass).
A Linear's deferred weight gradient (where it goes, keeping what its queued work reads, its
record, a chunk call's part) is one call, the layer handle's backward
(csrc/python/py_linear_call.c with csrc/python/py_grad_deferred.c). What is still here answers
what only autograd's Python API knows (accumulates).
"""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from . import _C
from .state import first_hook, forget_hook, group_size, is_initialized


# A .grad already summed over ranks (an overlapped backward, or run_concurrent's reducer) cannot
# take unsummed micro-batch gradients: raises RuntimeError, sync_gradients() must run first.
check_unsynced = _C.grad_check_unsynced


@contextlib.contextmanager
def no_grad_sync():
    """Gradient accumulation over micro-batches: inside this context backward starts no
    data-parallel reduction and sync_gradients does nothing. Run every micro-batch but the last
    inside it; the last one's backward (with overlap on) and sync_gradients reduce the whole
    accumulated gradient once. Also available as axonn_c.no_sync()."""
    prev = _C.grad_sync_enabled(False)  # (in C: the gradient hooks read it, _C.GradHook)
    try:
        yield
    finally:
        _C.grad_sync_enabled(prev)


# The groups over which p.grad was summed during an earlier backward (sync_gradients skips
# them). A mark counts only while p.grad is the tensor it was made for: a .grad that was set to
# None (zero_grad) or replaced since, or a copy's, holds nothing summed.
summed_over = _C.grad_summed_over
# mark_summed(p, groups): p.grad (as it is now) is summed over `groups` (() forgets)
mark_summed = _C.grad_mark_summed


# A synchronous sum (sync_gradients, run_concurrent's reducer) packs up to this many bytes per
# collective: it waits for all of them at once, so larger buckets only save calls. Under 32 MiB:
# glibc maps a CPU buffer of 32 MiB or more afresh (and page-faults it) each time, a smaller one
# comes back from the heap (docs/ARCHITECTURE.md#gradient-buckets).
SYNC_BUCKET_BYTES = 16 * 1024 * 1024


def expect_chunk(param: Tensor) -> None:
    """A chunk call's forward (axonn_c.Sequential) with grad: one more backward call will
    accumulate into param's gradient in this pass."""
    if (torch._C._current_graph_task_id() != -1 and not _C.grad_counting_ahead()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
        # a forward inside backward under saved-tensor hooks: torch.utils.checkpoint's
        # recomputation (use_reentrant=False), whose graph never runs backward (the original
        # forward's nodes do, and counted their calls); counting it would leave the records
        # open until the end of backward
        return
    _C.grad_expect_chunk(param)


new_chunk_counts = _C.grad_chunk_counts  # a table of chunk call counts for chunk_counts()


@contextlib.contextmanager
def chunk_counts(into):
    """Counts the chunk calls made inside into `into` (new_chunk_counts()): a forward run ahead
    inside another pass's backward (axonn_c.forward_backward), whose calls belong to the next
    pass, not to the one that finish() ends; add_chunk_counts hands them over once that pass is
    over."""
    saved = _C.grad_count_into(into)
    try:
        yield
    finally:
        _C.grad_count_into(saved)


add_chunk_counts = _C.grad_add_counts  # (the table is left empty)


def chunk_open(param: Tensor) -> bool:
    """Whether param has a chunk record of this pass still waiting for chunk calls."""
    return _C.grad_chunk_dw(param) is not None


# What in-flight work reads or writes is kept alive in C (csrc/grads/keeps.c), each until its
# scheduler number is done: "task" (a deferred dW GEMM has run), "result" (a held backward dX
# all-reduce was awaited: by the consumer's gradient hook, axonn_c/chunking.py, or at the end
# of backward), "output" (a held forward all-reduce was awaited by axonn_c.Sequential within
# its forward, so these never mean that a backward pass was abandoned or left work to
# finish()). Whoever drops such a tensor first, e.g. an exception unwinding autograd's
# Function.apply, must not free memory the progress thread still writes. A Linear's backward
# keeps its task's and result's tensors itself (csrc/python/py_linear_call.c).

def keep_output(number: int, y: Tensor) -> None:
    """Keeps a forward's output y, which a held all-reduce (result `number`) writes, alive until
    axonn_c.Sequential awaits it."""
    _C.keep_alive("output", number, y)


release_done = _C.keeps_release_done  # releases what tasks run and results awaited kept


# (a torch without either falls back to get_gradient_edge)
_ACCUMULATE_GRAD = getattr(torch._C._functions, "AccumulateGrad", None)
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def _accumulate_node(param: Tensor):
    """param's AccumulateGrad node: found from the node the engine is running (param's own, in
    its gradient hook; an input edge of it, in a Linear's backward) in about a microsecond;
    else through get_gradient_edge, which builds a view and its graph node (tens of
    microseconds inside a backward pass)."""
    node = _current_node()
    if node is not None and _ACCUMULATE_GRAD is not None:
        if type(node) is _ACCUMULATE_GRAD:
            if node.variable is param:
                return node
        else:
            for nxt, _ in node.next_functions:
                if type(nxt) is _ACCUMULATE_GRAD and nxt.variable is param:
                    return nxt
    return get_gradient_edge(param).node


def accumulates(param: Tensor) -> bool:
    """Whether the running backward pass accumulates into param.grad (loss.backward(), also with
    inputs=...) rather than handing its gradient back (torch.autograd.grad): only then may its
    gradient be deferred or summed into .grad. True outside a backward pass."""
    try:
        return bool(torch._C._will_engine_execute_node(_accumulate_node(param)))
    except RuntimeError as e:  # torch refuses the question for leaves inside autograd.grad
        return "autograd.grad" not in str(e)


# ----------------------------------------------------------------- parameters with a grad hook

def hook(param: Tensor, groups: Tuple[str, ...]) -> None:
    """Sums param's gradient over `groups` during backward (when the data overlap is on):
    registered once per parameter; `groups` can be changed later (param._axonn_hook_groups).
    Not in a world of one, where it would never have anything to do: a layer registers it when
    it first runs on a larger grid (Linear._check_placement), sync_gradients on its next call.
    A frozen parameter gets it too (torch sets no hook on a tensor that does not require grad,
    so requires_grad is switched on for the registration; the hook stays when it is switched
    back): sync_gradients sums a frozen parameter's .grad like any other (the replicas stay
    alike), and once it is unfrozen a backward that adds to that synced .grad must first turn
    it back into this rank's share, which only the hook does."""
    param._axonn_hook_groups = tuple(groups)
    if not is_initialized() or group_size("world") == 1:
        return
    if not (param.is_floating_point() or param.is_complex()):
        return  # (no gradient ever: torch lets only these require grad)
    if first_hook(param, "grad"):
        # the gradient of the pass (all its uses summed, before autograd accumulates it) goes
        # into a bucket with the .grad so far folded in, is recorded after a pending record, or
        # is left to autograd: decided and done in C (csrc/python/py_grad_hook.c, the decision
        # csrc/grads/grad_policy.c), which asks `accumulates` only when it matters; holds param
        # weakly
        frozen = not param.requires_grad
        try:
            if frozen:
                param.requires_grad_(True)
        except RuntimeError:  # (an inference tensor outside inference mode: it never requires
            # grad there, so it never needs the hook; sync_gradients asks again each call)
            forget_hook(param, "grad")
            return
        try:
            param.register_hook(_C.GradHook(param, accumulates))
        except BaseException:
            forget_hook(param, "grad")  # (the next call tries again)
            raise
        finally:
            if frozen:
                param.requires_grad_(False)


idle = _C.grad_idle  # nothing pending: no record, bucket, held result or taken .grad


# The end of a backward pass (csrc/python/py_grad_pass.c). A pass with pending gradients
# completes them when it ends (an engine callback queued once per pass, keyed by the pass's
# graph-task id, so a pass that raised does not block later ones; _C.grad_queue_finish); the
# callback also ends the scheduler's step. The engine holds the callback while the pass is
# alive and lets it go when the pass ends, also when it raised (then it never runs): a weak
# reference to it tells whether pending gradients still belong to a running pass.
# finish(): completes every deferred gradient: closes open buckets, waits for the collectives,
# sets .grad (or adds to it) record by record and marks what each .grad is summed over; on a
# failed sum the records' .grads become None. Called at the end of backward, by
# sync_gradients, and before a layer's second backward within one pass. A pass that raised is
# dropped first (drop_if_abandoned).
finish = _C.grad_finish
# drop_if_abandoned(): drops the pending work of a backward pass that raised before its end:
# its deferred work completes (nothing left reading freed memory) and the deferred Linear weight
# gradients are dropped, not set (a hooked parameter keeps what autograd accumulated before the
# error, as without overlap). A pass still running, on any thread, keeps its records; nothing
# on a micro-batch thread.
drop_if_abandoned = _C.grad_drop_if_abandoned


def reset() -> None:
    """Forgets everything pending (at init/finalize: nothing is in flight)."""
    _C.grad_records_clear()
    _C.grad_buckets_drop()
    _C.keeps_clear()
