"""axonn_c.Embedding (with its tied output layer and loss), parallel_cross_entropy, LayerNorm and
RMSNorm against the serial torch layers on the grids of the world size: outputs, input
gradients, parameter gradients (after the sums sync_gradients leaves to their
_axonn_grad_groups), both layouts, vocabularies that do not divide the plane, padding_idx,
full_state_dict / load_state_dict with the serial tensors."""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

import axonn_c
from common import close, grids, train_as_serial


def table_shard(full, emb):
    """This rank's flat depth piece of a full [V, H] tensor, as Embedding.load_full cuts it."""
    g = axonn_c.grid()
    block = full.new_zeros(emb.vocab_local, emb.embedding_dim)
    rows = full[emb.vocab_start:emb.vocab_start + emb.vocab_local]
    block[:rows.shape[0]] = rows
    padded = block.new_zeros(emb._shard * g.G_intra_d)
    padded[:emb._block] = block.reshape(-1)
    return padded[g.depth_rank * emb._shard:(g.depth_rank + 1) * emb._shard]


def tokens_of(g, expert, generator, t, low, high):
    """(every token shard's ids, this rank's shard index): easy, one shard per rank (uneven
    counts: odd ranks one more); expert, one per data x depth coordinate."""
    shards = g.world_size if not expert else g.G_data * g.G_intra_d
    me = g.rank if not expert else g.data_rank * g.G_intra_d + g.depth_rank
    counts = [t + (s % 2 if not expert else 0) for s in range(shards)]
    ids = [torch.randint(low, high, (n,), generator=generator) for n in counts]
    return ids, me


def hidden_block(x, g, expert, transpose):
    if not expert:
        return x
    n = g.G_intra_r if transpose else g.G_intra_c
    i = g.row_rank if transpose else g.col_rank
    w = x.shape[-1] // n
    return x[..., i * w:(i + 1) * w]


def check_embedding(g, V, H, expert, transpose, padding_idx, seed):
    what = (f"Embedding({V}, {H}) grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} "
            f"expert={expert} transpose={transpose} padding_idx={padding_idx} rank {g.rank}")
    torch.manual_seed(seed)
    ref = torch.nn.Embedding(V, H, padding_idx=padding_idx)
    torch.manual_seed(seed if g.rank == 0 else seed + g.rank)  # rank 0's draw is used
    emb = axonn_c.Embedding(V, H, padding_idx=padding_idx, expert_mode=expert, transpose=transpose)
    close(emb.full_weight(), ref.weight, what + " full_weight at init", 0)
    gen = torch.Generator().manual_seed(seed)
    ids, me = tokens_of(g, expert, gen, 5, 0, V)
    if padding_idx is not None:  # every shard looks the padding row up
        for s in ids:
            s[0] = padding_idx % V
    dys = [torch.randn(len(i), H, generator=gen) for i in ids]
    want = [ref(i) for i in ids]
    sum((w * d).sum() for w, d in zip(want, dys)).backward()
    y = emb(ids[me].view(1, -1))  # a 2-D input
    close(y[0], hidden_block(want[me], g, expert, transpose), what + " output")
    y[0].backward(hidden_block(dys[me], g, expert, transpose))
    axonn_c.sync_gradients(emb, expert_mode=expert)
    close(emb.weight.grad, table_shard(ref.weight.grad, emb), what + " weight grad")
    # full_state_dict gives the serial table; load_state_dict takes it back
    sd = axonn_c.full_state_dict(torch.nn.ModuleDict({"e": emb}))
    close(sd["e.weight"], ref.weight, what + " full_state_dict", 0)
    other = torch.randn(V, H, generator=gen)
    emb.load_state_dict({"weight": other})
    close(emb.full_weight(), other, what + " load_state_dict", 0)


def check_loss(g, V, H, expert, seed):
    """Tied input/output embedding: hidden = 1.5 * emb(ids) + h, loss = cross-entropy of
    hidden @ W.T; one weight collects both gradients."""
    what = (f"tied Embedding({V}, {H}) + loss grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x"
            f"{g.G_intra_d} expert={expert} rank {g.rank}")
    torch.manual_seed(seed)
    ref = torch.nn.Embedding(V, H)
    torch.manual_seed(seed)
    emb = axonn_c.Embedding(V, H, expert_mode=expert)
    gen = torch.Generator().manual_seed(seed)
    ids, me = tokens_of(g, expert, gen, 4, 0, V)
    targets = [torch.randint(0, V, (len(i),), generator=gen) for i in ids]
    for t in targets:
        t[-1] = -100  # ignored
    hs = [torch.randn(len(i), H, generator=gen, requires_grad=True) for i in ids]
    for reduction in ("mean", "sum", "none"):
        ref.zero_grad()
        emb.zero_grad()
        losses = [F.cross_entropy((1.5 * ref(i) + h) @ ref.weight.t(), t, reduction=reduction)
                  for i, h, t in zip(ids, hs, targets)]
        sum(ls.sum() for ls in losses).backward()
        h = hidden_block(hs[me].detach(), g, expert, False).clone().requires_grad_()
        loss = emb.cross_entropy(1.5 * emb(ids[me]) + h, targets[me], reduction=reduction)
        close(loss, losses[me], f"{what} {reduction} loss")
        loss.sum().backward()
        close(h.grad, hidden_block(hs[me].grad, g, expert, False), f"{what} {reduction} dh")
        axonn_c.sync_gradients(emb, expert_mode=expert)  # (the data group's sum)
        close(emb.weight.grad, table_shard(ref.weight.grad, emb),
              f"{what} {reduction} weight grad")
        close(axonn_c.clip_grad_norm_(emb.parameters(), 1e9), ref.weight.grad.norm(),
              f"{what} {reduction} clip_grad_norm_")
        for t in hs:
            t.grad = None
    if expert:  # the function itself on the layer's logits shard
        h = hidden_block(hs[me].detach(), g, expert, False).clone().requires_grad_()
        logits = emb.logits(h)
        assert logits.shape == (len(ids[me]), emb.vocab_local), what + " logits shard shape"
        for reduction in ("mean", "sum", "none"):
            h.grad = None
            hr = hs[me].detach().clone().requires_grad_()
            want = F.cross_entropy(hr @ ref.weight.t(), targets[me], reduction=reduction)
            got = axonn_c.parallel_cross_entropy(emb.logits(h), targets[me], reduction=reduction)
            close(got, want, f"{what} parallel_cross_entropy {reduction}")
            want.sum().backward()
            got.sum().backward()
            close(h.grad, hidden_block(hr.grad, g, expert, False),
                  f"{what} parallel_cross_entropy {reduction} dh")
        padded = emb.vocab_local * g.G_intra_r * g.G_intra_c
        if padded > V:  # a target in the vocabulary padding: refused given the real size
            bad = targets[me].clone()
            bad[0] = padded - 1
            try:
                axonn_c.parallel_cross_entropy(emb.logits(h), bad, vocab_size=V)
                raise AssertionError(f"{what}: a target in the padding was not refused")
            except IndexError as e:
                assert f"[0, {V})" in str(e), e


def check_norm(g, kind, H, expert, transpose, seed):
    what = (f"{kind}({H}) grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} "
            f"expert={expert} transpose={transpose} rank {g.rank}")
    gen = torch.Generator().manual_seed(seed)
    ref = getattr(torch.nn, kind)(H)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    norm = getattr(axonn_c, kind)(H, expert_mode=expert, transpose=transpose)
    norm.load_state_dict(ref.state_dict())  # the serial tensors
    ids, me = tokens_of(g, expert, gen, 3, 0, 1)
    xs = [(torch.randn(len(i), H, generator=gen) * 3 + 5).requires_grad_() for i in ids]
    dys = [torch.randn(len(i), H, generator=gen) for i in ids]
    sum((ref(x) * d).sum() for x, d in zip(xs, dys)).backward()
    x = hidden_block(xs[me].detach(), g, expert, transpose).clone().requires_grad_()
    y = norm(x)
    close(y, hidden_block(ref(xs[me]), g, expert, transpose), what + " output")
    y.backward(hidden_block(dys[me], g, expert, transpose))
    close(x.grad, hidden_block(xs[me].grad, g, expert, transpose), what + " dX")
    axonn_c.sync_gradients(norm, expert_mode=expert)
    for name, p in norm.named_parameters():
        close(p.grad, hidden_block(getattr(ref, name).grad, g, expert, transpose),
              f"{what} d{name}")
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).norm()
    close(axonn_c.clip_grad_norm_(norm.parameters(), 1e9), want, what + " clip_grad_norm_")
    sd = axonn_c.full_state_dict(norm)
    for k, v in ref.state_dict().items():
        close(sd[k], v, f"{what} full_state_dict {k}", 0)


def check_norm_half_input(g, kind, H, expert, dtype, seed):
    """A float16/bfloat16 input to float32 norm parameters: the statistics are accumulated in
    float32 as torch's kernels do (float16 squares of values near 60 overflow), so the result
    is the serial norm's, in the input's dtype (as torch's)."""
    what = (f"{kind}({H}) {dtype} input grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x"
            f"{g.G_intra_d} expert={expert} rank {g.rank}")
    gen = torch.Generator().manual_seed(seed)
    ref = getattr(torch.nn, kind)(H)
    norm = getattr(axonn_c, kind)(H, expert_mode=expert)
    norm.load_state_dict(ref.state_dict())
    # values near 60 (float16 squares overflow) and near 0.01 (the default eps matters)
    for scale, shift in ((2, 60), (0.01, 0)):
        x = (torch.randn(4, H, generator=gen) * scale + shift).to(dtype)
        want = ref(x)
        got = norm(hidden_block(x, g, expert, False))
        assert got.dtype == dtype, f"{what}: result dtype {got.dtype}"
        close(got, hidden_block(want, g, expert, False), f"{what} x ~ {scale}",
              2e-3 if dtype == torch.float16 else 1e-2)
    # under an autocast that runs norms in float32 (CUDA's policy, stood in for on the CPU by
    # a wrapper of torch's functional norm that both layers call), the result is float32 too
    fn_name = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm"}[kind]
    real = getattr(F, fn_name)

    def fp32_under_autocast(t, *args, **kw):
        out = real(t, *args, **kw)
        return out.float() if torch.is_autocast_enabled(t.device.type) else out

    setattr(F, fn_name, fp32_under_autocast)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = ref(x), norm(hidden_block(x, g, expert, False))
    finally:
        setattr(F, fn_name, real)
    assert got.dtype == want.dtype == torch.float32, \
        f"{what}: under autocast {got.dtype}, serial {want.dtype}"
    close(got, hidden_block(want, g, expert, False), f"{what} under autocast",
          2e-3 if dtype == torch.float16 else 1e-2)


def check_embedding_nonfinite_row(g, V, H, expert, seed):
    """A NaN row of the table makes NaN only the tokens that look it up (as serial): a rank
    that does not hold a token's word must not carry its stand-in row's NaN into the sum."""
    what = (f"Embedding({V}, {H}) NaN row grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x"
            f"{g.G_intra_d} expert={expert} rank {g.rank}")
    torch.manual_seed(seed)
    ref = torch.nn.Embedding(V, H)
    with torch.no_grad():
        ref.weight[0] = float("nan")
        ref.weight[V - 1, 0] = float("inf")
    emb = axonn_c.Embedding(V, H, expert_mode=expert)
    emb.load_state_dict(ref.state_dict())
    ids = torch.tensor([1, 0, 2, V - 1, 3])
    want = hidden_block(ref(ids), g, expert, False)
    got = emb(ids)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN where serial has none"
    assert torch.equal(got.isinf(), want.isinf()), f"{what}: Inf elsewhere than serial"
    keep = torch.isfinite(want)
    close(got[keep], want[keep], what)


class TinyLM(torch.nn.Module):
    """Embedding, a norm, an MLP and an output layer tied to the embedding (as transformers'
    tie_weights does it: the head's weight attribute is assigned the embedding's)."""

    def __init__(self, V, H):
        super().__init__()
        self.wte = torch.nn.Embedding(V, H)
        self.ln = torch.nn.LayerNorm(H)
        self.fc = torch.nn.Linear(H, 2 * H)
        self.proj = torch.nn.Linear(2 * H, H)
        self.head = torch.nn.Linear(H, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids)
        x = x + self.proj(torch.relu(self.fc(self.ln(x))))
        return self.head(x)


def check_auto_parallelize_tied(g, V, H, seed):
    """auto_parallelize swaps nn.Embedding and keeps the tie; AdamW steps equal serial
    training's (every rank its own tokens, global mean loss)."""
    what = (f"auto_parallelize TinyLM({V}, {H}) grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x"
            f"{g.G_intra_d} rank {g.rank}")
    torch.manual_seed(seed)
    ref = TinyLM(V, H)
    torch.manual_seed(seed)
    with axonn_c.auto_parallelize(embeddings=True):
        par = TinyLM(V, H)
    assert isinstance(par.wte, axonn_c.Embedding), what + ": nn.Embedding not swapped"
    assert par.head.weight is par.wte.weight, what + ": tie lost"
    assert len(list(par.parameters())) == len(list(ref.parameters())), what + ": parameters"
    gen = torch.Generator().manual_seed(seed)

    def batches(step):  # (ids, targets) for every rank
        ids = [torch.randint(0, V, (2, 3), generator=gen) for _ in range(g.world_size)]
        tgt = [torch.randint(0, V, (2, 3), generator=gen) for _ in range(g.world_size)]
        return list(zip(ids, tgt))

    train_as_serial(g, ref, par, what, batches,
                    lambda m, b: F.cross_entropy(m(b[0]).view(-1, V), b[1].view(-1)),
                    steps=3, lr=1e-2)
    par.load_state_dict(ref.state_dict())  # serial tensors, the tied entry twice
    close(par.wte.full_weight(), ref.wte.weight, what + " load_state_dict", 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grids", default="all", help="all, or G_data x r x c x d items: 1x2x2x2,...")
    p.add_argument("--overlap", action="store_true", help="init(overlap=True): the data-parallel "
                   "sums run during backward (the gradient hooks)")
    a = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    todo = list(grids(world)) if a.grids == "all" else [
        tuple(int(v) for v in s.split("x")) for s in a.grids.split(",")]
    n = 0
    for sizes in todo:
        g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2],
                         G_intra_d=sizes[3], overlap=a.overlap)
        for expert in (False, True):
            for V, padding_idx, transpose in ((37, None, False), (3, 1, expert), (64, -2, False)):
                check_embedding(g, V, 8, expert, transpose, padding_idx, seed=100 + n)
                n += 1
            for V in (37, 3):
                check_loss(g, V, 8, expert, seed=200 + n)
                n += 1
            for kind in ("LayerNorm", "RMSNorm"):
                for transpose in (False, True):
                    check_norm(g, kind, 8, expert, transpose, seed=300 + n)
                    n += 1
                for dtype in (torch.float16, torch.bfloat16):
                    check_norm_half_input(g, kind, 8, expert, dtype, seed=350 + n)
                    n += 1
            check_embedding_nonfinite_row(g, 37, 8, expert, seed=380 + n)
            n += 1
        check_auto_parallelize_tied(g, 37, 8, seed=400 + n)
        n += 1
        axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print(f"world {world}: {len(todo)} grids, {n} layer cases match torch"
              f"{' with overlap on' if a.overlap else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
