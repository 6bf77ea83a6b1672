"""AxoNN-compatible import path: `from axonn_c.intra_layer import Linear, sync_gradients, ...`
works like `from axonn.intra_layer import ...` for code migrating from AxoNN
(docs/migrating_from_axonn.md lists what still differs)."""
from .. import _C, grads
from ..linear import Linear
from ..auto_parallel import auto_parallelize
from ..parallel import (clip_grad_norm_, full_state_dict, no_grad_sync,
                        optimize_communication, sync_gradients, sync_gradients_depth_parallel)
from ..state import is_initialized
from . import communication
from .communication import Drop, Gather
from .layers import Conv2d, Embedding


def clear_weights_cache() -> None:
    """AxoNN's: drops the depth-gathered weights kept for reuse. axonn_c never keeps one past
    a training step (the scheduler frees them when backward ends), so this only ends the step
    early: a forward-only step's gathered (cached or prefetched) weights are freed now."""
    if not is_initialized():
        return
    if not grads.idle():
        raise RuntimeError("clear_weights_cache: a backward pass is still running; call it "
                           "after backward() (AxoNN: after the optimizer step)")
    _C.sched_finish()
    _C.sched_step_end()


__all__ = ["Linear", "Embedding", "Conv2d", "auto_parallelize", "optimize_communication",
           "sync_gradients", "sync_gradients_depth_parallel", "clip_grad_norm_", "no_grad_sync",
           "full_state_dict", "clear_weights_cache", "communication", "Drop", "Gather"]
