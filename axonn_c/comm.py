"""Collectives over the grid's groups, executed by the C transport.

Groups: "col", "row", "depth", "data", "intra", "world". Every call takes `async_op`: False waits;
True returns a Work whose wait() completes it (CPU: the output holds the result; CUDA: the
current stream is ordered after the collective).

all_reduce, reduce_scatter and all_gather take `compression=`: None (exact, as without it), a
codec name ("none", "bf16", "fp8", "int8", "int4") or a dict {"codec": name, "block": int,
"error_feedback": residual}. float32 CPU tensors on the shm backend; docs/compression.md has the
formats, the error bounds and the byte counts.
"""
from __future__ import annotations

import torch

from . import _C, validate

_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _ALL_TO_ALL, _BROADCAST, _BARRIER = range(6)


CODECS = ("none", "bf16", "fp8", "int8", "int4")
_COMPRESSION_KEYS = ("codec", "block", "error_feedback")


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if getattr(t, "is_cuda", False) else 0


def compression_args(compression):
    """(codec, block, residual) of a `compression=` value, or None for an exact collective.

    block 0 is the codec's default; residual is the caller's float32 error-feedback buffer
    (same shape as the input, updated in place) or None."""
    if compression is None:
        return None
    spec = {"codec": compression} if isinstance(compression, str) else compression
    if not isinstance(spec, dict):
        raise TypeError("compression must be None, a codec name or a dict with keys "
                        f"{list(_COMPRESSION_KEYS)}, got {type(compression).__name__}")
    unknown = sorted(set(spec) - set(_COMPRESSION_KEYS))
    if unknown:
        raise ValueError(f"unknown compression keys {unknown}, expected some of "
                         f"{list(_COMPRESSION_KEYS)}")
    codec = spec.get("codec")
    if codec not in CODECS:
        raise ValueError(f"unknown compression codec {codec!r}, expected one of {list(CODECS)}")
    block = spec.get("block") or 0
    if not isinstance(block, int) or isinstance(block, bool):
        raise TypeError(f"compression block must be an int, got {type(block).__name__}")
    residual = spec.get("error_feedback")
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise TypeError("compression error_feedback must be the float32 residual tensor (same "
                        f"shape as the input) or None, got {type(residual).__name__}")
    if codec == "none":
        return None
    return codec, block, residual


def _compressed(kind, group, output, input, op, async_op, args):
    codec, block, residual = args
    return _C.compressed_collective(kind, group, output, input, op, _stream(input), async_op,
                                    codec, block, residual)


def all_reduce(tensor: torch.Tensor, group: str = "world", op: str = "sum", async_op: bool = False,
               compression=None):
    """In place: tensor = op over the group (op: "sum", "avg", "max"; compressed: sum, avg)."""
    args = compression_args(compression)
    if args is not None:
        return _compressed(_ALL_REDUCE, group, tensor, tensor, op, async_op, args)
    return _C.collective(_ALL_REDUCE, group, tensor, tensor, op, 0, _stream(tensor), async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: str = "world",
               async_op: bool = False, compression=None):
    """output (G x input.numel()) = every member's input in group-rank order."""
    args = compression_args(compression)
    if args is not None:
        return _compressed(_ALL_GATHER, group, output, input, "sum", async_op, args)
    return _C.collective(_ALL_GATHER, group, output, input, "sum", 0, _stream(input), async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: str = "world",
                   op: str = "sum", async_op: bool = False, compression=None):
    """input has G pieces; output = op over members of the piece of this rank's group index."""
    args = compression_args(compression)
    if args is not None:
        return _compressed(_REDUCE_SCATTER, group, output, input, op, async_op, args)
    return _C.collective(_REDUCE_SCATTER, group, output, input, op, 0, _stream(input), async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: str = "world",
               async_op: bool = False):
    """Piece k of input goes to group rank k; piece k of output comes from group rank k."""
    return _C.collective(_ALL_TO_ALL, group, output, input, "sum", 0, _stream(input), async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: str = "world", async_op: bool = False):
    """In place: every member gets the tensor of group rank `src`."""
    validate.check_int("broadcast src (a rank of the group)", src, 0)
    return _C.collective(_BROADCAST, group, tensor, tensor, "sum", src, _stream(tensor), async_op)


def barrier(group: str = "world", async_op: bool = False):
    """Returns once every member of the group has called barrier."""
    return _C.collective(_BARRIER, group, None, None, "sum", 0, 0, async_op)
