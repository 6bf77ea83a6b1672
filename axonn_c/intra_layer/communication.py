"""`axonn.intra_layer.communication` for code migrating from AxoNN: split a tensor over a
torch.distributed group and put it back together (e.g. over the groups of
`axonn_c.axonn.comm_handle`). These run through torch.distributed, not through axonn_c's own
transport: they are for sharding inputs and checking results, not for the layers' traffic.

`process_group=None` is torch's default (world) group."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..autograd_comm import first_order_only

__all__ = ["_drop", "_gather", "Drop", "Gather"]


def _size_and_rank(process_group):
    if not dist.is_initialized():
        raise RuntimeError("axonn_c.intra_layer.communication works over torch.distributed "
                           "groups: call torch.distributed.init_process_group() first (or use "
                           "the groups of axonn_c.axonn.comm_handle, which creates it)")
    return dist.get_world_size(process_group), dist.get_rank(process_group)


def _drop(input_: Tensor, dim: int, process_group=None) -> Tensor:
    """This rank's equal slice of `input_` along `dim` (slice i for group rank i), a view."""
    size, rank = _size_and_rank(process_group)
    if size == 1:
        return input_
    if input_.shape[dim] % size:
        raise ValueError(f"_drop: dimension {dim} of size {input_.shape[dim]} does not divide "
                         f"over the group's {size} ranks")
    n = input_.shape[dim] // size
    return input_.narrow(dim, rank * n, n)


def _gather(input_: Tensor, dim: int, process_group=None, cache: bool = False) -> Tensor:
    """Every member's `input_` concatenated along `dim` in group-rank order (the inverse of
    _drop). `cache` is accepted for AxoNN's signature; nothing is cached."""
    del cache
    size, rank = _size_and_rank(process_group)
    if size == 1:
        return input_
    piece = input_.contiguous()
    pieces = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(pieces, piece, group=process_group)
    pieces[rank] = piece
    return torch.cat(pieces, dim=dim)


class Drop(torch.autograd.Function):
    """Forward _drop, backward _gather (the input is the same on every member)."""

    @staticmethod
    def forward(ctx, input_, process_group=None, dim=-1):
        ctx.process_group, ctx.dim = process_group, dim
        return _drop(input_, dim, process_group)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_output):
        return _gather(grad_output, ctx.dim, ctx.process_group), None, None


class Gather(torch.autograd.Function):
    """Forward _gather, backward _drop (the output is the same on every member)."""

    @staticmethod
    def forward(ctx, input_, process_group=None, dim=-1):
        ctx.process_group, ctx.dim = process_group, dim
        return _gather(input_, dim, process_group)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_output):
        return _drop(grad_output, ctx.dim, ctx.process_group), None, None
