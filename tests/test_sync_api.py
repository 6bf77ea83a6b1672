"""The synchronous packed sum behind sync_gradients and run_concurrent's reducer
(_C.grad_reduce_now, csrc/python/py_sync.c) in one process: every bucket size (pieces spread
over several buckets, the scale applied once per bucket), mixed dtypes, empty tensors, the
memcpy fast path against torch's copy (a lazily negated tensor), and bad input refused with no
bucket left open; on two ranks, a failed sum marks nothing summed. The multi-rank sums are
tested by test_training_utils.py."""
import pytest
import torch

import axonn_c
from axonn_c import _C, grads
from conftest import torchrun


@pytest.fixture(autouse=True)
def session():
    axonn_c.finalize()
    axonn_c.init()
    yield
    axonn_c.finalize()


@pytest.mark.parametrize("bucket_bytes", [8, 24, 40, 1 << 20])
def test_pieces_over_several_buckets_are_scaled_once(bucket_bytes):
    torch.manual_seed(0)
    ts = [torch.randn(n) for n in (4, 1, 3, 0, 5, 2, 7)]
    ts += [torch.randn(3, dtype=torch.float64), torch.randn(4, 2).t()]  # (non-contiguous)
    want = [t * 0.25 for t in ts]
    versions = [t._version for t in ts]
    _C.grad_reduce_now(ts, ("world",), 0.25, bucket_bytes)
    for t, w in zip(ts, want):
        assert torch.equal(t, w)
    # written in place by torch's copy_: autograd sees the change
    assert all(t._version > v for t, v in zip(ts, versions) if t.numel())
    assert grads.idle() and _C.grad_buckets_open() == 0


def test_a_lazily_negated_gradient_is_copied_by_its_values():
    x = torch.arange(1.0, 5.0)
    t = torch._neg_view(x)  # contiguous CPU memory holding x, values -x
    assert t.is_neg()
    _C.grad_reduce_now([t], ("world",), None, grads.SYNC_BUCKET_BYTES)
    assert torch.equal(t, -torch.arange(1.0, 5.0))


class _NoReshape(torch.Tensor):
    def reshape(self, *shape):
        raise RuntimeError("this gradient cannot be reshaped")


def test_bad_input_is_named_and_leaves_no_bucket_open():
    cases = [
        (([torch.ones(2), torch.ones(3).as_subclass(_NoReshape)], ("world",), None, 64),
         RuntimeError, "cannot be reshaped"),
        (([torch.ones(2)], ("nowhere",), None, 64), ValueError, "not a group name"),
        (([torch.ones(2)], {"world"}, None, 64), TypeError, "same order on every rank"),
        (([1.0], ("world",), None, 64), Exception, None),
        (([torch.ones(2)], ("world",), "x", 64), TypeError, "scale"),
        (([torch.ones(2)], ("world",), None, 0), ValueError, "bucket_bytes"),
        (([torch.ones(2, dtype=torch.complex64)], ("world",), None, 64), Exception, None),
    ]
    for args, kind, text in cases:
        with pytest.raises(kind, match=text):
            _C.grad_reduce_now(*args)
        assert _C.grad_buckets_open() == 0, args
    # and the next sum is right
    t = torch.full((3,), 2.0)
    _C.grad_reduce_now([t], ("world",), 0.5, 64)
    assert torch.equal(t, torch.ones(3))


@pytest.mark.multiproc
def test_a_failed_sum_is_not_marked_and_a_retry_sums_it():
    """Two ranks: sync_gradients_depth_parallel whose packing fails leaves no "summed over"
    mark, and the retry sums (tests/workers/sync_retry_worker.py)."""
    out = torchrun(2, "sync_retry_worker.py")
    assert "rank 0: sync retry ok" in out and "rank 1: sync retry ok" in out, out
