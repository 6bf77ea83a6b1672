"""axonn_c.Embedding: nn.Embedding with its table split by vocabulary over the row x column
plane and each plane rank's block depth-sharded like an axonn_c.Linear weight; also the tied
(vocabulary-parallel) output projection and its loss (docs/layers.md#embedding)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import grads, replicate, validate
from .autograd_comm import (PLANE, GatherDepth, GatherHidden, GatherRows, OwnRows, ScatterHidden,
                            ScatterRows, all_reduce_, gather_rows, group_index, groups_size)
from .linear import flat_block_boxes
from .loss import _VocabParallelCE, check_loss_args, reduce_loss
from .state import grid, group_size, microbatch_active, session


class Embedding(nn.Module):
    """Drop-in for nn.Embedding, sharded over the grid of axonn_c.init().

    The vocabulary is split over the plane's `P = G_intra_r * G_intra_c` ranks (plane rank
    `row_rank * G_intra_c + col_rank` holds words `[p*Vp, (p+1)*Vp)`, `Vp = ceil(V / P)`; the
    words past V are padding that never shows in a result); each block `[Vp, H]`, flattened, is
    split over depth like a Linear weight (the `weight` parameter is this rank's flat piece).

    Easy layout (default): every rank passes its own token ids `[...]` and gets `[..., H]`.
    Expert layout (`expert_mode=True`): the ids are the same on the whole plane (tokens split
    over data x depth, as for an expert-mode Linear) and the output is this rank's block of the
    hidden dimension over the column group (`transpose=True`: the row group), `[..., H/G]`:
    what an expert-mode Linear (or axonn_c.LayerNorm(expert_mode=True)) takes.

    The full table is initialised as nn.Embedding's (normal, padding row zero) from one draw
    broadcast from rank 0: nn.Embedding built after the same torch.manual_seed holds the same
    table. `padding_idx` is PyTorch's (that row gets no gradient); max_norm,
    scale_grad_by_freq and sparse are not supported (ValueError).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: Optional[Tensor] = None, _freeze: bool = False, device=None, dtype=None,
                 *, expert_mode: bool = False, transpose: bool = False):
        super().__init__()
        self.num_embeddings = validate.check_int("Embedding: num_embeddings", num_embeddings, 1,
                                                 2**31 - 1)
        self.embedding_dim = validate.check_int("Embedding: embedding_dim", embedding_dim, 1,
                                                2**31 - 1)
        for name, value, ok in (("max_norm", max_norm, None), ("scale_grad_by_freq",
                                scale_grad_by_freq, False), ("sparse", sparse, False)):
            if value != ok and not (ok is None and value is None):
                raise ValueError(f"axonn_c.Embedding does not support {name}={value!r} (expected "
                                 f"{ok}): use torch.nn.Embedding for it")
        self.max_norm, self.norm_type = None, norm_type
        self.scale_grad_by_freq, self.sparse = False, False
        if padding_idx is not None:
            v = self.num_embeddings
            validate.check_int("Embedding: padding_idx", padding_idx, -v, v - 1)
            padding_idx = padding_idx + v if padding_idx < 0 else padding_idx
        self.padding_idx = padding_idx
        self.expert_mode, self.transpose = bool(expert_mode), bool(transpose)
        self.hidden_group, self.other_group = ("row", "col") if transpose else ("col", "row")
        g = grid()  # raises before init()
        self._placed_on = session.placement
        if self.expert_mode and self.embedding_dim % group_size(self.hidden_group):
            raise ValueError(f"axonn_c.Embedding(expert_mode=True): embedding_dim "
                             f"{self.embedding_dim} must divide by the {self.hidden_group} group "
                             f"({group_size(self.hidden_group)} ranks)")
        plane = g.G_intra_r * g.G_intra_c
        self.vocab_local = -(-self.num_embeddings // plane)  # Vp
        self.vocab_start = group_index(PLANE) * self.vocab_local
        self._block = self.vocab_local * self.embedding_dim
        self._shard = -(-self._block // g.G_intra_d)
        dtype = dtype or torch.get_default_dtype()
        if _weight is not None:
            if tuple(_weight.shape) != (self.num_embeddings, self.embedding_dim):
                raise ValueError(f"Embedding: _weight must be [{self.num_embeddings}, "
                                 f"{self.embedding_dim}], got {list(_weight.shape)}")
            full = _weight.detach().to(torch.float32).clone()
        else:
            full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=dtype).normal_()
            full = full.float()
            if padding_idx is not None:
                full[padding_idx].zero_()
        replicate.same_full_init(full)  # one draw on every rank
        self.weight = nn.Parameter(torch.empty(self._shard, device=device, dtype=dtype),
                                   requires_grad=not _freeze)
        self._tag_parameters()
        self.load_full(full)

    def _tag_parameters(self) -> None:
        """As an axonn_c.Linear weight: the gradient covers the plane's and the depth group's
        tokens (the layer's own collectives); the data group's sum is left to sync_gradients."""
        w = self.weight
        w._axonn_grad_groups = ("data",)
        w._axonn_norm_groups = ("intra",)
        # whose table it is: auto_parallelize ties an output Linear assigned this weight to it
        w._axonn_table = self
        grads.hook(w, w._axonn_grad_groups)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._tag_parameters()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._tag_parameters()  # (the conversion may have made a new Parameter)
        return out

    def _check_placement(self) -> None:
        if microbatch_active():  # (its collectives would share the groups with the other thread)
            raise RuntimeError("axonn_c.Embedding does not run on run_concurrent's micro-batch "
                               "threads yet: call it before run_concurrent, or use nn.Embedding")
        if session.placement != self._placed_on:
            raise RuntimeError(
                f"axonn_c.Embedding({self.num_embeddings}, {self.embedding_dim}) was built on "
                f"another grid or rank place ({self._placed_on}, now {session.placement}): build "
                "it after init(), or move its weights with axonn_c.full_state_dict() and "
                "load_state_dict()")

    # ---------------------------------------------------------------- shards <-> full tensors

    @torch.no_grad()
    def load_full(self, weight: Tensor) -> None:
        """Loads this rank's shard from the full serial table [V, H]."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"full embedding weight must be [{self.num_embeddings}, "
                             f"{self.embedding_dim}], got {list(weight.shape)}")
        block = weight.new_zeros(self.vocab_local, self.embedding_dim)
        rows = weight[self.vocab_start:self.vocab_start + self.vocab_local]
        block[:rows.shape[0]] = rows
        padded = block.new_zeros(self._shard * group_size("depth"))
        padded[:self._block] = block.reshape(-1)
        d = grid().depth_rank
        self.weight.copy_(padded[d * self._shard:(d + 1) * self._shard])

    @torch.no_grad()
    def full_weight(self) -> Tensor:
        """The full [V, H] table on every rank (collective over the intra group)."""
        self._check_placement()
        block = gather_rows(self.weight.detach().contiguous(), ("depth",))[:self._block]
        return gather_rows(block.view(self.vocab_local, self.embedding_dim),
                           PLANE)[:self.num_embeddings]

    def weight_boxes(self):
        """Where this rank's depth shard lies in the full [V, H] table, without the padding
        (rows past the vocabulary, the depth padding): (offsets, sizes, start, stop) per box,
        as Linear.weight_boxes (axonn_c/checkpoint.py saves and loads through these)."""
        k = self.embedding_dim
        real = max(min(self.vocab_local, self.num_embeddings - self.vocab_start), 0) * k
        lo = grid().depth_rank * self._shard
        return flat_block_boxes(lo, min(lo + self._shard, real), k, self.vocab_start, 0)

    def full_tensors(self, prefix: str = "") -> dict:
        """{name: full serial tensor} for full_state_dict (collective)."""
        return {prefix + "weight": self.full_weight()}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dim() == 2:  # the full serial nn.Embedding table
            self.load_full(w)
            state_dict = dict(state_dict)
            state_dict[prefix + "weight"] = self.weight
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._tag_parameters()

    # ---------------------------------------------------------------- forward

    def _table(self, dtype=None) -> Tensor:
        """This plane rank's block [Vp, H], gathered over depth (its gradient reduce-scattered
        back over depth)."""
        w = self.weight if dtype is None or dtype == self.weight.dtype else self.weight.to(dtype)
        return GatherDepth.apply(w, self._block).view(self.vocab_local, self.embedding_dim)

    def _rows_info(self, rows: int, bad: bool, what: str) -> int:
        """The largest row count over the intra group (the plane pools that many per rank), and
        one verdict for all of it on bad ids: every rank raises together, none waits."""
        info = torch.tensor([rows, int(bad)], dtype=torch.int64)
        all_reduce_(info, ("intra",), op="max")
        if info[1]:
            raise IndexError(f"axonn_c.Embedding{what}: an id is out of range [0, "
                             f"{self.num_embeddings}) on some rank of the intra group (this "
                             f"rank: {'yes' if bad else 'no'})")
        return int(info[0])

    def _out_of_range(self, ids: Tensor, ignore=None) -> bool:
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if ignore is not None:
            bad &= ids != ignore
        return bool(bad.any()) if ids.numel() else False

    def _lookup(self, ids: Tensor, table: Tensor) -> Tensor:
        """Rows of the local block for the ids it holds, zero for the others."""
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_local)
        pad = None if self.padding_idx is None else self.padding_idx - self.vocab_start
        if pad is not None and not 0 <= pad < self.vocab_local:
            pad = None  # (another rank's word)
        out = F.embedding(torch.where(mine, local, torch.full_like(local, pad or 0)), table,
                          padding_idx=pad)
        # (selected, not multiplied by the mask: 0 * a NaN or Inf in the stand-in row is NaN)
        return torch.where(mine.unsqueeze(1), out, out.new_zeros(()))

    def forward(self, ids: Tensor) -> Tensor:
        self._check_placement()
        validate.check_tensor("Embedding: input", ids, 0)
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"axonn_c.Embedding expects integer token ids (int64 or int32), got "
                            f"{ids.dtype}")
        flat = ids.reshape(-1).long()
        t_max = self._rows_info(flat.shape[0], self._out_of_range(flat), "")
        # (the table's own dtype under autocast too: a lookup is no autocast op, nn.Embedding
        # returns its weight's rows exactly, and a model's residual stream starts from them)
        table = self._table()
        if self.expert_mode:  # the plane holds the same ids: a partial sum, then my block
            out = ScatterHidden.apply(self._lookup(flat, table), self.hidden_group,
                                      self.other_group)
            return out.view(*ids.shape, out.shape[-1])
        if groups_size(PLANE) == 1:
            return self._lookup(flat, table).view(*ids.shape, self.embedding_dim)
        pooled = gather_rows(_pad_rows(flat, t_max, -1), PLANE)  # (row, col, token) order
        out = ScatterRows.apply(self._lookup(pooled, table), PLANE)[:flat.shape[0]]
        return out.reshape(*ids.shape, self.embedding_dim)

    # ---------------------------------------------------------------- tied output projection

    def logits(self, hidden: Tensor) -> Tensor:
        """The output projection with this (tied) table: this rank's vocabulary shard of
        `hidden @ weight.T`, `[rows, Vp]`, words past V at -inf; the full logits never exist.

        Expert layout: `hidden [..., H/G]` as forward returns it; the rows are this rank's
        tokens (the same on the plane). Easy layout: `hidden [..., H]`, every rank its own
        tokens; the rows are the plane's tokens pooled (plane rank order, each rank's padded to
        the plane's largest count): use `cross_entropy`, which pools the targets the same way.
        Feed the shard to axonn_c.parallel_cross_entropy (groups: the plane)."""
        return self._logits(hidden, False)[0]

    def _logits(self, hidden: Tensor, bad_target: bool):
        self._check_placement()
        validate.check_tensor("Embedding.logits: hidden", hidden, 1)
        want = (self.embedding_dim // group_size(self.hidden_group) if self.expert_mode
                else self.embedding_dim)
        if hidden.shape[-1] != want:
            raise ValueError(f"Embedding.logits expects the last dimension to be {want} "
                             f"({'expert layout: H/G' if self.expert_mode else 'H'}), got "
                             f"{list(hidden.shape)}")
        h = hidden.reshape(-1, want)
        # (before any other collective: a bad target raises on every rank at once)
        t_max = self._rows_info(h.shape[0], bad_target, ".cross_entropy (target)")
        table = self._table(h.dtype)
        if self.expert_mode:
            h = GatherHidden.apply(h, self.hidden_group, self.other_group)
        elif groups_size(PLANE) > 1:
            h = GatherRows.apply(_pad_rows(h, t_max, 0), PLANE)
        out = h @ table.t()
        valid = self.num_embeddings - self.vocab_start
        if valid < self.vocab_local:  # padding words: never a class
            words = torch.arange(self.vocab_local, device=out.device)
            out = out.masked_fill(words >= valid, float("-inf"))
        return out, t_max

    def full_logits(self, hidden: Tensor) -> Tensor:
        """Easy layout: the full logits `[..., V]` of this rank's own tokens, as
        `hidden @ full_weight.T` (what a tied nn.Linear output layer returns, for code that
        computes its own loss). It gathers every vocabulary shard of the plane's pooled rows
        (P times the rank's own logits, for a moment): prefer `cross_entropy`."""
        if self.expert_mode:
            raise ValueError("Embedding.full_logits is for the easy layout; in the expert layout "
                             "use logits() with axonn_c.parallel_cross_entropy, or cross_entropy")
        shard, t_max = self._logits(hidden, False)
        rows = hidden.numel() // hidden.shape[-1]
        if groups_size(PLANE) > 1:  # [P vocab shards, P * t_max pooled rows, Vp] -> own rows
            i = group_index(PLANE)
            every = GatherRows.apply(shard, PLANE).view(-1, shard.shape[0], self.vocab_local)
            shard = every[:, i * t_max:i * t_max + rows].transpose(0, 1).reshape(rows, -1)
        return shard[:, :self.num_embeddings].reshape(*hidden.shape[:-1], self.num_embeddings)

    def cross_entropy(self, hidden: Tensor, target: Tensor, ignore_index: int = -100,
                      reduction: str = "mean") -> Tensor:
        """F.cross_entropy(hidden @ full_weight.T, target) through the vocabulary shards (the
        tied output layer and its loss in one call; both layouts). Easy layout: each rank's
        loss covers its own tokens, as a serial loss on them would (so sync_gradients(mean=True)
        gives the global mean's gradient); expert layout: the plane's shared tokens."""
        check_loss_args("cross_entropy", target, hidden.numel() // hidden.shape[-1],
                        "hidden row", reduction)
        flat = target.reshape(-1).long()
        logits, t_max = self._logits(hidden, self._out_of_range(flat, ignore_index))
        pooled = flat
        if not self.expert_mode and groups_size(PLANE) > 1:
            pooled = gather_rows(_pad_rows(flat, t_max, ignore_index), PLANE)
        loss = _VocabParallelCE.apply(logits, pooled, PLANE, int(ignore_index))
        if pooled is not flat:  # my tokens' losses; every plane rank's gradients reach all
            loss = OwnRows.apply(loss, PLANE, t_max, flat.shape[0])
        return reduce_loss(loss, flat != ignore_index, reduction, target.shape)

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings}, {self.embedding_dim}, expert_mode={self.expert_mode}, "
             f"vocab_shard={self.vocab_local}, shard={self._shard}")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + (", transpose=True" if self.transpose else "")


def _pad_rows(x: Tensor, rows: int, value) -> Tensor:
    """x [t, ...] -> [rows, ...], the extra rows filled with `value` (differentiable)."""
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), value)])
