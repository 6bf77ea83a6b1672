"""axonn_c.Linear: nn.Linear sharded over the 3D tensor-parallel grid
(docs/ARCHITECTURE.md#the-sharded-linear-layer).

Forward and backward run in C (csrc/layers/linear.c). They are torch.library custom ops with
fake kernels and a registered autograd formula, so torch.compile treats them as opaque nodes.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import _C, comm, grads, replicate, validate
from . import compression as compression_policy
from .autograd_comm import first_order_only
from .comm import _stream
from .state import OVERLAP_KNOBS, grid, microbatch_active, refuse_cuda, session

_EASY, _EXPERT = 0, 1


def _dev(t: Tensor) -> int:
    return t.device.index if t.is_cuda else -1


class _Caches:
    """Per-process memos of the layer calls (one instance, `_cache`)."""

    def __init__(self):
        # (cfg, dtype, epoch) -> the C handle the custom ops' ints stand for (torch.compile)
        self.op_calls: dict = {}
        self.layer_id_lock = threading.Lock()  # one scheduler id per layer, across threads


_cache = _Caches()

# hold bits (axonn_c.Sequential's chunk pipelining, axonn_c/chunking.py): a direct child leaves
# its forward all-reduce of y (HOLD_FWD) and its dX all-reduce (HOLD_BWD) in flight for the next
# consumer to await; every Linear call while a container pipelines on this thread is one of
# several chunk calls (HOLD_CHUNK: no deferred gradient, which expects one call per layer and
# pass)
HOLD_FWD, HOLD_BWD, HOLD_CHUNK = 1, 2, 4


def hold_flags(layer) -> int:
    """Which reductions this call of `layer` leaves held, and HOLD_CHUNK for any call made while
    an axonn_c.Sequential pipelines on this thread (0 outside)."""
    t = session.thread.hold_target
    if t is not None and t[0] is layer:
        return t[1]
    return HOLD_CHUNK if session.thread.hold_depth else 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)[6:]  # torch.float32 -> "float32"


def _op_call(cfg: List[int], dtype: torch.dtype, device: int):
    """The C handle a custom op's ints (Linear._handle's cfg) stand for, per init() and device
    of the weights (-1: host; whether a residual is kept depends on the device's transport)."""
    key = (*cfg, dtype, device, session.epoch)
    call = _cache.op_calls.get(key)
    if call is None:
        if len(_cache.op_calls) > 4096:
            _cache.op_calls.clear()
        call = _cache.op_calls[key] = _C.LinearCall(cfg, _dtype_name(dtype), device)
    return call


def _placement() -> tuple:
    """What decides which shard of a weight this rank holds (G_data does not)."""
    if session.placement is None:
        grid()  # raises: no init()
    return session.placement


def _forget(layer_id: int, ep: int) -> None:
    if ep == session.epoch and _C is not None:
        # (and the last shard C kept for the prefetch, and its depth dW residual: a reused id
        # starts at zeros)
        _C.sched_forget(layer_id)


def _keeps_residual_traced(cfg: tuple, dtype: torch.dtype, device: int, setting: tuple) -> bool:
    """Whether C keeps a depth dW error-feedback residual for the layer's calls, asked while
    torch.compile traces (a constant of the graph, no graph break: run eagerly, not traced);
    `setting` (init epoch, knobs version), read by the traced code, makes a policy change
    recompile."""
    return _C.LinearCall(cfg, _dtype_name(dtype), device, None).keeps_dw_residual


# torch._dynamo.assume_constant_result's mark, set without importing torch._dynamo (seconds
# at `import axonn_c` for users who never compile)
_keeps_residual_traced._dynamo_marked_constant = True


def _forward_impl(x: Tensor, w: Tensor, b: Optional[Tensor], call, hold: int = 0):
    """x: [rows, features] -> (y, saved) through the layer's C handle `call`; saved is what
    backward needs besides x (easy layout; None in the expert layout). The handle checks the
    shard against the grid and allocates the outputs."""
    y, saved = call.forward(x, w, b, *_dev_stream_or_c(x), bool(hold & HOLD_FWD))
    if hold & HOLD_FWD:  # y may still be written by its all-reduce (axonn_c.Sequential)
        grads.keep_output(_C.sched_counters()[1], y)
    return y, saved


def _backward_impl(dy: Tensor, x: Tensor, saved: Optional[Tensor], w: Tensor, call,
                   hold: int = 0, param=None, need_dx: bool = True,
                   trains: Callable[[], bool] = lambda: True):
    """-> (dx, dw, db); db is None when the layer has no bias. With `param` (the weight
    parameter itself, eager mode, when _deferred_param says so) dW is deferred: the handle's
    backward takes where it goes, queues its reductions and records it, and it is completed into
    param.grad at the end of backward (csrc/python/py_grad_deferred.c); dw is None, as it is
    when a run_concurrent micro-batch hands it to the reduce-scatter they share (the handle
    decides; added to .grad when run_concurrent ends).
    need_dx=False (the input needs no gradient, e.g. a first layer on raw data): no dX GEMM and
    no dX collectives, dx is None."""
    # (chunk calls of axonn_c.Sequential accumulate dW in the GEMM into the pass's chunk record;
    # a held dx is kept by C until its all-reduce is awaited; `trains`, asked by C only when it
    # matters: whether the dW reaches a .grad, which decides the depth error-feedback residual
    # and a run_concurrent micro-batch's shared reduce-scatter)
    return call.backward(dy, x, saved, w, need_dx, *_dev_stream_or_c(dy), param,
                         bool(hold & HOLD_CHUNK), trains, need_dx and bool(hold & HOLD_BWD))


def _deferred_param(param, call, hold: int):
    """`param` when this backward hands its dW to the deferred completion (the handle's backward,
    csrc/python/py_grad_deferred.c), else None. C decides from the layer, its knobs and the grid (call.defers, as
    csrc/layers/linear.c's backward); Python adds what only autograd knows: the weight is the
    leaf parameter itself (not a per-call cast) and the pass accumulates into .grad (not
    torch.autograd.grad)."""
    if param is None or call.layer < 0 or not param.requires_grad:
        return None
    mb = microbatch_active()
    if mb and not hold:  # autograd accumulates each micro-batch's dW (microbatches.py)
        grads.check_unsynced(param)
    return param if call.defers(bool(hold), mb) and grads.accumulates(param) else None


def _placement_error(in_f: int, out_f: int, placed_on: tuple, now: Optional[tuple]) -> str:
    names = ("G_intra_r", "G_intra_c", "G_intra_d", "row_rank", "col_rank", "depth_rank")

    def said(place):
        return ", ".join(f"{n}={v}" for n, v in zip(names, place))

    where = (f"this rank of the current init() is {said(now)}" if now is not None else
             "there is no grid now (call axonn_c.init() first)")
    return (f"axonn_c.Linear({in_f}, {out_f}) holds the shards of {said(placed_on)}; {where}. "
            "Build the layer after init(), or move its weights with axonn_c.full_state_dict() "
            "and load_state_dict()")


def _check_place(cfg, place) -> None:
    if tuple(place) != session.placement:
        raise RuntimeError(_placement_error(cfg[0], cfg[1], tuple(place), session.placement))


# ---- torch.library custom ops: what torch.compile sees (opaque nodes, no graph break)
# `place`: the layer's placement (Linear._placed_on). The ops' output shapes depend on the grid,
# so it must be an argument: torch.compile's caches key on the arguments only (without it, a
# layer compiled after an init() on another grid reused the old grid's compiled shapes); and
# a graph run after such an init() without recompiling is refused here.

@torch.library.custom_op("axonn_c::linear_fwd", mutates_args=())
def _linear_fwd(x: Tensor, w: Tensor, b: Optional[Tensor], cfg: List[int],
                place: List[int]) -> Tuple[Tensor, Tensor]:
    _check_place(cfg, place)
    y, saved = _forward_impl(x, w, b, _op_call(cfg, x.dtype, _dev(w)))
    return y, (saved if saved is not None else x.new_empty((0,)))


@_linear_fwd.register_fake
def _(x, w, b, cfg, place):
    s = _op_call(cfg, x.dtype, _dev(w)).shapes_for(x.shape[0])
    if cfg[4] == _EASY:
        return x.new_empty((x.shape[0], cfg[1])), x.new_empty((s["saved_rows"], s["saved_cols"]))
    return x.new_empty((x.shape[0], s["n_local"])), x.new_empty((0,))


@torch.library.custom_op("axonn_c::refused_layer", mutates_args=())
def _refused_layer(x: Tensor, w: Tensor, message: str, n_out: int, unsupported: bool) -> Tensor:
    """Stands for a compiled layer call that cannot run (its output: [..., n_out]): its shards
    are not this rank's on the current grid (RuntimeError), or it asks for what a compiled
    graph does not do (`unsupported`: NotImplementedError). Raises when the graph runs. (An
    exception raised while torch.compile traces never reaches the user: dynamo runs the frame
    eagerly instead, which for a setting only compiled graphs lack runs it silently, and makes
    every later compiled layer run eagerly; and the layer's own ops cannot be traced for a stale
    layer, their shapes follow the current grid.)"""
    raise (NotImplementedError if unsupported else RuntimeError)(message)


@_refused_layer.register_fake
def _(x, w, message, n_out, unsupported):
    return x.new_empty((*x.shape[:-1], n_out))


_refused_layer.register_autograd(lambda ctx, g: (None, None, None, None, None))


@torch.library.custom_op("axonn_c::linear_bwd", mutates_args=())
def _linear_bwd(dy: Tensor, x: Tensor, saved: Tensor, w: Tensor, cfg: List[int],
                need_dx: bool, place: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    _check_place(cfg, place)
    dx, dw, db = _backward_impl(dy, x, saved, w, _op_call(cfg, dy.dtype, _dev(w)),
                                need_dx=need_dx)
    return ((dx if dx is not None else dy.new_empty((0,))), dw,
            (db if db is not None else dy.new_empty((0,))))


@_linear_bwd.register_fake
def _(dy, x, saved, w, cfg, need_dx, place):
    s = _op_call(cfg, dy.dtype, _dev(w)).shapes
    return (torch.empty_like(x) if need_dx else dy.new_empty((0,)), torch.empty_like(w),
            dy.new_empty((s["n_local"],) if cfg[3] else (0,)))


def _setup_context(ctx, inputs, output):
    x, w, b, cfg, place = inputs
    ctx.save_for_backward(x, output[1], w)
    ctx.cfg, ctx.place = cfg, place
    ctx.has_bias = b is not None


def _backward(ctx, dy, _dsaved):
    x, saved, w = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]  # as the eager path: no dX work for an input without grad
    dx, dw, db = _linear_bwd(dy, x, saved, w, ctx.cfg, need_dx, ctx.place)
    return (dx if need_dx else None), dw, (db if ctx.has_bias else None), None, None


torch.library.register_autograd("axonn_c::linear_fwd", _backward, setup_context=_setup_context)


_MAIN_GRAPH_REFUSAL = (
    "an axonn_c.Linear output computed outside run_concurrent cannot be back-propagated on one "
    "of its micro-batch threads when the layer's depth all-gather and reduce-scatter are "
    "scheduled (init(overlap=True) with G_intra_d > 1): the scheduler's collectives of that "
    "forward belong to the main thread and would run out of step across ranks. Compute it "
    "inside fn, back-propagate it on the main thread, or set the layer's overlap_all_gather, "
    "overlap_reduce_scatter, overlap_data and defer_wgrad to False")


def _general_backward(ctx, dy, x, saved, w, call, hold: int, param, fwd_on_mb: bool):
    """-> (dx, dw, db): the general path's backward, its per-call decisions made here (the eager
    Functions' shared part; param: the leaf weight the forward got, or None for a per-call
    cast; fwd_on_mb: whether the forward ran on a micro-batch thread)."""
    if (not fwd_on_mb and microbatch_active() and call.scheduled
            and call.shapes["depth_size"] > 1):
        # (the same decision on every rank, before any collective)
        raise RuntimeError(_MAIN_GRAPH_REFUSAL)
    # an input that needs no gradient (the same on every rank: SPMD) skips dX entirely
    return _backward_impl(dy, x, saved, w, call, hold, _deferred_param(param, call, hold),
                          ctx.needs_input_grad[0],
                          # whether a .grad receives this dW (asked only when a residual is
                          # kept or a micro-batch would share its reduce-scatter; a per-call
                          # cast: the training step's)
                          lambda: ctx.needs_input_grad[1] and (
                              param is None or grads.accumulates(param)))


class _EagerLinear(torch.autograd.Function):
    """The same computation without the custom-op dispatcher's Python layers: eager mode's hot
    path (tens of microseconds less per call). torch.compile uses the custom ops above."""

    @staticmethod
    def forward(ctx, x, w, b, call, hold):
        y, saved = _forward_impl(x, w, b, call, hold)
        ctx.save_for_backward(x, saved, w)
        # (the scheduler id as of this forward: a __dict__ copy of the layer shares the handle)
        ctx.call, ctx.layer, ctx.hold, ctx.has_bias = call, call.layer, hold, b is not None
        # the weight as passed (the Parameter, or a per-call cast): a deferred gradient goes to
        # its .grad. Not the saved tensor: under torch.utils.checkpoint(use_reentrant=False) that
        # is a recomputed alias, whose .grad nobody reads
        ctx.param = w if w.is_leaf else None
        ctx.fwd_on_mb = microbatch_active()
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x, saved, w = ctx.saved_tensors
        call, hold, param = ctx.call, ctx.hold, ctx.param
        call.layer = ctx.layer
        dx, dw, db = _general_backward(ctx, dy, x, saved, w, call, hold, param, ctx.fwd_on_mb)
        return dx, dw, (db if ctx.has_bias else None), None, None


# whether the layer's C handle reads the device and torch's current CUDA stream itself (torch's
# C shim; a torch built without CUDA has no CUDA tensors to ask a stream for)
_TORCH_STREAMS = _C.LinearCall.torch_streams()
_C_PICKS_STREAM = _TORCH_STREAMS or not torch.backends.cuda.is_built()  # (no device query)


def _dev_stream(t: Tensor) -> tuple:
    """(device index or -1, stream): None asks the C handle for torch's current stream."""
    d = t.get_device()
    if d < 0:
        return -1, 0
    return d, (None if _TORCH_STREAMS else _stream(t))


def _dev_stream_or_c(t: Tensor) -> tuple:
    """The handle's (device, stream) arguments: (None, None) where it reads them itself."""
    return (None, None) if _C_PICKS_STREAM else _dev_stream(t)


_CAPTURE_REFUSAL = (
    "axonn_c.Linear cannot be captured in a CUDA graph with the cross-layer scheduler on (its "
    "prefetch order, gradient buckets and deferred dW GEMMs are decided at run time): set "
    "overlap_all_gather, overlap_reduce_scatter, overlap_data and defer_wgrad to False "
    "(init(overlap=False) or optimize_communication) for the captured region")


class _PlainLinear(torch.autograd.Function):
    """An eager call with nothing cross-layer to do (a self-contained handle, outside chunk
    pipelining and micro-batches, Linear._forward): forward and backward
    are one C call each through the layer's handle, which allocates the outputs and (where it
    can: _C_PICKS_STREAM) reads the device and torch's current stream itself."""

    @staticmethod
    def forward(ctx, x, w, b, call):
        y, saved = (call.forward(x, w, b) if _C_PICKS_STREAM
                    else call.forward(x, w, b, *_dev_stream(x)))
        ctx.save_for_backward(x, saved, w)
        ctx.call = call
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x, saved, w = ctx.saved_tensors
        if _C_PICKS_STREAM:
            dx, dw, db = ctx.call.backward(dy, x, saved, w, ctx.needs_input_grad[0])
        else:
            dx, dw, db = ctx.call.backward(dy, x, saved, w, ctx.needs_input_grad[0],
                                           *_dev_stream(dy))
        return dx, dw, db, None  # (db None: the handle was made without a bias)


class _DeferringLinear(torch.autograd.Function):
    """An eager call whose only cross-layer work is its gradients' (the data-parallel sums, a
    deferred dW GEMM: a non-self-contained handle outside chunk pipelining and micro-batches,
    whose weight is the layer's Parameter and keeps no depth residual, Linear._forward): the
    general path's calls with its per-call decisions made once (_EagerLinear's, less the
    Python that only chunks, micro-batches, casts and compiled graphs need)."""

    @staticmethod
    def forward(ctx, x, w, b, call):
        y, saved = call.forward(x, w, b, *_dev_stream_or_c(x), False)
        ctx.save_for_backward(x, saved, w)
        # (the scheduler id as of this forward: a __dict__ copy of the layer shares the handle)
        ctx.call, ctx.layer, ctx.param = call, call.layer, w
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x, saved, w = ctx.saved_tensors
        call, param = ctx.call, ctx.param
        call.layer = ctx.layer
        # (as _deferred_param: C decided the deferral when the memo was made; autograd decides
        # whether this pass accumulates into .grad)
        if session.thread.microbatch is not None:
            # (an output of a main-thread call back-propagated on a run_concurrent thread: the
            # general path's per-call decisions, as _EagerLinear.backward)
            # (the forward ran on the main thread: forward's shortcut is not taken on others)
            return (*_general_backward(ctx, dy, x, saved, w, call, 0, param, False), None)
        p = param if param.requires_grad and grads.accumulates(param) else None
        dx, dw, db = call.backward(dy, x, saved, w, ctx.needs_input_grad[0],
                                   *_dev_stream_or_c(dy), p, False, False, False)
        return dx, dw, db, None


_deferring_apply = super(torch.autograd.Function, _DeferringLinear).apply


# whether autocast is on for any device type (one C call; the general path looks at the input's
# device type)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))

# torch's C apply without Function.apply's Python wrapper (functorch unwrapping, default
# arguments): a few microseconds per call that _PlainLinear does not need
_plain_apply = super(torch.autograd.Function, _PlainLinear).apply


def _knob(name: str) -> property:
    """A per-layer overlap knob (None: inherited); setting it drops the layer's plain-call memo,
    which was decided with the old value."""
    attr = "_knob_" + name

    def get(self):
        return self.__dict__.get(attr)

    def set(self, value):
        self.__dict__[attr] = value
        self.__dict__["_plain_memo"] = None

    return property(get, set)


def flat_block_boxes(lo: int, hi: int, k: int, row0: int, col0: int) -> list:
    """Elements [lo, hi) of a row-major block of rows of `k` elements, whose element 0 is at
    (row0, col0) of a full matrix, as boxes of that matrix: (offsets, sizes, start, stop) per
    box, where elements [start, stop) counted from lo, viewed as `sizes`, are the box at
    `offsets`: one box of whole rows, or up to three (partial first row, whole rows, partial
    last row); none when lo >= hi."""
    return flat_range_boxes(lo, hi, (k,), (row0, col0))


def flat_range_boxes(lo: int, hi: int, inner: tuple, origin: tuple) -> list:
    """Elements [lo, hi) of a row-major block shaped (rows, *inner) whose element 0 is at
    `origin` of a full tensor, as boxes of that tensor: (offsets, sizes, start, stop) per box
    (elements [start, stop) counted from lo, viewed as `sizes`, are the box at `offsets`). Each
    dimension adds at most two partial boxes (a partial leading slice, whole slices, a partial
    trailing slice); none when lo >= hi."""
    boxes = []
    step = math.prod(inner)
    pos = lo
    while pos < hi and step > 0:
        r, c = divmod(pos, step)
        if c or hi - pos < step:  # inside one slice: to the slice's end or the range's
            n = min(step - c, hi - pos)
            for off, size, i, j in flat_range_boxes(c, c + n, inner[1:], origin[1:]):
                boxes.append(((origin[0] + r, *off), (1, *size), pos - lo + i, pos - lo + j))
        else:  # whole slices
            n = (hi - pos) // step * step
            boxes.append(((origin[0] + r, *origin[1:]), (n // step, *inner), pos - lo,
                          pos - lo + n))
        pos += n
    return boxes


class Linear(nn.Module):
    """Drop-in for nn.Linear, sharded over the grid of axonn_c.init().

    Default (easy) layout: every rank passes its own tokens `[..., in_features]` and gets
    `[..., out_features]`. `expert_mode=True` (the paper's layout): input `[..., in/G_in]`, output
    `[..., out/G_out]`, where G_in is the column group (row group if `transpose=True`) and G_out
    the other one; a `transpose=True` layer consumes what a normal layer produces.

    The full weight is initialised exactly like nn.Linear's (kaiming_uniform(a=sqrt(5)) and the
    matching bias), or by `init_method(full_weight)`, then sliced: a serial nn.Linear built after
    the same torch.manual_seed holds the same full weight. Shapes must divide the grid; there is
    no padding of features (the depth shard of the flattened block is padded internally).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 transpose: bool = False, skip_bias_add: bool = False, init_method=None,
                 expert_mode: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features = validate.check_int("Linear: in_features", in_features, 1, 2**31 - 1)
        self.out_features = validate.check_int("Linear: out_features", out_features, 1, 2**31 - 1)
        self.transpose, self.skip_bias_add = bool(transpose), bool(skip_bias_add)
        self.expert_mode = bool(expert_mode)
        dtype = dtype or torch.get_default_dtype()
        self._cfg = [self.in_features, self.out_features, int(self.transpose), int(bias),
                     _EXPERT if self.expert_mode else _EASY]
        # raises before init()
        s = self._shard_shapes = _C.LinearCall(self._cfg, _dtype_name(dtype)).shapes
        self._placed_on, self._epoch = _placement(), session.epoch
        if s["gin_size"] * s["gout_size"] == 1:
            # no feature sharding: both layouts hold full features and this rank's tokens, so
            # the easy layout needs no redistribution (and no copies)
            self._cfg[4] = _EXPERT
        full_w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        if init_method is not None:
            init_method(full_w)
        else:
            nn.init.kaiming_uniform_(full_w, a=math.sqrt(5))
        full_b = None
        if bias:
            full_b = torch.empty(self.out_features, dtype=torch.float32)
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(full_b, -bound, bound)
        replicate.same_full_init(full_w, full_b)  # one draw on every rank (issue 28 item 5)
        self.weight = nn.Parameter(torch.empty(s["shard"], device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(s["n_local"], device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._tag_parameters()
        Linear.load_full(self, full_w, full_b)  # ([out, in]; a subclass's takes its own shape)

    def _tag_parameters(self) -> None:
        """What sync_gradients, clip_grad_norm_ and the gradient hooks read off the parameters.
        Also run on a copy: copy.deepcopy of a Parameter keeps only its data, and neither a
        deepcopy nor torch.load restores hooks."""
        self._plain_memo = self._calls = None  # (new parameters, maybe another device: again)
        w, b = self.weight, self.bias
        w._axonn_grad_groups = ("data",)
        w._axonn_deferred = True  # its gradient is deferred by the handle's backward
        # what reaches autograd for it (a cast weight's gradient, another use of the weight: a
        # tied or regularised weight) is summed during backward, and added to a deferred
        # gradient of the same pass instead of being overwritten by it
        grads.hook(w, w._axonn_grad_groups)  # (a frozen one too: grads.hook)
        w._axonn_norm_groups = ("intra",)  # values differ over these (clip_grad_norm_)
        self._tag_layout()
        if b is not None:
            b._axonn_grad_groups = ("depth", "data")
            b._axonn_norm_groups = (self._shard_shapes["gout"],)
            grads.hook(b, b._axonn_grad_groups)  # summed during backward

    def _tag_layout(self) -> None:
        """What a tie must match to share this weight's shard (auto_parallelize's registration
        hook): the layer kind, its serial weight shape and its layout."""
        try:
            shape = tuple(self.serial_weight_shape)
        except AttributeError:  # a subclass still being built tags itself when it is done
            return
        self.weight._axonn_layout = (type(self).__name__, shape, self.expert_mode,
                                     self.transpose)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        # .to(), .half(), .cuda(): the memo holds dtype and device; and the conversion may have
        # made new Parameter objects (torch.__future__'s overwrite_module_params_on_conversion)
        self._tag_parameters()
        return out

    def __getstate__(self):
        state = super().__getstate__()
        if "_plain_memo" in state or "_calls" in state:  # (C handles: not picklable; the copy
            state = dict(state)                             # makes its own)
            state.pop("_plain_memo", None)
            state.pop("_calls", None)
        return state

    def __setstate__(self, state):
        # copy.deepcopy and torch.load(model) come here (the parameters are new objects)
        super().__setstate__(state)
        self._tag_parameters()
        self._epoch = None  # (maybe another process) the next forward checks the grid
        self.__dict__.pop("_sched_key", None)

    def _check_placement(self) -> None:
        """After a new init() (or in a copy): the shards must be this rank's on this grid."""
        _placement()  # raises: no init()
        _check_place(self._cfg, self._placed_on)
        self._shard_shapes = _C.LinearCall(self._cfg, _dtype_name(self.weight.dtype)).shapes
        self._epoch = session.epoch
        self._tag_parameters()  # (a larger world than the layer was built in needs the hooks)

    @property
    def _shapes(self) -> dict:
        """The shard's shapes and this rank's place (_C.LinearCall.shapes), checked against the
        current grid once per init() in eager mode (compiled code: forward)."""
        if self._epoch != session.epoch and not torch.compiler.is_compiling():
            self._check_placement()
        return self._shard_shapes

    @property
    def local_in_features(self) -> int:
        """Input features of this rank's weight block (AxoNN's name)."""
        return self._shapes["k_local"]

    @property
    def local_out_features(self) -> int:
        """Output features of this rank's weight block (AxoNN's name)."""
        return self._shapes["n_local"]

    # ---------------------------------------------------------------- shards <-> full tensors

    def _block_slices(self):
        s = self._shapes
        rows = slice(s["gout_rank"] * s["n_local"], (s["gout_rank"] + 1) * s["n_local"])
        cols = slice(s["gin_rank"] * s["k_local"], (s["gin_rank"] + 1) * s["k_local"])
        return rows, cols

    def weight_boxes(self) -> List[Tuple[Tuple[int, int], Tuple[int, int], int, int]]:
        """Where this rank's depth shard lies in the full [out, in] weight, without the padding:
        a list of (offsets, sizes, start, stop), one per box, where `shard[start:stop]` viewed
        as `sizes` is the full weight's box at `offsets`. One box when the shard covers whole
        rows of the block; else up to three (partial first row, whole rows, partial last row);
        none when the shard is all padding. (axonn_c/checkpoint.py saves and loads through
        these.)"""
        s = self._shapes
        lo = grid().depth_rank * s["shard"]
        return flat_block_boxes(lo, min(lo + s["shard"], s["block"]), s["k_local"],
                                s["gout_rank"] * s["n_local"], s["gin_rank"] * s["k_local"])

    @property
    def serial_weight_shape(self) -> Tuple[int, ...]:
        """The shape of the serial layer's weight ([out, in]; a subclass's own)."""
        return (self.out_features, self.in_features)

    def weight_pieces(self, flat: Tensor) -> list:
        """(offsets, sizes, view) per box of the serial weight that `flat` (this rank's shard,
        or optimizer state shaped like it) covers, the view a piece of `flat`
        (axonn_c/checkpoint.py)."""
        return [(off, size, flat[a:b].view(size)) for off, size, a, b in self.weight_boxes()]

    def bias_box(self) -> Tuple[int, int]:
        """(offset, size) of this rank's bias block in the full [out] bias."""
        s = self._shapes
        return s["gout_rank"] * s["n_local"], s["n_local"]

    @torch.no_grad()
    def load_full(self, weight: Tensor, bias: Optional[Tensor] = None) -> None:
        """Loads this rank's shard from the full serial weight [out, in] (and bias [out])."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"full weight must be [{self.out_features}, {self.in_features}], "
                             f"got {list(weight.shape)}")
        s = self._shapes
        rows, cols = self._block_slices()
        flat = weight[rows, cols].reshape(-1)
        padded = flat.new_zeros(s["shard"] * s["depth_size"])
        padded[: s["block"]] = flat
        d = grid().depth_rank
        self.weight.copy_(padded[d * s["shard"]:(d + 1) * s["shard"]])
        if self.bias is not None:
            if bias is None or tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"full bias must be [{self.out_features}], got "
                                 f"{None if bias is None else list(bias.shape)}")
            self.bias.copy_(bias[rows])

    @torch.no_grad()
    def full_weight(self) -> Tensor:
        """The full [out, in] weight on every rank (collective over the intra group)."""
        s = self._shapes
        shards = self.weight.new_empty(s["shard"] * s["depth_size"])
        comm.all_gather(shards, self.weight.detach().contiguous(), group="depth")
        block = shards[: s["block"]].view(s["n_local"], s["k_local"])
        full = self.weight.new_zeros(self.out_features, self.in_features)
        rows, cols = self._block_slices()
        full[rows, cols] = block
        # every block is owned by exactly one (gin, gout) pair: summing places them all
        comm.all_reduce(full, group="col")
        comm.all_reduce(full, group="row")
        return full

    @torch.no_grad()
    def full_bias(self) -> Optional[Tensor]:
        if self.bias is None:
            return None
        s = self._shapes
        out = self.bias.new_empty(s["gout_size"] * s["n_local"])
        comm.all_gather(out, self.bias.detach().contiguous(), group=s["gout"])
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dim() >= 2:  # a full serial state dict (the shard is 1-D)
            b = state_dict.get(prefix + "bias")
            full_b = b  # (load_full ignores it when the layer has no bias)
            if self.bias is not None and b is None:  # (the dict lacks it: this one stays)
                full_b = self.bias.new_zeros(self.out_features)
                full_b[self._block_slices()[0]] = self.bias
            self.load_full(w, full_b)
            # torch loads the shards now in place (copies of themselves); a bias the layer lacks
            # stays in (unexpected, as for nn.Linear) and one the dict lacks stays missing
            state_dict = {**state_dict, prefix + "weight": self.weight}
            if b is not None and self.bias is not None:
                state_dict[prefix + "bias"] = self.bias
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._tag_parameters()  # (load_state_dict(assign=True) puts in new Parameter objects)

    # ---------------------------------------------------------------- forward

    def forward(self, x: Tensor):
        # the common eager call, checked in one go (the general path below does the same checks
        # one by one, with the messages): the layer's C handle, knobs unchanged since it was
        # made, a flat input of its dtype and device, nothing pending, no autocast, no chunk
        # pipelining or micro-batch thread. (Ordered cheapest first; the parameters read from
        # _parameters, not through nn.Module's __getattr__, which costs more than the rest.)
        m = self._plain_memo
        # (an exact torch.Tensor: anything else, a subclass with its own data_ptr() included,
        # is checked by the general path; the same parameter objects and skip_bias_add the memo
        # was made with)
        if (m is not None and type(x) is Tensor and m[0] == (session.epoch, session.knobs_version)
                and not torch.compiler.is_compiling()):
            ps, dt, t = self._parameters, x.dtype, session.thread
            w, b = ps.get("weight"), ps.get("bias")  # (a parametrization removes "weight")
            if (w is m[5] and b is m[6] and self.skip_bias_add is m[7] and dt is m[1]
                    and dt is w.dtype and x.dim() == 2 and x.shape[1] == m[2]
                    and x.is_contiguous() and w.get_device() == m[9]
                    and (x.is_cpu and w.is_cpu or x.is_cuda and w.is_cuda
                         and x.get_device() == m[9])
                    and not _any_autocast() and t.hold_target is None and not t.hold_depth
                    and t.microbatch is None and grads.idle()):
                apply = _plain_apply
                if m[8] is not None:  # (the handle may be shared by a __dict__ copy of the layer)
                    if m[8][0] != id(self):
                        return self._forward(x)
                    # (the weight's gradient hook follows this layer's knob, as in _forward: a
                    # weight shared with a layer of another knob gets the caller's)
                    m[3].layer, w._axonn_overlap_data, apply = m[8][1], m[8][2], _deferring_apply
                if self.skip_bias_add:
                    return (apply(x, w, None, m[3]),
                            self._full_bias_for_output(b) if b is not None else None)
                return apply(x, w, b, m[3])
        return self._forward(x)

    def _forward(self, x: Tensor):
        if torch.compiler.is_compiling() and self._placed_on != session.placement:
            # both are plain values torch.compile guards on: an init() that changes this rank's
            # placement recompiles, and the new graph raises when it runs
            msg = _placement_error(self.in_features, self.out_features, self._placed_on,
                                   session.placement)
            y = _refused_layer(x, self.weight, msg, self._n_out(), False)
            return (y, self.bias) if self.skip_bias_add else y
        validate.check_tensor("Linear: input", x, 1)
        s = self._shapes
        want = s["k_local"] if self.expert_mode else self.in_features
        if x.shape[-1] != want:
            layout = (f"expert layout: in_features/{s['gin']} group = {self.in_features}/"
                      f"{s['gin_size']}") if self.expert_mode else "in_features"
            raise ValueError(f"axonn_c.Linear expects the last input dimension to be {want} "
                             f"({layout}), got input of shape {list(x.shape)}")
        w, b = self.weight, self.bias
        in_dtype = x.dtype
        if x.device != w.device:
            raise ValueError(f"input is on {x.device} but the layer's weights are on {w.device}")
        if torch.is_autocast_enabled(x.device.type):
            dt = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dt), w.to(dt)
            b = b.to(dt) if b is not None else None
        elif x.dtype != w.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match the layer's {w.dtype} "
                            "(cast the input, or use torch.autocast)")
        if not torch.compiler.is_compiling():
            grads.drop_if_abandoned()  # a backward pass that raised left its gradients behind
        flat = x.dim() == 2 and x.is_contiguous()  # the common case needs no reshaping
        x2 = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
        use_bias = b is not None and not self.skip_bias_add
        ov_ar, ov_rs, chunks, ov_ag, ov_data, defer_dw = self._overlap_knobs()
        if microbatch_active():  # micro-batch threads leave the scheduler's shared state alone
            if x.is_cuda:  # (fn moved its micro-batch to the GPU itself)
                refuse_cuda(x.device)
            ov_ag = ov_data = defer_dw = 0
            chunks = chunks or 1  # the other micro-batches hide the all-reduce: no auto split
        hold = 0 if torch.compiler.is_compiling() else hold_flags(self)
        if not torch.compiler.is_compiling() and not microbatch_active():
            # the weight's gradient hook follows this layer's knob (grads._on_grad)
            self.weight._axonn_overlap_data = bool(ov_data)
        if hold:  # a chunk of axonn_c.Sequential: the other chunks hide the all-reduces
            chunks, defer_dw = chunks or 1, 0
            if w is self.weight and w.requires_grad and torch.is_grad_enabled():
                grads.expect_chunk(w)  # its backward joins the pass's chunk record early
            if x.dtype != in_dtype or not x.is_contiguous():
                hold &= ~HOLD_BWD  # autograd reads dx (a cast, a copy) before anyone awaits it
        bc = b if use_bias else None  # (the bias the C call adds)
        if torch.compiler.is_compiling():  # compiled graphs: overlap inside the layer only
            cfg = [*self._cfg[:3], int(use_bias), self._cfg[4], ov_ar, ov_rs, chunks]
            refusal = self._compile_refusal(cfg, x2.dtype, w)
            if refusal:  # (raised when the graph runs, _refused_layer)
                y = _refused_layer(x2, w, refusal, self._n_out(), True)
            else:
                # (the handle's ints, written out: nothing of C may run while torch.compile
                # traces; the op maps them to the handle when the graph runs, _op_call)
                y = _linear_fwd(x2, w, bc, cfg, list(self._placed_on))[0]
        else:
            # the scheduler gathers (and prefetches) the parameter itself, not a per-call cast;
            # (a knob that asks for the scheduler: the handle refuses a CUDA graph capture)
            call = self._handle(x2.dtype, use_bias, (ov_ar, ov_rs, chunks,
                                                     int(ov_ag and w is self.weight), ov_data,
                                                     defer_dw), self._codecs(),
                                bool(ov_ag or ov_rs or ov_data or defer_dw))
            if call.self_contained and not hold and not microbatch_active():
                # nothing cross-layer to do: one C call each way (and the next call of the same
                # kind takes forward's shortcut)
                self._remember_plain(call, x2.dtype, use_bias, w)
                y = _PlainLinear.apply(x2, w, bc, call)
            else:
                call.layer = self._layer_id()  # (per object: a __dict__ copy shares _calls)
                if (not hold and not microbatch_active() and not call.keeps_dw_residual
                        and call.defers(False, False)):
                    # only its gradients are cross-layer: the next such call takes forward's
                    # shortcut too (_DeferringLinear)
                    self._remember_plain(call, x2.dtype, use_bias, w, deferring=True)
                y = _EagerLinear.apply(x2, w, bc, call, hold)
        if not flat:
            y = y.view(*x.shape[:-1], y.shape[-1])
        if self.skip_bias_add:
            return y, (self._full_bias_for_output(b) if b is not None else None)
        return y

    # per-layer overlap knobs: None inherits optimize_communication()'s, then init()'s
    overlap_all_reduce = _knob("overlap_all_reduce")
    overlap_reduce_scatter = _knob("overlap_reduce_scatter")
    fwd_chunks = _knob("fwd_chunks")  # 0: chosen by the output's size
    overlap_all_gather = _knob("overlap_all_gather")  # prefetch this layer's depth all-gather
    overlap_data = _knob("overlap_data")  # data-parallel reduction of dW during backward
    defer_wgrad = _knob("defer_wgrad")  # dW GEMM run under a later layer's dX reduction

    @property
    def compression(self):
        """This layer's own codecs for its collectives over depth/row/col (docs/compression.md),
        e.g. {"depth": "bf16", "row": {"codec": "int8", "block": 128}}: the dimensions named
        replace init()'s/optimize_communication()'s policy for this layer (None or "none"
        turns one off), the others follow it. None (the default): the session's policy."""
        return self.__dict__.get("_compression_arg")

    @compression.setter
    def compression(self, value):
        own = compression_policy.layer_policy(value)  # (raises before anything changes)
        self.__dict__["_compression_arg"] = value
        self.__dict__["_own_compression"] = own
        self.__dict__["_plain_memo"] = None  # (made again: the handle carries the codecs)

    def _n_out(self) -> int:
        """The last dimension of the layer's output on this rank."""
        return self._shard_shapes["n_local"] if self.expert_mode else self.out_features

    def _compile_refusal(self, cfg: list, dtype: torch.dtype, w: Tensor) -> str:
        """Why a compiled graph cannot run this call ("" if it can), asked while tracing."""
        if self._codecs():
            return ("Linear.compression (a layer's own codecs) is not supported under "
                    "torch.compile yet")
        if w.requires_grad and _keeps_residual_traced(
                tuple(cfg), dtype, _dev(w), (session.epoch, session.knobs_version)):
            # (C decided; the session's policy only names the codec in the message)
            depth = (session.compression.get("depth") or ("?",))[0]
            return (f"error feedback on the depth dW reduce-scatter (on by default for the depth "
                    f"codec {depth!r}) is not supported under torch.compile: a compiled graph "
                    f"keeps no residual; pass compression={{'depth': {{'codec': {depth!r}, "
                    "'error_feedback': False}} or run the model eagerly")
        return ""

    def _codecs(self) -> tuple:
        """The C layer's codec ints when this layer has its own policy, else ()."""
        own = self.__dict__.get("_own_compression")
        return () if own is None else compression_policy.layer_codec_ints(own)

    def _overlap_knobs(self) -> tuple:
        if (self.overlap_all_reduce is None and self.overlap_reduce_scatter is None
                and self.fwd_chunks is None and self.overlap_all_gather is None
                and self.overlap_data is None and self.defer_wgrad is None
                and not session.overlap_overrides):
            d = session.overlap_defaults  # the common case: init()'s defaults
            return (int(d["overlap_all_reduce"]), int(d["overlap_reduce_scatter"]),
                    d["fwd_chunks"], int(d["overlap_all_gather"]), int(d["overlap_data"]),
                    int(d["defer_wgrad"]))
        out = []
        for name in OVERLAP_KNOBS:
            v = getattr(self, name)
            if v is None:
                v = session.overlap_overrides.get(name, session.overlap_defaults[name])
            out.append(int(v))
        return tuple(out)

    _plain_memo = _calls = None
    # its depth dW reduce-scatter may keep an error-feedback residual (C's, by layer id): how
    # compression.compression_state(model) finds the layers
    _keeps_depth_residual = True

    def _handle(self, dtype, use_bias: bool, knobs: tuple, codecs: tuple = (),
                refuse_capture: bool = False):
        """The layer's C handle (_C.LinearCall) for these knobs ((overlap_all_reduce,
        overlap_reduce_scatter, fwd_chunks[, scheduled, overlap_data, defer_wgrad]): eager
        calls name all six, compiled ones the first three), dtype, bias use and codecs; made
        once per init() and knob setting and kept on the layer."""
        memo, key = self._calls, (session.epoch, session.knobs_version)
        if memo is None or memo[0] != key:
            memo = self._calls = (key, {})
        # (the device: whether a depth residual is kept depends on the device's transport)
        k = (dtype, use_bias, knobs, codecs, refuse_capture, _dev(self.weight))
        call = memo[1].get(k)
        if call is None:
            cfg = (*self._cfg[:3], int(use_bias), self._cfg[4], *knobs, *codecs)
            call = memo[1][k] = _C.LinearCall(cfg, _dtype_name(dtype), _dev(self.weight),
                                              _CAPTURE_REFUSAL if refuse_capture else None)
        return call

    def _remember_plain(self, call, dtype, use_bias: bool, w: Tensor,
                        deferring: bool = False) -> None:
        """Keeps a handle for forward's shortcut when this call is the common one: the layer's
        own parameters in their dtype. A self-contained handle (_PlainLinear), or with
        `deferring` one whose backward hands its gradients on (_DeferringLinear; its scheduler
        id set on it, which is this object's: a copy of the layer makes its own memo)."""
        if (use_bias == (self.bias is not None and not self.skip_bias_add) and w.dtype is dtype
                and w is self._parameters.get("weight")):
            # (forward's check: input features, device)
            want = self._shapes["k_local"] if self.expert_mode else self.in_features
            self._plain_memo = ((session.epoch, session.knobs_version), dtype, want, call,
                                use_bias, w, self.bias, self.skip_bias_add,
                                (id(self), call.layer, w._axonn_overlap_data) if deferring
                                else None, _dev(w))

    _sched_key = None

    def _layer_id(self) -> int:
        """This layer's scheduler id, per init() and per object (a deep copy gets its own).
        Concurrent micro-batches may ask for it at once: one id per layer, under a lock."""
        key = (session.epoch, id(self))
        if self._sched_key != key:
            with _cache.layer_id_lock:
                if self._sched_key != key:
                    self._sched_id = _C.sched_layer_new()
                    self._sched_key = key
                    weakref.finalize(self, _forget, self._sched_id, session.epoch)
        return self._sched_id

    def _full_bias_for_output(self, b: Tensor) -> Tensor:
        """The bias as the output needs it: expert layout, the local block; easy, the full vector
        (its gradient is summed over the plane, whose ranks hold different tokens)."""
        if self.expert_mode:
            return b
        return _GatherBias.apply(b, self._shapes["gout"], self._shapes["gin"],
                                 self._shapes["gout_size"])

    def extra_repr(self) -> str:
        s = self._shard_shapes  # (printable after finalize())
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, transpose={self.transpose}, "
                f"expert_mode={self.expert_mode}, block={s['n_local']}x{s['k_local']}, "
                f"shard={s['shard']}")


class _GatherBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b, gout, gin, gout_size):
        ctx.gout, ctx.gin, ctx.n = gout, gin, b.shape[0]
        out = b.new_empty(gout_size * b.shape[0])
        comm.all_gather(out, b.contiguous(), group=gout)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce(g, group=ctx.gin)
        comm.all_reduce(g, group=ctx.gout)
        g_ = grid()
        r = g_.row_rank if ctx.gout == "row" else g_.col_rank
        return g[r * ctx.n:(r + 1) * ctx.n], None, None, None
