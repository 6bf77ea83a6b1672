"""Concurrent micro-batches: over-decomposition across the whole model (Tensor3D).

Within one layer a collective can only hide behind that layer's own GEMMs; a tensor-parallel
forward all-reduce that takes longer stays exposed, because the next layer needs its result.
`run_concurrent(fn, *inputs)` splits the inputs into n micro-batches (n =
init(concurrent_microbatches=n)) and runs `fn` on each at once, one thread per micro-batch:
while one micro-batch waits for an all-reduce, another computes. Both forward and backward
overlap this way, since `fn` is a whole forward + backward (CPU autograd runs a backward on the
thread that calls it).

Ordering: collectives are matched across ranks in issue order, and threads issue in no fixed
order relative to each other, so each micro-batch uses its own channel, an independent copy of
every group (csrc/comm: axc_comm_set_thread_channel; shm gives each its own slots and progress
thread). Inside a micro-batch thread the cross-layer scheduler's shared state stays unused:
weights are gathered per call (no prefetch), dW's depth reduce-scatter runs in the layer's
backward, and gradients accumulate into .grad through autograd (which serialises the adds).
The data-parallel reduction is left to sync_gradients() after run_concurrent returns, on the
caller's channel 0.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List

import torch
from torch import Tensor

from . import _C, runtime

_tls = threading.local()


def active() -> bool:
    """True on a micro-batch thread of run_concurrent (while its fn runs)."""
    return getattr(_tls, "index", None) is not None


def check_unsynced(p: Tensor) -> None:
    """A .grad already summed during an earlier overlapped backward cannot take unsummed
    micro-batch gradients: sync_gradients() must run first."""
    if p.grad is not None and (getattr(p, "_axonn_data_reduced", False)
                               or getattr(p, "_axonn_reduced_groups", ())):
        raise RuntimeError(
            "run_concurrent: a parameter's .grad was already summed over ranks by an earlier "
            "backward with overlap on, and sync_gradients() has not run since; call "
            "axonn_c.sync_gradients(model) (or zero the gradients) before run_concurrent")


def run_concurrent(fn: Callable[..., Any], *inputs, dim: int = 0) -> List[Any]:
    """Runs fn(*micro_batch_inputs) for n micro-batches at once (n from
    init(concurrent_microbatches=n)) and returns the n results in micro-batch order.

    Every Tensor in `inputs` is split into n pieces along `dim` (torch.tensor_split); other
    values are passed to every call as they are. `fn` normally runs forward and backward of one
    micro-batch and returns its loss; gradients accumulate into .grad as over sequential
    micro-batches (scale each loss by its share of the batch for a mean). Call
    axonn_c.sync_gradients(model) afterwards, as after any backward. Every rank must call it
    with the same n and the same split sizes (collectives are matched per micro-batch).

    Micro-batch 0 runs on the calling thread; the grad mode is the caller's. CPU tensors only
    for now: on CUDA, torch's autograd runs every backward on one device thread.
    """
    if not runtime.is_initialized():
        raise RuntimeError("axonn_c is not initialised: call axonn_c.init(..., "
                           "concurrent_microbatches=n) first")
    if active():
        raise RuntimeError("run_concurrent cannot be nested: fn is already running on a "
                           "micro-batch thread")
    n = runtime.channels
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    if not tensors:
        raise ValueError("run_concurrent needs at least one Tensor input to split into "
                         "micro-batches")
    for t in tensors:
        if t.is_cuda:
            raise NotImplementedError(
                "run_concurrent runs CPU micro-batches only: torch's autograd runs all CUDA "
                "backward passes on one device thread, so concurrent CUDA micro-batches would "
                f"not overlap; got a tensor on {t.device}")
        if t.dim() <= dim or t.shape[dim] < n:
            raise ValueError(f"run_concurrent splits inputs into {n} micro-batches along dim "
                             f"{dim}, but got an input of shape {list(t.shape)}")
    from . import grads

    grads.finish()  # nothing deferred may still be in flight on channel 0
    pieces = [t.tensor_split(n, dim) if isinstance(t, Tensor) else None for t in inputs]
    args = [[p[i] if p is not None else v for p, v in zip(pieces, inputs)] for i in range(n)]
    results: List[Any] = [None] * n
    errors: List[BaseException | None] = [None] * n
    grad_mode = torch.is_grad_enabled()

    def body(i: int) -> None:
        _tls.index = i
        try:
            _C.set_thread_channel(i)
            with torch.set_grad_enabled(grad_mode):
                results[i] = fn(*args[i])
        except BaseException as e:  # re-raised on the calling thread
            errors[i] = e
        finally:
            _tls.index = None
            if i == 0 and _C.is_initialized():
                _C.set_thread_channel(0)

    threads = [threading.Thread(target=body, args=(i,), name=f"axonn_c-microbatch-{i}",
                                daemon=True) for i in range(1, n)]
    for t in threads:
        t.start()
    body(0)
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results
