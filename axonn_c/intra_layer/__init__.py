"""AxoNN-compatible import path: `from axonn_c.intra_layer import Linear, sync_gradients, ...`
works like `from axonn.intra_layer import ...` for code migrating from AxoNN."""
from ..linear import Linear
from ..parallel import (auto_parallelize, clip_grad_norm_, full_state_dict, no_grad_sync,
                        optimize_communication, sync_gradients)

__all__ = ["Linear", "auto_parallelize", "optimize_communication", "sync_gradients",
           "clip_grad_norm_", "no_grad_sync", "full_state_dict"]
