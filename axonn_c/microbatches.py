"""Concurrent micro-batches: over-decomposition across the whole model (Tensor3D).

Within one layer a collective can only hide behind that layer's own GEMMs; a tensor-parallel
forward all-reduce that takes longer stays exposed, because the next layer needs its result.
`run_concurrent(fn, *inputs)` splits the inputs into n micro-batches (n =
init(concurrent_microbatches=n)) and runs `fn` on each at once, one thread per micro-batch:
while one micro-batch waits for an all-reduce, another computes. Both forward and backward
overlap this way, since `fn` is a whole forward + backward (CPU autograd runs a backward on the
thread that calls it).

Ordering: collectives are matched across ranks in issue order, and threads issue in no fixed
order relative to each other, so micro-batch i uses channel i + 1, an independent copy of every
group (csrc/comm: axc_comm_set_thread_channel; shm gives each its own slots and progress
thread). Inside a micro-batch thread the cross-layer scheduler's shared state stays unused:
dW's depth reduce-scatter runs in the layer's backward, and gradients accumulate into .grad
through autograd (which serialises the adds).

The shared decisions are made in C (csrc/grads/microbatch.c, one call object held by the
runtime); this module runs the threads (they run user Python), registers the autograd hook and
makes thin calls.

Depth gathers are shared: the first micro-batch to reach a layer (in a phase, for its k-th use
there) all-gathers the weight on the gather channel (n + 1), the others wait for it and use the
same buffer, which is dropped once all n have. The order of first arrivals is the order in
which the uses first occur in the (identical) program of the threads, whichever thread gets
there first, so every rank issues the gathers in the same order; the next call prefetches one
ahead along it. dW's depth reduce-scatters are shared the same way (channel n + 2).

Gradient sums: with `model=` the calling thread is a reducer on channel 0 while the
micro-batches run. A post-accumulate hook counts, per parameter, the micro-batches whose
gradient has arrived; C buckets the parameters in a fixed order (reverse registration, about
the order backward finishes them) and hands the reducer each bucket as soon as all n
micro-batches have added to it, which it sums over its groups (sync_gradients' groups): the
order, the buckets, the loop over them, the sums and the summed-over marks are C's
(_C.microbatch_begin, _C.microbatch_reduce_all). The fixed order keeps the ranks' collectives
matched whatever order the threads finish in.
sync_gradients() then skips what is summed and only scales. Without `model=` everything is
summed by sync_gradients.
"""
from __future__ import annotations

import _thread
import contextlib
import threading
from typing import Any, Callable, List, Optional

import torch
from torch import Tensor, nn

from . import _C, grads, validate
from .parallel import _model_expert_mode, _replicated_groups
from .state import first_hook, forget_hook, is_initialized, microbatch_active, refuse_cuda, session


def caller_autocasts() -> list:
    """The calling thread's autocast state per device type (enabled, dtype, cache), as keyword
    arguments of torch.autocast: autocast is thread-local, so code run for the caller on another
    thread re-enters it."""
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [dict(device_type=k, enabled=torch.is_autocast_enabled(k),
                 dtype=torch.get_autocast_dtype(k), cache_enabled=torch.is_autocast_cache_enabled())
            for k in kinds]


# summed dW blocks in flight at most: each is a whole unsharded weight, so without a bound a
# call would hold the model's full gradient until its end, what depth sharding is there to avoid
SCATTER_BLOCKS_IN_FLIGHT = 2


def last_gathers() -> dict:
    """The last call's shared depth all-gathers: {"gathers": started, "prefetched": first asked
    for when already started (along the order learned on the call before)}."""
    st = _C.microbatch_stats()
    return {"gathers": st["gathers"], "prefetched": st["prefetched"]}


def learned_weights() -> list:
    """The weights of the learned gather order, in order (None: a per-call tensor, not kept)."""
    return _C.microbatch_learned()


def last_scatters() -> dict:
    """The last call's shared dW reduce-scatters: {"reduce_scatters", "peak_blocks": the most
    summed blocks held at once}."""
    st = _C.microbatch_stats()
    return {"reduce_scatters": st["reduce_scatters"], "peak_blocks": st["peak_blocks"]}


def _open_call(model: Optional[nn.Module], n: int, owner: object,
               expert_mode: Optional[bool] = None) -> tuple:
    """Opens `owner`'s call (n micro-batches) in C, whose reducer sums `model`'s gradients over
    their groups (sync_gradients' groups) while the micro-batches run (None: no reducer). C
    picks the parameters and their fixed order (reverse registration, about the order backward
    finishes them) and buckets them; this registers the hook that counts the micro-batches'
    arrivals and returns the order for _C.microbatch_reduce_all. Whatever this raises, the
    caller ends with _C.microbatch_end(owner), which ends the call only if this opened it (an
    exception taken as the C call returns, an interrupt, looks raised by it). `expert_mode`:
    sync_gradients' (None: read from the model's layers)."""
    params, replicated = (), ()
    if model is not None:  # (a frozen parameter has no gradient to sum: not the reducer's)
        params = [p for p in model.parameters() if p.requires_grad]
        replicated = _replicated_groups(_model_expert_mode(model, expert_mode))
    order = _C.microbatch_begin(owner, n, params, replicated, session.bucket_bytes,
                                SCATTER_BLOCKS_IN_FLIGHT)
    for p in order:
        if first_hook(p, "arrivals"):  # (once per parameter; a deepcopy again)
            try:
                p.register_post_accumulate_grad_hook(_C.microbatch_arrive)
            except BaseException:
                forget_hook(p, "arrivals")  # (the next call tries again)
                raise
        # the reducer marks .grad summed: a later ordinary backward into it must take its share
        # back out (the gradient hook does, as after sync_gradients; was: a replicated
        # parameter had none before its first sync_gradients, and was left half summed)
        if not getattr(p, "_axonn_deferred", False):
            grads.hook(p, getattr(p, "_axonn_grad_groups", replicated))
    return order


def _abort_interrupted() -> None:
    """An interrupt (KeyboardInterrupt) ends the call: with peers, the job's collectives are
    aborted (every wait of every rank fails at once, csrc/comm: axc_comm_abort), so micro-batch
    threads stuck in one end now rather than at the collective timeout, and the peers, left
    out of step, fail too instead of waiting it out. The job must init() again."""
    _C.abort_interrupted("KeyboardInterrupt")


def _join(ended: List[threading.Event], abort: bool = False) -> None:
    """Waits until every thread has ended its part of the call (each sets its event last): an
    interrupt (KeyboardInterrupt) during the wait, or `abort`, aborts the call's collectives
    (_abort_interrupted) but does not leave a micro-batch running while its call ends (its
    memory would be freed under it); it is raised once all have ended. The abort runs inside
    the try, so a further interrupt during it is caught too (and the abort tried again).
    (Events, not Thread.join: on Python 3.11 a join interrupted while the thread runs takes it
    for ended.)"""
    interrupted: Optional[BaseException] = None
    for e in ended:
        while True:
            try:
                if abort:
                    _abort_interrupted()  # (a second abort of an aborted job does nothing)
                    abort = False
                e.wait()
                break
            except KeyboardInterrupt as k:
                abort = abort or interrupted is None
                interrupted = interrupted or k
    if interrupted is not None:
        raise interrupted


def run_concurrent(fn: Callable[..., Any], *inputs, model: Optional[nn.Module] = None,
                   dim: int = 0, expert_mode: Optional[bool] = None) -> List[Any]:
    """Runs fn(*micro_batch_inputs) for n micro-batches at once (n from
    init(concurrent_microbatches=n)), one thread each, and returns the n results in
    micro-batch order.

    Every Tensor in `inputs` is split into n pieces along `dim` (torch.tensor_split); other
    values are passed to every call as they are. `fn` normally runs forward and backward of one
    micro-batch and returns its loss; gradients accumulate into .grad as over sequential
    micro-batches (scale each loss by its share of the batch for a mean). With `model=` (the
    module whose parameters fn trains) their sums over ranks run while the micro-batches still
    compute; call axonn_c.sync_gradients(model) afterwards in any case, as after any backward
    (it sums what is left and scales). `expert_mode`: the layout the sums assume, as
    sync_gradients' (None: the model's axonn_c layers', the easy layout without any; pass the
    value the later sync_gradients gets). Every rank must call it with the same n and the same
    split sizes (collectives are matched per micro-batch).

    The grad mode and CPU autocast are the caller's. CPU tensors only for now: on CUDA, torch's
    autograd runs every backward on one device thread. A parameter used by several backward
    passes of one micro-batch (reentrant checkpointing) must not be in `model`. An output
    computed outside fn by a Linear whose depth collectives are scheduled (overlap=True,
    G_intra_d > 1) cannot be back-propagated inside it (its backward refuses).
    """
    if not is_initialized():
        raise RuntimeError("axonn_c is not initialised: call axonn_c.init(..., "
                           "concurrent_microbatches=n) first")
    expert_mode = validate.check_bool("run_concurrent: expert_mode", expert_mode, none_ok=True)
    if microbatch_active():
        raise RuntimeError("run_concurrent cannot be nested: fn is already running on a "
                           "micro-batch thread")
    n = session.microbatches
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    if not tensors:
        raise ValueError("run_concurrent needs at least one Tensor input to split into "
                         "micro-batches")
    cuda = [t for t in tensors if t.is_cuda]
    if model is not None:
        cuda += [p for p in model.parameters() if p.is_cuda]
    if cuda:
        refuse_cuda(cuda[0].device)
    for t in tensors:
        if t.dim() <= dim or t.shape[dim] < n:
            raise ValueError(f"run_concurrent splits inputs into {n} micro-batches along dim "
                             f"{dim}, but got an input of shape {list(t.shape)}")
    grads.finish()  # nothing deferred may still be in flight on channel 0
    reducing = model is not None and _C.grad_sync_enabled()
    pieces = [t.tensor_split(n, dim) if isinstance(t, Tensor) else None for t in inputs]
    args = [[p[i] if p is not None else v for p, v in zip(pieces, inputs)] for i in range(n)]
    results: List[Any] = [None] * n
    errors: List[Optional[BaseException]] = [None] * n
    grad_mode = torch.is_grad_enabled()
    # the caller's autocast reaches every micro-batch, as torch.nn.parallel.parallel_apply does
    casts = caller_autocasts()

    def body(i: int) -> None:
        session.thread.microbatch = i
        _C.microbatch_thread(True)  # (the gradient hooks, in C, read it)
        try:
            _C.set_thread_channel(i + 1)  # 0: the caller's; n + 1, n + 2: shared gathers, RS
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad_mode))
                for cast in casts:
                    stack.enter_context(torch.autocast(**cast))
                results[i] = fn(*args[i])
        except BaseException as e:  # re-raised on the calling thread
            errors[i] = e
        finally:
            try:
                session.thread.microbatch = None
                _C.microbatch_thread(False)
                _C.microbatch_thread_done(errors[i] is not None)
            finally:
                ended[i + 1].set()  # (the last use of the call)

    threads = [threading.Thread(target=body, args=(i,), name=f"axonn_c-microbatch-{i}",
                                daemon=True) for i in range(n)]
    started, start_error = [0], []
    ended = [threading.Event() for _ in range(n + 1)]  # the starter's, each micro-batch's

    def start_all() -> None:
        # on a thread of its own: a KeyboardInterrupt (delivered to the main thread) cannot
        # come out of a Thread.start() whose thread already runs, uncounted and never joined
        try:
            for t in threads:
                t.start()
                started[0] += 1
        except BaseException as e:  # (raised on the calling thread)
            start_error.append(e)
        finally:
            ended[0].set()

    owner = object()  # (whose call microbatch_end ends: never another caller's)
    try:  # the call ends (microbatch_end) whatever happens, or every later call is refused
        order = _open_call(model if reducing else None, n, owner,
                           expert_mode)  # (the call is open)
        # abort: unless the try ends other than by an interrupt (the abort then runs in _join's
        # try, where a second interrupt is caught); starter: whether ended[0] will be set
        abort, starter = True, True
        try:
            try:  # (one C call, which CPython interrupts only once it returned, the thread
                # started: an interrupt right after it aborts and joins, unlike Thread.start's
                # Python code, which can take one before its thread exists)
                _thread.start_new_thread(start_all, ())
            except RuntimeError:  # (no thread: nothing will set its event)
                starter = False
                raise
            _join(ended[:1])
            if start_error:
                raise start_error[0]
            if order:  # sums each bucket as it comes due (in C; its waits look for an
                # interrupt every 50 ms)
                with torch.no_grad():
                    _C.microbatch_reduce_all(order, grads.SYNC_BUCKET_BYTES)
            abort = False
        except KeyboardInterrupt:
            raise
        except BaseException:
            abort = False
            raise
        finally:
            _join(ended[:1] if starter else [], abort=abort)
            _join(ended[1:1 + started[0]])
        ok = started[0] == n and all(e is None for e in errors)
        # reduce-scatters and unused prefetches waited for, the gather order learned
        _C.microbatch_close(ok)
        if ok:
            with torch.no_grad():  # each shard into its weight's .grad (set, or added), in C
                _C.microbatch_apply_scatters()
    finally:  # (a no-op unless this call opened it: another caller's is left alone)
        _C.microbatch_end(owner)
    for e in errors:
        if e is not None:
            raise e
    return results
