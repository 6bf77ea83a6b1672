"""Collectives over the grid's groups, executed by the C transport.

Groups: "col", "row", "depth", "data", "intra", "world". Every call takes `async_op`: False waits;
True returns a Work whose wait() completes it (CPU: the output holds the result; CUDA: the
current stream is ordered after the collective).
"""
from __future__ import annotations

import torch

from . import _C

_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _ALL_TO_ALL, _BROADCAST, _BARRIER = range(6)


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if getattr(t, "is_cuda", False) else 0


def all_reduce(tensor: torch.Tensor, group: str = "world", op: str = "sum", async_op: bool = False):
    """In place: tensor = op over the group (op: "sum", "avg", "max")."""
    return _C.collective(_ALL_REDUCE, group, tensor, tensor, op, 0, _stream(tensor), async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: str = "world",
               async_op: bool = False):
    """output (G x input.numel()) = every member's input in group-rank order."""
    return _C.collective(_ALL_GATHER, group, output, input, "sum", 0, _stream(input), async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: str = "world",
                   op: str = "sum", async_op: bool = False):
    """input has G pieces; output = op over members of the piece of this rank's group index."""
    return _C.collective(_REDUCE_SCATTER, group, output, input, op, 0, _stream(input), async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: str = "world",
               async_op: bool = False):
    """Piece k of input goes to group rank k; piece k of output comes from group rank k."""
    return _C.collective(_ALL_TO_ALL, group, output, input, "sum", 0, _stream(input), async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: str = "world", async_op: bool = False):
    """In place: every member gets the tensor of group rank `src`."""
    return _C.collective(_BROADCAST, group, tensor, tensor, "sum", src, _stream(tensor), async_op)


def barrier(group: str = "world", async_op: bool = False):
    """Returns once every member of the group has called barrier."""
    return _C.collective(_BARRIER, group, None, None, "sum", 0, 0, async_op)
