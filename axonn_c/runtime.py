"""init/finalize, the grid object, statistics: process setup around the C communicator."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from . import _C, validate
from .bootstrap import InitStore, env_store

DEFAULT_TIMEOUT_S = 300.0
GROUPS = ("col", "row", "depth", "data", "intra", "world")
_generation = 0  # counts init() calls so each gets fresh store keys
epoch = 0  # changes at every init/finalize: keys caches that depend on the grid
# overlap knobs: init(overlap=...) sets the defaults, optimize_communication() overrides them in
# a context, a layer's own attributes override both (axonn_c/linear.py resolves them per call)
OVERLAP_KNOBS = ("overlap_all_reduce", "overlap_reduce_scatter", "fwd_chunks",
                 "overlap_all_gather", "overlap_data", "defer_wgrad")
overlap_defaults = {"overlap_all_reduce": False, "overlap_reduce_scatter": False,
                    "fwd_chunks": 1, "overlap_all_gather": False, "overlap_data": False,
                    "defer_wgrad": False}
overlap_overrides: dict = {}
# False inside no_grad_sync(): backward does not start data-parallel reductions (process-wide:
# autograd may run backward on another thread)
grad_sync_enabled = True
_sizes = None  # (G_data, G_intra_r, G_intra_c, G_intra_d) of the current init
microbatches = 1  # concurrent_microbatches of the current init (axonn_c/concurrent.py)
# which shards this rank holds: (G_intra_r, G_intra_c, G_intra_d, row_rank, col_rank,
# depth_rank) of the current init, None without one; a plain value, so that torch.compile
# guards on it (axonn_c/linear.py checks a layer's placement against it in compiled code too)
placement = None
sched_config = [1, 0, False]  # prefetch, budget bytes (0: none), cache_weights


# parameter -> the kinds of hook registered on it, once per parameter object; kept here, not
# marked on the tensor: a weak reference attribute would make the model unpicklable
# (torch.save), and a deepcopy or an unpickled copy has the attributes but none of the hooks
_hooked = WeakIdKeyDictionary()


def first_hook(param, kind: str) -> bool:
    """True the first time it is asked for this parameter object and hook kind."""
    kinds = _hooked.setdefault(param, set())
    if kind in kinds:
        return False
    kinds.add(kind)
    return True


def _channels(n: int) -> int:
    """Comm channels for n concurrent micro-batches: one each, channel 0 for the caller (and its
    gradient sums), one for the depth gathers they share and one for the shared dW
    reduce-scatters (axonn_c/concurrent.py)."""
    return n + 3 if n > 1 else 1


def configure_scheduler(prefetch: int, budget: int, cache: bool) -> None:
    _C.sched_configure(prefetch, budget, cache)
    sched_config[:] = [prefetch, budget, cache]


def grid_sizes() -> tuple:
    """(G_data, G_intra_r, G_intra_c, G_intra_d), cached per init (for per-call paths)."""
    global _sizes
    if _sizes is None or _sizes[0] != epoch:
        g = grid()
        _sizes = (epoch, (g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d))
    return _sizes[1]


_SIZE_INDEX = {"data": 0, "row": 1, "col": 2, "depth": 3}


def group_size(name: str) -> int:
    """Ranks in this rank's group `name` (col, row, depth, data, intra, world), from the cache."""
    sizes = grid_sizes()
    if name in _SIZE_INDEX:
        return sizes[_SIZE_INDEX[name]]
    intra = sizes[1] * sizes[2] * sizes[3]
    return intra if name == "intra" else intra * sizes[0]


@dataclass(frozen=True)
class Grid:
    """Sizes of the 4D grid and this rank's coordinates in it."""

    G_data: int
    G_intra_r: int
    G_intra_c: int
    G_intra_d: int
    rank: int
    data_rank: int
    depth_rank: int
    row_rank: int
    col_rank: int
    backends: str

    @property
    def world_size(self) -> int:
        return self.G_data * self.G_intra_r * self.G_intra_c * self.G_intra_d

    @property
    def G_intra(self) -> int:
        return self.G_intra_r * self.G_intra_c * self.G_intra_d

    def members(self, name: str) -> list[int]:
        """Global ranks of this rank's group `name` ("col", "row", "depth", "data", "intra",
        "world"), in group-rank order."""
        return _C.grid_members(self.G_data, self.G_intra_r, self.G_intra_c, self.G_intra_d,
                               self.rank, name)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _make_store(rank: int, world: int, timeout: float):
    """The key-value store ranks meet through: torch's default store when a process group
    exists, else one built from MASTER_ADDR/MASTER_PORT (torchrun's agent store when present)."""
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if world == 1:
        return dist.HashStore()
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun "
            "or set them")
    return env_store(rank, world, timeout)  # one per process (issue 28 item 10)


def init(G_data: int = 1, G_intra_r: int = 1, G_intra_c: int = 1, G_intra_d: int = 1,
         G_inter: int = 1, backend: str | None = None, timeout: float | None = None,
         plan: str | None = None, model=None, overlap: bool = False,
         fwd_chunks: int | None = None, prefetch: int = 1, prefetch_budget: int | None = None,
         cache_weights: bool = False, bucket_size: int = 4 * 2**20,
         concurrent_microbatches: int = 1, **plan_kwargs) -> Grid:
    """Creates the 4D grid and its communicators on every rank (call on all ranks).

    Ranks come from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE);
    without it the process is a world of one. `backend`: None picks shm for CPU tensors on one
    node and nccl for CUDA tensors; "shm" or "nccl" force one. `timeout` (seconds; env
    AXONN_C_TIMEOUT) bounds every wait for a peer. `plan="auto"` lets the communication model
    choose the grid (see axonn_c.plan).

    `overlap=True` turns on every overlap of communication with computation (DESIGN §6, each
    also settable through optimize_communication() or per layer):
    - the expert forward's all-reduce (and backward's dX all-reduce) runs in `fwd_chunks` row
      chunks, each overlapping the next chunk's GEMM (default: chosen by the tensor's size);
    - backward: dX's reduction runs during the dW GEMM; dW's depth reduce-scatter and the
      data-parallel gradient all-reduce (in buckets of `bucket_size` bytes) run during the rest
      of backward and are complete when backward() returns;
    - backward (`defer_wgrad`): a layer's dW GEMM waits for the next layer that waits for a dX
      reduction, and runs under that reduction together with its own (a layer without one,
      e.g. the row-parallel half of a tensor-parallel pair, hands its dW GEMM on);
    - the depth all-gather of each weight is issued `prefetch` layers ahead in the execution
      order learned on the first step, with at most `prefetch_budget` bytes of gathered weights
      alive (None: no bound); `cache_weights=True` keeps a layer's forward gather for its
      backward.

    `concurrent_microbatches=n` (> 1) opens n + 3 independent channels of every group, so that
    axonn_c.run_concurrent() can run n micro-batches at once in threads, one micro-batch's
    GEMMs hiding the others' collectives, while the caller sums finished gradients
    (axonn_c/concurrent.py). Host tensors only: the extra channels open no NCCL communicators.
    """
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if fwd_chunks is not None and (not isinstance(fwd_chunks, int) or not 1 <= fwd_chunks <= 64):
        raise ValueError(f"fwd_chunks must be an int in [1, 64], got {fwd_chunks!r}")
    if not isinstance(prefetch, int) or not 0 <= prefetch <= 64:
        raise ValueError(f"prefetch must be an int in [0, 64] (layers ahead), got {prefetch!r}")
    if prefetch_budget is not None and (not isinstance(prefetch_budget, int)
                                        or prefetch_budget <= 0):
        raise ValueError(f"prefetch_budget must be None or a positive number of bytes, got "
                         f"{prefetch_budget!r}")
    validate.check_int("bucket_size (bytes)", bucket_size, 1, 2**40)
    timeout = validate.timeout_from_env(DEFAULT_TIMEOUT_S) if timeout is None else \
        validate.check_timeout(timeout)  # before any rank touches the store (issue 28 item 1)
    if not isinstance(cache_weights, bool):
        raise TypeError(f"cache_weights must be a bool, got {cache_weights!r}")
    if (not isinstance(concurrent_microbatches, int) or isinstance(concurrent_microbatches, bool)
            or not 1 <= concurrent_microbatches <= 8):
        raise ValueError(f"concurrent_microbatches must be an int in [1, 8], got "
                         f"{concurrent_microbatches!r}")
    overlap_defaults.update(overlap_all_reduce=overlap, overlap_reduce_scatter=overlap,
                            overlap_all_gather=overlap, overlap_data=overlap,
                            defer_wgrad=overlap, fwd_chunks=fwd_chunks or (0 if overlap else 1))
    from . import grads

    grads.bucket_bytes = bucket_size
    sched_cfg = (prefetch, prefetch_budget or 0, cache_weights)
    global _generation
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if plan is not None:
        if plan != "auto":
            raise ValueError(f"plan={plan!r}: expected 'auto' or None")
        from . import plan as planner

        G_data, G_intra_r, G_intra_c, G_intra_d = planner.auto_grid(world, model=model,
                                                                    verbose=rank == 0,
                                                                    **plan_kwargs)
    elif plan_kwargs:
        raise TypeError(f"unexpected arguments {sorted(plan_kwargs)} (only with plan='auto')")
    for name, value in (("G_data", G_data), ("G_intra_r", G_intra_r), ("G_intra_c", G_intra_c),
                        ("G_intra_d", G_intra_d), ("G_inter", G_inter)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if backend not in (None, "auto", "shm", "nccl"):
        raise ValueError(f"backend={backend!r}: expected None, 'shm' or 'nccl'")
    if _C.is_initialized():
        _C.init(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c, G_intra_d=G_intra_d,
                G_inter=G_inter, backend=backend, job_id="", timeout=timeout, cuda_device=-1,
                store_set=None, store_get=None,
                channels=_channels(concurrent_microbatches))  # same: no-op; different: raises
        configure_scheduler(*sched_cfg)
        _set_placement()
        return grid()
    # check the sizes before touching the store, so a wrong grid fails fast on every rank
    product = G_data * G_intra_r * G_intra_c * G_intra_d * G_inter
    if min(G_data, G_intra_r, G_intra_c, G_intra_d) < 1 or product != world or G_inter != 1:
        if G_inter != 1:
            raise ValueError(f"G_inter={G_inter}: pipeline parallelism is not supported, "
                             "expected G_inter=1")
        if min(G_data, G_intra_r, G_intra_c, G_intra_d) < 1:
            raise ValueError(f"grid sizes must be >= 1, got G_data={G_data} G_intra_r={G_intra_r} "
                             f"G_intra_c={G_intra_c} G_intra_d={G_intra_d}")
        raise ValueError(f"grid G_data={G_data} x G_intra_r={G_intra_r} x G_intra_c={G_intra_c} x "
                         f"G_intra_d={G_intra_d} = {product} ranks does not match the world size "
                         f"{world}")
    cuda_device = -1
    if torch.cuda.is_available():
        cuda_device = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(cuda_device)
    _generation += 1
    store = InitStore(dist.PrefixStore(f"axonn_c/{_generation}/",
                                       _make_store(rank, world, timeout)), rank)
    try:
        _C.init(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c, G_intra_d=G_intra_d,
                G_inter=G_inter, backend=backend, job_id=f"gen{_generation}", timeout=timeout,
                cuda_device=cuda_device, store_set=store.set, store_get=store.get,
                channels=_channels(concurrent_microbatches), store_peer_failed=store.peer_failed)
    except BaseException as e:  # the peers stop waiting for this rank at once
        store.publish_failure(e)
        raise
    global epoch, microbatches
    epoch += 1
    microbatches = concurrent_microbatches
    _set_placement()
    grads.reset()
    configure_scheduler(*sched_cfg)
    return grid()


def _set_placement() -> None:
    global placement
    g = grid()
    placement = (g.G_intra_r, g.G_intra_c, g.G_intra_d, g.row_rank, g.col_rank, g.depth_rank)


def finalize() -> None:
    """Releases the communicators; init() may be called again afterwards."""
    from . import grads

    global epoch, microbatches, placement
    epoch += 1
    microbatches, placement = 1, None
    from . import concurrent

    concurrent.reset()
    if is_initialized():
        try:  # what still writes into tensors grads keeps alive completes before they go
            _C.sched_finish()
        except Exception:  # (a dead peer: the collectives end with an error; finalize goes on)
            pass
    grads.reset()
    _C.finalize()


def is_initialized() -> bool:
    return _C.is_initialized()


def grid() -> Grid:
    """The grid of the current init(); raises before init()."""
    g = _C.grid_info()
    return Grid(G_data=g[0], G_intra_r=g[1], G_intra_c=g[2], G_intra_d=g[3], rank=g[4],
                data_rank=g[5], depth_rank=g[6], row_rank=g[7], col_rank=g[8], backends=g[9])


def comm_stats(reset: bool = False) -> dict:
    """Bytes each group has sent and received on this rank (closed-form ring volumes) and its
    number of calls: {"col": {"bytes_sent", "bytes_recv", "calls"}, ...}."""
    return _C.comm_stats(reset)


def reset_comm_stats() -> None:
    _C.reset_comm_stats()


def build_info() -> dict:
    """What the extension was compiled with and what it bound to at run time."""
    info = dict(_C.build_info())
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    return info


def scheduler_stats(reset: bool = False) -> dict:
    """The scheduler's counters on this rank: visits (layer calls with a depth all-gather),
    hits / waits / misses (the gather was complete / in flight / not issued when the layer
    started), prefetches, budget_skips, stale, relearned and off_order (the learned layer
    order), deferred collectives, alive/peak gathered-weight bytes and buffers, order_len,
    pending. `reset` zeroes the counters (peaks restart from what is alive)."""
    return _C.sched_stats(reset)
