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

What a backward already summed each `.grad` over is remembered here (summed_over/mark_summed),
not on the Parameter: a Parameter's __dict__ travels with torch.save and copy.copy, where the
copy's .grad is not the one that was summed.

Chunk calls (axonn_c.Sequential) accumulate a weight's gradient over the chunks of a pass in
the dW GEMM (chunk_prepare/chunk_done): one record per weight and pass, complete after the
chunk count the forwards announced (expect_chunk); its bucket starts its sum only then.

What is here is bookkeeping (which tensor goes where, keeping buffers alive until the C side
is done); every collective is started and waited for by csrc/sched/sched.c.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.utils.weak import WeakIdKeyDictionary

from . import _C
from .state import first_hook, group_size, grid_sizes, is_initialized, microbatch_active, \
    overlap_knob, session





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
    prev = session.grad_sync_enabled
    session.grad_sync_enabled = False
    try:
        yield
    finally:
        session.grad_sync_enabled = prev


def summed_over(p: Tensor) -> Tuple[str, ...]:
    """The groups over which p.grad was summed during an earlier backward (sync_gradients skips
    them). An entry counts only while p.grad is the tensor it was made for: a .grad that was set
    to None (zero_grad) or replaced since, or a copy's, holds nothing summed."""
    e = _st.summed.get(p)
    if e is None or p.grad is None or e[0]() is not p.grad:
        return ()
    return e[1]


def mark_summed(p: Tensor, groups: Tuple[str, ...]) -> None:
    """Records that p.grad (as it is now) is summed over `groups` (() forgets)."""
    if not groups or p.grad is None:
        _st.summed.pop(p, None)
    else:
        _st.summed[p] = (weakref.ref(p.grad), tuple(groups))


class _Record:
    __slots__ = ("param", "dw", "keep", "replace", "reduced")

    def __init__(self, param, dw, keep, replace, reduced):
        self.param, self.dw, self.keep = param, dw, keep
        self.replace, self.reduced = replace, reduced


def _groups_of(r: _Record) -> Tuple[str, ...]:
    """The groups a record's gradient is summed over (a hooked parameter's record names them; a
    deferred weight's says whether "data")."""
    return r.reduced if isinstance(r.reduced, tuple) else (("data",) if r.reduced else ())


class _ChunkRecord:
    """A weight gradient `dw` that several chunk calls of one pass accumulate into
    (axonn_c.Sequential): `left` calls to go (the forwards' count; <= 0: unknown, complete at
    finish())."""
    __slots__ = ("dw", "bucket", "left")

    def __init__(self, dw: Tensor, bucket: Optional[int], left: int):
        self.dw, self.bucket, self.left = dw, bucket, left


class _State:
    """Everything pending between a backward pass's gradients and their completion (one
    instance, `_st`; reset at init/finalize)."""

    def __init__(self):
        # param -> (the .grad it was recorded for, the groups that .grad is summed over)
        self.summed = WeakIdKeyDictionary()
        self.clear()

    def clear(self):
        self.records: List[_Record] = []
        self.params_pending: set = set()
        # param -> (its .grad or None, the scratch tensor put in its place) for a parameter
        # whose pending record replaces .grad and that gets another gradient through autograd
        # in the same pass (_add_after_pending): autograd then adds in place into the scratch,
        # not into the .grad that a deferred dW GEMM may still read (its fold). finish() drops
        # both; an abandoned pass puts the .grad back unless the scratch was replaced meanwhile.
        self.taken: Dict[Tensor, Tuple[Optional[Tensor], Tensor]] = {}
        # chunk calls (axonn_c.Sequential) made with grad by the forwards since the last
        # finish(), and the records those calls' backwards accumulate into, by weight parameter
        self.chunk_calls: Dict[Tensor, int] = {}
        self.chunk_open: Dict[Tensor, _ChunkRecord] = {}
        self.counting_ahead = False  # inside chunk_counts: a forward run ahead
        self.queued_task = None  # graph task whose end runs _end_of_backward
        self.pass_alive = None  # weakref to the callback queued for that pass: dead once gone


_st = _State()


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
    first by the caller's finish()) and copied back."""
    if groups:
        pieces = []
        for t in tensors:
            piece, bucket = _C.grad_bucket_take(t, t.numel(), groups, SYNC_BUCKET_BYTES)
            piece.copy_(t.reshape(-1))
            _C.grad_bucket_written(bucket)
            pieces.append(piece)
        _C.grad_buckets_finish()
        for t, piece in zip(tensors, pieces):
            if scale is not None:
                piece.mul_(scale)
            t.copy_(piece.view_as(t))
    elif scale is not None:
        for t in tensors:
            t.mul_(scale)


def prepare(param: Tensor, n: int, overlap_data: bool) -> Tuple[Tensor, Optional[Tensor], bool,
                                                                 Optional[int]]:
    """For a deferred weight gradient of `param` ([n] elements): the tensor the layer writes
    (dw), the accumulated gradient to fold in (or None), whether dw replaces .grad (else it is
    added), and the bucket dw is in when it is reduced over the data group (`overlap_data`: the
    layer's knob), else None."""
    drop_if_abandoned()  # e.g. a second backward over a retained graph after one that raised
    if param in _st.params_pending:  # the layer ran twice in this backward (shared weights)
        finish()
    prev = param.grad
    flagged = "data" in summed_over(param)
    # a gradient already summed over data (a backward outside no_grad_sync, no sync_gradients
    # since) cannot absorb an unreduced one: the new part is then reduced too, and added
    reduce = grid_sizes()[0] > 1 and ((overlap_data and session.grad_sync_enabled)
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
    _st.records.append(_Record(param, dw, keep, replace, bucket is not None))
    _st.params_pending.add(param)
    if bucket is not None:
        _C.grad_bucket_written(bucket)
    queue_finish()


def expect_chunk(param: Tensor) -> None:
    """A chunk call's forward (axonn_c.Sequential) with grad: one more backward call will
    accumulate into param's gradient in this pass."""
    if (not _st.counting_ahead and torch._C._current_graph_task_id() != -1
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
        # a forward inside backward under saved-tensor hooks: torch.utils.checkpoint's
        # recomputation (use_reentrant=False), whose graph never runs backward (the original
        # forward's nodes do, and counted their calls); counting it would leave the records
        # open until the end of backward
        return
    _st.chunk_calls[param] = _st.chunk_calls.get(param, 0) + 1


@contextlib.contextmanager
def chunk_counts(into: Dict[Tensor, int]):
    """Counts the chunk calls made inside into `into`: a forward run ahead inside another pass's
    backward (axonn_c.forward_backward), whose calls belong to the next pass, not to the one
    that finish() ends; add_chunk_counts hands them over once that pass is over."""
    saved, was = _st.chunk_calls, _st.counting_ahead
    _st.chunk_calls, _st.counting_ahead = into, True
    try:
        yield
    finally:
        _st.chunk_calls, _st.counting_ahead = saved, was


def add_chunk_counts(counts: Dict[Tensor, int]) -> None:
    for p, k in counts.items():
        _st.chunk_calls[p] = _st.chunk_calls.get(p, 0) + k
    counts.clear()


def chunk_prepare(param: Tensor, n: int, overlap_data: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """For a chunk call's weight gradient: (the tensor its dW GEMM writes, the tensor it adds
    to: the gradient so far, or for the pass's later chunks dw itself). The chunks of a pass
    accumulate in the GEMM, without a per-chunk dW tensor for autograd to sum; the record
    completes (its bucket may then start its sum) after the last chunk's backward, chunk_done."""
    c = _st.chunk_open.get(param)
    if c is not None:
        return c.dw, c.dw
    dw, fold, replace, bucket = prepare(param, n, overlap_data)
    if bucket is not None:  # its sums wait for the pass's last chunk (chunk_done)
        _C.grad_bucket_hold(bucket)
    _st.records.append(_Record(param, dw, (fold,), replace, bucket is not None))
    _st.params_pending.add(param)
    _st.chunk_open[param] = _ChunkRecord(dw, bucket, _st.chunk_calls.pop(param, 0))
    queue_finish()
    return dw, fold


def chunk_done(param: Tensor) -> None:
    """A chunk call's backward has written its part: after the last one the record is complete
    and its bucket, if full, starts its sum."""
    c = _st.chunk_open.get(param)
    if c is None:
        return
    c.left -= 1
    if c.left != 0:  # more chunks to come (or an unknown count: finish() completes it)
        return
    del _st.chunk_open[param]
    if c.bucket is not None:
        _C.grad_bucket_unhold(c.bucket)


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


def accumulates(param: Tensor) -> bool:
    """Whether the running backward pass accumulates into param.grad (loss.backward(), also with
    inputs=...) rather than handing its gradient back (torch.autograd.grad): only then may its
    gradient be deferred or summed into .grad. True outside a backward pass."""
    try:
        return bool(torch._C._will_engine_execute_node(get_gradient_edge(param).node))
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
        ref = weakref.ref(param)
        param.register_hook(lambda g: _on_grad(ref, g))


def _data_overlap_on() -> bool:
    return bool(overlap_knob("overlap_data"))


def _on_grad(ref, g: Tensor) -> None:
    """The gradient of this backward pass (all its uses summed, before it is accumulated into
    .grad) goes into a bucket, with the gradient accumulated so far folded in: the bucket's sum
    is the reduced total, which replaces .grad when backward ends. A .grad already reduced in an
    earlier pass (no sync_gradients since) is identical on all ranks of the groups, so it enters
    divided by their rank count."""
    p = ref()
    if g is None:  # (a Linear weight whose gradient this pass deferred: nothing reached autograd)
        return
    if idle() and not _st.summed and not _sums_now(p):  # the common case: nothing to do
        return
    # (grad mode is on in a hook exactly when backward builds a graph: create_graph=True)
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        _take_grad(p, g, create_graph)


def idle() -> bool:
    """Nothing pending: no record, bucket, held result or taken .grad."""
    return not (_st.records or _st.taken or _C.keeps_count("result")
                or _C.grad_buckets_open())


def _sums_now(p: Optional[Tensor]) -> bool:
    """Whether a gradient of p arriving now would be summed during backward (the data overlap
    on, sums enabled, a group of several ranks); on a micro-batch thread, whether it must be
    checked. With nothing pending and no .grad marked summed, every other gradient goes to
    autograd untouched (_take_grad would find nothing to do)."""
    if p is None or microbatch_active() or not is_initialized():
        return p is not None and microbatch_active()
    on = getattr(p, "_axonn_overlap_data", None)
    if not session.grad_sync_enabled or not (_data_overlap_on() if on is None else on):
        return False
    return any(group_size(n) > 1 for n in p._axonn_hook_groups)


def _take_grad(p: Optional[Tensor], g: Tensor, create_graph: bool) -> None:
    if p is not None and microbatch_active():  # autograd accumulates it; sync_gradients sums
        check_unsynced(p)
        return
    if p is None or not is_initialized() or not accumulates(p):
        return
    drop_if_abandoned()
    # a gradient of this pass is pending (a Linear's deferred dW, or an earlier gradient of a
    # reentrant checkpoint): this one is added after it, or it is completed first
    if p in _st.params_pending:
        if not create_graph and _add_after_pending(p, g):
            return
        finish()
    on = getattr(p, "_axonn_overlap_data", None)  # a Linear weight: its layer's knob
    if not session.grad_sync_enabled or not (_data_overlap_on() if on is None else on):
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
    _st.records.append(_Record(p, view, None, True, groups))
    _st.params_pending.add(p)
    _C.grad_bucket_written(bucket)
    queue_finish()


def _add_after_pending(p: Tensor, g: Tensor) -> bool:
    """Another gradient of this pass for a parameter whose pending record replaces .grad (so
    what autograd accumulates there is dropped): a record of its own, reduced like the pending
    one, which finish() adds after it; nothing waits now (a regulariser on every weight would
    otherwise complete all pending work once per weight). False when the pending record adds
    to a .grad already summed in an earlier pass, or for an unusual gradient: the caller then
    completes the pending work first (also under create_graph=True, where autograd accumulates
    out of place, replacing the scratch)."""
    r = next((r for r in reversed(_st.records) if r.param is p), None)
    if r is None or not r.replace or g.dtype != p.dtype or g.layout != torch.strided:
        return False
    if p not in _st.taken:
        prev = p.grad
        scratch = torch.empty_like(p if prev is None else prev)  # (finish() replaces it)
        _st.taken[p] = (prev, scratch)
        p.grad = scratch
    groups = _groups_of(r)
    if groups:
        part, bucket = _bucket_view(p.numel(), p, groups)
        part.copy_(g.reshape(-1))
    else:  # (summed with the rest by sync_gradients; a copy: autograd may keep g as .grad)
        part = g.detach().reshape(-1).clone()
    _st.records.append(_Record(p, part, None, False, r.reduced))
    if groups:
        _C.grad_bucket_written(bucket)
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
    if task != _st.queued_task:
        cb = _EndOfBackward()
        torch.autograd.Variable._execution_engine.queue_callback(cb)
        _st.queued_task = task
        _st.pass_alive = weakref.ref(cb)


def _end_of_backward() -> None:
    _st.queued_task = None
    finish()
    _C.sched_step_end()


@torch.no_grad()
def finish() -> None:
    """Completes every deferred gradient: closes open buckets, waits for the collectives, sets
    .grad. Called at the end of backward, by sync_gradients, and before a layer's second
    backward within one pass."""
    drop_if_abandoned()  # a pass that raised: its half gradients are dropped, not set
    _st.chunk_calls.clear()
    if idle():  # (held results no hook awaited count)
        return
    taken = dict(_st.taken)
    _st.taken.clear()
    records = list(_st.records)
    _st.records.clear()
    _st.params_pending.clear()
    _st.chunk_open.clear()
    try:
        _C.grad_buckets_finish()  # every bucket's sums, then everything deferred completes
    except BaseException:
        for r in records:  # do not leave half-reduced values where a gradient is expected
            r.param.grad = None
        raise
    finally:
        release_done()  # (the tasks run even when one fails)
    for r in records:
        p = r.param
        taken.pop(p, None)
        # a hooked parameter's record names its groups; a deferred weight's, whether "data"
        groups = _groups_of(r)
        if r.replace or p.grad is None:
            p.grad = r.dw.view_as(p)
        else:  # (added to a .grad summed like it: see prepare and _add_after_pending)
            groups = tuple(dict.fromkeys(summed_over(p) + groups))
            p.grad.add_(r.dw.view_as(p))
        mark_summed(p, groups)
    for p, (prev, scratch) in taken.items():  # (taken for a record that was never made)
        if p.grad is scratch:
            p.grad = prev


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
    if (idle() or microbatch_active()
            or (_st.pass_alive is not None and _st.pass_alive() is not None)):
        return
    _st.queued_task = None
    try:
        _C.sched_finish()  # (the records hold what the queued dW GEMMs write: cleared after)
        _C.sched_step_abort()  # the half step's layer order is not learned
    finally:
        _st.records.clear()
        _st.params_pending.clear()
        _C.grad_buckets_drop()  # not summed: partial buckets
        _st.chunk_open.clear()
        _st.chunk_calls.clear()
        for p, (prev, scratch) in _st.taken.items():  # the gradient accumulated before the pass
            if p.grad is scratch:
                p.grad = prev
        _st.taken.clear()
        release_done()


def reset() -> None:
    """Forgets everything pending (at init/finalize: nothing is in flight)."""
    _st.clear()
    _C.grad_buckets_drop()
    _C.keeps_clear()
