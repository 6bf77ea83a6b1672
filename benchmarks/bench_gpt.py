"""One GPT trained three ways on the same ranks, in one run (issue 25's benchmark, CPU part):

- expert: axonn_c.models.GPT, the 4D paper's layout (docs/models.md), on --grid;
- easy:   examples/gpt.py's GPT built inside axonn_c.auto_parallelize() (the default layout of
          examples/train_gpt.py: every rank its own sequences, every nn.Linear sharded and
          redistributed), on the same --grid;
- ddp:    examples/gpt.py's GPT in plain PyTorch, torch DistributedDataParallel on gloo, every
          rank a data-parallel replica.

Run: torchrun --nproc_per_node 4 benchmarks/bench_gpt.py [--grid 1,2,2,1 --layers 2 --hidden 128
     --heads 8 --vocab 1024 --seq 64 --batch 16 --steps 8 --json out.json]

The same global batch (--batch sequences of --seq tokens) and AdamW step in all three; the
models have the same blocks (examples/gpt.py's head is untied: vocab x hidden more parameters,
sharded as a Linear in the easy layout). The three take their steps in turn (step i of each,
then step i + 1), so that load from other jobs on the machine falls on all of them alike.
Reported per layout: the median step time over --steps timed steps (after --warmup), tokens/s, and the bytes each rank sent per step (axonn_c.comm_stats
for the axonn_c layouts; for DDP the ring all-reduce of every gradient, 2 (n-1)/n of their
bytes, which is what gloo's ring sends). On a shared CPU the times are noisy: compare within
one run.
"""
import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import axonn_c  # noqa: E402
from gpt import GPT as PlainGPT, GPTConfig  # noqa: E402


@dataclass
class Config:  # GPT2Config's fields for axonn_c.models.GPT
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    activation_function: str = "gelu"  # (examples/gpt.py's F.gelu)


def batch(step, a):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)


def sent_and_calls() -> tuple:
    stats = axonn_c.comm_stats().values()
    return sum(v["bytes_sent"] for v in stats), sum(v["calls"] for v in stats)


def plain_loss(model, x, vocab):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                                             x[:, 1:].reshape(-1))


def build(a, g, world):
    """{layout: (step function, parameters on this rank)}: the three models, the same
    initialisation seed, each rank's share of the same global batch."""
    torch.manual_seed(0)
    expert = axonn_c.models.GPT(Config(a.vocab, a.seq, a.hidden, a.layers, a.heads))
    torch.manual_seed(0)
    with axonn_c.auto_parallelize():
        easy = PlainGPT(GPTConfig(a.vocab, a.seq, a.layers, a.heads, a.hidden))
    torch.manual_seed(0)
    plain = PlainGPT(GPTConfig(a.vocab, a.seq, a.layers, a.heads, a.hidden))
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    shards = {"expert": (g.G_data * g.G_intra_d, g.data_rank * g.G_intra_d + g.depth_rank),
              "easy": (world, g.rank), "ddp": (world, g.rank)}
    models = {"expert": expert, "easy": easy, "ddp": ddp}
    steps = {}
    for name, model in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        n, me = shards[name]
        n = a.batch // n

        def step(i, name=name, model=model, opt=opt, n=n, me=me):
            x = batch(i, a)[me * n:(me + 1) * n]
            opt.zero_grad(set_to_none=True)
            loss = model(x, labels=x).loss if name == "expert" else plain_loss(model, x, a.vocab)
            loss.backward()
            if name != "ddp":  # (DDP summed during backward)
                axonn_c.sync_gradients(model, mean=True)
            opt.step()
            return loss.item()

        steps[name] = (step, sum(p.numel() for p in model.parameters()))
    return steps


def run(a, sizes, world):
    """The layouts' steps interleaved (step i of each in turn), so that a machine shared with
    other jobs loads them alike; axonn_c's byte counters read around each axonn_c step."""
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3],
                     overlap=a.overlap)
    steps = build(a, g, world)
    times = {name: [] for name in steps}
    sent = {name: [0, 0] for name in steps}
    loss = {}
    for i in range(a.warmup + a.steps):
        for name, (step, _) in steps.items():
            axonn_c.reset_comm_stats()
            t0 = time.perf_counter()
            loss[name] = step(i)
            dt = time.perf_counter() - t0
            if i >= a.warmup:
                times[name].append(dt)
                b, c = sent_and_calls()
                sent[name][0] += b
                sent[name][1] += c
    out = {}
    for name, (_, params) in steps.items():
        out[name] = dict(step_s=statistics.median(times[name]), last_loss=loss[name],
                         params_per_rank=params,
                         bytes_sent_per_step=sent[name][0] / a.steps,
                         collectives_per_step=sent[name][1] / a.steps)
    # DDP's gradient all-reduce runs on gloo, outside axonn_c's counters: a ring all-reduce
    # sends 2 (n-1)/n of the gradient bytes
    grad_bytes = 4 * out["ddp"]["params_per_rank"]
    out["ddp"].update(bytes_sent_per_step=2 * (world - 1) / world * grad_bytes,
                      collectives_per_step=None)
    axonn_c.finalize()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="1,2,2,1", help="G_data,G_intra_r,G_intra_c,G_intra_d")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                    help="init(overlap=...) for the axonn_c layouts (off: on a CPU with fewer "
                         "cores than ranks the progress threads compete with the compute)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = [int(v) for v in a.grid.split(",")]
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo")  # (first: axonn_c.init then uses its store)
    results = run(a, sizes, world)
    dist.destroy_process_group()  # (after axonn_c.finalize, README's shutdown order)
    tokens = a.batch * a.seq
    for r in results.values():
        r["tokens_per_s"] = tokens / r["step_s"]
    if rank == 0:
        print(f"GPT {a.layers}x{a.hidden} ({a.heads} heads, vocab {a.vocab}), global batch "
              f"{a.batch}x{a.seq} tokens, {world} ranks, grid {a.grid}, overlap={a.overlap}")
        print(f"{'layout':8s} {'step (s)':>9s} {'tokens/s':>10s} {'MB sent/rank/step':>18s} "
              f"{'collectives':>11s} {'params/rank':>12s} {'loss':>8s}")
        for name, r in results.items():
            print(f"{name:8s} {r['step_s']:9.4f} {r['tokens_per_s']:10.0f} "
                  f"{r['bytes_sent_per_step'] / 1e6:18.3f} "
                  f"{r['collectives_per_step'] or float('nan'):11.0f} {r['params_per_rank']:12d} "
                  f"{r['last_loss']:8.4f}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(config=vars(a), world=world, results=results,
                               torch=torch.__version__), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
