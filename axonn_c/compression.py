"""Compressed collectives per grid dimension (docs/compression.md): the policy
init(compression=...) sets, and the error-feedback state it keeps.

- "data": the gradient buckets (csrc/grads/buckets.c) compress every float32 sum over the data
  group (backward's overlapped sums, sync_gradients, run_concurrent's reducer), with error
  feedback by default for int8/int4; a replicated parameter summed over "world" or
  ("depth", "data") stays exact on the groups other than data.
- "depth", "row", "col": the layers' own float32 collectives over that group (csrc/comm:
  axc_comm_apply_layer_codec): depth = the weights' all-gathers (no error feedback) and dW's
  reduce-scatters (gradient rules: error feedback by default for int8/int4, a residual per
  Linear kept by the runtime in C by the layer's scheduler id, csrc/grads/layer_residuals.c),
  row/col = the activation
  all-reduces, all-gathers and reduce-scatters (all-to-alls stay exact), without error
  feedback.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from . import _C, validate
from .comm import CODECS
from .state import knobs_changed, session

DIMENSIONS = ("data", "depth", "row", "col")
LAYER_DIMENSIONS = ("depth", "row", "col")  # the layers' own collectives
GRADIENT_DIMENSIONS = ("data", "depth")  # with gradient traffic: error feedback applies
_SPEC_KEYS = ("codec", "block", "error_feedback")

# (codec, block (0: the codec's default), error feedback) per dimension
Policy = Dict[str, Tuple[str, int, bool]]


def _spec(dim: str, value) -> Optional[Tuple[str, int, bool]]:
    spec = {"codec": value} if value is None or isinstance(value, str) else value
    if not isinstance(spec, dict):
        raise TypeError(f"compression[{dim!r}] must be None, a codec name or a dict with keys "
                        f"{list(_SPEC_KEYS)}, got {type(value).__name__}")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"compression[{dim!r}]: unknown keys {unknown}, expected some of "
                         f"{list(_SPEC_KEYS)}")
    codec = spec.get("codec")
    codec = "none" if codec is None else codec
    if codec not in CODECS:
        raise ValueError(f"compression[{dim!r}]: unknown codec {codec!r}, expected None or one "
                         f"of {list(CODECS)}")
    block = spec.get("block") or 0
    if not isinstance(block, int) or isinstance(block, bool):
        raise TypeError(f"compression[{dim!r}]: block must be an int, got {block!r}")
    # error feedback by default where quantisation loses most: int8 and int4 gradients
    ef = spec.get("error_feedback", codec in ("int8", "int4") and dim in GRADIENT_DIMENSIONS)
    ef = validate.check_bool(f"compression[{dim!r}]: error_feedback", ef)
    if codec == "none":
        return None
    _C.codec_encoded_bytes(codec, 1, block)  # raises for a block size the codec cannot take
    if ef and dim not in GRADIENT_DIMENSIONS:
        raise ValueError(
            f"compression[{dim!r}]: error feedback applies to gradient traffic only (the "
            f"data-parallel sums and the depth dW reduce-scatters); {dim!r} carries "
            f"activations: pass error_feedback=False for {dim!r}")
    return codec, block, ef


def _by_dimension(compression) -> dict:
    """The compression= argument as {dimension: codec name or spec}: a codec name or spec dict
    alone is the data dimension's."""
    if compression is None:
        return {}
    if isinstance(compression, str) or (isinstance(compression, dict) and "codec" in compression):
        compression = {"data": compression}
    if not isinstance(compression, dict):
        raise TypeError("compression must be None, a codec name, a dict {'codec': ...} or a dict "
                        f"by dimension {list(DIMENSIONS)}, got {type(compression).__name__}")
    unknown = sorted(set(compression) - set(DIMENSIONS))
    if unknown:
        raise ValueError(f"compression: unknown dimensions {unknown}, expected some of "
                         f"{list(DIMENSIONS)}")
    return compression


def parse_policy(compression) -> Policy:
    """init(compression=...) as {dimension: (codec, block, error_feedback)}: None (nothing
    compressed), a codec name or spec dict (the data dimension), or a dict by dimension."""
    policy = {}
    for dim, value in _by_dimension(compression).items():
        spec = _spec(dim, value)
        if spec is not None:
            policy[dim] = spec
    return policy


def merge_policy(base: Policy, compression) -> Policy:
    """`base` with the dimensions that `compression` names replaced (None or "none" turns one
    off); the others keep base's setting (optimize_communication(compression=...))."""
    named = _by_dimension(compression)
    merged = {dim: spec for dim, spec in base.items() if dim not in named}
    merged.update(parse_policy(named))
    return merged


def check_transport(policy: Policy, backend) -> None:
    """Refuses, before any rank touches the store, a data codec that no gradient sum of this job
    could run: with backend="nccl" alone every bucket is a CUDA one, and a build without the
    codec kernels cannot compress it (the first backward would fail). (The layers' codecs stay
    exact where a transport cannot compress; CPU gradients compress on shm.)"""
    if "data" in policy and backend == "nccl" and not _C.codec_cuda_compiled():
        raise ValueError(
            f"compression['data'] = {policy['data'][0]!r} needs the CUDA codec kernels with "
            "backend='nccl', and this build has none (built without nvcc): rebuild with nvcc, "
            "or pass compression=None")


def apply(policy: Policy) -> None:
    """Hands the policy to the gradient buckets and the communicator, and records it as the
    session's (the residuals stay: init clears them when the grid is new)."""
    session.compression = dict(policy)
    knobs_changed()  # (what a layer decided from the policy is stale: its memos)
    codec, block, ef = policy.get("data", ("none", 0, False))
    _C.grad_buckets_set_codec("data", codec, block, ef)
    if _C.is_initialized():  # (the layers' policy lives in the communicator: gone at finalize)
        for dim in LAYER_DIMENSIONS:
            codec, block, ef = policy.get(dim, ("none", 0, False))
            _C.set_layer_codec(dim, codec, block, ef)


def layer_policy(compression, what: str = "Linear.compression") -> Optional[Policy]:
    """A layer's own policy (Linear.compression): None (init's/optimize_communication's), or the
    dimensions it names among depth/row/col (a codec name alone is refused: it would mean
    data's). "data" is refused: the data-parallel gradient sums are packed into buckets shared
    by every layer (csrc/grads/buckets.c), so their codec is the job's."""
    if compression is None:
        return None
    if isinstance(compression, str) or (isinstance(compression, dict) and "codec" in compression):
        raise ValueError(f"{what}: name the dimensions, e.g. {{'depth': 'bf16', 'row': 'int8'}}"
                         f" (some of {list(LAYER_DIMENSIONS)}), got {compression!r}")
    by_dim = _by_dimension(compression)
    if "data" in by_dim:
        raise ValueError(f"{what}: 'data' cannot be set per layer (the data-parallel gradient "
                         "sums share buckets across layers): set it with "
                         "init(compression=...) or optimize_communication(compression=...); "
                         f"a layer takes some of {list(LAYER_DIMENSIONS)}")
    return {dim: _spec(dim, value) for dim, value in by_dim.items()}


def layer_codec_ints(own: Policy) -> tuple:
    """(depth codec, depth block, row codec, row block, col codec, col block, depth error
    feedback) as the C layer takes them (csrc/python/py_linear.c): the layer's own where it
    names a dimension (None: off), the session's policy elsewhere."""
    out, depth_ef = [], 0
    for dim in LAYER_DIMENSIONS:
        spec = own[dim] if dim in own else session.compression.get(dim)
        codec, block = (spec[0], spec[1]) if spec else ("none", 0)
        out += [CODECS.index(codec), block]
        if dim == "depth" and spec:
            depth_ef = int(spec[2])
    return (*out, depth_ef)


def _depth_layers(model) -> dict:
    """{module name: Linear} of `model`'s axonn_c.Linear layers (and subclasses), found by their
    class marker (linear.py imports this module, not the other way round)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return {name: m for name, m in model.named_modules()
            if getattr(type(m), "_keeps_depth_residual", False)}


def _depth_residual_of(layer):
    """The layer's depth dW residual in this init, or None (it has none yet)."""
    if getattr(layer, "_sched_key", None) != (session.epoch, id(layer)):
        return None  # (no scheduler id in this init: it has not run)
    return _C.grad_layer_residual(layer._sched_id)


def compression_state(model=None) -> dict:
    """The error-feedback residuals of this rank ({"residuals": {slot: float32 tensor}}, copies),
    for a checkpoint: load them with load_compression_state on the same grid and model.

    - "residuals": the compressed data-parallel gradient sums'. A slot is (the pass within the
      step, the bucket's position in the pass, the group's position), kept across steps:
      sync_gradients ends a step; a residual whose bucket changes size or holds other
      gradients (a parameter bucketed from a later step on shifts the rest) starts again from
      zeros, so no gradient gets another's residual. A loaded residual is taken by the first
      bucket at its slot.
    - "depth" (with `model`): {module name: residual} of its axonn_c.Linear layers whose depth dW
      reduce-scatter keeps one (compressed with error feedback, after their first backward),
      named by module so that another process building the same model finds them. Without
      `model` they cannot be named: a rank that holds any raises (pass the model).
    """
    out = {"residuals": {k: v.detach().clone() for k, v in _C.grad_buckets_residuals().items()}}
    if model is None:
        held = _C.grad_layer_residuals_held()
        if held:
            raise ValueError(f"compression_state: {held} Linear layers "
                             "keep error-feedback residuals of their depth dW reduce-scatters, "
                             "named by module: pass model=")
        return out
    depth = {}
    for name, layer in _depth_layers(model).items():
        r = _depth_residual_of(layer)
        if r is not None:
            depth[name] = r.detach().clone()
    out["depth"] = depth
    return out


def load_compression_state(state: dict, model=None) -> None:
    """Restores what compression_state() returned (the residuals are copied); every residual
    this rank held before is dropped (those not in `state` start again from zeros). A "depth"
    entry needs `model` (the same model, on the same grid): a name that is not one of its
    axonn_c.Linear layers, or a residual whose length differs from the layer's (shard * G_d,
    another grid or layer shape), raises ValueError before anything changes."""
    if not isinstance(state, dict) or not isinstance(state.get("residuals"), dict):
        raise TypeError("load_compression_state: expected the dict compression_state() "
                        "returned, with a 'residuals' dict")
    depth = state.get("depth") or {}
    if not isinstance(depth, dict):
        raise TypeError("load_compression_state: 'depth' must be a dict {module name: tensor}")
    for slot in state["residuals"]:
        try:
            ok = int(slot) >= 0 and int(slot) == slot
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"load_compression_state: residual slot {slot!r} is not one that "
                             "compression_state() gives (a non-negative int)")
    for slot, t in [*state["residuals"].items(), *depth.items()]:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"load_compression_state: residual {slot!r} must be a float32 "
                            f"tensor, got {type(t).__name__} {getattr(t, 'dtype', '')}")
    targets = {}
    if depth:
        if model is None:
            raise ValueError("load_compression_state: the state holds depth dW residuals of "
                             f"{len(depth)} Linear layers, named by module: pass model=")
        layers = _depth_layers(model)
        for name, t in depth.items():
            layer = layers.get(name)
            if layer is None:
                raise ValueError(f"load_compression_state: the depth residual of {name!r} has "
                                 "no axonn_c.Linear of that name in the model")
            s = layer._shapes
            want = s["shard"] * s["depth_size"]
            if t.dim() != 1 or t.numel() != want:
                raise ValueError(f"load_compression_state: the depth residual of {name!r} has "
                                 f"shape {list(t.shape)}, the layer needs [{want}] (shard "
                                 f"{s['shard']} x G_intra_d {s['depth_size']}): saved for "
                                 "another layer shape or grid")
            if layer.weight.device.type not in ("cpu", "cuda"):  # (C keeps cpu/cuda ones)
                raise ValueError(f"load_compression_state: {name!r} is on "
                                 f"{layer.weight.device}, expected a cpu or cuda layer")
            targets[layer._layer_id()] = torch.empty(
                want, dtype=torch.float32, device=layer.weight.device).copy_(t.detach())
    _C.grad_buckets_clear_residuals()
    _C.grad_layer_clear_residuals()
    for layer_id, t in targets.items():
        _C.grad_layer_set_residual(layer_id, t)
    for slot, t in state["residuals"].items():
        _C.grad_buckets_set_residual(int(slot), t.detach().clone().contiguous())
