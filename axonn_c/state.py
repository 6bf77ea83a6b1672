"""What init() set, in one object (`session`), and the grid queries every module asks.

The bottom of the package: it imports only the C extension, so every other module can read the
session without importing the modules that change it (axonn_c/runtime.py: init and finalize).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import MappingProxyType

from torch.utils.weak import WeakIdKeyDictionary

from . import _C

GROUPS = ("col", "row", "depth", "data", "intra", "world")
# overlap knobs: init(overlap=...) sets the defaults, optimize_communication() overrides them in
# a context, a layer's own attributes override both (axonn_c/linear.py resolves them per call)
OVERLAP_KNOBS = ("overlap_all_reduce", "overlap_reduce_scatter", "fwd_chunks",
                 "overlap_all_gather", "overlap_data", "defer_wgrad")
_SIZE_INDEX = MappingProxyType({"data": 0, "row": 1, "col": 2, "depth": 3})


def _knobs_off() -> dict:
    return {"overlap_all_reduce": False, "overlap_reduce_scatter": False, "fwd_chunks": 1,
            "overlap_all_gather": False, "overlap_data": False, "defer_wgrad": False}


class ThreadState(threading.local):
    """Per-thread session state (see Session.thread). The defaults are class attributes so that
    reading an unset one is a plain lookup: a missing attribute of a threading.local raises
    AttributeError internally, which cost microseconds in every forward and gradient hook."""

    microbatch = None  # run_concurrent: this thread's micro-batch index
    hold_target = None  # axonn_c.Sequential: the child call that holds its chunk's results
    hold_depth = 0  # axonn_c.Sequential: nesting of chunk-holding calls
    pass_ = None  # axonn_c.Sequential: the chunk-pipelined pass running on this thread
    auto = None  # auto_parallelize(): the open context


@dataclass(eq=False)
class Session:
    """The process's axonn_c session: one instance, `session`."""

    generation: int = 0  # counts init() calls so each gets fresh store keys
    # held by init() and finalize(): a second thread's call waits for the first's outcome (the
    # C init lets go of the interpreter lock while it waits for the ranks)
    init_lock: threading.RLock = field(default_factory=threading.RLock)
    epoch: int = 0  # changes at every init/finalize: keys caches that depend on the grid
    # changes at every init(), a repeated one on the same grid too: what a context set and
    # restores on exit (optimize_communication) is not restored over a newer init's settings
    settings_version: int = 0
    overlap_defaults: dict = field(default_factory=_knobs_off)
    overlap_overrides: dict = field(default_factory=dict)
    # changes whenever overlap_defaults or overlap_overrides do: keys what a layer decided from
    # them (Linear._handle, Linear._plain_memo)
    knobs_version: int = 0
    sizes: tuple = None  # (epoch, (G_data, G_intra_r, G_intra_c, G_intra_d))
    microbatches: int = 1  # concurrent_microbatches of the current init (microbatches.py)
    # which shards this rank holds: (G_intra_r, G_intra_c, G_intra_d, row_rank, col_rank,
    # depth_rank) of the current init, None without one; a plain value, so that torch.compile
    # guards on it (axonn_c/linear.py checks a layer's placement against it in compiled code)
    placement: tuple = None
    transport: tuple = None  # (backend asked for, timeout) of the current init
    sched_config: tuple = (1, 0, False)  # prefetch, budget bytes (0: none), cache_weights
    bucket_bytes: int = 4 * 2**20  # data-parallel gradient bucket size (init(bucket_size=))
    # the compression policy in force ({dimension: (codec, block, error_feedback)}, compression.py)
    compression: dict = field(default_factory=dict)
    # parameter -> the kinds of hook registered on it, once per parameter object; kept here,
    # not marked on the tensor: a weak reference attribute would make the model unpicklable
    # (torch.save), and a deepcopy or an unpickled copy has the attributes but none of the hooks
    hooked: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    # (MASTER_ADDR, MASTER_PORT, rank, world) -> the store built from them, kept for later
    # inits (axonn_c/bootstrap.py)
    env_stores: dict = field(default_factory=dict)
    # the asynchronous checkpoint save in flight (axonn_c/checkpoint.py SaveHandle), or None:
    # the next save or load joins it
    checkpoint_pending: object = None
    # per thread: `microbatch` (index) on a run_concurrent thread; `hold_target`,
    # `hold_depth` and `pass_` while axonn_c.Sequential pipelines chunks (chunking.py); `auto`
    # inside auto_parallelize()
    thread: ThreadState = field(default_factory=ThreadState)


session = Session()


def first_hook(param, kind: str) -> bool:
    """True the first time it is asked for this parameter object and hook kind."""
    kinds = session.hooked.setdefault(param, set())
    if kind in kinds:
        return False
    kinds.add(kind)
    return True


def forget_hook(param, kind: str) -> None:
    """Undoes first_hook (the hook it allowed could not be registered): asked again, it says
    True."""
    kinds = session.hooked.get(param)
    if kinds is not None:
        kinds.discard(kind)


def microbatch_active() -> bool:
    """True on a micro-batch thread of run_concurrent (while its fn runs)."""
    return session.thread.microbatch is not None


def refuse_cuda(device) -> None:
    raise NotImplementedError(
        "run_concurrent runs CPU micro-batches only: torch's autograd runs all CUDA backward "
        "passes on one device thread, so concurrent CUDA micro-batches would not overlap (and "
        f"their collectives would leave the micro-batch channels); got a tensor on {device}")


def overlap_knob(name: str):
    """The knob's value from optimize_communication(), else from init()."""
    return session.overlap_overrides.get(name, session.overlap_defaults[name])


def knobs_changed() -> None:
    """After overlap_defaults or overlap_overrides changed: what a layer decided from them is
    stale, and the gradient hooks (in C) read the data overlap knob now in force."""
    session.knobs_version += 1
    _C.grad_overlap_data(bool(overlap_knob("overlap_data")))


def configure_scheduler(prefetch: int, budget: int, cache: bool) -> None:
    _C.sched_configure(prefetch, budget, cache)
    session.sched_config = (prefetch, budget, cache)


def is_initialized() -> bool:
    return _C.is_initialized()


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


def grid() -> Grid:
    """The grid of the current init(); raises before init()."""
    g = _C.grid_info()
    return Grid(G_data=g[0], G_intra_r=g[1], G_intra_c=g[2], G_intra_d=g[3], rank=g[4],
                data_rank=g[5], depth_rank=g[6], row_rank=g[7], col_rank=g[8], backends=g[9])


def grid_sizes() -> tuple:
    """(G_data, G_intra_r, G_intra_c, G_intra_d), cached per init (for per-call paths)."""
    s = session.sizes
    if s is None or s[0] != session.epoch:
        g = grid()
        s = session.sizes = (session.epoch, (g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d))
    return s[1]


def group_size(name: str) -> int:
    """Ranks in this rank's group `name` (col, row, depth, data, intra, world), from the cache."""
    sizes = grid_sizes()
    if name in _SIZE_INDEX:
        return sizes[_SIZE_INDEX[name]]
    intra = sizes[1] * sizes[2] * sizes[3]
    return intra if name == "intra" else intra * sizes[0]
