"""axonn_c.Sequential: cross-layer chunk pipelining (docs/scheduler.md, "Chunk pipelining").

Within one layer, over-decomposition hides a chunk's all-reduce under the next chunk's GEMM of
the same layer; the last chunk's reduction stays exposed, and on a tensor-parallel grid a
layer's all-reduce is often longer than its own GEMM. Across layers the next layer only needs
*its* chunk: so this container runs the batch in chunks (dim 0) through all of its children,
chunk by chunk and layer by layer, and leaves each axonn_c.Linear child's all-reduce in flight
(a "held result" of the C scheduler, csrc/sched/sched.c) until that chunk's next child needs
it. While chunk 0 waits for its reduction, chunk 1 computes, in this layer or the next ones.

Backward follows by itself: autograd runs the chunks' nodes in reverse creation order, a
Linear child leaves its dX all-reduce held, and a gradient hook on the child's input awaits it
just before the previous child reads it. The weight gradients of the chunks are summed by
autograd (with the data overlap on, summed over data by the gradient hook of axonn_c/grads.py).

The order in which chunks advance depends only on which children hold a result, which the grid
and the knobs decide: it is the same on every rank, as collective matching requires.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from . import _C, concurrent, grads, runtime

_state = threading.local()


def hold_flags(layer) -> int:
    """For axonn_c.Linear's forward: which reductions this call leaves held (linear.HOLD_FWD,
    HOLD_BWD), 0 unless it is a direct child call of a pipelining axonn_c.Sequential."""
    t = getattr(_state, "target", None)
    return t[1] if t is not None and t[0] is layer else 0


def dw_sum(layer):
    """For axonn_c.Linear's forward: the DwSum shared by this child's chunk calls."""
    t = getattr(_state, "target", None)
    return t[2] if t is not None and t[0] is layer else None


class DwSum:
    """The chunks of one child share one weight gradient: the first chunk whose backward runs
    writes it and hands it to autograd, the later ones add to it in place (C's dW GEMM with
    beta = 1) and hand back None. Autograd accumulates the weight only once all of them have run,
    so it sees the total, without allocating and summing one gradient per chunk. Per backward
    pass (a retained graph's second pass starts a new sum)."""

    __slots__ = ("dw", "task")

    def __init__(self):
        self.dw, self.task = None, None

    def running(self, w: Tensor) -> bool:
        """Whether this pass's sum is started (for this weight's shape and dtype)."""
        return (self.dw is not None and self.task == torch._C._current_graph_task_id()
                and self.dw.shape == w.shape and self.dw.dtype == w.dtype)

    def start(self, dw: Tensor) -> None:
        self.dw, self.task = dw, torch._C._current_graph_task_id()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _await(t: Tensor) -> None:
    _C.sched_await_result(t.data_ptr(), _nbytes(t))


def _await_grad(g: Tensor) -> None:
    """Gradient hook on a child's input: dX's all-reduce, held by the child, completes before
    the previous child reads the gradient."""
    if runtime.is_initialized():
        _await(g)
        grads.release_run_tasks()


class Sequential(nn.Sequential):
    """nn.Sequential whose forward runs the batch in `chunks` pieces along dim 0 through its
    children, pipelined across layers, when it pays: overlap on (init(overlap=True) or
    optimize_communication(overlap_all_reduce=True)), a row or column group of several ranks,
    no depth sharding (G_intra_d == 1: every chunk would gather the weights again), eager mode,
    outside run_concurrent. Otherwise it is plain nn.Sequential.

    Every child must treat the rows of dim 0 independently (token-wise layers: Linear,
    activations, norms over features, dropout; attention only if dim 0 is the batch) and
    return one tensor. The pipelined children are the direct axonn_c.Linear children in the
    expert layout (expert_mode=True); others run chunk by chunk without holding anything.
    In-place activations directly after a Linear child are fine (its result is awaited first).
    """

    def __init__(self, *args, chunks: int = 2):
        super().__init__(*args)
        chunks = int(chunks)
        if chunks < 1:
            raise ValueError(f"axonn_c.Sequential: chunks must be >= 1, got {chunks}")
        self.chunks = chunks

    def _pipelines(self, x) -> bool:
        if (self.chunks < 2 or len(self) == 0 or not isinstance(x, Tensor) or x.dim() < 1
                or x.shape[0] < 2 or not runtime.is_initialized()):
            return False
        if torch.compiler.is_compiling() or concurrent.active():
            return False
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        _, g_r, g_c, g_d = runtime.grid_sizes()
        if g_d != 1 or g_r * g_c == 1:
            return False
        return bool(runtime.overlap_overrides.get("overlap_all_reduce",
                                                  runtime.overlap_defaults["overlap_all_reduce"]))

    def forward(self, x):
        if not self._pipelines(x):
            return super().forward(x)
        from .linear import HOLD_BWD, HOLD_FWD, Linear

        mods = list(self)
        vals = list(x.chunk(self.chunks, dim=0))
        n, L = len(vals), len(mods)
        sums = [DwSum() for _ in mods]  # per child: its chunks' weight gradient
        nxt = [0] * n  # the next child of each chunk
        held = [0] * n  # the result number a chunk's value waits for (0: none)
        hooks = torch.is_grad_enabled()
        try:
            while True:
                # the first chunk that can go on; when all wait, the oldest reduction completes
                c = next((i for i in range(n) if nxt[i] < L and not held[i]), None)
                if c is None:
                    waiting = [i for i in range(n) if held[i]]
                    if not waiting:
                        break
                    c = min(waiting, key=held.__getitem__)
                    _await(vals[c])
                    held[c] = 0
                    continue
                l, v = nxt[c], vals[c]
                if l > 0 and hooks and v.requires_grad:
                    v.register_hook(_await_grad)  # the child's dX may be held
                flags = HOLD_FWD | (HOLD_BWD if l > 0 else 0)
                _state.target = (mods[l], flags, sums[l]) if isinstance(mods[l], Linear) else None
                before = _C.sched_counters()[1]
                try:
                    out = mods[l](v)
                finally:
                    _state.target = None
                if not isinstance(out, Tensor):
                    raise TypeError(f"axonn_c.Sequential: child {l} ({type(mods[l]).__name__}) "
                                    f"returned {type(out).__name__}, expected one tensor")
                after = _C.sched_counters()[1]
                held[c] = after if after != before else 0
                vals[c], nxt[c] = out, l + 1
        except BaseException:
            try:  # nothing may still write into tensors being dropped
                _C.sched_await_results()
            except Exception:  # (e.g. the same dead peer): the first error is the one to see
                pass
            raise
        return torch.cat(vals, dim=0)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"
