"""axonn_c.checkpoint with the other sharded layers (tests/test_checkpoint.py): a model of
axonn_c.Embedding (odd vocabularies, both layouts), split norms, output layers tied to their
tables (auto_parallelize), Conv2d (transpose or not; boxes of [out, in, kh, kw], depth shards
that cut the block's rows) and Conv1D (boxes of the transposed [in, out] weight), one AdamW step, saved on one
grid (--mode save, rank 0 also writes the full state dict and the optimizer's full state) and
loaded on another (--mode load): the full state dict and every optimizer state tensor, gathered,
equal the saved ones bitwise.
"""
import argparse
import os

import torch
from torch import nn

import axonn_c
import axonn_c.checkpoint as ckpt
from layers_worker import TinyLM


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = axonn_c.Embedding(37, 12, padding_idx=3)
        self.emb_x = axonn_c.Embedding(29, 12, expert_mode=True)
        self.ln = axonn_c.LayerNorm(12, expert_mode=True)
        self.rms = axonn_c.RMSNorm(12, expert_mode=True, transpose=True)
        with axonn_c.auto_parallelize(embeddings=True):  # an output layer tied to its table
            self.lm = TinyLM(37, 12)
            self.lm2 = TinyLM(40, 12)
        self.conv = axonn_c.Conv2d(4, 6, (3, 3), padding=1)
        # output channels over col: an odd block on the save grid, its depth shards cut rows
        self.conv_t = axonn_c.Conv2d(2, 6, (2, 3), transpose=True)
        self.c1d = axonn_c.Conv1D(10, 12)


def full_optimizer_state(model, opt):
    """{param name: {state: full tensor}}: each state tensor loaded into a copy of the layer
    and gathered like the parameter (collective)."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == p.shape:
                saved = p.detach().clone()
                with torch.no_grad():
                    p.copy_(v)
                out[f"{names[id(p)]}.{k}"] = axonn_c.full_state_dict(model)[names[id(p)]]
                with torch.no_grad():
                    p.copy_(saved)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("save", "load"), required=True)
    ap.add_argument("--grid", required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    g = axonn_c.init(*(int(v) for v in args.grid.split(",")))
    torch.manual_seed(1 if args.mode == "save" else 7)  # load: other weights to replace
    model = Layers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path, ref = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "full.pt")
    if args.mode == "save":
        ids = torch.arange(8) % 37
        gen = torch.Generator().manual_seed(1)
        loss = (model.emb(ids).sum() + model.ln(model.emb_x(ids % 29)).square().sum()
                + model.rms(torch.randn(8, model.rms.local, generator=torch.Generator()
                                        .manual_seed(0))).sum()
                + model.lm(ids.view(2, 4)).square().sum() + model.lm2(ids.view(2, 4)).sum()
                + model.conv(torch.randn(2, 4, 5, 5, generator=gen)).square().sum()
                + model.conv_t(torch.randn(1, 2, 4, 4, generator=gen)).sum()
                + model.c1d(torch.randn(3, 12, generator=gen)).square().sum())
        loss.backward()
        axonn_c.sync_gradients(model)
        opt.step()
        ckpt.save(path, model, opt)
        full = {k: v.clone() for k, v in axonn_c.full_state_dict(model).items()}
        optim = full_optimizer_state(model, opt)
        if g.rank == 0:
            torch.save({"model": full, "optim": optim}, ref)
    else:
        ckpt.load(path, model, opt)
        want = torch.load(ref)
        got = axonn_c.full_state_dict(model)
        assert got.keys() == want["model"].keys(), (got.keys(), want["model"].keys())
        for k, v in want["model"].items():
            assert torch.equal(got[k], v), f"grid {args.grid}: {k} differs after the load"
        optim = full_optimizer_state(model, opt)
        assert optim.keys() == want["optim"].keys(), (optim.keys(), want["optim"].keys())
        for k, v in want["optim"].items():
            assert torch.equal(optim[k], v), f"grid {args.grid}: optimizer {k} differs"
    axonn_c.finalize()
    print(f"layers {args.mode} on {args.grid} ok", flush=True)


if __name__ == "__main__":
    main()
