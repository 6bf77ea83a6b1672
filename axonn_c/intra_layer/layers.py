"""AxoNN's `intra_layer.Embedding` and `intra_layer.Conv2d` constructors over axonn_c's layers
(docs/migrating_from_axonn.md says what differs)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

import axonn_c as _pkg

from .. import comm
from ..autograd_comm import first_order_only
from ..conv import Conv2d as _Conv2d
from ..embedding import Embedding as _Embedding
from ..state import group_size


class Embedding(_Embedding):
    """axonn.intra_layer.Embedding's arguments over axonn_c.Embedding.

    `init_method(full_weight)` initialises the full [V, H] table (default: normal, as
    nn.Embedding). `expert_mode=True`: as AxoNN, the output's hidden dimension is split over the
    row (outer) group, or over the column (inner) group with `transpose=True`; the ids must be
    the same over the row x column plane. Easy layout: every rank its own ids, full-width
    output. Unlike AxoNN the table is split by vocabulary over the plane (and depth), not by
    hidden over one group: `weight` is this rank's flat piece of a [local_in_features (words),
    local_out_features (= embedding_dim)] block."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: Optional[Tensor] = None, _freeze: bool = False, *args,
                 transpose: bool = False, init_method=None, expert_mode: bool = False,
                 device=None, dtype=None):
        if args:
            raise TypeError(f"Embedding: unexpected positional arguments {args!r}")
        if init_method is not None:
            if _weight is not None:
                raise ValueError("Embedding: pass either init_method or _weight, not both")
            _weight = torch.empty(num_embeddings, embedding_dim)
            init_method(_weight)
        # axonn_c's expert Embedding splits the hidden dimension over the column group, and
        # over the row group when transposed: AxoNN's default is the row group
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                         scale_grad_by_freq, sparse, _weight, _freeze, device, dtype,
                         expert_mode=expert_mode, transpose=not transpose)
        self.axonn_transpose = bool(transpose)

    @property
    def local_in_features(self) -> int:
        """Words in this rank's block of the table."""
        return self.vocab_local

    @property
    def local_out_features(self) -> int:
        return self.embedding_dim


def _split_dim(x: Tensor, dim: int, group: str) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"Conv2d: dimension {dim} of the input ({x.shape[dim]}) does not divide "
                         f"over the {group} group ({n} ranks)")
    rank = {"row": _pkg.grid().row_rank, "col": _pkg.grid().col_rank,
            "depth": _pkg.grid().depth_rank}[group]
    k = x.shape[dim] // n
    return x.narrow(dim, rank * k, k)


def _join_dim(x: Tensor, dim: int, group: str) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    piece = x.movedim(dim, 0).contiguous()
    out = piece.new_empty((n * piece.shape[0], *piece.shape[1:]))
    comm.all_gather(out, piece, group=group)
    return out.movedim(0, dim)


class _Scatter(torch.autograd.Function):
    """This rank's slice of a tensor every member holds (backward: the slices joined)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_dim(x, dim, group).contiguous()

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return _join_dim(g, ctx.dim, ctx.group), None, None


class _Join(torch.autograd.Function):
    """Every member's slice joined (backward: this rank's slice of the gradient)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _join_dim(x, dim, group)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return _split_dim(g, ctx.dim, ctx.group).contiguous(), None, None


class Conv2d(_Conv2d):
    """axonn.intra_layer.Conv2d's arguments over axonn_c.Conv2d (expert layout inside).

    `forward(x, scatter_input=True, gather_output=True)`: AxoNN's old easy API, where every
    rank of the grid holds the same full batch `x [B, C, H, W]`; the layer takes its input
    channels (column group; row with `transpose=True`) and its batch slice (depth), and gathers
    the output channels and batch back. With both False, `x` is this rank's expert-layout block
    `[B/G_d, C/G_in, H, W]` and so is the output `[B/G_d, OC/G_out, H', W']`. `weight` is
    axonn_c.Conv2d's flat depth shard of the [local_out_channels, local_in_channels, k, k]
    block; the state dict's keys are `weight` and `bias`, as AxoNN's. `expert_mode` is accepted
    for symmetry with Linear and Embedding: the layer computes in the expert layout either
    way."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, *args,
                 transpose: bool = False, bias: bool = True, skip_bias_add: bool = False,
                 init_method=None, stride=1, padding=0, dilation=1, groups: int = 1,
                 expert_mode: bool = True):
        if args:
            raise TypeError(f"Conv2d: unexpected positional arguments {args!r}")
        if skip_bias_add:
            raise NotImplementedError("Conv2d: skip_bias_add=True is not supported")
        del expert_mode  # (always the expert layout inside, see above)
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, bias=bias, transpose=transpose,
                         expert_mode=True, init_method=init_method)
        self.in_group, self.out_group = ("row", "col") if transpose else ("col", "row")

    @property
    def local_in_channels(self) -> int:
        return self.in_channels // group_size(self.in_group)

    @property
    def local_out_channels(self) -> int:
        return self.out_channels // group_size(self.out_group)

    def forward(self, x: Tensor, scatter_input: bool = True, gather_output: bool = True,
                cache_weights_in_all_gather: bool = False) -> Tensor:
        del cache_weights_in_all_gather  # (init(cache_weights=)/optimize_communication's)
        if x.dim() != 4:
            raise ValueError(f"intra_layer.Conv2d expects a batch [N, C, H, W], got input of "
                             f"shape {list(x.shape)}")
        if scatter_input:
            x = _Scatter.apply(_Scatter.apply(x, 1, self.in_group), 0, "depth")
        y = super().forward(x)
        if gather_output:
            y = _Join.apply(_Join.apply(y, 1, self.out_group), 0, "depth")
        return y
