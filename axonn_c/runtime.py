"""init/finalize and statistics: process setup around the C communicator (what they set
lives in axonn_c/state.py)."""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from . import _C, grads, validate
from . import compression as compression_policy
from .bootstrap import InitStore, env_store
from .state import Grid, configure_scheduler, grid, is_initialized, knobs_changed, session

__all__ = ["init", "finalize", "grid", "is_initialized", "Grid", "comm_stats",
           "reset_comm_stats", "build_info", "scheduler_stats"]

DEFAULT_TIMEOUT_S = 300.0


def _channels(n: int) -> int:
    """Comm channels for n concurrent micro-batches: one each, channel 0 for the caller (and its
    gradient sums), one for the depth gathers they share and one for the shared dW
    reduce-scatters (axonn_c/microbatches.py)."""
    return n + 3 if n > 1 else 1


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


def _one_at_a_time(fn):
    """init() and finalize() hold session.init_lock: a call on another thread while one runs
    waits for its outcome (then init with the same grid returns it, another grid raises)."""
    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with session.init_lock:
            return fn(*args, **kwargs)

    return locked


@_one_at_a_time
def init(G_data: int = 1, G_intra_r: int = 1, G_intra_c: int = 1, G_intra_d: int = 1,
         G_inter: int = 1, backend: str | None = None, timeout: float | None = None,
         plan: str | None = None, model=None, overlap: bool = False,
         fwd_chunks: int | None = None, prefetch: int = 1, prefetch_budget: int | None = None,
         cache_weights: bool = False, bucket_size: int = 4 * 2**20,
         concurrent_microbatches: int = 1, compression=None, **plan_kwargs) -> Grid:
    """Creates the 4D grid and its communicators on every rank (call on all ranks).

    Ranks come from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE);
    without it the process is a world of one. `backend`: None picks shm for CPU tensors on one
    node and nccl for CUDA tensors; "shm" or "nccl" force one. `timeout` (seconds; env
    AXONN_C_TIMEOUT) bounds every wait for a peer. `plan="auto"` lets the communication model
    choose the grid (see axonn_c.plan). Called again on the same grid, init keeps the
    communicators and applies the new overlap, scheduler and compression settings; another
    grid, backend or timeout raises (finalize() first).

    `overlap=True` turns on every overlap of communication with computation
    (docs/ARCHITECTURE.md#one-training-step; each also settable through optimize_communication()
    or per layer):
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
    (axonn_c/microbatches.py). Host tensors only: the extra channels open no NCCL communicators.

    `compression` compresses collectives per grid dimension (docs/compression.md): None,
    a codec ("bf16", "fp8", "int8", "int4") for the data-parallel gradient sums, or a dict
    {"data": ..., "depth": ..., "row": ..., "col": ...} whose values are None, a codec name or
    {"codec": ..., "block": ..., "error_feedback": ...} (error feedback is on by default for
    int8 and int4 on "data"). "data": the gradient sums; "depth", "row", "col": the layers' own
    float32 collectives over that group (no error feedback).
    """
    overlap = validate.check_bool("overlap", overlap)
    if fwd_chunks is not None:
        validate.check_int("fwd_chunks", fwd_chunks, 1, 64)
    validate.check_int("prefetch (layers ahead)", prefetch, 0, 64)
    if prefetch_budget is not None:
        validate.check_int("prefetch_budget (bytes, or None for no bound)", prefetch_budget, 1)
    validate.check_int("bucket_size (bytes)", bucket_size, 1, 2**40)
    policy = compression_policy.parse_policy(compression)
    timeout_given = timeout is not None
    timeout = validate.timeout_from_env(DEFAULT_TIMEOUT_S) if timeout is None else \
        validate.check_timeout(timeout)  # before any rank touches the store (issue 28 item 1)
    cache_weights = validate.check_bool("cache_weights", cache_weights)
    if (not isinstance(concurrent_microbatches, int) or isinstance(concurrent_microbatches, bool)
            or not 1 <= concurrent_microbatches <= 8):
        raise ValueError(f"concurrent_microbatches must be an int in [1, 8], got "
                         f"{concurrent_microbatches!r}")
    def apply_settings():  # (once the grid stands: a refused init changes nothing)
        session.settings_version += 1
        session.overlap_defaults.update(
            overlap_all_reduce=overlap, overlap_reduce_scatter=overlap,
            overlap_all_gather=overlap, overlap_data=overlap, defer_wgrad=overlap,
            fwd_chunks=fwd_chunks or (0 if overlap else 1))
        knobs_changed()  # (after the change)
        session.bucket_bytes = bucket_size
        _C.grad_bucket_bytes(bucket_size)  # (the gradient hooks' buckets, in C)

    sched_cfg = (prefetch, prefetch_budget or 0, cache_weights)
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
    compression_policy.check_transport(policy, backend)
    if _C.is_initialized():
        _check_same_transport(backend, timeout if timeout_given else None)
        _C.init(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c, G_intra_d=G_intra_d,
                G_inter=G_inter, backend=backend, job_id="", timeout=timeout, cuda_device=-1,
                store_set=None, store_get=None,
                channels=_channels(concurrent_microbatches))  # same: no-op; different: raises
        apply_settings()
        configure_scheduler(*sched_cfg)
        _set_placement()
        compression_policy.apply(policy)
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
        launch = ("; RANK and WORLD_SIZE are not set, so this process is a world of one: launch "
                  f"it with torchrun --nproc_per_node {product} (or set RANK/WORLD_SIZE)"
                  if world == 1 and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
                  else "")
        raise ValueError(f"grid G_data={G_data} x G_intra_r={G_intra_r} x G_intra_c={G_intra_c} x "
                         f"G_intra_d={G_intra_d} = {product} ranks does not match the world size "
                         f"{world}{launch}")
    cuda_device = -1
    if torch.cuda.is_available():
        cuda_device = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(cuda_device)
    session.generation += 1
    gen = session.generation
    store = InitStore(dist.PrefixStore(f"axonn_c/{gen}/", _make_store(rank, world, timeout)),
                      rank)
    try:
        _C.init(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c, G_intra_d=G_intra_d,
                G_inter=G_inter, backend=backend, job_id=f"gen{gen}", timeout=timeout,
                cuda_device=cuda_device, store_set=store.set, store_get=store.get,
                channels=_channels(concurrent_microbatches), store_peer_failed=store.peer_failed)
    except BaseException as e:  # the peers stop waiting for this rank at once
        store.publish_failure(e)
        raise
    session.epoch += 1
    session.microbatches = concurrent_microbatches
    session.transport = (backend if backend != "auto" else None, timeout)
    apply_settings()
    _set_placement()
    grads.reset()
    compression_policy.apply(policy)
    # (a new grid: the buckets' layout may differ; the Linears' depth residuals, by layer id,
    # the C runtime cleared when it opened)
    _C.grad_buckets_clear_residuals()
    configure_scheduler(*sched_cfg)
    return grid()


def _check_same_transport(backend, timeout) -> None:
    """A repeated init keeps the communicators: one that asks for another backend or timeout
    (None: whatever the first chose) is refused instead of silently getting the old ones."""
    first_backend, first_timeout = session.transport or (None, None)
    if backend not in (None, "auto", first_backend, grid().backends):
        raise RuntimeError(f"axonn_c is already initialised with backend={first_backend!r} "
                           f"(in use: {grid().backends!r}); call axonn_c.finalize() before init "
                           f"with backend={backend!r}")
    if timeout is not None and first_timeout is not None and timeout != first_timeout:
        raise RuntimeError(f"axonn_c is already initialised with timeout={first_timeout:g} s; "
                           f"call axonn_c.finalize() before init with timeout={timeout:g} s")


def _set_placement() -> None:
    g = grid()
    session.placement = (g.G_intra_r, g.G_intra_c, g.G_intra_d, g.row_rank, g.col_rank,
                         g.depth_rank)


@_one_at_a_time
def finalize() -> None:
    """Releases the communicators; init() may be called again afterwards."""
    # (refused before anything is reset, also while a call closes on another thread)
    if _C.microbatch_running():
        raise RuntimeError("axonn_c.finalize() while run_concurrent runs (from fn, or on another "
                           "thread): finalize after it returns")
    session.epoch += 1
    session.microbatches, session.placement, session.transport = 1, None, None
    if is_initialized():
        try:  # what still writes into tensors grads keeps alive completes before they go
            _C.sched_finish()
        except Exception:  # (a dead peer: the collectives end with an error; finalize goes on)
            pass
    grads.reset()
    compression_policy.apply({})
    _C.grad_buckets_clear_residuals()
    _C.finalize()  # (and the Linears' depth residuals go, after the scheduler drained)


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
    pending; and the gradient buckets': buckets (made), buckets_early (whose sums started
    during backward), buckets_after_holds (of those, at the last chunk of a pass),
    buckets_at_end (started when backward ended), ef_cutoffs (steps whose passes went past 64
    without sync_gradients, so later passes had no error feedback: warned); and what is kept
    alive for work in flight:
    kept_tasks, kept_results, kept_outputs; and the pending gradient records: grad_records (of
    this pass), chunk_records_open (chunk records still waiting for calls), summed_marks
    (parameters whose .grad is marked summed). `reset` zeroes the counters (peaks restart from
    what is alive)."""
    stats = _C.sched_stats(reset)
    stats.update(_C.grad_buckets_stats(reset))
    for kind in ("task", "result", "output"):
        stats[f"kept_{kind}s"] = _C.keeps_count(kind)
    stats.update(_C.grad_records_stats())
    return stats
