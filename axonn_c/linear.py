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
from .comm import _stream
from .state import OVERLAP_KNOBS, grid, grid_sizes, microbatch_active, refuse_cuda, session

_EASY, _EXPERT = 0, 1


def _dev(t: Tensor) -> int:
    return t.device.index if t.is_cuda else -1


class _Caches:
    """Per-process memos of the layer calls (one instance, `_cache`)."""

    def __init__(self):
        self.desc: dict = {}  # (cfg, dtype) -> the description tuple the C calls take
        self.shapes: dict = {}  # (desc, rows, epoch) -> _C.linear_shapes
        # the scheduler reads a layer's last-seen shard when it prefetches: kept alive per id
        self.keep: dict = {}
        self.layer_id_lock = threading.Lock()  # one scheduler id per layer, across threads


_cache = _Caches()

# cfg: (in_features, out_features, transpose, has_bias, layout[, overlap_all_reduce,
#       overlap_reduce_scatter, fwd_chunks, scheduled, overlap_data, layer_id, defer_wgrad,
#       hold])
_SCHED, _OV_DATA, _LAYER, _DEFER_DW, _HOLD = 8, 9, 10, 11, 12
_CODECS = 13  # [13:20]: the layer's own codecs (Linear.compression), compression.layer_codec_ints
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


def _hold(cfg) -> int:
    return cfg[_HOLD] if len(cfg) > _HOLD else 0


def _desc(cfg, dtype: torch.dtype) -> tuple:
    """The layer description the C functions take, memoised (this runs on every call)."""
    key = (*cfg, dtype)
    d = _cache.desc.get(key)
    if d is None:
        in_f, out_f, transpose, has_bias, layout, *knobs = cfg
        ov_ar, ov_rs, chunks, scheduled = (*knobs, 0, 0, 1, 0)[:4] if knobs else (0, 0, 1, 0)
        defer_dw = len(cfg) > _DEFER_DW and bool(cfg[_DEFER_DW])
        d = _cache.desc[key] = (in_f, out_f, bool(transpose), bool(has_bias), layout,
                                str(dtype)[6:], bool(ov_ar), bool(ov_rs), chunks, bool(scheduled),
                                defer_dw) + ((tuple(cfg[_CODECS:]),) if len(cfg) > _CODECS else ())
    return d




def _sched_args(w: Tensor, cfg) -> tuple:
    """(layer id, weight version, prefetch_ok) for the C call."""
    if len(cfg) <= _LAYER:
        return (-1, 0, False)
    if cfg[_SCHED]:
        _cache.keep[cfg[_LAYER]] = w
    return (cfg[_LAYER], w._version, bool(cfg[_SCHED]))


def _placement() -> tuple:
    """What decides which shard of a weight this rank holds (G_data does not)."""
    if session.placement is None:
        grid()  # raises: no init()
    return session.placement


def _forget(layer_id: int, ep: int) -> None:
    _cache.keep.pop(layer_id, None)
    if ep == session.epoch and _C is not None:
        _C.sched_forget(layer_id)  # (and its depth dW residual: a reused id starts at zeros)


@torch._dynamo.assume_constant_result
def _keeps_residual_traced(cfg: tuple, dtype: torch.dtype, device: int, setting: tuple) -> bool:
    """Whether C keeps a depth dW error-feedback residual for the layer's calls, asked while
    torch.compile traces (a constant of the graph, no graph break); `setting` (init epoch, knobs
    version), read by the traced code, makes a policy change recompile."""
    return _C.linear_dw_residual_elems(_desc(cfg, dtype), device) > 0


def _shapes(desc: tuple, rows: int) -> dict:
    """_C.linear_shapes, memoised per init() (session.epoch changes at init and finalize)."""
    key = (desc, rows, session.epoch)
    s = _cache.shapes.get(key)
    if s is None:
        if len(_cache.shapes) > 4096:
            _cache.shapes.clear()
        s = _cache.shapes[key] = _C.linear_shapes(desc, rows)
    return s


def _forward_impl(x: Tensor, w: Tensor, b: Optional[Tensor], cfg: List[int]):
    """x: [rows, features] -> (y, saved); saved is what backward needs besides x (easy layout;
    empty in the expert layout)."""
    desc = _desc(cfg, x.dtype)
    rows = x.shape[0]
    t_max = _C.linear_plane_tokens(desc, rows, _dev(x), _stream(x)) if cfg[4] == _EASY else rows
    s = _shapes(desc, t_max)
    if w.numel() != s["shard"]:  # (a layer built for another grid, reached without the check)
        raise RuntimeError(f"axonn_c.Linear({cfg[0]}, {cfg[1]}): the weight shard has "
                           f"{w.numel()} elements, the current grid needs {s['shard']}; build "
                           "the layer after init(), or move its weights with full_state_dict()")
    if cfg[4] == _EASY:
        y = x.new_empty((rows, cfg[1]))
        saved = x.new_empty((s["saved_rows"], s["saved_cols"]))
    else:  # backward reads x itself
        y = x.new_empty((rows, s["n_local"]))
        saved = None
    n_ws = s["workspace_elems"]
    ws_t = x.new_empty((n_ws,)) if n_ws else None  # kept alive until the C call returns
    ws = ws_t.data_ptr() if n_ws else 0
    wf = _shared_gather(w, cfg, s, "fwd")  # kept alive until the C call returns
    _C.linear_forward(desc, _dev(x), _stream(x), rows, t_max, x.data_ptr(), w.data_ptr(),
                      b.data_ptr() if b is not None else 0, y.data_ptr(),
                      saved.data_ptr() if saved is not None else 0, ws, *_sched_args(w, cfg),
                      wf.data_ptr() if wf is not None else 0, bool(_hold(cfg) & HOLD_FWD))
    if _hold(cfg) & HOLD_FWD:  # y may still be written by its all-reduce (axonn_c.Sequential)
        grads.keep_output(_C.sched_counters()[1], y)
    return y, saved


def _backward_impl(dy: Tensor, x: Tensor, saved: Tensor, w: Tensor, cfg, param=None,
                   need_dx: bool = True, trains: Callable[[], bool] = lambda: True):
    """-> (dx, dw, db); db is None when the layer has no bias. With `param` (the weight
    parameter itself, eager mode with deferral on) dW is deferred: it is completed into
    param.grad at the end of backward (axonn_c/grads.py) and dw is None. need_dx=False (the
    input needs no gradient, e.g. a first layer on raw data): no dX GEMM and no dX collectives,
    dx is None."""
    desc = _desc(cfg, dy.dtype)
    dy = dy.contiguous()
    rows = x.shape[0]
    t_max = rows
    s = _shapes(desc, rows)
    if cfg[4] == _EASY:
        t_max = saved.shape[0] // (s["gin_size"] * s["gout_size"])
        s = _shapes(desc, t_max)
    dx = torch.empty_like(x) if need_dx else None
    db = dy.new_empty((s["n_local"],)) if cfg[3] else None
    n_ws = s["workspace_elems"]
    ws_t = dy.new_empty((n_ws,)) if n_ws else None  # kept alive until the C call returns
    ws = ws_t.data_ptr() if n_ws else 0
    src = saved if cfg[4] == _EASY else x
    chunk = param is not None and bool(_hold(cfg) & HOLD_CHUNK)
    if chunk:  # the chunks of axonn_c.Sequential accumulate dW in the GEMM (grads.chunk_prepare)
        dw, fold = grads.chunk_prepare(param, s["shard"], bool(cfg[_OV_DATA]))
    elif param is not None:
        dw, fold, replace, bucket = grads.prepare(param, s["shard"], bool(cfg[_OV_DATA]))
    if param is not None:
        tail = (*_sched_args(w, cfg), True, fold.data_ptr() if fold is not None else 0)
    else:
        dw, tail = torch.empty_like(w), (*_sched_args(w, cfg), False, 0)
    wf = _shared_gather(w, cfg, s, "bwd")  # kept alive until the C call returns
    # concurrent micro-batches: dW's reduce-scatter shared by all of them (None: the layer's own)
    dwf = _shared_scatter_block(w, cfg, s) if param is None else None
    hold = need_dx and bool(_hold(cfg) & HOLD_BWD)
    # the depth dW error-feedback residual is C's (by layer id, where C says the call needs one):
    # a micro-batch thread or a dW no .grad receives takes scratch zeros, not the layer's
    trains_residual = s["depth_size"] > 1 and dy.dtype is torch.float32 and (
        not microbatch_active() and trains())
    task = _C.linear_backward(desc, _dev(dy), _stream(dy), rows, t_max, src.data_ptr(),
                              w.data_ptr(), dy.data_ptr(), dx.data_ptr() if need_dx else 0,
                              dw.data_ptr(),
                              db.data_ptr() if db is not None else 0, ws, *tail,
                              wf.data_ptr() if wf is not None else 0,
                              dwf.data_ptr() if dwf is not None else 0, hold, trains_residual)
    if hold:  # dx may still be written by its all-reduce: kept until the latest result is done
        grads.keep_for_result(_C.sched_counters()[1], dx)
    if dwf is not None:  # added to .grad when run_concurrent ends
        session.concurrent_call.reduce_scatter(cfg[_LAYER], w, dwf)
        return dx, None, db
    if chunk:  # (no dW GEMM task: chunk calls run it in the call, G_d == 1: no reduce-scatter)
        grads.chunk_done(param)
        return dx, None, db
    if param is not None:
        if task:  # the dW GEMM runs later (a scheduler task, Gd == 1): what it reads stays alive
            grads.keep_for_task(task, (dy, src, dw, fold, ws_t))
        # the reduce-scatter reads the workspace (and the residual, which C keeps) and writes dw
        # until grads.finish()
        grads.add(param, dw, (ws_t, fold) if s["depth_size"] > 1 else (fold,), replace, bucket)
        return dx, None, db
    if len(cfg) > _LAYER and cfg[_SCHED]:
        grads.queue_finish()  # the end of backward ends the scheduler's step
    return dx, dw, db


def _shares_depth(cfg, s: dict) -> bool:
    """An unscheduled depth-sharded call on a micro-batch thread of run_concurrent: its depth
    traffic is shared by the micro-batches (axonn_c/microbatches.py)."""
    return (s["depth_size"] > 1 and len(cfg) > _LAYER and not cfg[_SCHED]
            and session.concurrent_call is not None and microbatch_active())


def _shared_gather(w: Tensor, cfg, s: dict, phase: str) -> Optional[Tensor]:
    """The weight gathered over depth once for all micro-batches, or None (the call gathers it
    itself)."""
    if not _shares_depth(cfg, s):
        return None
    return session.concurrent_call.gather(cfg[_LAYER], phase, w, s["shard"] * s["depth_size"])


def _shared_scatter_block(w: Tensor, cfg, s: dict) -> Optional[Tensor]:
    """A buffer for dW's unreduced block when the micro-batches share its depth reduce-scatter,
    or None (the call reduce-scatters it itself)."""
    if not _shares_depth(cfg, s):
        return None
    if not grads.accumulates(w):  # torch.autograd.grad wants dW handed back
        return None
    return session.concurrent_call.scatter_block(w, s["shard"] * s["depth_size"])


def _defers(w: Tensor, cfg) -> bool:
    """Whether this backward hands dW to the scheduler: eager mode, the weight is the parameter
    itself (not a per-call cast), there is a deferred reduction or a deferred dW GEMM
    (defer_wgrad) to run, and the pass accumulates into .grad (not torch.autograd.grad)."""
    if len(cfg) <= _LAYER or not (w.is_leaf and w.requires_grad):
        return False
    if _hold(cfg):  # one call per chunk: the chunks accumulate into one gradient (grads.py)
        return grads.accumulates(w)
    if microbatch_active():  # autograd accumulates each micro-batch's dW (microbatches.py)
        grads.check_unsynced(w)
        return False
    g_data, g_r, g_c, g_d = grid_sizes()
    # defer_wgrad as csrc/layers/linear.c's defers_dw: under a dX reduction of a tensor-parallel
    # grid, and not with depth sharding
    defer_dw = (len(cfg) > _DEFER_DW and bool(cfg[_DEFER_DW]) and bool(cfg[5]) and g_d == 1
                and g_r * g_c > 1)
    return (((bool(cfg[6]) and g_d > 1) or (bool(cfg[_OV_DATA]) and g_data > 1) or defer_dw)
            and grads.accumulates(w))  # torch.autograd.grad wants dW handed back


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
    y, saved = _forward_impl(x, w, b, cfg)
    return y, (saved if saved is not None else x.new_empty((0,)))


@_linear_fwd.register_fake
def _(x, w, b, cfg, place):
    s = _shapes(_desc(cfg, x.dtype), x.shape[0])
    if cfg[4] == _EASY:
        return x.new_empty((x.shape[0], cfg[1])), x.new_empty((s["saved_rows"], s["saved_cols"]))
    return x.new_empty((x.shape[0], s["n_local"])), x.new_empty((0,))


@torch.library.custom_op("axonn_c::stale_layer", mutates_args=())
def _stale_layer(x: Tensor, w: Tensor, message: str, n_out: int) -> Tensor:
    """Stands for a compiled layer whose shards are not this rank's on the current grid (its
    output: [..., n_out]): raises when the graph runs. (Raising while torch.compile traces would
    make it skip Linear.forward for good: every later compiled layer would run eagerly; and the
    layer's own ops cannot be traced, their shapes follow the current grid.)"""
    raise RuntimeError(message)


@_stale_layer.register_fake
def _(x, w, message, n_out):
    return x.new_empty((*x.shape[:-1], n_out))


_stale_layer.register_autograd(lambda ctx, g: (None, None, None, None))


@torch.library.custom_op("axonn_c::linear_bwd", mutates_args=())
def _linear_bwd(dy: Tensor, x: Tensor, saved: Tensor, w: Tensor, cfg: List[int],
                need_dx: bool, place: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    _check_place(cfg, place)
    dx, dw, db = _backward_impl(dy, x, saved, w, cfg, None, need_dx)
    return ((dx if dx is not None else dy.new_empty((0,))), dw,
            (db if db is not None else dy.new_empty((0,))))


@_linear_bwd.register_fake
def _(dy, x, saved, w, cfg, need_dx, place):
    s = _shapes(_desc(cfg, dy.dtype), x.shape[0])
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


class _EagerLinear(torch.autograd.Function):
    """The same computation without the custom-op dispatcher's Python layers: eager mode's hot
    path (tens of microseconds less per call). torch.compile uses the custom ops above."""

    @staticmethod
    def forward(ctx, x, w, b, cfg):
        y, saved = _forward_impl(x, w, b, cfg)
        ctx.save_for_backward(x, saved, w)
        ctx.cfg, ctx.has_bias = cfg, b is not None
        # the weight as passed (the Parameter, or a per-call cast): a deferred gradient goes to
        # its .grad. Not the saved tensor: under torch.utils.checkpoint(use_reentrant=False) that
        # is a recomputed alias, whose .grad nobody reads
        ctx.param = w if w.is_leaf else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, saved, w = ctx.saved_tensors
        cfg = ctx.cfg
        param = ctx.param
        # an input that needs no gradient (the same on every rank: SPMD) skips dX entirely
        dx, dw, db = _backward_impl(dy, x, saved, w, cfg,
                                    param if param is not None and _defers(param, cfg) else None,
                                    ctx.needs_input_grad[0],
                                    # whether a .grad receives this dW (asked only when a
                                    # residual is kept; a per-call cast: the training step's)
                                    lambda: ctx.needs_input_grad[1] and (
                                        param is None or grads.accumulates(param)))
        return dx, dw, (db if ctx.has_bias else None), None


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


_CAPTURE_REFUSAL = (
    "axonn_c.Linear cannot be captured in a CUDA graph with the cross-layer scheduler on (its "
    "prefetch order, gradient buckets and deferred dW GEMMs are decided at run time): set "
    "overlap_all_gather, overlap_reduce_scatter, overlap_data and defer_wgrad to False "
    "(init(overlap=False) or optimize_communication) for the captured region")


class _PlainLinear(torch.autograd.Function):
    """An eager call with nothing cross-layer to do (Linear._plain_call): forward and backward
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
    def backward(ctx, dy):
        x, saved, w = ctx.saved_tensors
        if _C_PICKS_STREAM:
            dx, dw, db = ctx.call.backward(dy, x, saved, w, ctx.needs_input_grad[0])
        else:
            dx, dw, db = ctx.call.backward(dy, x, saved, w, ctx.needs_input_grad[0],
                                           *_dev_stream(dy))
        return dx, dw, db, None  # (db None: the handle was made without a bias)


# whether autocast is on for any device type (one C call; the general path looks at the input's
# device type)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))

# torch's C apply without Function.apply's Python wrapper (functorch unwrapping, default
# arguments): a few microseconds per call that _PlainLinear does not need
_plain_apply = super(torch.autograd.Function, _PlainLinear).apply


def linear_op(x: Tensor, w: Tensor, b: Optional[Tensor], cfg, place: tuple) -> Tensor:
    # (an eager cfg here while compiling: torch.compile skipped Linear.forward and traces this
    # function alone; the eager path keeps the scheduler's semantics)
    if torch.compiler.is_compiling() and len(cfg) <= _SCHED:
        return _linear_fwd(x, w, b, list(cfg), list(place))[0]
    return _EagerLinear.apply(x, w, b, cfg)


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
        self.in_features = validate.check_int("Linear: in_features", in_features, 0, 2**31 - 1)
        self.out_features = validate.check_int("Linear: out_features", out_features, 0, 2**31 - 1)
        self.transpose, self.skip_bias_add = bool(transpose), bool(skip_bias_add)
        self.expert_mode = bool(expert_mode)
        dtype = dtype or torch.get_default_dtype()
        self._cfg = [self.in_features, self.out_features, int(self.transpose), int(bias),
                     _EXPERT if self.expert_mode else _EASY]
        # raises before init()
        s = self._shard_shapes = _C.linear_shapes(_desc(self._cfg, dtype), 0)
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
        self._plain_memo = None  # (new parameters: decide again)
        w, b = self.weight, self.bias
        w._axonn_grad_groups = ("data",)
        w._axonn_deferred = True  # its gradient goes through grads.prepare/add
        # what reaches autograd for it (a cast weight's gradient, another use of the weight: a
        # tied or regularised weight) is summed during backward, and added to a deferred
        # gradient of the same pass instead of being overwritten by it
        grads.hook(w, w._axonn_grad_groups)
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
        if "_plain_memo" in state:  # (a C handle: not picklable; the copy makes its own)
            state = dict(state)
            del state["_plain_memo"]
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
        self._shard_shapes = _C.linear_shapes(_desc(self._cfg, self.weight.dtype), 0)
        self._epoch = session.epoch
        self._tag_parameters()  # (a larger world than the layer was built in needs the hooks)

    @property
    def _shapes(self) -> dict:
        """The shard's shapes and this rank's place (_C.linear_shapes), checked against the
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
            self.load_full(w, b)
            state_dict = {k: v for k, v in state_dict.items()
                          if k not in (prefix + "weight", prefix + "bias")}
            for k in ("weight", "bias"):
                state_dict[prefix + k] = getattr(self, k) if getattr(self, k) is not None else None
            state_dict = {k: v for k, v in state_dict.items() if v is not None}
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
                    and x.is_contiguous() and (x.is_cpu and w.is_cpu or x.is_cuda and w.is_cuda
                                               and x.get_device() == w.get_device())
                    and not _any_autocast() and t.hold_target is None and not t.hold_depth
                    and t.microbatch is None and grads.idle()):
                if self.skip_bias_add:
                    return (_plain_apply(x, w, None, m[3]),
                            self._full_bias_for_output(b) if b is not None else None)
                return _plain_apply(x, w, b, m[3])
        return self._forward(x)

    def _forward(self, x: Tensor):
        if torch.compiler.is_compiling() and self._placed_on != session.placement:
            # both are plain values torch.compile guards on: an init() that changes this rank's
            # placement recompiles, and the new graph raises when it runs
            msg = _placement_error(self.in_features, self.out_features, self._placed_on,
                                   session.placement)
            y = _stale_layer(x, self.weight, msg,
                             self._shard_shapes["n_local"] if self.expert_mode
                             else self.out_features)
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
        if (x.is_cuda and (ov_ag or ov_rs or ov_data or defer_dw)
                and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError(_CAPTURE_REFUSAL)
        codecs = self._codecs()
        plain = None if torch.compiler.is_compiling() or codecs else self._plain_call(
            x.dtype, use_bias, (ov_ar, ov_rs, chunks, ov_ag, ov_data, defer_dw), hold)
        if plain is not None:  # nothing cross-layer to do: one C call each way
            y = _PlainLinear.apply(x2, w, b if use_bias else None, plain)
        elif torch.compiler.is_compiling():  # compiled graphs: overlap inside the layer only
            if codecs:
                raise NotImplementedError("Linear.compression (a layer's own codecs) is not "
                                          "supported under torch.compile yet")
            if w.requires_grad and _keeps_residual_traced(
                    self._cfg, x2.dtype, _dev(w), (session.epoch, session.knobs_version)):
                # (C decided; the session's policy only names the codec in the message)
                depth = session.compression.get("depth") or ("?",)
                raise NotImplementedError(
                    f"error feedback on the depth dW reduce-scatter (on by default for the "
                    f"depth codec {depth[0]!r}) is not supported under torch.compile: a "
                    "compiled graph keeps no residual; pass compression={'depth': {'codec': "
                    f"{depth[0]!r}, 'error_feedback': False}}}} or run the model eagerly")
            cfg = (*self._cfg[:3], int(use_bias), self._cfg[4], ov_ar, ov_rs, chunks)
            y = linear_op(x2, w, b if use_bias else None, cfg, self._placed_on)
        else:
            # the scheduler gathers (and prefetches) the parameter itself, not a per-call cast
            scheduled = ov_ag and w is self.weight
            cfg = (*self._cfg[:3], int(use_bias), self._cfg[4], ov_ar, ov_rs, chunks,
                   int(scheduled), ov_data, self._layer_id(), defer_dw, hold) + codecs
            y = linear_op(x2, w, b if use_bias else None, cfg, self._placed_on)
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
        self.__dict__["_plain_memo"] = None  # (a layer with its own codecs takes the general path)

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

    _plain_memo = None
    _residual_memo = None
    # its depth dW reduce-scatter may keep an error-feedback residual (C's, by layer id): how
    # compression.compression_state(model) finds the layers
    _keeps_depth_residual = True

    def _keeps_residual(self, dtype) -> bool:
        """Whether its depth dW reduce-scatter keeps an error-feedback residual for this dtype:
        C decides (_C.linear_dw_residual_elems), asked once per init() and knob setting (the
        compression policy changes only with them) and weight device, like the plain-call
        memo."""
        key = (session.epoch, session.knobs_version, dtype, _dev(self.weight))
        m = self._residual_memo
        if m is None or m[0] != key:
            n = _C.linear_dw_residual_elems(_desc(self._cfg, dtype), key[3])
            m = self._residual_memo = (key, n > 0)
        return m[1]

    def _plain_call(self, dtype, use_bias, knobs: tuple, hold: int):
        """The layer's C handle (_C.LinearCall) when this call needs nothing cross-layer: no
        chunk pipelining or concurrent micro-batch, no scheduled depth gather, no deferred dW
        (reduce-scatter, data-parallel bucket or dW GEMM); else None. Kept per init() and knob
        setting: the same decision as _defers and linear.c's defers_dw, made once."""
        if hold or microbatch_active():
            return None
        ov_ar, ov_rs, chunks, ov_ag, ov_data, defer_dw = knobs
        g_data, g_r, g_c, g_d = grid_sizes()
        if ((ov_ag or ov_rs) and g_d > 1) or (ov_data and g_data > 1) or (
                defer_dw and ov_ar and g_d == 1 and g_r * g_c > 1):
            return None
        key = (session.epoch, session.knobs_version)
        if g_d > 1 and dtype is torch.float32 and self._keeps_residual(dtype):
            return None  # (its depth dW reduce-scatter keeps an error-feedback residual)
        memo = self._plain_memo
        if (memo is not None and memo[0] == key and memo[1] is dtype
                and memo[4] == (use_bias, knobs)):
            return memo[3]
        # (a knob that asks for the scheduler: the handle refuses a CUDA graph capture, as the
        # general path does)
        refuse = _CAPTURE_REFUSAL if (ov_ag or ov_rs or ov_data or defer_dw) else None
        call = _C.LinearCall((*self._cfg[:3], bool(use_bias), self._cfg[4], str(dtype)[6:],
                              bool(ov_ar), bool(ov_rs), chunks), refuse)
        w = self.weight
        if use_bias == (self.bias is not None and not self.skip_bias_add) and w.dtype is dtype:
            # (forward's check: input features, device)
            want = self._shapes["k_local"] if self.expert_mode else self.in_features
            self._plain_memo = (key, dtype, want, call, (use_bias, knobs), w, self.bias,
                                self.skip_bias_add)
        return call

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
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce(g, group=ctx.gin)
        comm.all_reduce(g, group=ctx.gout)
        g_ = grid()
        r = g_.row_rank if ctx.gout == "row" else g_.col_rank
        return g[r * ctx.n:(r + 1) * ctx.n], None, None, None
