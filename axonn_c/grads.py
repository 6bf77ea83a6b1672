"""Deferred gradients (DESIGN §6): the Python half of the scheduler's backward.

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

What is here is bookkeeping (which tensor goes where, keeping buffers alive until the C side
is done); every collective is started and waited for by csrc/sched/sched.c.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import _C, runtime
from .comm import _stream

# data-parallel gradient bucket size (bytes); init(bucket_size=...) sets it
bucket_bytes = 4 * 1024 * 1024


class _Record:
    __slots__ = ("param", "dw", "keep", "replace", "reduced")

    def __init__(self, param, dw, keep, replace, reduced):
        self.param, self.dw, self.keep = param, dw, keep
        self.replace, self.reduced = replace, reduced


class _Bucket:
    __slots__ = ("flat", "used")

    def __init__(self, flat: Tensor):
        self.flat, self.used = flat, 0


_records: List[_Record] = []
_params_pending: set = set()
_open: Dict[Tuple[torch.dtype, torch.device], _Bucket] = {}
_queued_task = None  # graph task whose end runs _end_of_backward


def _close(bucket: _Bucket) -> None:
    """Starts the bucket's data-parallel sum (after every reduce-scatter deferred so far)."""
    if bucket.used:
        f = bucket.flat
        _C.sched_reduce_after_deferred("data", f.data_ptr(), bucket.used, str(f.dtype)[6:],
                                       f.device.index if f.is_cuda else -1, _stream(f))
        bucket.used = 0


def _bucket_view(n: int, like: Tensor) -> Tensor:
    """n elements in the open bucket of like's dtype/device (a new bucket when it is full)."""
    key = (like.dtype, like.device)
    b = _open.get(key)
    if b is not None and b.used + n > b.flat.numel():
        _close(b)
        b = None
    if b is None:
        elems = max(n, bucket_bytes // like.element_size())
        b = _open[key] = _Bucket(like.new_empty((elems,)))
    view = b.flat[b.used:b.used + n]
    b.used += n
    return view


def prepare(param: Tensor, n: int, overlap_data: bool) -> Tuple[Tensor, Optional[Tensor], bool,
                                                                 bool]:
    """For a deferred weight gradient of `param` ([n] elements): the tensor the layer writes
    (dw), the accumulated gradient to fold in (or None), whether dw replaces .grad (else it is
    added), and whether it is reduced over the data group (`overlap_data`: the layer's knob)."""
    if param in _params_pending:  # the layer ran twice in this backward (shared weights)
        finish()
    prev = param.grad
    flagged = prev is not None and getattr(param, "_axonn_data_reduced", False)
    # a gradient already summed over data (a backward outside no_grad_sync, no sync_gradients
    # since) cannot absorb an unreduced one: the new part is then reduced too, and added
    reduce = runtime.grid_sizes()[0] > 1 and ((overlap_data and runtime.grad_sync_enabled)
                                              or flagged)
    fold = None
    if prev is not None and not flagged:
        fold = prev if prev.is_contiguous() and prev.dtype == param.dtype else \
            prev.detach().to(param.dtype).contiguous()
    dw = _bucket_view(n, param) if reduce else param.new_empty((n,))
    return dw, fold, not flagged, reduce


def add(param: Tensor, dw: Tensor, keep, replace: bool, reduced: bool) -> None:
    """Records a deferred gradient; `keep`: tensors the C side reads until finish()."""
    _records.append(_Record(param, dw, keep, replace, reduced))
    _params_pending.add(param)
    key = (dw.dtype, dw.device)
    b = _open.get(key)
    if reduced and b is not None and b.used == b.flat.numel():  # full: its sum can start
        _close(b)
        del _open[key]
    queue_finish()


def queue_finish() -> None:
    """Runs finish() when the current backward pass ends (once per pass). Keyed by the pass's
    graph-task id, so a pass that raised (its callbacks dropped) does not block later ones."""
    global _queued_task
    task = torch._C._current_graph_task_id()
    if task != _queued_task:
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)
        _queued_task = task


def _end_of_backward() -> None:
    global _queued_task
    _queued_task = None
    finish()
    _C.sched_step_end()


@torch.no_grad()
def finish() -> None:
    """Completes every deferred gradient: closes open buckets, waits for the collectives, sets
    .grad. Called at the end of backward, by sync_gradients, and before a layer's second
    backward within one pass."""
    if not _records and not _open:
        return
    for b in list(_open.values()):
        _close(b)
    _open.clear()
    records = list(_records)
    _records.clear()
    _params_pending.clear()
    try:
        _C.sched_finish()
    except BaseException:
        for r in records:  # do not leave half-reduced values where a gradient is expected
            r.param.grad = None
        raise
    for r in records:
        p = r.param
        if r.replace or p.grad is None:
            p.grad = r.dw.view_as(p)
        else:
            p.grad.add_(r.dw.view_as(p))
        p._axonn_data_reduced = r.reduced


def reset() -> None:
    """Forgets everything pending (at init/finalize)."""
    global _queued_task
    _queued_task = None
    _records.clear()
    _params_pending.clear()
    _open.clear()
