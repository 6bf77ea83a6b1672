"""axonn_c: 4D hybrid parallel training (3D tensor parallelism x data parallelism) for PyTorch.

The core is C (axonn_c._C); this package is the thin Python API over it.
"""
import torch  # noqa: F401  (loads libtorch/libcudart/libnccl that the core binds to)

from . import _C, comm
from ._C import CommError, CommTimeoutError, Work
from .auto_parallel import auto_parallelize
from .chunking import Sequential, forward_backward
from .compression import compression_state, load_compression_state
from .conv import Conv1D, Conv2d
from .embedding import Embedding
from .linear import Linear
from .loss import parallel_cross_entropy
from .microbatches import run_concurrent
from .norm import LayerNorm, RMSNorm
from .parallel import (clip_grad_norm_, finish_grads, full_state_dict,
                       no_grad_sync, no_sync, optimize_communication, sync_gradients)
from .runtime import scheduler_stats
from .runtime import Grid, build_info, comm_stats, finalize, grid, init, is_initialized, reset_comm_stats
from . import models  # (axonn_c.models.GPT)

__all__ = [
    "Linear", "Conv2d", "Conv1D", "Embedding", "LayerNorm", "RMSNorm", "parallel_cross_entropy", "init", "finalize",
    "grid", "is_initialized", "Grid", "comm", "comm_stats",
    "reset_comm_stats", "build_info", "CommError", "CommTimeoutError", "Work",
    "sync_gradients", "no_grad_sync", "no_sync", "finish_grads", "clip_grad_norm_", "full_state_dict", "auto_parallelize",
    "optimize_communication", "timeline", "scheduler_stats", "run_concurrent", "Sequential", "forward_backward",
    "compression_state", "load_compression_state", "models",
]
__version__ = "0.1.0"


def __getattr__(name):
    # axonn_c.checkpoint and axonn_c.timeline on first use: importing torch.distributed.checkpoint
    # at every `import axonn_c` would cost its import time, and `python -m axonn_c.checkpoint`
    # (or .timeline) warns when `import axonn_c` imported the module before it runs as __main__
    if name in ("checkpoint", "timeline"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'axonn_c' has no attribute {name!r}")
