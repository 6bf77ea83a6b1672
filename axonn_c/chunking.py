"""axonn_c.Sequential: cross-layer chunk pipelining (docs/scheduler.md, "Chunk pipelining").

Within one layer, over-decomposition hides a chunk's all-reduce under the next chunk's GEMM of
the same layer; the last chunk's reduction stays exposed, and on a tensor-parallel grid a
layer's all-reduce is often longer than its own GEMM. Across layers the next layer only needs
*its* chunk: so this container runs the batch in chunks (dim 0) through all of its children,
chunk by chunk and layer by layer, and leaves each axonn_c.Linear child's all-reduce in flight
(a "held result" of the C scheduler, csrc/sched/sched.c) until that chunk's next child needs
it. While chunk 0 waits for its reduction, chunk 1 computes, in this layer or the next ones.

Backward follows by itself: autograd runs the chunks' nodes in reverse creation order, a
Linear child leaves its dX all-reduce held, and an identity node in front of the child's input
(_AwaitGrad) awaits it before anything else can read it. The chunks' weight gradients are
accumulated by their dW GEMMs into one buffer per weight and pass (the chunk record), whose
data-parallel sum starts once the last chunk has written.

The order in which chunks advance depends only on which children hold a result, which the grid
and the knobs decide: it is the same on every rank, as collective matching requires.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn

from torch.nn.modules import module as M

from . import validate

from . import _C, grads
from .grads import no_grad_sync
from .linear import HOLD_BWD, HOLD_CHUNK, HOLD_FWD, Linear
from .microbatches import caller_autocasts
from .state import grid_sizes, is_initialized, microbatch_active, overlap_knob, session

# (this thread's chunk state lives in session.thread: hold_target, the child call that holds
# its results, and hold_depth, how many containers pipeline; linear.hold_flags reads them)


def _plain_call(m) -> bool:
    """Whether calling m is exactly axonn_c.Linear.forward: no module hooks (a forward hook could
    read or replace the output before its all-reduce is awaited, a backward hook would see dX
    before its all-reduce is), no override of forward."""
    return (type(m).forward is Linear.forward and not (
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        or M._global_forward_hooks or M._global_forward_pre_hooks or M._global_backward_hooks
        or M._global_backward_pre_hooks))


def _holds_forward(m) -> bool:
    """Whether child m's call ends with an all-reduce that a later call could await (an expert
    Linear whose input group has several ranks): what the chunk order is planned on. Decided by
    the layer and the grid only, never by hooks, which may be registered on some ranks only:
    every rank must call the children in the same order."""
    return (isinstance(m, Linear) and m.expert_mode and m._shapes["gin_size"] > 1
            and m._shapes["depth_size"] == 1)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _await(t: Tensor) -> None:
    _C.sched_await_result(t.data_ptr(), _nbytes(t))


class _Pass:
    """One micro-batch of a forward_backward call: the nodes its forward made carry it
    (_AwaitGrad), so that only its own backward advances the next micro-batch's forward, not
    another graph's backward running meanwhile (another thread, or a backward run from a hook)."""

    __slots__ = ("ahead",)

    def __init__(self):
        self.ahead = None  # the _Lookahead to advance while this pass's backward runs


@contextlib.contextmanager
def _forward_of(p: Optional[_Pass]):
    """The forward run inside belongs to micro-batch p (on this thread; None: to none)."""
    outer = session.thread.pass_
    session.thread.pass_ = p
    try:
        yield
    finally:
        session.thread.pass_ = outer


class _AwaitGrad(torch.autograd.Function):
    """Identity in front of a Linear child's input: in backward, the child's dX all-reduce (held
    by the child) completes here, before the gradient reaches anything else (the previous
    child, or other uses of the same tensor, whose gradients autograd would add to it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.pass_ = session.thread.pass_
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if is_initialized():
            ahead = getattr(ctx.pass_, "ahead", None)
            if ahead is not None:  # the next micro-batch's GEMM hides this reduction
                ahead.advance()
            _await(g)
            grads.release_done()
        return g


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
        chunks = validate.check_int("axonn_c.Sequential: chunks", chunks, 1, 2**16)
        self.chunks = chunks

    def _pipelines(self, x) -> bool:
        # (not decided by the number of rows: data-parallel ranks with uneven batches must take
        # the same gradient path; a batch of one row is one chunk)
        if (self.chunks < 2 or len(self) == 0 or not isinstance(x, Tensor) or x.dim() < 2
                or not is_initialized()):
            return False
        if torch.compiler.is_compiling() or microbatch_active():
            return False
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        _, g_r, g_c, g_d = grid_sizes()
        if g_d != 1 or g_r * g_c == 1:
            return False
        return bool(overlap_knob("overlap_all_reduce"))

    def __getitem__(self, idx):
        out = super().__getitem__(idx)
        if isinstance(out, Sequential):  # a slice keeps the chunk count
            out.chunks = self.chunks
        return out

    def forward(self, x):
        if not self._pipelines(x):
            return super().forward(x)
        steps = self._steps(x)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def _steps(self, x):
        """The pipelined forward as a generator: it yields after each child call (True after a
        call that left a reduction in flight) and returns the output. forward() runs it
        through; forward_backward runs the next micro-batch's steps inside this one's backward."""
        mods = list(self)
        linear = [isinstance(m, Linear) for m in mods]
        plain = [_plain_call(m) for m in mods]
        # exactly `chunks` pieces (some may be empty): every rank of a group makes the same calls
        vals = list(torch.tensor_split(x, self.chunks, dim=0))
        # the order (which chunk calls its next child, when the oldest held reduction is
        # awaited) is decided in C from the children planned to hold a result, the same on
        # every rank; whether a call really holds its result also needs it to be plain (no hooks)
        plan = _C.ChunkPlan(len(vals), [_holds_forward(m) for m in mods])
        grad_on = torch.is_grad_enabled()
        # awaits[c]: vals[c] passed through _AwaitGrad, so the next child may hold its dX. The
        # node is made as soon as the value exists (not when the next child runs): autograd runs
        # ready nodes newest first, so it then runs after the other chunks' nodes of the next
        # layer, which is what lets their GEMMs hide this chunk's dX all-reduce.
        awaits = [False] * len(vals)

        def wrap(c: int, l: int) -> None:  # vals[c] is about to enter child l
            if l < len(mods) and linear[l] and grad_on and vals[c].requires_grad:
                vals[c], awaits[c] = _AwaitGrad.apply(vals[c]), True

        for c in range(len(vals)):
            wrap(c, 0)
        try:
            while (step := plan.next()) is not None:  # (awaits while every chunk waits)
                c, l = step
                # (any other Linear call in here is a chunk call that waits for its own reductions:
                # hold_flags gives it HOLD_CHUNK)
                session.thread.hold_target = (
                    (mods[l], HOLD_FWD | HOLD_CHUNK | (HOLD_BWD if awaits[c] else 0))
                    if plain[l] else None)
                session.thread.hold_depth += 1
                try:
                    out = mods[l](vals[c])
                finally:
                    session.thread.hold_target = None
                    session.thread.hold_depth -= 1
                if not isinstance(out, Tensor):
                    raise TypeError(f"axonn_c.Sequential: child {l} ({type(mods[l]).__name__}) "
                                    f"returned {type(out).__name__}, expected one tensor")
                held = plan.ran()  # (C reads whether the call left a reduction held)
                vals[c], awaits[c] = out, False
                wrap(c, l + 1)
                yield held
        except BaseException:
            try:  # nothing may still write into tensors being dropped
                _C.sched_await_results()
            except Exception:  # (e.g. the same dead peer): the first error is the one to see
                pass
            raise
        finally:
            grads.release_done()  # the outputs kept for their held all-reduces
        return torch.cat(vals, dim=0)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"


class _Lookahead:
    """The next micro-batch's pipelined forward, run a child call at a time from inside the
    running backward (at each _AwaitGrad, before it waits), with grad on: its GEMMs hide the
    backward's reductions and its own reductions run under the backward's GEMMs. The chunk calls
    it makes belong to the next pass (grads.chunk_counts), not to the one running."""

    def __init__(self, steps, casts, pass_):
        self.steps, self.out, self.counts = steps, None, grads.new_chunk_counts()
        self.done, self.casts, self.pass_ = False, casts, pass_

    def _next(self) -> bool:
        # (the caller's autocast: on CUDA the backward, and so this forward, runs on autograd's
        # device thread, whose autocast state is not the caller's)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for cast in self.casts:
                stack.enter_context(torch.autocast(**cast))
            stack.enter_context(grads.chunk_counts(self.counts))
            stack.enter_context(_forward_of(self.pass_))
            try:
                return next(self.steps)
            except StopIteration as e:
                self.out, self.done = e.value, True
                return False

    def advance(self) -> None:
        """Runs the forward up to its next call that leaves a reduction in flight."""
        while not self.done and not self._next():
            pass

    def result(self) -> Tensor:
        """Runs the rest of the forward (after the backward) and returns its output."""
        while not self.done:
            self._next()
        grads.add_chunk_counts(self.counts)
        return self.out


def _call_with_hooks(model: "Sequential", x):
    """model(x) through model._steps(x) (a generator returning the output), with the container's
    forward pre-hooks and forward hooks run around it as Module.__call__ would: the hooks are
    user code that may exist on some ranks only, so they must not decide whether the forward is
    looked ahead (every rank must issue the same collectives in the same order). A generator."""
    pre = {**M._global_forward_pre_hooks, **model._forward_pre_hooks}
    for hid, hook in pre.items():
        if hid in model._forward_pre_hooks_with_kwargs:
            res = hook(model, (x,), {})
            args = res[0] if res is not None else (x,)
        else:
            res = hook(model, (x,))
            args = (res if isinstance(res, tuple) else (res,)) if res is not None else (x,)
        x = args[0]
    out = yield from model._steps(x)
    post = {**M._global_forward_hooks, **model._forward_hooks}
    for hid, hook in post.items():
        res = (hook(model, (x,), {}, out) if hid in model._forward_hooks_with_kwargs
               else hook(model, (x,), out))
        if res is not None:
            out = res
    return out


def forward_backward(model: nn.Module, inputs, loss_fn, micro_batches: int = 2) -> Tensor:
    """Forward and backward of a batch in `micro_batches` pieces along dim 0, with the gradients
    of `sum over pieces of loss_fn(model(piece of inputs[0]), pieces of inputs[1:]...)`
    accumulated into .grad (the data-parallel reduction, with overlap on, runs once, in the
    last piece's backward). Returns that sum of losses, detached.

    For an axonn_c.Sequential that pipelines (see its docstring), piece i+1's forward runs
    inside piece i's backward, one child call at a time: the forward's reductions, which the
    forward alone cannot hide (a forward has half the GEMMs of a backward), run under the
    backward's GEMMs. Other models run the pieces one after the other.

    `inputs`: a tensor or a tuple of tensors with the same dim 0 (e.g. (tokens, targets)).

    More pieces than rows (an epoch's short last batch; data-parallel ranks with uneven
    batches) leave some pieces empty. Every piece still runs its forward and backward, because
    the other ranks' pieces take part in the same collectives, but an empty piece has no loss:
    it adds nothing to the sum returned (a mean-reduced loss of nothing is NaN), nor to .grad.
    A batch of no rows returns a loss of 0."""
    # (bounded: 2**31 pieces never returned; not by the rows, see above)
    micro_batches = validate.check_int("forward_backward: micro_batches", micro_batches, 1, 2**16)
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    if not inputs or not all(isinstance(t, Tensor) and t.dim() >= 1 for t in inputs):
        raise TypeError("forward_backward: inputs must be a tensor or a non-empty tuple of "
                        "tensors with a batch dimension (dim 0)")
    rows = inputs[0].shape[0]
    for t in inputs[1:]:
        if t.shape[0] != rows:
            raise ValueError(f"forward_backward: every input needs the same dim 0 ({rows}), "
                             f"got {tuple(t.shape)}")
    pieces = list(zip(*(torch.tensor_split(t, micro_batches, dim=0) for t in inputs)))
    # (decided by the model and the grid only, the same on every rank: not by hooks; and not
    # from inside a forward that forward_backward runs)
    interleave = (micro_batches > 1 and isinstance(model, Sequential)
                  and session.thread.pass_ is None and torch.is_grad_enabled()
                  and model._pipelines(pieces[0][0])
                  and getattr(model, "_compiled_call_impl", None) is None)
    if interleave:
        _refuse_backward_hooks(model)
        casts = caller_autocasts()

    def loss_of(out, piece):
        loss = loss_fn(out, *piece[1:])
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError("forward_backward: loss_fn must return a one-element tensor")
        return loss

    total = None
    # (the model's forwards carry their micro-batch, loss_fn's nodes none: only the model's own
    # _AwaitGrad nodes advance a look-ahead; without one, a forward_backward called from inside
    # another's forward does not tag its nodes with the outer micro-batch)
    passes = [_Pass() for _ in range(micro_batches)] if interleave else [None] * micro_batches
    with _forward_of(passes[0]):
        out = model(pieces[0][0])
    loss = loss_of(out, pieces[0])
    for i in range(micro_batches):
        ahead = (_Lookahead(_call_with_hooks(model, pieces[i + 1][0]), casts, passes[i + 1])
                 if interleave and i + 1 < micro_batches else None)
        last = i + 1 == micro_batches
        try:
            if ahead is not None:
                passes[i].ahead = ahead
            if last:
                loss.backward()
            else:
                with no_grad_sync():
                    loss.backward()
        except BaseException:
            if ahead is not None:
                ahead.steps.close()  # (awaits its reductions in flight)
            raise
        finally:
            if ahead is not None:
                passes[i].ahead = None
        if pieces[i][0].shape[0]:  # (an empty piece has no loss: see the docstring)
            total = loss.detach() if total is None else total + loss.detach()
        if not last:
            if ahead is not None:
                out = ahead.result()
            else:
                with _forward_of(passes[i + 1]):
                    out = model(pieces[i + 1][0])
            loss = loss_of(out, pieces[i + 1])
    return torch.zeros_like(loss.detach()) if total is None else total


def _refuse_backward_hooks(m: nn.Module) -> None:
    """Full backward hooks on the container itself (local or global) are not run around a
    looked-ahead forward: refused rather than skipped (hooks on the container's children are
    fine, they run as usual)."""
    if (m._backward_hooks or m._backward_pre_hooks or M._global_backward_hooks
            or M._global_backward_pre_hooks):
        raise RuntimeError("forward_backward: the axonn_c.Sequential has (or all modules have) a "
                           "full backward hook, which a forward run inside the previous "
                           "micro-batch's backward cannot call; register it on its children")
