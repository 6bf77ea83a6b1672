"""AxoNN-compatible import path: `from axonn_c import axonn as ax; ax.init(G_data=..., ...)`
works like `from axonn import axonn as ax`.

`init` takes AxoNN's arguments; `gpus_per_node` and `enable_internal_timers` are accepted and
ignored (the device is chosen from LOCAL_RANK; timers are not implemented). After init,
`config` holds the sizes and this rank's coordinates under AxoNN's names.
"""
from __future__ import annotations

from types import SimpleNamespace

from .runtime import grid
from .runtime import init as _init

config = SimpleNamespace()
is_initialized = False


def init(G_inter: int = 1, G_data: int = 1, G_intra_r: int = 1, G_intra_c: int = 1,
         G_intra_d: int = 1, gpus_per_node=None, enable_internal_timers: bool = False,
         **kwargs):
    """axonn.axonn.init: the product of the sizes must equal the world size; G_inter (pipeline
    parallelism) must be 1. Extra keyword arguments go to axonn_c.init (backend, timeout)."""
    del gpus_per_node, enable_internal_timers
    global is_initialized
    g = _init(G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c, G_intra_d=G_intra_d,
              G_inter=G_inter, **kwargs)
    config.G_inter, config.G_data = G_inter, g.G_data
    config.G_intra, config.G_intra_r, config.G_intra_c, config.G_intra_d = (
        g.G_intra, g.G_intra_r, g.G_intra_c, g.G_intra_d)
    config.inter_layer_parallel_rank = 0
    config.data_parallel_rank = g.data_rank
    config.intra_layer_depth_parallel_rank = g.depth_rank
    config.intra_layer_row_parallel_rank = g.row_rank
    config.intra_layer_column_parallel_rank = g.col_rank
    config.intra_layer_parallel_rank = (g.depth_rank * g.G_intra_r + g.row_rank) * g.G_intra_c \
        + g.col_rank
    is_initialized = True
    return g


__all__ = ["init", "config", "grid"]
