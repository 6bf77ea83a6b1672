"""Differentiable collectives over the grid's groups, shared by the vocabulary-parallel
embedding, the loss and the split-hidden norms (docs/layers.md).

Convention (the same as axonn_c.Linear's): a value that every rank of a group holds after a
reduction is *replicated*; the gradient each rank receives for it is the whole gradient, not a
partial one. So the backward of "sum over a group, everyone keeps the result" is the identity
when the consumer is replicated too, and a sum when each rank's consumer only saw its own part
(`AllReduceSum`, used where every rank computes a different share of what follows).

The plane is the row x column part of the grid; its ranks are numbered row-major
(`row_rank * G_intra_c + col_rank`), which is also the order `plane_gather` pools rows in.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

from . import comm
from .state import grid, group_size

PLANE = ("row", "col")  # slowest first: plane index = row_rank * G_intra_c + col_rank


def first_order_only(backward):
    """For an autograd Function's backward computed outside autograd (C GEMMs, collectives):
    under create_graph=True its gradients carry torch's once_differentiable error, so a double
    backward through it raises instead of using gradients silently cut from the graph. (A plain
    backward runs with grad mode off: one flag check.)"""
    once = torch.autograd.function.once_differentiable(backward)

    def run(ctx, *grads):
        return once(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)
    return run


def _nontrivial(groups: Sequence[str]) -> Tuple[str, ...]:
    return tuple(g for g in groups if group_size(g) > 1)


def group_index(groups: Sequence[str]) -> int:
    """This rank's index in the product of `groups` (slowest first)."""
    g = grid()
    ranks = {"row": g.row_rank, "col": g.col_rank, "depth": g.depth_rank, "data": g.data_rank}
    index = 0
    for name in groups:
        if name not in ranks:
            raise ValueError(f"group {name!r} cannot index a shard, expected one of "
                             f"{sorted(ranks)}")
        index = index * group_size(name) + ranks[name]
    return index


def groups_size(groups: Sequence[str]) -> int:
    n = 1
    for name in groups:
        n *= group_size(name)
    return n


def all_reduce_(t: Tensor, groups: Sequence[str], op: str = "sum") -> Tensor:
    """In place over each of `groups` in turn (sum/max over their product); returns t."""
    for name in _nontrivial(groups):
        comm.all_reduce(t, group=name, op=op)
    return t


def gather_rows(x: Tensor, groups: Sequence[str]) -> Tensor:
    """[n, ...] -> [prod(groups) * n, ...]: every member's rows, ordered by group_index."""
    out = x.contiguous()
    for name in reversed(_nontrivial(groups)):  # fastest group first: it ends up innermost
        g = out.new_empty((group_size(name) * out.shape[0], *out.shape[1:]))
        comm.all_gather(g, out, group=name)
        out = g
    return out


def scatter_rows(y: Tensor, groups: Sequence[str]) -> Tensor:
    """gather_rows' adjoint: [prod(groups) * n, ...] -> [n, ...], the sum over the members of
    the rows of this rank's index."""
    out = y.contiguous()
    for name in _nontrivial(groups):  # slowest group first: its pieces are the outermost
        r = out.new_empty((out.shape[0] // group_size(name), *out.shape[1:]))
        comm.reduce_scatter(r, out, group=name)
        out = r
    return out


class GatherRows(torch.autograd.Function):
    """Forward gather_rows, backward scatter_rows (each rank's rows feed every member)."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return gather_rows(x, groups)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return scatter_rows(g, ctx.groups), None


class ScatterRows(torch.autograd.Function):
    """Forward scatter_rows (each member held a partial sum of every member's rows), backward
    gather_rows."""

    @staticmethod
    def forward(ctx, y, groups):
        ctx.groups = groups
        return scatter_rows(y, groups)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return gather_rows(g, ctx.groups), None


class OwnRows(torch.autograd.Function):
    """Rows [i*n : i*n + t] of a tensor every member of `groups` holds identically (i: this
    rank's group_index): no communication forward; backward gathers every member's gradient of
    its own rows, which all members' copies of the tensor stand for."""

    @staticmethod
    def forward(ctx, full, groups, n, t):
        ctx.groups, ctx.n, ctx.t = groups, n, t
        i = group_index(groups)
        return full[i * n:i * n + t].clone()

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        padded = g.new_zeros((ctx.n, *g.shape[1:]))
        padded[:ctx.t] = g
        return gather_rows(padded, ctx.groups), None, None, None


def _split_last(x: Tensor, parts: int) -> Tensor:
    """[t, H] -> [parts, t, H/parts] (the last dimension's blocks, outermost)."""
    t, h = x.shape
    return x.view(t, parts, h // parts).transpose(0, 1).contiguous()


def _join_last(x: Tensor) -> Tensor:
    """_split_last's inverse: [parts, t, h] -> [t, parts * h]."""
    parts, t, h = x.shape
    return x.transpose(0, 1).reshape(t, parts * h)


def scatter_hidden(x: Tensor, hidden: str, other: str) -> Tensor:
    """[t, H] partial sums over the plane -> [t, H/|hidden|], this rank's block of the total:
    reduce-scatter over the hidden group, all-reduce over the other plane group."""
    n = group_size(hidden)
    out = scatter_rows(_split_last(x, n), (hidden,))[0] if n > 1 else x.contiguous().clone()
    return all_reduce_(out, (other,))


def gather_hidden(x: Tensor, hidden: str) -> Tensor:
    """[t, H/|hidden|] -> [t, H]: every member's block of the last dimension."""
    if group_size(hidden) == 1:
        return x
    return _join_last(gather_rows(x.contiguous().unsqueeze(0), (hidden,)))


class ScatterHidden(torch.autograd.Function):
    """scatter_hidden; the result is replicated over the plane's other group, so backward only
    all-gathers the block's gradient over the hidden group."""

    @staticmethod
    def forward(ctx, x, hidden, other):
        ctx.hidden = hidden
        return scatter_hidden(x, hidden, other)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return gather_hidden(g, ctx.hidden), None, None


class GatherHidden(torch.autograd.Function):
    """ScatterHidden's adjoint: [t, H/|hidden|] (replicated over `other`) -> [t, H] on every
    rank; backward: each rank's gradient is a partial (its own use of the full rows), summed
    over the plane and cut to this rank's block."""

    @staticmethod
    def forward(ctx, x, hidden, other):
        ctx.hidden, ctx.other = hidden, other
        return gather_hidden(x, hidden)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return scatter_hidden(g.contiguous(), ctx.hidden, ctx.other), None, None


class AllReduceSum(torch.autograd.Function):
    """Sum over `groups`, every member keeping it; each member's consumer sees only its own part
    of what follows, so the gradient is summed over the members too."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return all_reduce_(x.clone(), groups)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        return all_reduce_(g.clone(), ctx.groups), None


class GatherDepth(torch.autograd.Function):
    """A depth-sharded flat parameter -> its first `numel` elements gathered over depth;
    backward pads the gradient and reduce-scatters it over depth (summing the depth group's
    tokens, as axonn_c.Linear does for its weight)."""

    @staticmethod
    def forward(ctx, shard, numel):
        ctx.numel = numel
        if group_size("depth") == 1:
            return shard[:numel]
        return gather_rows(shard, ("depth",))[:numel]

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        if group_size("depth") == 1:
            return g, None
        n = group_size("depth")
        shard = -(-ctx.numel // n)
        padded = g.new_zeros(shard * n)
        padded[:ctx.numel] = g.reshape(-1)
        return scatter_rows(padded, ("depth",)), None
