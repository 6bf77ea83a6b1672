"""axonn_c.parallel_cross_entropy: cross-entropy of logits sharded by vocabulary, without ever
materialising the full logits (docs/layers.md#vocabulary-parallel-cross-entropy)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import validate
from .autograd_comm import PLANE, all_reduce_, first_order_only, group_index, groups_size

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCE(torch.autograd.Function):
    """Per-row loss log(sum_v exp(z_v)) - z_target over the whole vocabulary: the row max, the
    target logit and the sum of exponentials are reduced over the groups (three small
    all-reduces of [rows] tensors, the last two in one); backward is local:
    d logits = softmax - onehot(target), times the row's gradient."""

    @staticmethod
    def forward(ctx, logits, target, groups, ignore_index):
        n_local = logits.shape[1]
        lo = group_index(groups) * n_local
        x = logits.float()
        row_max = x.max(dim=1).values
        all_reduce_(row_max, groups, op="max")
        z = x - row_max.unsqueeze(1)
        e = torch.exp(z)
        local = target - lo
        mine = (local >= 0) & (local < n_local) & (target != ignore_index)
        idx = torch.where(mine, local, torch.zeros_like(local))
        sums = torch.stack([e.sum(dim=1), torch.where(mine, z.gather(1, idx.unsqueeze(1))[:, 0],
                                                      torch.zeros_like(row_max))])
        all_reduce_(sums, groups, op="sum")
        keep = target != ignore_index
        loss = torch.where(keep, torch.log(sums[0]) - sums[1], torch.zeros_like(row_max))
        e.div_(sums[0].unsqueeze(1))  # the softmax shard, for backward
        ctx.save_for_backward(e, idx, mine, keep)
        ctx.dtype = logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        softmax, idx, mine, keep = ctx.saved_tensors
        g = torch.where(keep, g.float(), torch.zeros_like(g, dtype=torch.float32))
        d = softmax * g.unsqueeze(1)
        d.scatter_add_(1, idx.unsqueeze(1), torch.where(mine, -g, torch.zeros_like(g)).unsqueeze(1))
        return d.to(ctx.dtype), None, None, None


def check_loss_args(what: str, target: Tensor, rows: int, per: str, reduction: str) -> None:
    """A class-index target with one entry per row (`per` names a row in the message; a float
    target is refused, not truncated) and a reduction F.cross_entropy knows."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{what}: reduction must be one of {list(_REDUCTIONS)}, got "
                         f"{reduction!r}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: target must be an int64 or int32 tensor of class indices, got "
                        f"{target.dtype}")
    if target.numel() != rows:
        raise ValueError(f"{what}: target has {target.numel()} elements, expected one per {per} "
                         f"({rows})")


def _check_target(target: Tensor, rows: int, vocab: int, ignore_index: int,
                  reduction: str) -> None:
    check_loss_args("parallel_cross_entropy", target, rows, "logits row", reduction)
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):  # (the same targets on every member: every member raises)
        raise IndexError(f"parallel_cross_entropy: target {int(target[bad][0])} is out of "
                         f"bounds, expected class indices in [0, {vocab}) or ignore_index "
                         f"{ignore_index}")


def parallel_cross_entropy(logits_shard: Tensor, target: Tensor, ignore_index: int = -100,
                           reduction: str = "mean",
                           groups: Union[str, Sequence[str]] = PLANE,
                           vocab_size: Optional[int] = None) -> Tensor:
    """torch.nn.functional.cross_entropy(full_logits, target, ...) computed from this rank's
    vocabulary shard `logits_shard [..., V/n]` (n: the ranks of `groups`; shard i holds the
    words [i*V/n, (i+1)*V/n), i = row_rank*G_intra_c + col_rank for the default plane). Every
    member must hold the same rows (tokens) and the same `target [...]`; every member gets the
    same result. Words a vocabulary padding added must have logit -inf (Embedding.logits does
    that); `vocab_size` (the real vocabulary, without the padding) refuses targets in the
    padding, as F.cross_entropy refuses targets past the full logits (without it only targets
    past the padded size are refused: one in the padding would give an infinite loss).
    Collective over `groups`."""
    groups = (groups,) if isinstance(groups, str) else tuple(groups)
    validate.check_tensor("parallel_cross_entropy: logits_shard", logits_shard, 1)
    validate.check_tensor("parallel_cross_entropy: target", target, 0)
    if not logits_shard.is_floating_point():
        raise TypeError(f"parallel_cross_entropy: logits_shard must be floating point, got "
                        f"{logits_shard.dtype}")
    n_local = logits_shard.shape[-1]
    logits = logits_shard.reshape(-1, n_local)
    padded = n_local * groups_size(groups)
    if vocab_size is not None:
        validate.check_int("parallel_cross_entropy: vocab_size", vocab_size, 1, padded)
    _check_target(target, logits.shape[0], padded if vocab_size is None else vocab_size,
                  ignore_index, reduction)
    flat_target = target.reshape(-1).long()
    loss = _VocabParallelCE.apply(logits, flat_target, groups, int(ignore_index))
    return reduce_loss(loss, flat_target != ignore_index, reduction, target.shape)


def reduce_loss(loss: Tensor, keep: Tensor, reduction: str, shape) -> Tensor:
    """Per-token losses [rows] -> as F.cross_entropy reduces them (mean over the kept rows)."""
    if reduction == "none":
        return loss.view(shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / keep.sum().to(loss.dtype)
