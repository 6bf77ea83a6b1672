"""What a user trains with around axonn_c.Linear: gradient synchronisation, global-norm
clipping, the full (serial-equivalent) state dict and optimize_communication
(auto_parallelize: axonn_c/auto_parallel.py).

Which ranks hold which tokens decides every reduction here:

- easy layout (the default): every rank passes its own tokens, so every rank of the world holds
  different tokens; a replicated parameter (LayerNorm, Embedding, ...) has one partial gradient
  per rank and is summed over "world".
- expert layout: tokens are split over data x depth only and replicated over row and column; a
  replicated parameter is summed over ("depth", "data").

A parameter of an axonn_c.Linear names the groups to sum its gradient over in
`param._axonn_grad_groups` (the layer has already reduced what its own collectives cover).

sync_gradients checks its arguments and does the first call's set-up here; the loop over the
parameters, the decision of what each gradient still needs summing over (csrc/grads/sync.c)
and the packed sums are one call into C (_C.grad_sync, csrc/python/py_sync.c).
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from . import _C, comm, grads, replicate, validate
from . import compression as compression_policy
from .grads import no_grad_sync
from .embedding import Embedding
from .linear import Linear
from .norm import LayerNorm, RMSNorm
from .state import configure_scheduler, grid, group_size, is_initialized, knobs_changed, session

__all__ = ["sync_gradients", "no_grad_sync", "no_sync", "finish_grads", "clip_grad_norm_", "full_state_dict",
           "optimize_communication"]

# ------------------------------------------------------------------------- token layout

def _axonn_layers(model: nn.Module) -> List[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def _model_expert_mode(model: nn.Module, expert_mode: Optional[bool],
                       layers: Optional[List[Linear]] = None) -> bool:
    """True when the model's axonn_c.Linear layers (`layers`, when the caller has them) use the
    expert layout (tokens split over data x depth only), False for the easy layout or a model
    without axonn_c layers."""
    if expert_mode is not None:
        return bool(expert_mode)
    modes = {m.expert_mode for m in (_axonn_layers(model) if layers is None else layers)}
    if len(modes) > 1:
        raise ValueError(
            "the model mixes expert_mode=True and expert_mode=False axonn_c.Linear layers, so "
            "which ranks hold different tokens for its replicated parameters is ambiguous: pass "
            "sync_gradients(model, expert_mode=True|False)")
    return modes == {True}


def _replicated_groups(expert: bool) -> Tuple[str, ...]:
    return ("depth", "data") if expert else ("world",)


def _token_shards(expert: bool) -> int:
    g = grid()
    return g.G_data * g.G_intra_d if expert else g.world_size


def _nontrivial(groups: Iterable[str]) -> Tuple[str, ...]:
    return tuple(name for name in groups if group_size(name) > 1)


# ------------------------------------------------------------------------- sync_gradients

no_sync = no_grad_sync


def finish_grads() -> None:
    """Waits for every gradient reduction still in flight and sets the weights' .grad (backward
    does this itself when it ends; for code that reads .grad from inside backward hooks)."""
    grads.finish()


def sync_gradients(model: nn.Module, mean: bool = False, expert_mode: Optional[bool] = None,
                   gradient_attr_name: str = "grad", vectorize: bool = True) -> None:
    """Sums every parameter's gradient over exactly the groups whose ranks hold different tokens
    (call on every rank after backward(), before the optimizer step).

    - axonn_c.Linear parameters: over `param._axonn_grad_groups` (the layer's own collectives
      have already summed over the rest: weight over "data", bias over ("depth", "data")).
    - every other (replicated) parameter: over "world" in the easy layout, over ("depth",
      "data") in the expert layout; the layout is read from the model's axonn_c.Linear layers
      (a model without any is treated as easy) or forced with `expert_mode`.

    `mean=True` divides every gradient by the number of distinct token shards (the world size in
    the easy layout, G_data * G_intra_d in the expert one), so that a per-rank mean loss gives
    the gradient of the global mean loss, as torch's DistributedDataParallel does.

    Parameters whose gradient is None are skipped; every rank must have gradients for the same
    parameters. A frozen parameter's .grad is summed like the others (torch's optimizers step
    every parameter that has one: the replicas stay alike). Small gradients are packed into one
    flat buffer per set of groups (`vectorize`; False reduces each gradient on its own). Does
    nothing inside `no_grad_sync()`.

    With the data overlap on (init(overlap=True)), the sums are done during backward and this
    call only scales: Linear weights and biases from the first step, the model's other
    parameters from the second (this call registers their gradient hooks, axonn_c/grads.py).
    """
    _sync(model, mean, expert_mode, gradient_attr_name, vectorize, only=None)


def sync_gradients_depth_parallel(model: nn.Module, mean: bool = False,
                                  expert_mode: Optional[bool] = None,
                                  gradient_attr_name: str = "grad",
                                  vectorize: bool = True) -> None:
    """AxoNN's older name: the part of sync_gradients over the depth group only (the parameters
    whose gradients differ over depth: Linear biases, replicated parameters in the expert
    layout). A later sync_gradients does not sum them over depth again. `mean=True` divides what
    it sums by G_intra_d; a later sync_gradients replaces that scale by its own (its mean= is
    divided once in all), as does a second call with the other mean= (a repeat sums nothing)."""
    _sync(model, mean, expert_mode, gradient_attr_name, vectorize, only=("depth",))


def _sync(model: nn.Module, mean: bool, expert_mode: Optional[bool], gradient_attr_name: str,
          vectorize: bool, only: Optional[Tuple[str, ...]]) -> None:
    """sync_gradients; `only`: sum over these groups only (and mark the gradients so)."""
    what = "sync_gradients" if only is None else "sync_gradients_depth_parallel"
    validate.check_grad_attr(validate.check_module(f"{what}: model", model),
                             gradient_attr_name)
    mean = validate.check_bool(f"{what}: mean", mean)
    vectorize = validate.check_bool(f"{what}: vectorize", vectorize)
    expert_mode = validate.check_bool(f"{what}: expert_mode", expert_mode, none_ok=True)
    grid()  # raises before init(): without a grid nothing would be summed
    if not _C.grad_sync_enabled():
        return
    grads.finish()
    layers = _axonn_layers(model)
    expert = _model_expert_mode(model, expert_mode, layers)
    if any(not hasattr(m.weight, "_axonn_norm_groups") for m in layers):
        tag_norm_groups(model)  # for clip_grad_norm_, which sees parameters only
    replicated = _replicated_groups(expert)
    replicate.same_replicated_state(model, replicated)  # first call: as DDP does (issue 28 item 5)
    shards = _token_shards(expert) if only is None else group_size("depth")
    scale = 1.0 / shards if mean else None
    if scale == 1.0:
        scale = None
    # C decides per parameter what is left to sum (csrc/grads/sync.c), updates the summed-over
    # marks, registers the gradient hooks through grads.hook (with .grad: later backward passes
    # sum while they run) and sums set by set through the gradient buckets (py_sync.c)
    with torch.no_grad():
        _C.grad_sync(model.parameters(), gradient_attr_name, replicated, only, scale, vectorize,
                     grads.hook, grads.SYNC_BUCKET_BYTES)
    if only is None:
        # the step's gradient sums are done: the next pass is the first of the next step (the
        # compression residuals are kept per pass of a step and bucket, csrc/grads/buckets.c)
        _C.grad_buckets_new_step()


# ------------------------------------------------------------------------- clip_grad_norm_

def _norm_groups(p: nn.Parameter) -> Tuple[str, ...]:
    """The groups over which a parameter's values differ (its shard's share of the norm must be
    summed over them; over any other group the values are copies, counted once)."""
    groups = getattr(p, "_axonn_norm_groups", None)
    if groups is not None:
        return tuple(groups)
    if hasattr(p, "_axonn_grad_groups"):
        layer = getattr(p, "_axonn_layer", None)
        layer = layer() if callable(layer) else layer
        if layer is not None:
            return _layer_param_norm_groups(layer, p)
        raise RuntimeError(
            "an axonn_c parameter carries no _axonn_norm_groups: cannot tell over which groups "
            "its values are sharded")
    return ()


def _layer_param_norm_groups(layer: Linear, p: nn.Parameter) -> Tuple[str, ...]:
    if p is layer.weight:
        return ("intra",)
    return (layer._shapes["gout"],)


def tag_norm_groups(model: nn.Module) -> None:
    """Marks the parameters of the model's axonn_c.Linear layers with `_axonn_norm_groups`
    (the weight's depth shard differs over "intra"; the bias block over the output group).
    clip_grad_norm_ reads these marks; the layer sets them itself, this is for older layers."""
    for m in _axonn_layers(model):
        m.weight._axonn_norm_groups = ("intra",)
        if m.bias is not None:
            m.bias._axonn_norm_groups = (m._shapes["gout"],)


def _by_device_dtype(tensors: List[Tensor]) -> Dict[tuple, List[Tensor]]:
    """{(device, dtype, dense on cpu/cuda): tensors}: the lists torch's foreach kernels take."""
    out: Dict[tuple, List[Tensor]] = {}
    for t in tensors:
        dense = (type(t) is Tensor and t.layout == torch.strided  # (no subclass: DTensor)
                 and t.device.type in ("cpu", "cuda"))
        out.setdefault((t.device, t.dtype, dense), []).append(t)
    return out


def _grad_norm(t: Tensor, norm_type: float) -> Tensor:
    """One gradient's norm, at least in float32 (a sparse one's: of its coalesced values)."""
    v = t.coalesce().values() if t.is_sparse else t
    v = v if v.dtype == torch.float64 else v.float()
    if math.isinf(norm_type):  # (on the CPU much faster than vector_norm's)
        return v.abs().max() if v.numel() else v.new_zeros(())
    return torch.linalg.vector_norm(v, norm_type)


def _grad_norms(grads: List[Tensor], norm_type: float, device) -> Tensor:
    """The norms of `grads` in float32 on `device`, one per gradient: a few foreach kernels per
    device and dtype, as torch's clip_grad_norm_ computes them (was: three kernels each)."""
    norms: List[Tensor] = []
    for (dev, dtype, dense), same in _by_device_dtype(grads).items():
        # (CPU's foreach max-norm is slower than a max per tensor, and the same sums)
        if dense and (dev.type == "cuda" or not math.isinf(norm_type)):  # (float64 stays)
            try:
                norms.extend(torch._foreach_norm(same, norm_type,
                                                 dtype=torch.promote_types(dtype, torch.float32)))
                continue
            except TypeError:  # (a torch whose foreach norm takes no dtype)
                pass
        norms.extend(_grad_norm(t, norm_type) for t in same)
    if not norms:
        return torch.zeros(0, device=device, dtype=torch.float32)
    return torch.stack([n.to(device, torch.float32) for n in norms])


@torch.no_grad()
def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> Tensor:
    """Clips gradients by the true global norm of the whole (unsharded) model, like
    torch.nn.utils.clip_grad_norm_ on the serial model; returns that norm. Call on every rank,
    after sync_gradients.

    A sharded gradient contributes the sum of |g|^p of its shard, summed over the groups that
    shard it (weight: "intra", bias: the output-feature group); a replicated gradient (every
    rank holds the same values after sync_gradients) contributes once.
    """
    del foreach
    parameters = validate.check_params("clip_grad_norm_: parameters", parameters)
    validate.check_number("clip_grad_norm_: max_norm", max_norm, finite=True)
    norm_type = validate.check_number("clip_grad_norm_: norm_type", norm_type, positive=True)
    g = grid()
    # (the device of the parameters, not of the gradients present: a rank whose gradients are
    # all missing takes its part in the same collectives, on the same device, as the others)
    device = parameters[0].device if parameters else torch.device("cpu")
    zero = torch.zeros(1, device=device, dtype=torch.float32)
    if math.isinf(norm_type):
        present = [p.grad for p in parameters if p.grad is not None and p.grad.numel()]
        local = torch.cat([zero, _grad_norms(present, norm_type, device)]).max().reshape(1)
        if g.world_size > 1:
            comm.all_reduce(local, group="world", op="max")
        total = local.reshape(())
    else:
        by_groups: Dict[Tuple[str, ...], List[Tensor]] = {}
        nontrivial: Dict[Tuple[str, ...], Tuple[str, ...]] = {}
        for p in parameters:  # (a missing gradient counts as zeros: every rank has every key)
            groups = _norm_groups(p)
            if groups not in nontrivial:
                nontrivial[groups] = _nontrivial(groups)
            present = by_groups.setdefault(nontrivial[groups], [])
            if p.grad is not None:
                present.append(p.grad)
        # the same set of group tuples on every rank: order them by name, not by encounter
        total_p = torch.zeros((), device=device, dtype=torch.float32)
        for groups in sorted(by_groups):
            s = torch.cat([zero, _grad_norms(by_groups[groups], norm_type, device)
                           .pow(norm_type)]).sum().reshape(1)
            for name in groups:
                comm.all_reduce(s, group=name, op="sum")
            total_p = total_p + s.reshape(())
        total = total_p ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}), so it cannot be clipped")
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for (dev, dtype, dense), same in _by_device_dtype(
            [p.grad for p in parameters if p.grad is not None]).items():
        coef = clip_coef.to(dev, dtype)
        if dense:
            torch._foreach_mul_(same, coef)
        else:
            for t in same:
                t.mul_(coef)
    return total


# ------------------------------------------------------------------------- state dicts

@torch.no_grad()
def full_state_dict(model: nn.Module, prefix: str = "") -> "OrderedDict[str, Tensor]":
    """The model's state dict with every axonn_c.Linear's weight and bias gathered to their full
    serial shapes ([out, in] and [out]), every axonn_c.Embedding's table to [V, H] and every
    split norm's weight and bias to [H], on every rank: exactly the state dict of the serial model
    in which nn.Linear stands for axonn_c.Linear, loadable by it (or by this model, through
    load_state_dict). A model with a `_axonn_to_serial(full)` method (axonn_c.models.GPT) gives
    that serial model's state dict instead. Collective: call on every rank."""
    sd = validate.check_module("full_state_dict: model", model).state_dict(prefix=prefix)
    full = OrderedDict()
    gathered: Dict[str, Tensor] = {}
    done: Dict[int, Dict[str, Tensor]] = {}  # id(module) -> its full tensors by local name
    # every name of a module used under several (state_dict lists each), each module gathered
    # once, on its first name: the same order on every rank
    for name, m in model.named_modules(remove_duplicate=False):
        mine = done.get(id(m))
        if mine is None:
            mine = done[id(m)] = _full_tensors_of(m)
        key = prefix + (name + "." if name else "")
        gathered.update({key + k: v for k, v in mine.items()})
    for k, v in sd.items():
        full[k] = gathered.get(k, v)
    # a model that is a known serial one in other coordinates (axonn_c.models.GPT: transformers'
    # names and Conv1D orientation) turns the gathered tensors into that model's state dict
    to_serial = getattr(model, "_axonn_to_serial", None)
    return to_serial(full) if to_serial is not None else full


def _full_tensors_of(m: nn.Module) -> Dict[str, Tensor]:
    """{"weight": ..., "bias": ...} of a sharded layer's own parameters in their serial shapes
    (collective over its groups); {} for any other module."""
    if "_axonn_tied" in m.__dict__:  # an output layer tied to an Embedding: its weight
        out = {"weight": m._axonn_tied[0].full_weight()}
    elif isinstance(m, (Embedding, LayerNorm, RMSNorm)):  # (the other sharded layers)
        return dict(m.full_tensors(""))
    elif isinstance(m, Linear):
        out = {"weight": m.full_weight()}
    else:
        return {}
    if isinstance(m, Linear) and m.bias is not None:  # (a tied head's bias is its own)
        out["bias"] = m.full_bias()
    return out


# ------------------------------------------------------------------------- optimize_communication

@contextlib.contextmanager
def optimize_communication(overlap_all_reduce: bool = False, overlap_reduce_scatter: bool = False,
                           overlap_all_gather: bool = False, cache_weights: bool = False,
                           model_object_for_overlapping_allgathers=None, *args,
                           overlap_data: Optional[bool] = None,
                           defer_wgrad: Optional[bool] = None, compression=None, **kwargs):
    """Overlap knobs for the layers run inside the context (AxoNN's API, for migration; init(
    overlap=True) sets them all for the whole run).

    overlap_all_reduce: each layer's backward dX reduction runs while its dW GEMM computes, and
    the expert forward's all-reduce is over-decomposed into row chunks (count chosen by size).
    overlap_reduce_scatter: dW's depth reduce-scatter runs during the rest of backward.
    overlap_all_gather: each weight's depth all-gather is prefetched in the learned layer order.
    cache_weights: a layer's forward gather is kept for its backward.
    overlap_data (not in AxoNN; None keeps init()'s): the data-parallel gradient reduction runs
    in buckets during backward.
    defer_wgrad (not in AxoNN; None keeps init()'s): a layer's dW GEMM is deferred to run under
    the next dX reduction that backward waits for.
    Unlike AxoNN, gradients are complete when backward() returns, not when the context exits.
    compression (not in AxoNN; None keeps init()'s): the compression policy inside the
    context, as init(compression=...) takes it; the dimensions it names replace init()'s (None or
    "none" turns one off), the others stay (docs/compression.md). Restored on exit.
    A layer's own attributes override the context."""
    del args, kwargs, model_object_for_overlapping_allgathers
    what = "optimize_communication: "
    overlap_all_reduce = validate.check_bool(what + "overlap_all_reduce", overlap_all_reduce)
    overlap_reduce_scatter = validate.check_bool(what + "overlap_reduce_scatter",
                                                 overlap_reduce_scatter)
    overlap_all_gather = validate.check_bool(what + "overlap_all_gather", overlap_all_gather)
    cache_weights = validate.check_bool(what + "cache_weights", cache_weights)
    overlap_data = validate.check_bool(what + "overlap_data", overlap_data, none_ok=True)
    defer_wgrad = validate.check_bool(what + "defer_wgrad", defer_wgrad, none_ok=True)
    saved_policy = dict(session.compression)
    policy = None if compression is None else compression_policy.merge_policy(saved_policy,
                                                                              compression)
    saved = dict(session.overlap_overrides)
    saved_sched = tuple(session.sched_config)
    # an init() inside the context, also a repeated one, sets its own policy: not undone
    version = session.settings_version
    try:  # (everything set here is undone on exit, also when setting it fails part-way)
        session.overlap_overrides.update(overlap_all_reduce=overlap_all_reduce,
                                         overlap_reduce_scatter=overlap_reduce_scatter,
                                         overlap_all_gather=overlap_all_gather,
                                         fwd_chunks=0 if overlap_all_reduce else 1)
        if overlap_data is not None:
            session.overlap_overrides["overlap_data"] = overlap_data
        if defer_wgrad is not None:
            session.overlap_overrides["defer_wgrad"] = defer_wgrad
        knobs_changed()  # (after the change: a memo made meanwhile is not kept)
        configure_scheduler(saved_sched[0], saved_sched[1], cache_weights)
        if policy is not None:
            compression_policy.apply(policy)
        yield
    finally:
        try:
            if policy is not None and is_initialized() and session.settings_version == version:
                compression_policy.apply(saved_policy)
        finally:
            session.overlap_overrides.clear()
            session.overlap_overrides.update(saved)
            knobs_changed()  # (after the change: a memo made meanwhile is not kept)
            if is_initialized() and session.settings_version == version:
                configure_scheduler(*saved_sched)
