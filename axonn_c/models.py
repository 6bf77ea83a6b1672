"""axonn_c.models: reference models built from axonn_c's parallel layers in the 4D paper's
expert layout (docs/models.md).

`GPT(config)` is transformers' GPT2LMHeadModel (pre-LayerNorm blocks, causal multi-head
attention, GELU MLP, learned positions, embedding tied to the output layer) with every tensor
split over the grid of axonn_c.init():

- tokens: whole sequences split over data x depth (each rank passes its share of the batch; the
  row x column plane of a rank holds the same sequences);
- the residual stream `[b, s, H/G_c]`: hidden split over the column group, replicated over row;
- attention heads split over the row group: QKV is a normal expert Linear (H -> 3H, output over
  row), the out-projection a `transpose=True` one (input over row, output over column), so they
  chain with no redistribution; the MLP the same (FC1 normal, FC2 transposed);
- the embedding split by vocabulary over the plane and depth-sharded (axonn_c.Embedding), used
  again as the output layer; the loss is vocabulary-parallel (axonn_c.parallel_cross_entropy);
- exact LayerNorm over the hidden shards (axonn_c.LayerNorm, expert_mode=True).
"""
from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from . import validate
from .chunking import Sequential
from .embedding import Embedding
from .linear import Linear
from .loss import parallel_cross_entropy
from .norm import LayerNorm
from .state import grid

__all__ = ["GPT", "CausalLMOutput"]

# transformers' GPT-2 Conv1D layers: their weight is [in, out], nn.Linear's (and ours) [out, in]
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# buffers older transformers versions kept in GPT2Attention (the causal mask): not weights
_BUFFERS = (".attn.bias", ".attn.masked_bias")
_EXTRA_STATE = "_extra_state"  # (torch's state dict key of get_extra_state: the dropout counter)
_ACTIVATIONS = MappingProxyType({
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
})


@dataclass
class CausalLMOutput:
    """What GPT.forward returns: `loss` (None without labels) and `logits`, this rank's
    vocabulary shard `[b, s, Vp]` (Vp = ceil(V / (G_intra_r * G_intra_c)); shard p of the plane
    holds words [p*Vp, (p+1)*Vp), words past V at -inf)."""
    loss: Optional[Tensor]
    logits: Tensor


def _field(config, name, default=None, required=False):
    value = getattr(config, name, None)
    if value is None:
        if required:
            raise ValueError(f"axonn_c.models.GPT: config has no {name!r} (expected a "
                             "transformers GPT2Config or a dataclass with its field names)")
        return default
    return value


class _Dropout:
    """Dropout whose masks are right for the layout: a value replicated over some group gets the
    same mask on each replica (seeded without that group's index), values that differ get
    independent masks. `replicated` names the group over which the tensor is a copy."""

    def __init__(self, p: float, replicated: str, site: int):
        self.p, self.replicated, self.site = float(p), replicated, site

    def __call__(self, x: Tensor, seed: Optional[int]) -> Tensor:
        if self.p == 0.0 or seed is None:
            return x
        g = grid()
        # the tensor differs over data, depth and the plane group it is not a copy over
        coords = (g.data_rank, g.depth_rank,
                  g.col_rank if self.replicated == "row" else g.row_rank)
        key = f"{seed}:{self.site}:{coords}".encode()
        gen = torch.Generator(device=x.device).manual_seed(zlib.crc32(key) * 7919 + seed)
        keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)


class _Attention(nn.Module):
    def __init__(self, H: int, n_head: int, scale: bool, attn_pdrop: float, resid_pdrop: float,
                 layer: int, init):
        super().__init__()
        g = grid()
        self.head_dim = H // n_head
        self.heads_local = n_head // g.G_intra_r
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale else 1.0
        # output features in head-interleaved order [q_h, k_h, v_h] per head (grid-independent,
        # so a checkpoint reshards): the row group's contiguous block is a set of whole heads
        self.c_attn = Linear(H, 3 * H, expert_mode=True, init_method=init[0])
        self.c_proj = Linear(H, H, transpose=True, expert_mode=True, init_method=init[1])
        self.attn_dropout = _Dropout(attn_pdrop, "col", 3 * layer + 1)
        self.resid_dropout = _Dropout(resid_pdrop, "row", 3 * layer + 2)

    def forward(self, x: Tensor, seed: Optional[int]) -> Tensor:
        b, s, _ = x.shape
        qkv = self.c_attn(x.reshape(b * s, -1)).view(b, s, self.heads_local, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))  # [b, heads, s, hd]
        if self.attn_dropout.p and seed is not None:
            att = (q @ k.transpose(-2, -1)) * self.scale
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            y = self.attn_dropout(att, seed) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        y = self.c_proj(y.transpose(1, 2).reshape(b * s, -1))
        return self.resid_dropout(y, seed).view(b, s, -1)


class _Block(nn.Module):
    def __init__(self, cfg: dict, layer: int):
        super().__init__()
        H, eps = cfg["n_embd"], cfg["eps"]
        std, proj_std = cfg["std"], cfg["std"] / math.sqrt(2 * cfg["n_layer"])

        def normal(s):
            return lambda w: nn.init.normal_(w, 0.0, s)

        self.ln_1 = LayerNorm(H, eps=eps, expert_mode=True)
        self.attn = _Attention(H, cfg["n_head"], cfg["scale_attn"], cfg["attn_pdrop"],
                               cfg["resid_pdrop"], layer, (normal(std), normal(proj_std)))
        self.ln_2 = LayerNorm(H, eps=eps, expert_mode=True)
        # FC1 -> activation -> FC2 on rows: axonn_c.Sequential pipelines its chunks across the
        # two Linears where that pays (overlap on, no depth sharding), else runs as nn.Sequential
        self.mlp = Sequential(OrderedDict(
            c_fc=Linear(H, cfg["n_inner"], expert_mode=True, init_method=normal(std)),
            act=_Activation(cfg["activation"]),
            c_proj=Linear(cfg["n_inner"], H, transpose=True, expert_mode=True,
                          init_method=normal(proj_std))))
        self.mlp_dropout = _Dropout(cfg["resid_pdrop"], "row", 3 * layer + 3)
        for lin in (self.attn.c_attn, self.attn.c_proj, self.mlp.c_fc, self.mlp.c_proj):
            nn.init.zeros_(lin.bias)  # (transformers' GPT-2 starts every bias at zero)

    def forward(self, x: Tensor, seed: Optional[int] = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), seed)
        b, s, h = x.shape
        m = self.mlp(self.ln_2(x).reshape(b * s, h))
        return x + self.mlp_dropout(m, seed).view(b, s, -1)


class _Activation(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.fn = _ACTIVATIONS[name]

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


def _qkv_order(H: int, n_head: int) -> Tensor:
    """Row i of our c_attn weight is row order[i] of the serial one ([q | k | v], each head-major):
    ours is head-interleaved, [q_h, k_h, v_h] for each head h in turn."""
    return torch.arange(3 * H).view(3, n_head, H // n_head).permute(1, 0, 2).reshape(-1)


class GPT(nn.Module):
    """transformers' GPT2LMHeadModel in axonn_c's expert layout (module docstring), on the grid
    of axonn_c.init(); the grid's row size must divide n_head and the column size n_embd.

    `config`: a transformers GPT2Config, or any object with its field names (n_embd, n_head,
    n_layer, n_positions, vocab_size; optional layer_norm_epsilon, n_inner,
    activation_function, resid_pdrop, embd_pdrop, attn_pdrop, initializer_range,
    scale_attn_weights). `checkpoint=True` recomputes each block in backward (activation
    checkpointing). `dropout_seed` seeds the per-rank dropout masks (docs/models.md#dropout).

    Weights start as transformers initialises GPT-2 (normal(0, initializer_range), the
    projections into the residual stream scaled by 1/sqrt(2*n_layer), zero biases), drawn once
    and cut; `load_state_dict` takes the serial GPT2LMHeadModel state dict (names and Conv1D
    orientation as transformers writes them) or this model's own sharded one;
    `axonn_c.full_state_dict(model)` gives the serial one back.
    """

    def __init__(self, config, *, checkpoint: bool = False, dropout_seed: int = 0):
        super().__init__()
        self.config = config
        H = validate.check_int("GPT: n_embd", _field(config, "n_embd", required=True), 1)
        n_head = validate.check_int("GPT: n_head", _field(config, "n_head", required=True), 1)
        n_layer = validate.check_int("GPT: n_layer", _field(config, "n_layer", required=True), 0)
        self.n_positions = validate.check_int(
            "GPT: n_positions", _field(config, "n_positions", required=True), 1)
        self.vocab_size = validate.check_int(
            "GPT: vocab_size", _field(config, "vocab_size", required=True), 1)
        for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                     "add_cross_attention"):
            if _field(config, name, False):
                raise ValueError(f"axonn_c.models.GPT does not support {name}=True (expected "
                                 "False)")
        if not _field(config, "tie_word_embeddings", True):
            raise ValueError("axonn_c.models.GPT ties the output layer to the embedding: "
                             "tie_word_embeddings=False is not supported")
        activation = _field(config, "activation_function", "gelu_new")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"axonn_c.models.GPT: activation_function {activation!r} is not "
                             f"supported (expected one of {sorted(_ACTIVATIONS)})")
        g = grid()  # raises before init()
        if H % n_head:
            raise ValueError(f"GPT: n_embd {H} must divide by n_head {n_head}")
        if n_head % g.G_intra_r:
            raise ValueError(f"GPT: n_head {n_head} must divide by the row group "
                             f"(G_intra_r = {g.G_intra_r}): heads are split over it")
        n_inner = _field(config, "n_inner", 4 * H)
        cfg = dict(n_embd=H, n_head=n_head, n_layer=n_layer, n_inner=n_inner,
                   eps=float(_field(config, "layer_norm_epsilon", 1e-5)),
                   std=float(_field(config, "initializer_range", 0.02)),
                   scale_attn=bool(_field(config, "scale_attn_weights", True)),
                   attn_pdrop=float(_field(config, "attn_pdrop", 0.0)),
                   resid_pdrop=float(_field(config, "resid_pdrop", 0.0)), activation=activation)
        for name in ("n_embd", "n_inner"):
            for group, size in (("column", g.G_intra_c), ("row", g.G_intra_r)):
                if cfg[name] % size:
                    raise ValueError(f"GPT: {name} {cfg[name]} must divide by the {group} group "
                                     f"({size} ranks)")
        self.n_embd, self.n_head = H, n_head
        self.checkpoint = bool(checkpoint)
        self.dropout_seed = int(dropout_seed)
        # training forward calls so far: each draws new dropout masks. A CPU int64 tensor, not
        # a buffer (.to/.cuda leave it on the host: reading it syncs no device), in the state
        # dict as extra state, so that axonn_c.checkpoint saves it and load writes it back
        # in place: a resumed run draws the masks an uninterrupted one would
        self._dropout_calls = torch.zeros((), dtype=torch.int64, device="cpu")
        std = cfg["std"]
        # the tables are drawn here (std = initializer_range) and broadcast by Embedding
        wte = Embedding(self.vocab_size, H, expert_mode=True,
                        _weight=torch.empty(self.vocab_size, H).normal_(0.0, std))
        wpe = Embedding(self.n_positions, H, expert_mode=True,
                        _weight=torch.empty(self.n_positions, H).normal_(0.0, std))
        self.transformer = nn.Module()
        self.transformer.wte, self.transformer.wpe = wte, wpe
        self.transformer.h = nn.ModuleList(_Block(cfg, i) for i in range(n_layer))
        self.transformer.ln_f = LayerNorm(H, eps=cfg["eps"], expert_mode=True)
        self.embd_dropout = _Dropout(float(_field(config, "embd_pdrop", 0.0)), "row", 0)
        self._qkv = _qkv_order(H, n_head)

    # ---------------------------------------------------------------- forward

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None) -> CausalLMOutput:
        """`input_ids [b, s]`: this rank's sequences (the batch split over data x depth, shard
        `data_rank * G_intra_d + depth_rank`; the same on the row x column plane). `labels`
        (optional, `[b, s]`, -100 ignored) are shifted as transformers does: the loss is the
        mean over this rank's predicted tokens, the same on the plane."""
        validate.check_tensor("GPT: input_ids", input_ids, 2)
        if input_ids.dim() != 2:  # (more than two)
            raise ValueError(f"GPT: input_ids must be [batch, seq], got {list(input_ids.shape)}")
        b, s = input_ids.shape
        if s > self.n_positions:
            raise ValueError(f"GPT: sequence length {s} exceeds n_positions {self.n_positions}")
        if labels is not None and tuple(labels.shape) != (b, s):
            raise ValueError(f"GPT: labels must have input_ids' shape {[b, s]}, got "
                             f"{list(labels.shape)}")
        seed = None
        if self.training and torch.is_grad_enabled():
            calls = int(self._dropout_calls) + 1
            self._dropout_calls.fill_(calls)
            seed = self.dropout_seed * 1_000_003 + calls
        t = self.transformer
        pos = t.wpe(torch.arange(s, device=input_ids.device))  # [s, H/G_c], one per position
        x = t.wte(input_ids) + pos
        x = self.embd_dropout(x.to(t.ln_f.weight.dtype), seed)  # (the residual stream's dtype)
        for block in t.h:
            if self.checkpoint and torch.is_grad_enabled():
                x = _checkpoint(block, x, seed, use_reentrant=False)
            else:
                x = block(x, seed)
        h = t.ln_f(x)
        emb = t.wte
        if labels is None:
            return CausalLMOutput(None, emb.logits(h).view(b, s, -1))
        flat = labels.reshape(-1)
        # a bad label raises on every rank of the intra group at once (before any collective)
        logits, _ = emb._logits(h, emb._out_of_range(flat, -100))
        logits = logits.view(b, s, -1)
        loss = parallel_cross_entropy(logits[:, :-1].reshape(b * (s - 1), -1),
                                      labels[:, 1:].reshape(-1), ignore_index=-100,
                                      vocab_size=emb.num_embeddings)
        return CausalLMOutput(loss, logits)

    # ---------------------------------------------------------------- serial state dicts

    # checkpoints written before the dropout counter was state lack it: axonn_c.checkpoint.load
    # then leaves this model's own
    _axonn_optional_extra_state = True

    def get_extra_state(self) -> Tensor:
        """The dropout call counter (the tensor itself: a checkpoint load writes into it)."""
        return self._dropout_calls

    def set_extra_state(self, state) -> None:
        if not isinstance(state, Tensor) or state.numel() != 1:
            raise ValueError(f"GPT: extra state must be the dropout call counter (a one-element "
                             f"tensor), got {state!r}")
        self._dropout_calls.fill_(int(state))

    def _is_serial(self, state_dict) -> bool:
        w = state_dict.get("transformer.wte.weight")
        return w is not None and w.dim() == 2

    def _is_conv1d(self, state_dict) -> bool:
        """Whether full tensors are in transformers' orientation ([in, out], QKV [q | k | v]),
        not in this model's own (what axonn_c.checkpoint's export writes): c_attn's weight is
        [H, 3H] in the one and [3H, H] in the other (the model has no other tell: c_proj's
        [H, H] is square)."""
        w = state_dict.get("transformer.h.0.attn.c_attn.weight")
        return w is None or tuple(w.shape) == (self.n_embd, 3 * self.n_embd)

    def from_serial(self, state_dict) -> "OrderedDict[str, Tensor]":
        """transformers' GPT2LMHeadModel state dict -> full tensors under this model's names
        (nn.Linear orientation, QKV rows head-interleaved), which its layers load by cutting.
        Full tensors already in this model's orientation (a checkpoint export) pass through."""
        conv1d = self._is_conv1d(state_dict)
        out = OrderedDict()
        for k, v in state_dict.items():
            if k == "lm_head.weight" or k.endswith(_BUFFERS):
                continue  # (tied to wte; the causal-mask buffers)
            if conv1d and any(k.endswith(c + ".weight") for c in _CONV1D):
                v = v.t()
            if conv1d and (k.endswith("attn.c_attn.weight") or k.endswith("attn.c_attn.bias")):
                v = v[self._qkv]
            out[k] = v
        return out

    def to_serial(self, full) -> "OrderedDict[str, Tensor]":
        """The inverse of from_serial: full tensors under this model's names (what
        axonn_c.full_state_dict gathers) -> transformers' GPT2LMHeadModel state dict."""
        back = torch.argsort(self._qkv)
        out = OrderedDict()
        for k, v in full.items():
            if k == _EXTRA_STATE:  # (the dropout counter: not a transformers entry)
                continue
            if k.endswith("attn.c_attn.weight") or k.endswith("attn.c_attn.bias"):
                v = v[back]
            if any(k.endswith(c + ".weight") for c in _CONV1D):
                v = v.t().contiguous()
            out[k] = v
        wte = [k for k in out if k.endswith("transformer.wte.weight")]
        if wte:
            out[wte[0][:-len("transformer.wte.weight")] + "lm_head.weight"] = out[wte[0]]
        return out

    # read by axonn_c.full_state_dict: what it gathers is turned into the serial state dict
    _axonn_to_serial = to_serial

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """This model's own (sharded) state dict, or transformers' serial GPT2LMHeadModel one
        (told apart by the embedding table: [V, H] is serial). Every rank cuts its own shards
        from the full tensors: no collective."""
        if self._is_serial(state_dict):
            state_dict = self.from_serial(state_dict)
        if _EXTRA_STATE not in state_dict:
            # transformers' state dict, or one this model gave before the dropout counter was
            # state, has none: this model keeps its own
            metadata = getattr(state_dict, "_metadata", None)
            state_dict = OrderedDict(state_dict)
            if metadata is not None:
                state_dict._metadata = metadata
            state_dict[_EXTRA_STATE] = self._dropout_calls.clone()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def extra_repr(self) -> str:
        return f"checkpoint={self.checkpoint}"
