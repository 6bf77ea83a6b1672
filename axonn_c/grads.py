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
deferred one and added after it when backward ends (_add_after_pending).

What a backward already summed each `.grad` over is remembered in C (summed_over/mark_summed),
not on the Parameter: a Parameter's __dict__ travels with torch.save and copy.copy, where the
copy's .grad is not the one that was summed.

Chunk calls (axonn_c.Sequential) accumulate a weight's gradient over the chunks of a pass in
the dW GEMM (chunk_prepare/chunk_done): one record per weight and pass, complete after the
chunk count the forwards announced (expect_chunk); its bucket starts its sum only then.

The records of pending gradients, the taken .grads, the chunk records and counts and the
summed-over marks live in C (csrc/grads/records.c, bound by csrc/python/py_records.c), which
also applies them at the end of a pass; every collective is started and waited for by
csrc/sched/sched.c. What is here decides what to record from torch's side of things.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from . import _C
from .state import first_hook, group_size, grid_sizes, is_initialized, microbatch_active, \
    session


def check_unsynced(p: Tensor) -> None:
    """A .grad already summed over ranks (an overlapped backward, or run_concurrent's reducer)
    cannot take unsummed micro-batch gradients: sync_gradients() must run first."""
    if summed_over(p):
        raise RuntimeError(
            "run_concurrent: a parameter's .grad was already summed over ranks (by an earlier "
            "backward with overlap on, or an earlier run_concurrent with model=), and "
            "sync_gradients() has not run since; call axonn_c.sync_gradients(model) (or zero "
            "the gradients) before run_concurrent")


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


def _bucket_view(n: int, like: Tensor, groups: Tuple[str, ...] = ("data",)
                 ) -> Tuple[Tensor, int]:
    """n elements of the open bucket of like's dtype/device summed over `groups`, and that
    bucket's number (csrc/grads/buckets.c decides which bucket and when its sums start)."""
    return _C.grad_bucket_take(like, n, groups, session.bucket_bytes)


# A synchronous sum (sync_gradients, run_concurrent's reducer) packs up to this many bytes per
# collective: it waits for all of them at once, so larger buckets only save calls.
SYNC_BUCKET_BYTES = 32 * 1024 * 1024


@torch.no_grad()
def reduce_now(tensors: List[Tensor], groups: Tuple[str, ...], scale: Optional[float]) -> None:
    """Sums the tensors in place over `groups` (in this order) and multiplies them by `scale`,
    waiting for the result: packed into gradient buckets (the same ones as backward's, emptied
    first by the caller's finish()) and copied back (in C: csrc/python/py_sync.c)."""
    _C.grad_reduce_now(tensors, groups, scale, SYNC_BUCKET_BYTES)


def prepare(param: Tensor, n: int, overlap_data: bool) -> Tuple[Tensor, Optional[Tensor], bool,
                                                                 Optional[int]]:
    """For a deferred weight gradient of `param` ([n] elements): the tensor the layer writes
    (dw), the accumulated gradient to fold in (or None), whether dw replaces .grad (else it is
    added), and the bucket dw is in when it is reduced over the data group (`overlap_data`: the
    layer's knob), else None."""
    drop_if_abandoned()  # e.g. a second backward over a retained graph after one that raised
    if _C.grad_pending(param):  # the layer ran twice in this backward (shared weights)
        finish()
    prev = param.grad
    flagged = "data" in summed_over(param)
    # a gradient already summed over data (a backward outside no_grad_sync, no sync_gradients
    # since) cannot absorb an unreduced one: the new part is then reduced too, and added
    reduce = grid_sizes()[0] > 1 and ((overlap_data and _C.grad_sync_enabled())
                                              or flagged)
    fold = None
    if prev is not None and not flagged:
        fold = prev if prev.is_contiguous() and prev.dtype == param.dtype else \
            prev.detach().to(param.dtype).contiguous()
    dw, bucket = _bucket_view(n, param) if reduce else (param.new_empty((n,)), None)
    return dw, fold, not flagged, bucket


def add(param: Tensor, dw: Tensor, keep, replace: bool, bucket: Optional[int]) -> None:
    """Records a deferred gradient (in `bucket` when it is reduced over data, from prepare);
    `keep`: tensors the C side reads until finish()."""
    _C.grad_record(param, dw, keep, replace, () if bucket is None else ("data",), bucket)
    queue_finish()


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


def chunk_prepare(param: Tensor, n: int, overlap_data: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """For a chunk call's weight gradient: (the tensor its dW GEMM writes, the tensor it adds
    to: the gradient so far, or for the pass's later chunks dw itself). The chunks of a pass
    accumulate in the GEMM, without a per-chunk dW tensor for autograd to sum; the record
    completes (its bucket may then start its sum) after the last chunk's backward, chunk_done."""
    dw = _C.grad_chunk_dw(param)
    if dw is not None:
        return dw, dw
    dw, fold, replace, bucket = prepare(param, n, overlap_data)
    _C.grad_record(param, dw, (fold,), replace, () if bucket is None else ("data",), None)
    # its calls counted so far; its bucket's sums wait for the pass's last chunk (chunk_done)
    _C.grad_chunk_open(param, bucket)
    queue_finish()
    return dw, fold


def chunk_done(param: Tensor) -> None:
    """A chunk call's backward has written its part: after the last one the record is complete
    and its bucket, if full, starts its sum."""
    _C.grad_chunk_done(param)  # (an unknown count: finish() completes it)


def chunk_open(param: Tensor) -> bool:
    """Whether param has a chunk record of this pass still waiting for chunk calls."""
    return _C.grad_chunk_dw(param) is not None


# What in-flight work reads or writes is kept alive in C (csrc/grads/keeps.c), each until its
# scheduler number is done: "task" (a deferred dW GEMM has run), "result" (a held backward dX
# all-reduce was awaited: by the consumer's gradient hook, axonn_c/chunking.py, or at the end
# of backward), "output" (a held forward all-reduce was awaited by axonn_c.Sequential within
# its forward, so these never mean that a backward pass was abandoned or left work to
# finish()). Whoever drops such a tensor first, e.g. an exception unwinding autograd's
# Function.apply, must not free memory the progress thread still writes.

def keep_for_task(task: int, tensors: tuple) -> None:
    """Keeps what a deferred dW GEMM (scheduler task `task`) reads until it has run."""
    _C.keep_alive("task", task, tensors)


def keep_output(number: int, y: Tensor) -> None:
    """Keeps a forward's output y, which a held all-reduce (result `number`) writes, alive until
    axonn_c.Sequential awaits it."""
    _C.keep_alive("output", number, y)


def keep_for_result(number: int, dx: Tensor) -> None:
    """Keeps dx, which a held dX all-reduce of backward (result `number`) writes, alive until it
    is awaited."""
    _C.keep_alive("result", number, dx)
    queue_finish()  # the end of backward awaits what no hook did


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
    it first runs on a larger grid (Linear._check_placement), sync_gradients on its next call."""
    param._axonn_hook_groups = tuple(groups)
    if not is_initialized() or group_size("world") == 1:
        return
    if first_hook(param, "grad"):
        # decides in C whether the gradient has anything to do (the common case: nothing
        # pending, no .grad marked summed, no sum to start now) and only then calls _on_grad;
        # holds param weakly (axc_runtime_grad_needs_work, csrc/python/py_grad_hook.c)
        param.register_hook(_C.GradHook(param, _on_grad))


def _on_grad(p: Tensor, g: Tensor) -> None:
    """The gradient of this backward pass (all its uses summed, before it is accumulated into
    .grad) goes into a bucket, with the gradient accumulated so far folded in: the bucket's sum
    is the reduced total, which replaces .grad when backward ends. A .grad already reduced in an
    earlier pass (no sync_gradients since) is identical on all ranks of the groups, so it enters
    divided by their rank count. Called by p's GradHook when there is something to do."""
    # (grad mode is on in a hook exactly when backward builds a graph: create_graph=True)
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        _take_grad(p, g, create_graph)


idle = _C.grad_idle  # nothing pending: no record, bucket, held result or taken .grad


def _take_grad(p: Tensor, g: Tensor, create_graph: bool) -> None:
    if microbatch_active():  # autograd accumulates it; sync_gradients sums
        check_unsynced(p)
        return
    if not is_initialized() or not accumulates(p):
        return
    drop_if_abandoned()
    # a gradient of this pass is pending (a Linear's deferred dW, or an earlier gradient of a
    # reentrant checkpoint): this one is added after it, or it is completed first
    if _C.grad_pending(p):
        if not create_graph and _add_after_pending(p, g):
            return
        finish()
    on = getattr(p, "_axonn_overlap_data", None)  # a Linear weight: its layer's knob
    if not _C.grad_sync_enabled() or not (_C.grad_overlap_data() if on is None else on):
        _unreduce(p)  # autograd adds an unsummed gradient: sync_gradients sums the total
        return
    groups = tuple(n for n in p._axonn_hook_groups if group_size(n) > 1)
    if not groups or g.dtype != p.dtype or g.layout != torch.strided:
        _unreduce(p)  # nothing to sum / an unusual gradient: sync_gradients sums the total
        return
    prev = p.grad
    copies = _copies(p)
    view, bucket = _bucket_view(p.numel(), p, groups)
    view.copy_(g.reshape(-1))
    if prev is not None:
        view.add_(prev.reshape(-1), alpha=1.0 / copies)
        # autograd now adds g, not summed, into .grad: a summed .grad takes its share first, so
        # that if the pass raises (the record dropped) .grad is a consistent unsummed total for
        # sync_gradients, not a summed one with an unsummed part in it
        _unreduce(p)
    _C.grad_record(p, view, None, True, groups, bucket)
    queue_finish()


def _add_after_pending(p: Tensor, g: Tensor) -> bool:
    """Another gradient of this pass for a parameter whose pending record replaces .grad (so
    what autograd accumulates there is dropped): a record of its own, reduced like the pending
    one, which finish() adds after it; nothing waits now (a regulariser on every weight would
    otherwise complete all pending work once per weight). False when the pending record adds
    to a .grad already summed in an earlier pass, or for an unusual gradient: the caller then
    completes the pending work first (also under create_graph=True, where autograd accumulates
    out of place, replacing the scratch)."""
    last = _C.grad_last_record(p)  # (replace, groups) of p's last record
    if last is None or not last[0] or g.dtype != p.dtype or g.layout != torch.strided:
        return False
    if not _C.grad_taken(p):
        # autograd then adds in place into the scratch, not into the .grad that a deferred dW
        # GEMM may still read (its fold); finish() drops both, an abandoned pass puts the .grad
        # back unless the scratch was replaced meanwhile
        prev = p.grad
        scratch = torch.empty_like(p if prev is None else prev)  # (finish() replaces it)
        _C.grad_take(p, prev, scratch)
        p.grad = scratch
    groups, bucket = last[1], None
    if groups:
        part, bucket = _bucket_view(p.numel(), p, groups)
        part.copy_(g.reshape(-1))
    else:  # (summed with the rest by sync_gradients; a copy: autograd may keep g as .grad)
        part = g.detach().reshape(-1).clone()
    _C.grad_record(p, part, None, False, groups, bucket)
    return True


def _copies(p: Tensor) -> int:
    """How many ranks hold p.grad as one sum: the product of the sizes of the groups it was
    summed over during an earlier backward (1 when it was not)."""
    copies = 1
    for n in summed_over(p):
        copies *= group_size(n)
    return copies


def _unreduce(p: Tensor) -> None:
    """A .grad summed over groups during an earlier backward, about to absorb a gradient that is
    not summed (no_grad_sync, or the overlap off): its share of the sum, so that the later
    sync_gradients, which sums the whole .grad again, restores it."""
    copies = _copies(p)
    if copies > 1:
        if p.grad is not None:
            p.grad.div_(copies)
        mark_summed(p, ())


class _EndOfBackward:
    """The end-of-backward callback. The autograd engine holds it while the pass is alive and
    lets it go when the pass ends, also when the pass raised (then it never runs): a weak
    reference to it tells whether pending gradients still belong to a running pass."""
    __slots__ = ("__weakref__",)

    def __call__(self) -> None:
        _end_of_backward()


def queue_finish() -> None:
    """Runs finish() when the current backward pass ends (once per pass). Keyed by the pass's
    graph-task id, so a pass that raised (its callbacks dropped) does not block later ones."""
    task = torch._C._current_graph_task_id()
    if task != _C.grad_pass():
        cb = _EndOfBackward()
        torch.autograd.Variable._execution_engine.queue_callback(cb)
        _C.grad_set_pass(task, weakref.ref(cb))


def _end_of_backward() -> None:
    _C.grad_set_pass(None)  # (its callback, alive while it runs, still tells the pass is on)
    finish()
    _C.sched_step_end()


@torch.no_grad()
def finish() -> None:
    """Completes every deferred gradient: closes open buckets, waits for the collectives, sets
    .grad (or adds to it) record by record and marks what each .grad is summed over; on a failed
    sum the records' .grads become None. Called at the end of backward, by sync_gradients, and
    before a layer's second backward within one pass."""
    drop_if_abandoned()  # a pass that raised: its half gradients are dropped, not set
    _C.grad_records_finish()


def drop_if_abandoned() -> None:
    """Drops the pending work of a backward pass that raised before its end (its callback never
    ran, and the engine let it go): its deferred work is completed, so nothing is left reading
    freed memory, and the deferred Linear weight gradients are dropped, not set, so the next
    backward or sync_gradients does not find a half pass's values in .grad. (A hooked
    parameter, e.g. a bias, keeps what autograd accumulated into its .grad before the error, as
    without overlap.) Called by a Linear's forward, by the first gradient of a pass, and by
    finish() (so sync_gradients, run_concurrent, finish_grads); a pass still running, on any
    thread, keeps its records. Not on a micro-batch thread: those own no pass, and the caller's
    run_concurrent reducer may be summing through the buckets meanwhile."""
    if idle() or microbatch_active() or _C.grad_pass_alive():
        return
    _C.grad_set_pass(None)
    try:
        _C.sched_finish()  # (the records hold what the queued dW GEMMs write: dropped after)
        _C.sched_step_abort()  # the half step's layer order is not learned
    finally:
        # records, chunk records and counts and partial buckets dropped; taken .grads put back
        _C.grad_records_drop()


def reset() -> None:
    """Forgets everything pending (at init/finalize: nothing is in flight)."""
    _C.grad_records_clear()
    _C.grad_buckets_drop()
    _C.keeps_clear()
