"""A small GPT in plain PyTorch (no axonn_c in it): token + position embeddings, pre-LayerNorm
blocks with causal self-attention and a GELU MLP, a final LayerNorm and a linear head.

Every matrix multiply is an nn.Linear (QKV, attention out-projection, MLP FC1/FC2, head), so
building the model inside `axonn_c.auto_parallelize()` shards all of them. No dropout, so a
forward pass is deterministic. The head is untied (a tied head would share the embedding's
weight with a sharded layer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must divide by n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # GPT-2's initialisation of the embeddings; the linear layers keep nn.Linear's default,
        # which axonn_c.Linear reproduces exactly whatever the grid
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: [batch, time] token ids -> logits [batch, time, vocab] (and the mean
        cross-entropy over this call's tokens when targets are given)."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ------------------------------------------------------------------------- data

_SUBJECTS = ["the old sailor", "a quiet river", "the miller's daughter", "the grey wolf",
             "a travelling scholar", "the king of the valley", "an honest clerk", "the lamplighter",
             "a small brown hen", "the keeper of the bridge", "the young weaver", "a stranger"]
_VERBS = ["walked along", "looked upon", "spoke softly to", "remembered", "waited beside",
          "sang about", "followed", "counted", "dreamed of", "built a fence around", "forgot",
          "carried water to"]
_OBJECTS = ["the northern hills", "a field of barley", "the sleeping town", "the winter stars",
            "an empty boat", "the long road home", "a letter never sent", "the bells of morning",
            "the garden wall", "a lantern in the rain", "the harbour", "seven silver coins"]
_ENDINGS = [".", ".", ".", ", and the day grew long.", ", for it was evening.", "!",
            ", as the wind turned cold.", "; nobody asked why."]


def make_corpus(n_chars: int = 20000, seed: int = 1234) -> str:
    """A deterministic English-like text generated from a tiny grammar (no download): short
    sentences with a learnable structure, for a character-level language model."""
    import random

    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        s = s[0].upper() + s[1:]
        s += "\n" if rng.random() < 0.2 else " "
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]


class CharData:
    """Character-level tokens of a text; `batch(step, n)` gives the same n sequences of
    block_size + 1 characters on every rank for a step (a rank then takes its slice)."""

    def __init__(self, text: str, block_size: int, pad_vocab_to: int = 8, seed: int = 0):
        chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.itos = chars
        # pad the vocabulary so the head's output dimension divides by any small grid
        self.vocab_size = int(math.ceil(len(chars) / pad_vocab_to) * pad_vocab_to)
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        self.seed = seed

    def batch(self, step: int, n: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.block_size - 1, (n,), generator=g)
        x = torch.stack([self.data[s:s + self.block_size] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1:s + 1 + self.block_size] for s in starts.tolist()])
        return x, y

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.itos[i] if i < len(self.itos) else "?" for i in ids)
