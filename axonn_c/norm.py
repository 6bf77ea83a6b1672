"""axonn_c.LayerNorm and axonn_c.RMSNorm: the serial norms, exact when the hidden dimension is
split over a group (the expert layout's activations): the statistics are summed over that group
(docs/layers.md#norms)."""
from __future__ import annotations

import numbers
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import grads, validate
from .autograd_comm import AllReduceSum, gather_rows
from .state import grid, group_size, microbatch_active, session


def _wide(x: Tensor) -> Tensor:
    """x in float32 when it is a half type (the statistics' accumulation type), else x."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _SplitNorm(nn.Module):
    """What both norms share: the (1-D) normalised shape, the hidden group, the parameter
    shards and their gradient groups, full <-> shard conversion."""

    def __init__(self, kind: str, normalized_shape, eps, elementwise_affine: bool, bias: bool,
                 expert_mode: bool, transpose: bool, device, dtype):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        normalized_shape = tuple(normalized_shape)
        if len(normalized_shape) != 1:
            raise ValueError(f"axonn_c.{kind} normalises one (the hidden) dimension, got "
                             f"normalized_shape {list(normalized_shape)}")
        self.normalized_shape = normalized_shape
        self.hidden = validate.check_int(f"{kind}: normalized_shape", normalized_shape[0], 1)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        self.expert_mode, self.transpose = bool(expert_mode), bool(transpose)
        self.group = "row" if transpose else "col"
        grid()  # raises before init()
        self._placed_on = session.placement
        g = group_size(self.group) if self.expert_mode else 1
        if self.hidden % g:
            raise ValueError(f"axonn_c.{kind}(expert_mode=True): normalized_shape {self.hidden} "
                             f"must divide by the {self.group} group ({g} ranks)")
        self.local = self.hidden // g
        self._index = (grid().row_rank if transpose else grid().col_rank) if g > 1 else 0
        affine = self.elementwise_affine
        self.weight = (nn.Parameter(torch.ones(self.local, device=device, dtype=dtype))
                       if affine else None)
        self.bias = (nn.Parameter(torch.zeros(self.local, device=device, dtype=dtype))
                     if affine and bias else None)
        self._tag_parameters()

    def _split(self) -> bool:
        return self.expert_mode and group_size(self.group) > 1

    def _tag_parameters(self) -> None:
        # expert layout: the tokens differ over depth and data; the other plane group holds the
        # same tokens and the same shard (each rank's gradient is already the whole one)
        if not self.expert_mode:
            return  # replicated: sync_gradients sums it as any replicated parameter
        for p in (self.weight, self.bias):
            if p is not None:
                p._axonn_grad_groups = ("depth", "data")
                p._axonn_norm_groups = (self.group,)
                grads.hook(p, p._axonn_grad_groups)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._tag_parameters()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._tag_parameters()
        return out

    def _check_input(self, x: Tensor) -> None:
        if session.placement != self._placed_on:
            raise RuntimeError(f"axonn_c.{type(self).__name__} was built on another grid or "
                               "rank place: build it after init(), or move its weights with "
                               "axonn_c.full_state_dict() and load_state_dict()")
        if self._split() and microbatch_active():
            raise RuntimeError(f"axonn_c.{type(self).__name__}(expert_mode=True) does not run on "
                               "run_concurrent's micro-batch threads yet")
        validate.check_tensor(f"{type(self).__name__}: input", x, 1)
        if not x.is_floating_point():  # (as torch's norms: an integer input is refused)
            raise TypeError(f"axonn_c.{type(self).__name__} expects a floating-point input, got "
                            f"{x.dtype}")
        if x.shape[-1] != self.local:
            what = (f"expert layout: {self.hidden}/{group_size(self.group)} over the "
                    f"{self.group} group" if self._split() else "normalized_shape")
            raise ValueError(f"axonn_c.{type(self).__name__} expects the last input dimension "
                             f"to be {self.local} ({what}), got {list(x.shape)}")

    def _out_dtype(self, x: Tensor, serial) -> torch.dtype:
        """The dtype torch's own norm returns for x here: x's, except under an autocast that
        runs norms in float32 (CUDA's). Asked of `serial` on one element, once per autocast
        state and input dtype (memo on the layer)."""
        dev = x.device.type
        if not torch.is_autocast_enabled(dev):
            return x.dtype
        key = (torch.get_autocast_dtype(dev), x.dtype, dev)
        memo = self.__dict__.get("_autocast_dtype")
        if memo is None or memo[0] != key:
            with torch.no_grad():
                one = torch.ones(1, device=x.device, dtype=x.dtype)
                w = None if self.weight is None else self.weight.detach()[:1]
                memo = self.__dict__["_autocast_dtype"] = (key, serial(one, w).dtype)
        return memo[1]

    def _sum_hidden(self, t: Tensor) -> Tensor:
        """Sum of the last dimension over the whole hidden size (all shards), kept."""
        s = t.sum(dim=-1, keepdim=True)
        return AllReduceSum.apply(s, (self.group,)) if self._split() else s

    # ---------------------------------------------------------------- shards <-> full tensors

    def _slice(self):
        return slice(self._index * self.local, (self._index + 1) * self.local)

    @torch.no_grad()
    def load_full(self, weight: Optional[Tensor], bias: Optional[Tensor] = None) -> None:
        for name, full in (("weight", weight), ("bias", bias)):
            p = getattr(self, name)
            if p is None:
                continue
            if full is None or tuple(full.shape) != (self.hidden,):
                raise ValueError(f"full {name} must be [{self.hidden}], got "
                                 f"{None if full is None else list(full.shape)}")
            p.copy_(full[self._slice()])

    def full_tensors(self, prefix: str = "") -> dict:
        """{name: full serial tensor} for full_state_dict (collective over the hidden group)."""
        out = {}
        for name in ("weight", "bias"):
            p = getattr(self, name)
            if p is not None:
                out[prefix + name] = (gather_rows(p.detach(), (self.group,)) if self._split()
                                      else p.detach().clone())
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        w = state_dict.get(prefix + "weight")
        if self._split() and w is not None and w.shape[-1] == self.hidden:  # full serial tensors
            self.load_full(w, state_dict.get(prefix + "bias"))
            state_dict = dict(state_dict)
            for name in ("weight", "bias"):
                if getattr(self, name) is not None:
                    state_dict[prefix + name] = getattr(self, name)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._tag_parameters()


class LayerNorm(_SplitNorm):
    """Drop-in for nn.LayerNorm over the last (hidden) dimension. Easy layout (default): the
    serial layer on full-width rows, parameters replicated. `expert_mode=True`: the input is
    this rank's block of the hidden dimension over the column group (`transpose=True`: the row
    group), `[..., H/G]`, as an expert-mode Linear or Embedding produces; mean and variance are
    summed over that group (two all-reduces of [rows]), so the result is the serial norm's
    block; weight and bias are the matching blocks."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, *, expert_mode: bool = False,
                 transpose: bool = False):
        super().__init__("LayerNorm", normalized_shape, eps, elementwise_affine, bias,
                         expert_mode, transpose, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if not self._split():
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        # two passes (mean, then the centred squares), as the serial kernel: no cancellation;
        # in float32 for half types, as torch's kernels accumulate (fp16 squares overflow)
        xf = _wide(x)
        mean = self._sum_hidden(xf) / self.hidden
        xc = xf - mean
        var = self._sum_hidden(xc * xc) / self.hidden
        y = xc * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        # (torch's norms: the input's dtype, whatever the weight's; float32 under CUDA autocast)
        return y.to(self._out_dtype(x, lambda t, w: F.layer_norm(t, (1,), w)))

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine="
                f"{self.elementwise_affine}, expert_mode={self.expert_mode}, local={self.local}")


class RMSNorm(_SplitNorm):
    """Drop-in for nn.RMSNorm over the last (hidden) dimension, layouts as axonn_c.LayerNorm
    (expert layout: the mean square is summed over the hidden group, one all-reduce of
    [rows]). eps=None is torch.finfo(input dtype).eps, as nn.RMSNorm."""

    def __init__(self, normalized_shape, eps: Optional[float] = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 expert_mode: bool = False, transpose: bool = False):
        super().__init__("RMSNorm", normalized_shape, eps, elementwise_affine, False,
                         expert_mode, transpose, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if not self._split():
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        xf = _wide(x)  # (as LayerNorm)
        # (torch's kernel: the default eps of the type it computes in, float32 for half inputs)
        eps = self.eps if self.eps is not None else torch.finfo(xf.dtype).eps
        y = xf * torch.rsqrt(self._sum_hidden(xf * xf) / self.hidden + eps)
        y = y * self.weight if self.weight is not None else y
        return y.to(self._out_dtype(x, lambda t, w: F.rms_norm(t, (1,), w)))

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine="
                f"{self.elementwise_affine}, expert_mode={self.expert_mode}, local={self.local}")
