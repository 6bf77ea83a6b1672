"""axonn_c.models.GPT against the serial GPT-2 (tests/test_models_multiproc.py) on the grids of
the world size: transformers' GPT2LMHeadModel when transformers is installed, else the plain
torch GPT-2 below (the same computation on the same state dict; the one-process test checks
the two agree). Per grid: the serial state dict loads and full_state_dict gives it back
bitwise; loss and every gradient (gathered to serial coordinates) equal serial's; AdamW steps
track serial training; the own sharded state dict round-trips; axonn_c.checkpoint saved on the
previous grid loads on this one (resharding); bf16 autocast runs; dropout masks agree on the
replicas."""
import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import axonn_c
import axonn_c.checkpoint as ckpt
from axonn_c.models import GPT
from common import grids


@dataclass
class Config:  # the GPT2Config fields the model reads (a plain dataclass works as well)
    vocab_size: int = 50  # (not a multiple of the plane: the table is padded)
    n_positions: int = 16
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_inner: int = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    initializer_range: float = 0.02


def have_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_model(cfg, seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    c = GPT2Config(**{k: v for k, v in vars(cfg).items()}, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(c).float()


def serial_state(cfg, seed):
    """A random serial GPT-2 state dict in transformers' names and Conv1D orientation."""
    g = torch.Generator().manual_seed(seed)
    H, F_ = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd

    def r(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    sd = {"transformer.wte.weight": r(cfg.vocab_size, H), "transformer.wpe.weight": r(cfg.n_positions, H)}
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        sd.update({p + "ln_1.weight": 1 + r(H), p + "ln_1.bias": r(H),
                   p + "attn.c_attn.weight": r(H, 3 * H), p + "attn.c_attn.bias": r(3 * H),
                   p + "attn.c_proj.weight": r(H, H), p + "attn.c_proj.bias": r(H),
                   p + "ln_2.weight": 1 + r(H), p + "ln_2.bias": r(H),
                   p + "mlp.c_fc.weight": r(H, F_), p + "mlp.c_fc.bias": r(F_),
                   p + "mlp.c_proj.weight": r(F_, H), p + "mlp.c_proj.bias": r(H)})
    sd.update({"transformer.ln_f.weight": 1 + r(H), "transformer.ln_f.bias": r(H)})
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def serial_loss(p, cfg, ids, labels):
    """GPT-2 (transformers' computation) from a state dict of leaf tensors: the mean shifted
    cross-entropy."""
    b, s = ids.shape
    H, nh, eps = cfg.n_embd, cfg.n_head, cfg.layer_norm_epsilon
    x = p["transformer.wte.weight"][ids] + p["transformer.wpe.weight"][:s]
    for i in range(cfg.n_layer):
        q = f"transformer.h.{i}."
        h = F.layer_norm(x, (H,), p[q + "ln_1.weight"], p[q + "ln_1.bias"], eps)
        qkv = h @ p[q + "attn.c_attn.weight"] + p[q + "attn.c_attn.bias"]
        qs, ks, vs = (t.view(b, s, nh, H // nh).transpose(1, 2) for t in qkv.split(H, -1))
        y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, H)
        x = x + y @ p[q + "attn.c_proj.weight"] + p[q + "attn.c_proj.bias"]
        h = F.layer_norm(x, (H,), p[q + "ln_2.weight"], p[q + "ln_2.bias"], eps)
        m = F.gelu(h @ p[q + "mlp.c_fc.weight"] + p[q + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ p[q + "mlp.c_proj.weight"] + p[q + "mlp.c_proj.bias"]
    h = F.layer_norm(x, (H,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], eps)
    logits = h @ p["transformer.wte.weight"].t()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class Serial:
    """The serial reference: (state dict, loss(ids, labels), named parameters)."""

    def __init__(self, cfg, seed, use_hf):
        self.cfg = cfg
        if use_hf:
            self.model = hf_model(cfg, seed)
            with torch.no_grad():  # random norms and biases too, not transformers' ones/zeros
                g = torch.Generator().manual_seed(seed)
                for p in self.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        else:
            self.model = None
            self.params = {k: v.clone().requires_grad_(True) for k, v in serial_state(cfg, seed).items()
                           if k != "lm_head.weight"}

    def state_dict(self):
        if self.model is not None:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        sd = {k: v.detach().clone() for k, v in self.params.items()}
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
        return sd

    def named_parameters(self):
        if self.model is not None:
            return dict(self.model.named_parameters())
        return self.params

    def loss(self, ids, labels):
        if self.model is not None:
            return self.model(input_ids=ids, labels=labels).loss
        return serial_loss(self.params, self.cfg, ids, labels)


def close(got, want, what, tol):
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
    scale = max(want.abs().max().item() if want.numel() else 1.0, 0.1)
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if diff > tol * scale:
        raise AssertionError(f"{what}: max |diff| {diff:.3e} (tolerance {tol * scale:.1e})")


def full_grads(model):
    """The gradients in serial coordinates (transformers' names): each parameter's data swapped
    for its gradient while full_state_dict gathers (collective)."""
    params = list(model.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return axonn_c.full_state_dict(model)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def my_share(g, ids):
    shards = g.G_data * g.G_intra_d
    i = g.data_rank * g.G_intra_d + g.depth_rank
    n = ids.shape[0] // shards
    return ids[i * n:(i + 1) * n]


def mean_over_shards(loss):
    """The mean of the per-shard losses (equal token counts: the global batch's mean)."""
    t = loss.detach().double().reshape(1).clone()
    axonn_c.comm.all_reduce(t, group="depth")
    axonn_c.comm.all_reduce(t, group="data")
    g = axonn_c.grid()
    return t.item() / (g.G_data * g.G_intra_d)


def batch(cfg, step, n=8, s=12):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.vocab_size, (n, s), generator=gen)
    labels = ids.clone()
    labels[:, 3] = -100  # ignored, the same count in every sequence
    return ids, labels


def check_grid(sizes, cfg, use_hf, steps, ckpt_dir, prev_dir, checkpoint, n, overlap):
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3],
                     overlap=overlap)
    what = f"grid {'x'.join(map(str, sizes))} checkpoint={checkpoint} rank {g.rank}"
    ref = Serial(cfg, seed=n, use_hf=use_hf)
    torch.manual_seed(1234 + g.rank)  # other weights on each rank: the load must replace them
    model = GPT(cfg, checkpoint=checkpoint)
    sd = ref.state_dict()
    model.load_state_dict(sd)
    full = axonn_c.full_state_dict(model)
    if list(full) != list(sd):
        raise AssertionError(f"{what}: full_state_dict keys {list(full)[:4]}..., expected "
                             f"{list(sd)[:4]}...")
    for k in sd:
        close(full[k], sd[k], f"{what} full_state_dict {k}", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ropt = torch.optim.AdamW(ref.named_parameters().values(), lr=3e-3, weight_decay=0.01)
    for step in range(steps):
        ids, labels = batch(cfg, step)
        rloss = ref.loss(ids, labels)
        ropt.zero_grad()
        rloss.backward()
        opt.zero_grad(set_to_none=True)
        out = model(my_share(g, ids), labels=my_share(g, labels))
        out.loss.backward()
        axonn_c.sync_gradients(model, mean=True)
        got = mean_over_shards(out.loss)
        if abs(got - rloss.item()) > 1e-4:
            raise AssertionError(f"{what} step {step}: loss {got:.6f}, serial {rloss.item():.6f}")
        if step == 0:
            vp = -(-cfg.vocab_size // (g.G_intra_r * g.G_intra_c))
            if tuple(out.logits.shape) != (8 // (g.G_data * g.G_intra_d), 12, vp):
                raise AssertionError(f"{what}: logits shape {list(out.logits.shape)}")
            grads = full_grads(model)
            for k, p in ref.named_parameters().items():
                close(grads[k], p.grad, f"{what} grad {k}", 2e-5)
        opt.step()
        ropt.step()
    ids, labels = batch(cfg, steps)  # the trained models' loss
    with torch.no_grad():
        rloss, out = ref.loss(ids, labels), model(my_share(g, ids), labels=my_share(g, labels))
    got = mean_over_shards(out.loss)
    if abs(got - rloss.item()) > 1e-4:
        raise AssertionError(f"{what} after {steps} steps: loss {got:.6f}, serial {rloss.item():.6f}")
    # (loose: Adam turns rounding noise in a gradient that is zero in exact arithmetic, the key
    # bias's, into steps of lr's size)
    full = axonn_c.full_state_dict(model)
    for k, p in ref.named_parameters().items():
        close(full[k], p, f"{what} weights after {steps} AdamW steps {k}", 0.05)
    # the own (sharded) state dict round-trips
    torch.manual_seed(99)
    other = GPT(cfg)
    other.load_state_dict(model.state_dict())
    for k, v in axonn_c.full_state_dict(other).items():
        close(v, full[k], f"{what} own state dict {k}", 0)
    # axonn_c.checkpoint: the previous grid's checkpoint loads here (resharded), then ours is saved
    if prev_dir is not None:
        other_opt = torch.optim.AdamW(other.parameters(), lr=3e-3)
        extra = ckpt.load(prev_dir, other, other_opt)
        want = torch.load(os.path.join(os.path.dirname(prev_dir), f"full{n - 1}.pt"))
        for k, v in axonn_c.full_state_dict(other).items():
            close(v, want[k], f"{what} checkpoint from the previous grid {k}", 0)
        if extra.get("step") != n - 1:
            raise AssertionError(f"{what}: checkpoint extra {extra}")
    ckpt.save(ckpt_dir, model, opt, extra={"step": n})
    if g.rank == 0:
        torch.save(full, os.path.join(os.path.dirname(ckpt_dir), f"full{n}.pt"))
    # bf16 autocast: the same loss to bf16 precision
    ids, labels = batch(cfg, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(my_share(g, ids), labels=my_share(g, labels))
    with torch.no_grad():
        want = model(my_share(g, ids), labels=my_share(g, labels)).loss
    close(out.loss.float(), want, f"{what} bf16 autocast loss", 3e-2)
    out.loss.backward()
    axonn_c.finalize()
    return g.rank


def same_over(x, group):
    """Whether x holds the same values on every rank of the group."""
    both = torch.cat([x.detach().reshape(-1), -x.detach().reshape(-1)]).double()
    axonn_c.comm.all_reduce(both, group=group, op="max")
    n = x.numel()
    return bool((both[:n] == -both[n:]).all())


def check_dropout(sizes, cfg, ckpt_dir):
    """Dropout on: copies get the same mask (the residual stream, replicated over row, is the same
    on the row group; the attention output, replicated over col, on the column group), the
    recompute of checkpoint=True draws the masks again (its gradients equal those without
    checkpointing), dropout changes the loss, and a run resumed from a checkpoint draws the
    masks an uninterrupted one does."""
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3])
    cfg = Config(**{**vars(cfg), "resid_pdrop": 0.2, "embd_pdrop": 0.2, "attn_pdrop": 0.2})
    ids, labels = batch(cfg, 0)
    ids, labels = my_share(g, ids), my_share(g, labels)
    grads = []
    for checkpoint in (False, True):
        torch.manual_seed(5)
        model = GPT(cfg, checkpoint=checkpoint, dropout_seed=3)
        seen = {}
        model.transformer.ln_f.register_forward_pre_hook(lambda m, a: seen.update(res=a[0]))
        model.transformer.h[-1].attn.c_proj.register_forward_pre_hook(
            lambda m, a: seen.update(att=a[0]))
        out = model(ids, labels=labels)
        out.loss.backward()
        if not same_over(seen["res"], "row") or not same_over(seen["att"], "col"):
            raise AssertionError(f"dropout grid {sizes}: copies drew different masks")
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        close(b, a, f"dropout grid {sizes}: checkpoint=True gradient", 1e-5)
    model.eval()
    with torch.no_grad():
        plain = model(ids, labels=labels).loss
    if plain.item() == out.loss.item():
        raise AssertionError(f"dropout grid {sizes}: dropout changed nothing")
    check_dropout_resume(g, cfg, ckpt_dir)
    axonn_c.finalize()


def check_dropout_resume(g, cfg, ckpt_dir, k=2):
    """k steps, axonn_c.checkpoint save, load into a fresh model, k more steps: bitwise the
    losses and weights of 2k uninterrupted steps (the dropout call counter is saved). Returns
    the uninterrupted model."""
    def model_and_opt(seed):
        torch.manual_seed(seed)
        model = GPT(cfg, dropout_seed=3)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model, opt, steps):
        losses = []
        for step in steps:
            ids, labels = batch(cfg, step)
            loss = model(my_share(g, ids), labels=my_share(g, labels)).loss
            loss.backward()
            axonn_c.sync_gradients(model, mean=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    whole, opt = model_and_opt(5)
    want = train(whole, opt, range(2 * k))
    first, opt = model_and_opt(5)
    got = train(first, opt, range(k))
    ckpt.save(ckpt_dir, first)
    resumed, opt = model_and_opt(6)
    ckpt.load(ckpt_dir, resumed)
    got += train(resumed, opt, range(k, 2 * k))
    what = f"dropout resume grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    for step, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            raise AssertionError(f"{what} step {step}: loss {a.item()}, uninterrupted {b.item()}")
    for (name, a), b in zip(resumed.state_dict().items(), whole.state_dict().values()):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {name} differs from the uninterrupted run's")
    return whole


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grids", default="all")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dir", required=True)
    p.add_argument("--checkpoint", action="store_true", help="GPT(checkpoint=True)")
    p.add_argument("--overlap", action="store_true", help="init(overlap=True): the scheduler, "
                   "the MLP's chunk pipelining (axonn_c.Sequential)")
    p.add_argument("--serial", choices=("auto", "torch"), default="auto",
                   help="auto: transformers' GPT2LMHeadModel when installed")
    a = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    todo = list(grids(world)) if a.grids == "all" else [
        tuple(int(v) for v in s.split("x")) for s in a.grids.split(",")]
    use_hf = a.serial == "auto" and have_transformers()
    cfg = Config()
    prev = None
    for n, sizes in enumerate(todo):
        d = os.path.join(a.dir, f"ckpt{n}")
        rank = check_grid(sizes, cfg, use_hf, a.steps, d, prev, a.checkpoint, n, a.overlap)
        prev = d
    check_dropout(todo[-1], cfg, os.path.join(a.dir, "dropout_ckpt"))
    if rank == 0:
        print(f"world {world}: {len(todo)} grids match the serial GPT-2 "
              f"({'transformers' if use_hf else 'plain torch'}, {a.steps} AdamW steps"
              f"{', checkpoint=True' if a.checkpoint else ''}{', overlap' if a.overlap else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
