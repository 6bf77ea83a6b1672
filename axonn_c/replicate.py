"""Replicated state identical on every rank without a common seed (issue 28 item 5), as
DistributedDataParallel broadcasts module state at construction:

- an axonn_c.Linear's full initial weight and bias are broadcast from world rank 0 when the
  layer is built, so that every rank cuts its shards (and its copy of the bias) out of one
  draw, whatever each rank's random stream;
- at a model's first sync_gradients, every other (replicated) parameter and every buffer is
  broadcast from group rank 0 of the groups it is replicated over, once per tensor.

Both are collective: every rank builds the same layers and calls sync_gradients on the same
model, in the same order (as the rest of the API already requires)."""
from __future__ import annotations

import torch

from . import comm
from .state import first_hook, grid, group_size, is_initialized

# the dtypes the transport reduces; anything else travels as its bytes
_NATIVE = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)


def _broadcast(t: torch.Tensor, groups) -> None:
    """t (in place) = group rank 0's t, over each of `groups` in turn."""
    flat = t.detach().contiguous().reshape(-1)
    wire = flat if flat.dtype in _NATIVE else flat.view(torch.uint8)
    if not wire.is_cuda and "shm" not in grid().backends:  # NCCL only: no host path
        wire = wire.to(torch.cuda.current_device())
    for group in groups:
        if group_size(group) > 1:
            comm.broadcast(wire, src=0, group=group)
    if wire.device != flat.device:
        flat.view(wire.dtype).copy_(wire)
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        with torch.no_grad():
            t.copy_(flat.view(t.shape))


def same_full_init(*tensors) -> None:
    """Every rank's copy of `tensors` (a new Linear's full weight and bias) becomes rank 0's."""
    if not is_initialized() or group_size("world") == 1:
        return
    for t in tensors:
        if t is not None:
            _broadcast(t, ("world",))


def same_replicated_state(model: torch.nn.Module, groups) -> None:
    """The first time each is seen: the model's parameters that no axonn_c layer shards and its
    buffers take group rank 0's values over `groups` (the groups they are replicated over)."""
    if group_size("world") == 1:
        return
    with torch.no_grad():
        for p in model.parameters():
            if not hasattr(p, "_axonn_grad_groups") and first_hook(p, "replicated"):
                _broadcast(p.data, groups)
        for b in model.buffers():
            if first_hook(b, "replicated"):
                _broadcast(b, groups)
