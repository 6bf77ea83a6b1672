"""axonn_c.Embedding, parallel_cross_entropy, LayerNorm and RMSNorm in one process: the serial
results, autocast-free dtypes, copies and state dicts, and the errors for what they do not take
(multi-rank equality: test_layers_multiproc.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import axonn_c


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    axonn_c.finalize()
    axonn_c.init()
    yield
    axonn_c.finalize()


def pair(v=11, h=6, seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.Embedding(v, h, padding_idx=kw.get("padding_idx"))
    torch.manual_seed(seed)
    return axonn_c.Embedding(v, h, **kw), ref


def test_embedding_equals_nn_embedding_with_padding_idx():
    ours, ref = pair(padding_idx=3)
    ids = torch.tensor([[3, 1, 10], [0, 3, 3]])
    y, want = ours(ids), ref(ids)
    assert torch.equal(y, want)
    g = torch.randn_like(want)
    y.backward(g)
    want.backward(g)
    assert torch.equal(ours.weight.grad.view(11, 6), ref.weight.grad)
    assert not ours.weight.grad.view(11, 6)[3].any()  # the padding row learns nothing


def test_embedding_under_autocast_returns_the_tables_rows():
    """A lookup is no autocast op: as nn.Embedding, the rows in the table's dtype, exactly (was:
    the table cast to the autocast dtype first, so a model's residual stream started in bf16)."""
    ours, ref = pair()
    ids = torch.tensor([[1, 2, 10]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = ours(ids), ref(ids)
    assert y.dtype == want.dtype == torch.float32 and torch.equal(y, want)


def test_tied_loss_equals_serial():
    ours, ref = pair()
    h = torch.randn(5, 6)
    target = torch.tensor([1, -100, 10, 0, 4])
    loss = ours.cross_entropy(h, target)
    want = F.cross_entropy(h @ ref.weight.t(), target)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(axonn_c.parallel_cross_entropy(ours.logits(h), target), want)


def test_parallel_cross_entropy_equals_torch_in_every_reduction():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    target = torch.tensor([[1, 2, -1], [6, 0, -1]])
    for reduction in ("mean", "sum", "none"):
        got = axonn_c.parallel_cross_entropy(logits, target, ignore_index=-1, reduction=reduction)
        want = F.cross_entropy(logits.view(-1, 7), target.view(-1), ignore_index=-1,
                               reduction=reduction)
        torch.testing.assert_close(got, want.view_as(got))
        (gg,) = torch.autograd.grad(got.sum(), logits)
        (gw,) = torch.autograd.grad(want.sum(), logits)
        torch.testing.assert_close(gg, gw)


def test_norms_equal_torch():
    x = torch.randn(4, 10) * 3 + 2
    for ours, ref in ((axonn_c.LayerNorm(10), torch.nn.LayerNorm(10)),
                      (axonn_c.RMSNorm(10, eps=1e-6), torch.nn.RMSNorm(10, eps=1e-6)),
                      (axonn_c.LayerNorm(10, expert_mode=True), torch.nn.LayerNorm(10))):
        torch.testing.assert_close(ours(x), ref(x))
        assert ours.state_dict().keys() == ref.state_dict().keys()


def test_state_dict_round_trip_and_copies():
    ours, ref = pair(v=9, h=4)
    sd = axonn_c.full_state_dict(ours)
    assert torch.equal(sd["weight"], ref.weight)
    twin = copy.deepcopy(ours)
    assert twin.weight._axonn_grad_groups == ("data",)
    ours.load_state_dict({"weight": torch.zeros(9, 4)})
    assert not ours.full_weight().any()


@pytest.mark.parametrize("kw,msg", [
    (dict(max_norm=1.0), "max_norm"),
    (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
    (dict(sparse=True), "sparse"),
    (dict(padding_idx=11), "padding_idx"),
])
def test_embedding_refuses_what_it_does_not_support(kw, msg):
    with pytest.raises(ValueError, match=msg):
        axonn_c.Embedding(11, 6, **kw)


def test_bad_inputs_raise_clear_errors():
    emb = axonn_c.Embedding(11, 6)
    with pytest.raises(IndexError, match=r"out of range \[0, 11\)"):
        emb(torch.tensor([11]))
    with pytest.raises(TypeError, match="integer token ids"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="last dimension to be 6"):
        emb.logits(torch.randn(2, 5))
    with pytest.raises(IndexError, match="out of range"):
        emb.cross_entropy(torch.randn(2, 6), torch.tensor([0, 11]))
    with pytest.raises(ValueError, match="reduction"):
        axonn_c.parallel_cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), reduction="avg")
    with pytest.raises(IndexError, match="out of bounds"):
        axonn_c.parallel_cross_entropy(torch.randn(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="one per logits row"):
        axonn_c.parallel_cross_entropy(torch.randn(2, 3), torch.tensor([0]))
    with pytest.raises(TypeError, match="target must be an int64 or int32 tensor"):
        emb.cross_entropy(torch.randn(3, 6), torch.tensor([1.7, 2.2, 3.9]))  # (not truncated)
    for norm in (axonn_c.LayerNorm(4), axonn_c.RMSNorm(4)):  # (as torch's norms)
        with pytest.raises(TypeError, match="expects a floating-point input, got torch.int64"):
            norm(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="normalises one"):
        axonn_c.LayerNorm((2, 3))
    with pytest.raises(ValueError, match="last input dimension to be 10"):
        axonn_c.RMSNorm(10)(torch.randn(2, 4))


def test_layers_need_init():
    axonn_c.finalize()
    for build in (lambda: axonn_c.Embedding(4, 2), lambda: axonn_c.LayerNorm(4)):
        with pytest.raises(RuntimeError):
            build()


def test_auto_parallelize_swaps_embeddings_only_when_asked_and_keeps_ties():
    with axonn_c.auto_parallelize():
        plain = torch.nn.Embedding(5, 4)
    assert type(plain) is torch.nn.Embedding
    torch.manual_seed(3)
    ref = torch.nn.Embedding(5, 4)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match=r"kept torch nn.Embedding.*5x4 \(.*max_norm"):
        with axonn_c.auto_parallelize(embeddings=True):
            with axonn_c.auto_parallelize():  # (nested: inherits embeddings=True)
                emb = torch.nn.Embedding(5, 4)
            head = torch.nn.Linear(4, 5, bias=False)
            head.weight = emb.weight  # a tie, as transformers makes it
            kept = torch.nn.Embedding(5, 4, max_norm=1.0)
    assert isinstance(emb, axonn_c.Embedding) and type(kept) is torch.nn.Embedding
    assert torch.equal(emb.full_weight(), ref.weight)
    assert head.weight is emb.weight and isinstance(head, axonn_c.Linear)
    h = torch.randn(3, 4)
    torch.testing.assert_close(head(h), h @ ref.weight.t())
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert len(list(model.parameters())) == 1
    sd = axonn_c.full_state_dict(model)
    assert torch.equal(sd["emb.weight"], ref.weight) and torch.equal(sd["head.weight"], ref.weight)
    twin = copy.deepcopy(model)
    assert twin["head"].weight is twin["emb"].weight
    torch.testing.assert_close(twin["head"](h), h @ ref.weight.t())
    # outside the context a tie is not seen (documented)
    other = torch.nn.Linear(4, 5, bias=False)
    other.weight = emb.weight
    assert type(other) is torch.nn.Linear


def test_bfloat16_table_and_loss_follow_torch():
    ours, ref = pair(v=13, h=8, dtype=torch.bfloat16)
    ref = ref.to(torch.bfloat16)
    ours.load_state_dict({"weight": ref.weight.detach()})
    ids = torch.tensor([0, 5, 12])
    assert ours(ids).dtype == torch.bfloat16 and torch.equal(ours(ids), ref(ids))
    h = torch.randn(3, 8, dtype=torch.bfloat16)
    loss = ours.cross_entropy(h, torch.tensor([1, 2, 3]))
    want = F.cross_entropy((h @ ref.weight.t()).float(), torch.tensor([1, 2, 3]))
    assert loss.dtype == torch.bfloat16
    torch.testing.assert_close(loss.float(), want, rtol=2e-2, atol=2e-2)


def test_refused_on_micro_batch_threads():
    axonn_c.finalize()
    axonn_c.init(concurrent_microbatches=2)
    emb = axonn_c.Embedding(7, 4)
    with pytest.raises(RuntimeError, match="micro-batch threads"):
        axonn_c.run_concurrent(lambda ids: emb(ids), torch.tensor([1, 2, 3, 4]))


def test_full_state_dict_shared_module_and_root_layer_prefix():
    with axonn_c.auto_parallelize():
        lin = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(lin, torch.nn.GELU(), lin)  # one module under two names
    sd = axonn_c.full_state_dict(model)
    assert sd["0.weight"].shape == sd["2.weight"].shape == (4, 4)
    assert torch.equal(sd["0.weight"], sd["2.weight"])
    sd = axonn_c.full_state_dict(lin, prefix="p.")
    assert sd["p.weight"].shape == (4, 4) and torch.equal(sd["p.weight"], lin.full_weight())


def test_auto_parallelize_leaves_non_int_sizes_to_torch():
    with axonn_c.auto_parallelize():
        with pytest.raises(TypeError):
            torch.nn.Linear(8.5, 4)  # (as serial torch)
        lin = torch.nn.Linear(8, 4, bias=None)  # (serial torch: no bias)
    assert isinstance(lin, axonn_c.Linear) and lin.bias is None
