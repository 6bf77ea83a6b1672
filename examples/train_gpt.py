"""Train a small character-level GPT with axonn_c's 4D parallelism.

    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py            # CPU, grid 1x2x2x1
    torchrun --standalone --nproc_per_node 8 examples/train_gpt.py --G-intra-d 2 --device cuda

The model (examples/gpt.py) is plain PyTorch; three things make it parallel:
`axonn_c.init(grid)`, building it inside `axonn_c.auto_parallelize()` (every nn.Linear whose shapes
divide by the grid becomes an axonn_c.Linear) and `axonn_c.sync_gradients(model, mean=True)` after
backward. Every rank trains on its own micro-batch (the easy layout), so the global batch is
world_size x --batch-size sequences and the printed loss is its mean. `--concurrent 2` runs
each rank's batch as two micro-batches at once (axonn_c.run_concurrent, CPU), one hiding the
other's tensor-parallel all-reduces.

`--layout expert` trains axonn_c.models.GPT instead (transformers' GPT-2 in the 4D paper's
expert layout: sequences split over data x depth, hidden over the column group, heads over the
row group, vocabulary-parallel tied embedding and loss; docs/models.md), on the same global
batch (world_size x --batch-size sequences, each data x depth shard an equal part of it);
`--hf-init` starts it from a transformers GPT2LMHeadModel built from the same config
(transformers must be installed):

    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --layout expert
    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --layout expert \
        --G-intra-r 2 --G-intra-d 2 --hf-init --checkpoint-activations

`--save DIR` writes a checkpoint (axonn_c.checkpoint: model, AdamW state, the next step) at the
end, and every `--save-every` steps in the background; `--resume DIR` continues from one, on any
grid and number of ranks (keep the global batch, world_size x --batch-size, to continue the same
run):

    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --steps 100 --save ckpt
    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --steps 200 --batch-size 16 \
        --resume ckpt --save ckpt
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import axonn_c  # noqa: E402
import axonn_c.checkpoint  # noqa: E402
from gpt import GPT, CharData, GPTConfig, make_corpus  # noqa: E402


def default_grid(world: int, args) -> tuple[int, int, int, int]:
    """Grid flags left out are filled in: without any, 2x2 tensor parallelism (row x column)
    where the world divides by 4, data parallelism over the rest."""
    r, c, d = args.G_intra_r, args.G_intra_c, args.G_intra_d
    if r is None and c is None and d is None and args.G_data is None:
        r = 2 if world % 2 == 0 else 1
        c = 2 if world % (2 * r) == 0 else 1
        d = 1
    r, c, d = r or 1, c or 1, d or 1
    data = args.G_data or max(world // (r * c * d), 1)
    return data, r, c, d


def expert_config(vocab_size: int, args):
    """The GPT2Config fields axonn_c.models.GPT reads, as a plain dataclass (transformers' own
    GPT2Config when --hf-init needs it)."""
    from dataclasses import make_dataclass

    fields = dict(vocab_size=vocab_size, n_positions=args.block_size, n_embd=args.n_embd,
                  n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=args.dropout,
                  embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    if args.hf_init:
        from transformers import GPT2Config

        return GPT2Config(**fields, bos_token_id=0, eos_token_id=0)
    return make_dataclass("GPTConfig", list(fields))(**fields)


def build_expert(vocab_size: int, args):
    """axonn_c.models.GPT, from a serial transformers GPT2LMHeadModel's weights with --hf-init."""
    config = expert_config(vocab_size, args)
    torch.manual_seed(args.seed)
    model = axonn_c.models.GPT(config, checkpoint=args.checkpoint_activations,
                               dropout_seed=args.seed)
    if args.hf_init:
        from transformers import GPT2LMHeadModel

        torch.manual_seed(args.seed)  # (the same draw on every rank)
        model.load_state_dict(GPT2LMHeadModel(config).float().state_dict())
    return model


def expert_logits(model, idx):
    """The full [V] logits of the last position (every rank passes the same idx): each vocabulary
    shard gathered over the row x column plane."""
    from axonn_c.autograd_comm import PLANE, gather_rows

    shard = model(idx).logits[0, -1]
    return gather_rows(shard.contiguous(), PLANE)[:model.vocab_size]


def forward_backward(model, x, y, concurrent: int = 1):
    """The loss of (x, y), its gradients accumulated into .grad; with concurrent > 1 as that
    many micro-batches at once (axonn_c.run_concurrent, summing over ranks meanwhile), each
    loss weighted by its share of the batch so that the gradient is the batch mean's."""
    if concurrent <= 1:
        _, loss = model(x, y)
        loss.backward()
        return loss

    def micro_batch(xb, yb):
        share = xb.shape[0] / x.shape[0]
        _, loss = model(xb, yb)
        (loss * share).backward()
        return loss.detach() * share

    return sum(axonn_c.run_concurrent(micro_batch, x, y, model=model))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    grid_help = "grid size (left out: 2x2 row x column where the world divides, data the rest)"
    p.add_argument("--G-data", type=int, default=None, help=grid_help)
    p.add_argument("--G-intra-r", type=int, default=None, help=grid_help)
    p.add_argument("--G-intra-c", type=int, default=None, help=grid_help)
    p.add_argument("--G-intra-d", type=int, default=None, help=grid_help)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64, help="sequence length")
    p.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=64, help="hidden size")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--corpus-chars", type=int, default=50000, help="size of the generated text")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--log-every", type=int, default=25, help="print the loss every N steps")
    p.add_argument("--sample-chars", type=int, default=120, help="greedy sample at the end")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap communication with computation (the scheduler, "
                        "docs/ARCHITECTURE.md#one-training-step)")
    p.add_argument("--concurrent", type=int, default=1,
                   help="split each rank's batch into this many micro-batches run at once "
                        "(axonn_c.run_concurrent, CPU; hides row/column all-reduces)")
    p.add_argument("--compression", default=None,
                   help="compress the data-parallel gradient sums: bf16, fp8, int8 or int4 "
                        "(docs/compression.md#compressed-gradient-sums)")
    p.add_argument("--layout", choices=("easy", "expert"), default="easy",
                   help="easy: examples/gpt.py under auto_parallelize (any model); expert: "
                        "axonn_c.models.GPT, the paper's layout (docs/models.md)")
    p.add_argument("--hf-init", action="store_true",
                   help="--layout expert: start from transformers' GPT2LMHeadModel(config)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="--layout expert: recompute each block in backward")
    p.add_argument("--dropout", type=float, default=0.0, help="--layout expert: GPT-2's "
                   "resid/embd/attn dropout")
    p.add_argument("--save", default=None, help="checkpoint directory written at the end")
    p.add_argument("--save-every", type=int, default=0,
                   help="also save every N steps, in the background (0: only at the end)")
    p.add_argument("--resume", default=None,
                   help="checkpoint directory to continue from (any grid, any world size)")
    args = p.parse_args(argv)
    if args.layout == "easy" and (args.hf_init or args.checkpoint_activations or args.dropout):
        p.error("--hf-init, --checkpoint-activations and --dropout need --layout expert")
    if args.layout == "expert" and args.concurrent > 1:
        p.error("--concurrent runs the easy layout only (axonn_c.Embedding does not run on "
                "run_concurrent's threads)")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    G_data, G_r, G_c, G_d = default_grid(world, args)
    g = axonn_c.init(G_data=G_data, G_intra_r=G_r, G_intra_c=G_c, G_intra_d=G_d,
                     overlap=args.overlap, concurrent_microbatches=args.concurrent,
                     compression=args.compression)
    rank, main_rank = g.rank, g.rank == 0
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    data = CharData(make_corpus(args.corpus_chars), args.block_size, seed=args.seed)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    expert = args.layout == "expert"
    if expert:
        model = build_expert(data.vocab_size, args)
    else:
        torch.manual_seed(args.seed)
        with axonn_c.auto_parallelize():
            model = GPT(cfg)
    model.to(device)
    # the sequences of a step: every rank's own (easy), or one data x depth shard's (expert)
    shards, shard = (G_data * G_d, g.data_rank * G_d + g.depth_rank) if expert else (world, rank)
    per_shard = args.batch_size * world // shards
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    n_sharded = sum(isinstance(m, axonn_c.Linear) for m in model.modules())
    n_linear = n_sharded + sum(type(m) is torch.nn.Linear for m in model.modules())
    if main_rank:
        print(f"axonn_c grid: G_data={G_data} G_intra_r={G_r} G_intra_c={G_c} G_intra_d={G_d} "
              f"({world} ranks, {device.type}); GPT {cfg.n_layer}x{cfg.n_embd}, "
              f"{sum(p.numel() for p in model.parameters())} parameters on rank 0, "
              f"{n_sharded}/{n_linear} linear layers sharded, {args.layout} layout; "
              f"global batch {world}x{args.batch_size}x{args.block_size} tokens", flush=True)

    start = 0
    if args.resume:
        start = axonn_c.checkpoint.load(args.resume, model, opt)["step"]
        if main_rank:
            print(f"resumed from {args.resume} at step {start}", flush=True)

    losses = []
    t0 = time.perf_counter()
    # a progress bar only on a terminal: in a log file its redraws would flood it (the loss
    # lines below are printed either way)
    bar = tqdm(range(start, args.steps), disable=not (main_rank and sys.stderr.isatty()), desc="train",
               dynamic_ncols=True)
    for step in bar:
        xg, yg = data.batch(step, args.batch_size * world)  # the same global batch on every rank
        sl = slice(shard * per_shard, (shard + 1) * per_shard)  # this rank's share
        x, y = xg[sl].to(device), yg[sl].to(device)
        opt.zero_grad(set_to_none=True)
        if expert:  # (transformers' convention: the labels are the ids, shifted inside)
            loss = model(x, labels=x).loss
            loss.backward()
        else:
            loss = forward_backward(model, x, y, args.concurrent)
        axonn_c.sync_gradients(model, mean=True)
        if args.clip > 0:
            axonn_c.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        mean_loss = loss.detach().float().reshape(1).clone()
        axonn_c.comm.all_reduce(mean_loss, group="world", op="avg")  # global-batch mean
        # (expert: the plane's ranks hold the same loss, so the world's mean is the shards')
        losses.append(mean_loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if main_rank and (step % args.log_every == 0 or step == args.steps - 1):
            tqdm.write(f"step {step:5d}  loss {losses[-1]:.4f}")
        if args.save and args.save_every and (step + 1) % args.save_every == 0:
            # written while training goes on; the next save (or the final one) joins it
            axonn_c.checkpoint.save(args.save, model, opt, extra={"step": step + 1},
                                    async_save=True)
    elapsed = time.perf_counter() - t0
    bar.close()
    if args.save:
        axonn_c.checkpoint.save(args.save, model, opt, extra={"step": args.steps})
        if main_rank:
            print(f"saved {args.save} at step {args.steps}", flush=True)

    tokens = (args.steps - start) * world * args.batch_size * args.block_size
    if main_rank and losses:
        print(f"done: {args.steps - start} steps in {elapsed:.1f} s "
              f"({tokens / elapsed:,.0f} tokens/s), loss {losses[0]:.4f} -> {losses[-1]:.4f}",
              flush=True)

    if args.sample_chars > 0:  # every rank runs the layers (they are collective); rank 0 prints
        model.eval()
        idx = data.encode("The ").unsqueeze(0).to(device)
        with torch.no_grad():
            for _ in range(args.sample_chars):
                if expert:
                    logits = expert_logits(model, idx[:, -args.block_size:])[None, :len(data.itos)]
                else:
                    logits = model(idx[:, -args.block_size:])[:, -1, : len(data.itos)]
                idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        if main_rank:
            print("sample: " + data.decode(idx[0].tolist()).replace("\n", " | "), flush=True)
    axonn_c.finalize()
    return losses


if __name__ == "__main__":
    main()
