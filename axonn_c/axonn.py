"""AxoNN-compatible import path: `from axonn_c import axonn as ax; ax.init(G_data=..., ...)`
works like `from axonn import axonn as ax`.

`init` takes AxoNN's arguments; `gpus_per_node` and `enable_internal_timers` are accepted and
ignored (the device is chosen from LOCAL_RANK; timers are not implemented). As in AxoNN it may
be called again, with other sizes: the grid is then rebuilt (layers built on the old grid must
be rebuilt). After init, `config` holds the sizes and this rank's coordinates under AxoNN's
names, and `comm_handle` the torch.distributed groups of the grid (docs/migrating_from_axonn.md).
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from . import _C, runtime
from .runtime import grid

# AxoNN's module attributes (its code reads them off the module)
config = SimpleNamespace()
is_initialized = False
comm_handle = None


class CommHandle:
    """AxoNN's `communication_handle`: this rank's place in the grid and the grid's groups as
    torch.distributed process groups (inner = column, outer = row, depth, data, and the whole
    intra-layer block), laid out like axonn_c's grid.

    axonn_c's layers do not use these groups (they run on axonn_c's own transport); they are
    for code that shards or gathers tensors itself (axonn_c.intra_layer.communication). Each
    kind of group is created on its first use, with torch.distributed.new_group for every group
    of that kind: the first use is collective (every rank of the world must make it, in the
    same order). Without a torch.distributed default group one is initialised from the
    torchrun environment (gloo; nccl too when CUDA is available)."""

    _KINDS = {"inner_intra_layer_parallel_group": "col",
              "outer_intra_layer_parallel_group": "row",
              "depth_intra_layer_parallel_group": "depth",
              "data_parallel_group": "data",
              "intra_layer_group": "intra"}

    def __init__(self, g):
        self._grid = g
        self.world_rank, self.world_size = g.rank, g.world_size
        self.data_parallel_rank = g.data_rank
        self.inter_layer_parallel_rank = 0
        self.intra_layer_depth_parallel_rank = g.depth_rank
        self.intra_layer_row_parallel_rank = g.row_rank
        self.intra_layer_column_parallel_rank = g.col_rank
        self.intra_layer_parallel_rank = g.rank % g.G_intra
        self.G_inter, self.G_data, self.G_intra = 1, g.G_data, g.G_intra
        self.G_intra_r, self.G_intra_c, self.G_intra_d = g.G_intra_r, g.G_intra_c, g.G_intra_d
        self._groups = {}

    def __getattr__(self, name):
        kind = CommHandle._KINDS.get(name)
        if kind is None:
            raise AttributeError(f"comm_handle has no attribute {name!r}")
        if kind not in self._groups:
            self._groups[kind] = self._make_groups(kind)
        return self._groups[kind]

    def _make_groups(self, kind):
        g = self._grid
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend, rank=g.rank, world_size=g.world_size)
        if dist.get_world_size() != g.world_size:
            raise RuntimeError(f"comm_handle: torch.distributed's world has "
                               f"{dist.get_world_size()} ranks, the axonn_c grid "
                               f"{g.world_size}")
        sizes = (g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d)
        # every group of this kind, in the order of its first member (the same on every rank)
        every, mine = {}, None
        for r in range(g.world_size):
            members = tuple(_C.grid_members(*sizes, r, kind))
            every.setdefault(members[0], members)
        for first in sorted(every):
            members = every[first]
            pg = dist.new_group(list(members))
            if g.rank in members:
                mine = pg
        return mine


def init(G_inter: int = 1, G_data: int = 1, G_intra_r: int = 1, G_intra_c: int = 1,
         G_intra_d: int = 1, gpus_per_node=None, enable_internal_timers: bool = False,
         **kwargs):
    """axonn.axonn.init: the product of the sizes must equal the world size; G_inter (pipeline
    parallelism) must be 1. Extra keyword arguments go to axonn_c.init (backend, timeout).
    Called again with other sizes, it finalises the old grid and builds the new one (AxoNN
    re-initialises too); with the same sizes it keeps the grid (asking for another backend or
    timeout then raises, as axonn_c.init does). Either way `comm_handle` is
    new (its groups are made again on first use: torch's groups may have been destroyed)."""
    del gpus_per_node, enable_internal_timers
    global is_initialized, comm_handle
    if runtime.is_initialized():
        old = grid()
        if (old.G_data, old.G_intra_r, old.G_intra_c, old.G_intra_d) != (
                G_data, G_intra_r, G_intra_c, G_intra_d):
            runtime.finalize()
            # (an init that fails below leaves no stale description of the old grid)
            is_initialized, comm_handle = False, None
    g = runtime.init(G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c,
                     G_intra_d=G_intra_d, G_inter=G_inter, **kwargs)
    config.G_inter, config.G_data = G_inter, g.G_data
    config.G_intra, config.G_intra_r, config.G_intra_c, config.G_intra_d = (
        g.G_intra, g.G_intra_r, g.G_intra_c, g.G_intra_d)
    config.inter_layer_parallel_rank = 0
    config.data_parallel_rank = g.data_rank
    config.intra_layer_depth_parallel_rank = g.depth_rank
    config.intra_layer_row_parallel_rank = g.row_rank
    config.intra_layer_column_parallel_rank = g.col_rank
    config.intra_layer_parallel_rank = g.rank % g.G_intra
    comm_handle = CommHandle(g)
    is_initialized = True
    return g


_ALIASED = ("axonn_c.axonn", "axonn_c.intra_layer", "axonn_c.intra_layer.communication")


def install_import_alias() -> None:
    """Makes `import axonn`, `from axonn import axonn as ax` and `from axonn.intra_layer[...]
    import ...` resolve to these compatibility modules, so that AxoNN code (its test suite)
    runs unmodified. Refuses when a real `axonn` package is already imported."""
    import importlib

    present = sys.modules.get("axonn")
    if present is not None and not getattr(present, "__name__", "").startswith("axonn_c"):
        raise RuntimeError(f"install_import_alias: a module 'axonn' is already imported "
                           f"({getattr(present, '__file__', present)!r}); refusing to shadow it")
    for name in _ALIASED:
        importlib.import_module(name)
    sys.modules["axonn"] = sys.modules["axonn_c"]
    for name in _ALIASED:
        sys.modules["axonn" + name[len("axonn_c"):]] = sys.modules[name]


__all__ = ["init", "config", "grid", "comm_handle", "is_initialized", "CommHandle",
           "install_import_alias"]
