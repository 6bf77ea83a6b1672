"""The summed-over marks and the records of pending gradients kept in C (csrc/grads/records.c,
csrc/python/py_records.c): what a mark is worth after .grad changes, that a parameter's mark
goes with it (its address may be reused), and bad input named. One process, no init needed."""
import copy
import gc

import pytest
import torch

import axonn_c
from axonn_c import _C, grads


def _marks():
    return _C.grad_records_stats()["summed_marks"]


def test_mark_counts_only_for_the_grad_it_was_made_for():
    p = torch.nn.Parameter(torch.zeros(3))
    assert grads.summed_over(p) == ()
    grads.mark_summed(p, ("data",))  # no .grad: nothing to mark
    assert grads.summed_over(p) == ()
    p.grad = torch.ones(3)
    grads.mark_summed(p, ("depth", "data", "depth"))
    assert grads.summed_over(p) == ("depth", "data")
    q = copy.copy(p)  # a copy's .grad is not the one that was summed
    assert grads.summed_over(q) == ()
    p.grad.add_(1)  # in place: still the same tensor
    assert grads.summed_over(p) == ("depth", "data")
    p.grad = p.grad.clone()  # replaced
    assert grads.summed_over(p) == ()
    grads.mark_summed(p, ("world",))
    p.grad = None  # zero_grad(set_to_none=True)
    assert grads.summed_over(p) == ()
    p.grad = torch.ones(3)
    assert grads.summed_over(p) == ()
    grads.mark_summed(p, ("data",))
    grads.mark_summed(p, ())  # forgets
    assert grads.summed_over(p) == ()


def test_mark_goes_with_its_parameter():
    gc.collect()
    before = _marks()
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(50)]
    for p in params:
        p.grad = torch.ones(2)
        grads.mark_summed(p, ("data",))
    assert _marks() == before + 50
    assert {grads.summed_over(p) for p in params} == {("data",)}
    marked = {id(p): p.grad for p in params}  # address -> the marked .grad (kept alive)
    del p
    params.clear()
    gc.collect()
    assert _marks() == before
    # new parameters, most at a freed one's address (CPython reuses them), each given the very
    # .grad tensor that was marked at its address: a mark that outlived its parameter would
    # count for it
    fresh = [torch.nn.Parameter(torch.zeros(2)) for _ in range(50)]
    for f in fresh:
        f.grad = marked.get(id(f), torch.ones(2))
    assert [grads.summed_over(f) for f in fresh] == [()] * 50


def test_bad_groups_are_named():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(Exception, match="bogus"):
        grads.mark_summed(p, ("data", "bogus"))
    with pytest.raises(TypeError, match="tuple"):
        grads.mark_summed(p, ["data"])
    assert grads.summed_over(p) == ()


def test_nothing_pending_outside_a_pass():
    assert grads.idle()
    stats = _C.grad_records_stats()
    assert stats["grad_records"] == 0 and stats["chunk_records_open"] == 0
    grads.finish()  # idle: nothing to do, also before init
    assert not axonn_c.is_initialized() or grads.idle()
