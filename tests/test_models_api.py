"""axonn_c.models.GPT in one process: transformers' GPT2LMHeadModel's logits, loss and
gradients from its state dict, the plain torch reference of the multi-rank worker against
transformers, the serial state dict round trip, and the errors for what the model does not take
(multi-rank: test_models_multiproc.py)."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import axonn_c
from axonn_c.models import GPT

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from models_worker import (Config, Serial, batch, check_dropout_resume, serial_loss,  # noqa: E402
                           serial_state)


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    axonn_c.finalize()
    axonn_c.init()
    yield
    axonn_c.finalize()


def test_serial_state_dict_loads_and_comes_back():
    cfg = Config()
    sd = serial_state(cfg, 0)
    model = GPT(cfg)
    model.load_state_dict(sd)
    full = axonn_c.full_state_dict(model)
    assert list(full) == list(sd)
    for k in sd:
        assert torch.equal(full[k], sd[k]), k
    ids, labels = batch(cfg, 0)
    params = {k: v.clone().requires_grad_(True) for k, v in sd.items() if k != "lm_head.weight"}
    want = serial_loss(params, cfg, ids, labels)
    out = model(ids, labels=labels)
    assert out.logits.shape == (8, 12, cfg.vocab_size)
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-5)


def test_matches_transformers_gpt2():
    pytest.importorskip("transformers")
    from transformers import GPT2Config

    cfg = Config()
    ref = Serial(cfg, seed=3, use_hf=True)
    model = GPT(GPT2Config(**vars(cfg), bos_token_id=0, eos_token_id=0))  # a real GPT2Config
    model.load_state_dict(ref.state_dict())
    ids, labels = batch(cfg, 1)
    want = ref.model(input_ids=ids, labels=labels)
    out = model(ids, labels=labels)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-5)
    want.loss.backward()
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.data = p.grad
    full = axonn_c.full_state_dict(model)
    for n, p in ref.model.named_parameters():
        torch.testing.assert_close(full[n], p.grad, rtol=2e-5, atol=2e-6, msg=n)
    assert grads
    # the worker's plain torch GPT-2 is transformers' computation
    params = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    torch.testing.assert_close(serial_loss(params, cfg, ids, labels), want.loss.detach(),
                               rtol=1e-5, atol=1e-6)


def test_no_labels_gives_logits_only_and_checkpoint_changes_nothing():
    cfg = Config()
    sd = serial_state(cfg, 1)
    a, b = GPT(cfg), GPT(cfg, checkpoint=True)
    a.load_state_dict(sd)
    b.load_state_dict(sd)
    ids, labels = batch(cfg, 2)
    out = a(ids)
    assert out.loss is None and out.logits.shape == (8, 12, cfg.vocab_size)
    la, lb = a(ids, labels=labels).loss, b(ids, labels=labels).loss
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_own_state_dict_round_trip():
    cfg = Config()
    torch.manual_seed(0)
    a = GPT(cfg)
    torch.manual_seed(1)
    b = GPT(cfg)
    b.load_state_dict(a.state_dict())
    for (k, v), (k2, v2) in zip(axonn_c.full_state_dict(a).items(),
                                axonn_c.full_state_dict(b).items()):
        assert k == k2 and torch.equal(v, v2)


@pytest.mark.parametrize("change,match", [
    (dict(n_head=5), "must divide by n_head"),
    (dict(activation_function="mish"), "activation_function 'mish'"),
    (dict(n_embd=None), "config has no 'n_embd'"),
])
def test_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        GPT(replace(Config(), **change))


def test_unsupported_options_and_bad_inputs():
    cfg = Config()

    class Untied(Config):
        tie_word_embeddings = False

    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        GPT(Untied())
    model = GPT(cfg)
    with pytest.raises(ValueError, match="exceeds n_positions 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have input_ids' shape"):
        model(torch.zeros(2, 4, dtype=torch.long), labels=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(IndexError, match="out of range"):
        model(torch.zeros(2, 4, dtype=torch.long), labels=torch.full((2, 4), 50))
    with pytest.raises(ValueError, match="input_ids must have at least 2"):
        model(torch.zeros(4, dtype=torch.long))


def test_checkpoint_export_loads_back(tmp_path):
    """axonn_c.checkpoint's export writes the model's own full tensors (nn.Linear orientation,
    QKV head-interleaved): load_state_dict tells them from transformers' (c_attn's shape) and
    does not transpose the square c_proj."""
    import axonn_c.checkpoint as ckpt

    cfg = Config()
    sd = serial_state(cfg, 4)
    model = GPT(cfg)
    model.load_state_dict(sd)
    ckpt.save(tmp_path / "ck", model)
    exported = ckpt.export(tmp_path / "ck")
    assert exported["transformer.h.0.attn.c_attn.weight"].shape == (96, 32)
    other = GPT(cfg)
    other.load_state_dict(exported)
    for k, v in axonn_c.full_state_dict(other).items():
        assert torch.equal(v, sd[k]), k


def test_dropout_masks_resume_from_a_checkpoint(tmp_path):
    """The dropout call counter is model state: k steps, axonn_c.checkpoint save, load into a
    fresh model, k more steps give bitwise the losses and weights of 2k uninterrupted steps (the
    worker's check, here on one rank); it also travels through state_dict / load_state_dict,
    and transformers' state dict keeps it."""
    cfg = replace(Config(), resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    k = 3
    whole = check_dropout_resume(axonn_c.grid(), cfg, str(tmp_path / "ck"), k)
    copy = GPT(cfg, dropout_seed=3)
    copy.load_state_dict(whole.state_dict())  # (the counter comes along)
    assert int(copy.get_extra_state()) == int(whole.get_extra_state()) == 2 * k
    copy.load_state_dict(serial_state(cfg, 5))  # transformers' state dict: the counter stays
    assert int(copy.get_extra_state()) == 2 * k and "_extra_state" not in \
        axonn_c.full_state_dict(copy)


def test_checkpoint_without_the_dropout_counter_loads(tmp_path):
    """A checkpoint written before the GPT had extra state (no dropout counter in it) loads:
    the model keeps its own counter; the weights come from the checkpoint."""
    import axonn_c.checkpoint as ckpt

    class Before(GPT):  # the GPT as it was: no extra state in its state dict
        get_extra_state = torch.nn.Module.get_extra_state
        set_extra_state = torch.nn.Module.set_extra_state

    cfg = Config()
    old = GPT(cfg)
    old.load_state_dict(serial_state(cfg, 4))
    old.__class__ = Before
    assert "_extra_state" not in old.state_dict()
    ckpt.save(tmp_path / "ck", old)
    new = GPT(cfg)
    new._dropout_calls.fill_(7)
    ckpt.load(tmp_path / "ck", new)
    assert int(new.get_extra_state()) == 7
    got = new.state_dict()
    for k, v in old.state_dict().items():
        assert torch.equal(got[k], v), k
    new.load_state_dict(old.state_dict())  # (its own sharded state dict, as torch.save kept it)
    assert int(new.get_extra_state()) == 7
