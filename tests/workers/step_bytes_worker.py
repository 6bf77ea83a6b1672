"""Whole training steps: the bytes the transport counts on this rank, per group (col, row,
depth, data, intra, world), equal the communication model's prediction for the model
(axonn_c.plan.step_layers), on every grid of the world size (issue 24 item 7). Two models:

- easy layout: the demo GPT of examples/train_gpt.py (examples/gpt.py built inside
  auto_parallelize(): every Linear sharded, embeddings and norms replicated, the loss local);
- expert layout: a tied stack, axonn_c.Embedding -> blocks of split LayerNorm, Linear,
  transposed Linear (residual) -> split LayerNorm -> the tied logits and cross_entropy.

- the reference GPT (axonn_c.models.GPT, expert layout): positional and tied token tables,
  split LayerNorms, QKV/out-projection and FC1/FC2 pairs, attention (no traffic: whole heads),
  the tied logits and the shifted vocabulary-parallel loss (plan.step_layers(model, seq=...)).

One step = forward, loss, backward, sync_gradients; a first step runs before the counters are
reset (sync_gradients's first call broadcasts the replicated state). Launched by
tests/test_plan.py under torchrun (`--grids 1x2x2x2,...`: those grids only).
"""
import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))

import axonn_c  # noqa: E402
from axonn_c import plan  # noqa: E402
from axonn_c.models import GPT as ReferenceGPT  # noqa: E402
from common import assert_bytes_equal, grids  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

STEP = dict(grad_acc=1, recompute=0, dtype="float32", grad_dtype="float32")


class ExpertStack(torch.nn.Module):
    def __init__(self, vocab, hidden, blocks):
        super().__init__()
        self.emb = axonn_c.Embedding(vocab, hidden, expert_mode=True)
        self.norms = torch.nn.ModuleList(axonn_c.LayerNorm(hidden, expert_mode=True)
                                         for _ in range(blocks + 1))
        self.fc1 = torch.nn.ModuleList(axonn_c.Linear(hidden, 4 * hidden, expert_mode=True)
                                       for _ in range(blocks))
        self.fc2 = torch.nn.ModuleList(axonn_c.Linear(4 * hidden, hidden, transpose=True,
                                                      expert_mode=True) for _ in range(blocks))

    def forward(self, ids, target):
        x = self.emb(ids)
        for norm, fc1, fc2 in zip(self.norms, self.fc1, self.fc2):
            x = x + fc2(F.gelu(fc1(norm(x))))
        return self.emb.cross_entropy(self.norms[-1](x), target)


def compare(what, g, grid4, layers, tokens):
    stats = axonn_c.comm_stats()
    pred = axonn_c._C.model_volume(grid4, g.rank, layers, dict(STEP, tokens=tokens))
    assert_bytes_equal(stats, pred, f"rank {g.rank} {what} grid {grid4}", f"; layers {layers}")


def easy_gpt(g, grid4):
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16)
    torch.manual_seed(0)
    with axonn_c.auto_parallelize():
        model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    b = 2
    for step in range(2):
        x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size))
        y = torch.randint(0, cfg.vocab_size, (b, cfg.block_size))
        axonn_c.reset_comm_stats()
        _, loss = model(x, y)
        loss.backward()
        axonn_c.sync_gradients(model, mean=True)
        if step == 1:
            compare("easy GPT", g, grid4, plan.step_layers(model),
                    g.world_size * b * cfg.block_size)
        opt.step()
        opt.zero_grad(set_to_none=True)


def expert_stack(g, grid4):
    vocab, hidden, t = 24, 16, 4
    torch.manual_seed(1)
    model = ExpertStack(vocab, hidden, blocks=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = g.G_data * g.G_intra_d
    for step in range(2):
        ids = torch.randint(0, vocab, (shards * t,))
        target = torch.randint(0, vocab, (shards * t,))
        mine = slice((g.data_rank * g.G_intra_d + g.depth_rank) * t,
                     (g.data_rank * g.G_intra_d + g.depth_rank + 1) * t)
        axonn_c.reset_comm_stats()
        model(ids[mine], target[mine]).backward()
        axonn_c.sync_gradients(model, mean=True)
        if step == 1:
            compare("expert stack", g, grid4, plan.step_layers(model, tied_loss=True),
                    shards * t)
        opt.step()
        opt.zero_grad(set_to_none=True)


@dataclass
class RefConfig:  # GPT2Config's field names; 8 heads split over a row group of up to 8
    vocab_size: int = 50  # (not a multiple of the plane: the table is padded)
    n_positions: int = 16
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 8


def reference_gpt(g, grid4):
    cfg, b, s = RefConfig(), 2, 12
    torch.manual_seed(2)
    model = ReferenceGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shards = g.G_data * g.G_intra_d
    mine = slice((g.data_rank * g.G_intra_d + g.depth_rank) * b,
                 (g.data_rank * g.G_intra_d + g.depth_rank + 1) * b)
    for step in range(2):
        ids = torch.randint(0, cfg.vocab_size, (shards * b, s))
        axonn_c.reset_comm_stats()
        model(ids[mine], labels=ids[mine]).loss.backward()
        axonn_c.sync_gradients(model, mean=True)
        if step == 1:
            compare("reference GPT", g, grid4, plan.step_layers(model, seq=s), shards * b * s)
        opt.step()
        opt.zero_grad(set_to_none=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grids", default="all", help="G_data x r x c x d items: 1x2x2x2,...")
    a = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    todo = list(grids(world)) if a.grids == "all" else [
        tuple(int(v) for v in item.split("x")) for item in a.grids.split(",")]
    checked = 0
    for grid4 in todo:
        g = axonn_c.init(G_data=grid4[0], G_intra_r=grid4[1], G_intra_c=grid4[2],
                         G_intra_d=grid4[3])
        try:
            easy_gpt(g, grid4)
            expert_stack(g, grid4)
            reference_gpt(g, grid4)
            checked += 1
        finally:
            axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print(f"step_bytes_worker: {checked} grids equal on world {world}", flush=True)


if __name__ == "__main__":
    main()
