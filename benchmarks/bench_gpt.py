"""One GPT trained three ways on the same ranks, in one run (issue 25's benchmark, CPU part):

- expert: axonn_c.models.GPT, the 4D paper's layout (docs/models.md), on --grid;
- easy:   examples/gpt.py's GPT built inside axonn_c.auto_parallelize() (the default layout of
          examples/train_gpt.py: every rank its own sequences, every nn.Linear sharded and
          redistributed), on the same --grid;
- ddp:    examples/gpt.py's GPT in plain PyTorch, torch DistributedDataParallel on gloo, every
          rank a data-parallel replica;
- torch_tp: examples/gpt.py's GPT with PyTorch's own tensor parallelism
          (torch.distributed.tensor.parallel on gloo, Megatron's plan: QKV and FC1 column-wise,
          out-projection and FC2 row-wise, the head column-wise under loss_parallel) at the
          same tensor-parallel degree as --grid's plane (G_intra_r * G_intra_c), data parallel
          over the rest (each gradient all-reduced over it); embeddings and norms replicated.

Run: torchrun --nproc_per_node 4 benchmarks/bench_gpt.py [--grid 1,2,2,1 --layers 2 --hidden 128
     --heads 8 --vocab 1024 --seq 64 --batch 16 --steps 8 --sim-gbps 1 --sim-us 50
     --json out.json]

Simulated link (`--sim-gbps`, `--sim-us`): axonn_c's shm collectives take at least
`US + bytes sent / GBPS` (AXONN_C_SIM_GBPS / AXONN_C_SIM_US, csrc/comm/shm.c); the gloo layouts
get the same rule from the benchmark: DDP through a comm hook whose bucket all-reduce completes
no earlier than that, torch_tp through a dispatch mode that holds each functional collective
that long after issuing it (both on the ring bytes below).

Peak memory per rank (`peak_mb`): the most live tensor bytes during one more step of each layout
after the timed ones (parameters, gradients, AdamW's state, activations, the layers' workspaces
and temporaries), as torch.distributed._tools.mem_tracker.MemTracker counts them (a dispatch
mode: what torch allocates, not the allocator's cached or the process's other memory).
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
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import axonn_c  # noqa: E402
from axonn_c import plan as axonn_plan  # noqa: E402
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
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))


class SimLink:
    """The simulated link's rule for gloo collectives (see the module docstring) and their ring
    bytes: `hold(t0, sent)` sleeps until `t0 + US + sent / GBPS`."""

    def __init__(self, gbps: float, us: float):
        self.gbps, self.us = gbps, us
        self.sent = self.calls = 0

    def count(self, sent: float) -> None:
        self.sent += sent
        self.calls += 1

    def hold(self, t0: float, sent: float) -> None:
        if self.gbps > 0 or self.us > 0:
            until = t0 + self.us * 1e-6 + (sent / (self.gbps * 1e9) if self.gbps > 0 else 0.0)
            time.sleep(max(0.0, until - time.perf_counter()))


def ddp_hook(link: SimLink, world: int):
    """DDP's bucket all-reduce (mean), counted and held by the simulated link."""
    def hook(_, bucket):
        t = bucket.buffer().div_(world)
        sent = 2 * (world - 1) / world * t.numel() * t.element_size()
        link.count(sent)
        t0 = time.perf_counter()
        fut = dist.all_reduce(t, async_op=True).get_future()

        def done(f):
            link.hold(t0, sent)
            return f.value()[0]
        return fut.then(done)
    return hook


_RING = {"all_reduce": 2.0, "all_gather_into_tensor": 1.0, "reduce_scatter_tensor": 1.0,
         "all_to_all_single": 1.0}


class FunctionalCollectives(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (ring bytes of the input; an all-gather
    by its output) and holds each by the simulated link after issuing it."""

    def __init__(self, link: SimLink, sizes: dict):
        super().__init__()
        self.link, self.sizes = link, sizes  # {group name: ranks}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # DTensor's own handler first: the collectives it issues on local tensors (the
            # redistributions, loss_parallel's) then come back here
            return NotImplemented
        kwargs = kwargs or {}
        name = func._schema.name
        op = name.split("::")[-1]
        if not name.startswith("_c10d_functional::") or op not in _RING:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        n = self.sizes[args[-1]]  # (the group name is the last positional argument)
        x = out if op == "all_gather_into_tensor" else args[0]
        sent = _RING[op] * (n - 1) / n * x.numel() * x.element_size()
        self.link.count(sent)
        self.link.hold(t0, sent)
        return out


def tp_attention_forward(attn, heads_local):
    """examples/gpt.py's attention on a column shard of whole heads (QKV rows reordered to
    [q_h, k_h, v_h] per head before sharding), its output row-sharded into the out-projection."""
    def forward(x):
        b, t, _ = x.shape
        qkv = attn.qkv(x).view(b, t, heads_local, 3, -1)
        q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.proj(y.transpose(1, 2).reshape(b, t, -1))
    return forward


def build_torch_tp(a, tp: int, world: int, link: SimLink):
    """examples/gpt.py's GPT under torch.distributed.tensor.parallel: (model, its dp group,
    the dispatch mode that counts and holds its collectives)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    if a.heads % tp:
        raise SystemExit(f"torch_tp: --heads {a.heads} must divide by the tensor-parallel "
                         f"degree {tp}")
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = PlainGPT(GPTConfig(a.vocab, a.seq, a.layers, a.heads, a.hidden))
    H = a.hidden
    order = torch.arange(3 * H).view(3, a.heads, H // a.heads).permute(1, 0, 2).reshape(-1)
    plan = {"head": ColwiseParallel(use_local_output=False)}  # (logits stay vocab-sharded)
    for i, block in enumerate(model.blocks):
        with torch.no_grad():  # whole heads on each shard
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
        block.attn.forward = tp_attention_forward(block.attn, a.heads // tp)
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                     f"blocks.{i}.mlp.fc2": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    sizes = {mesh["tp"].get_group().group_name: tp, mesh["dp"].get_group().group_name: world // tp}
    return model, mesh["dp"].get_group(), FunctionalCollectives(link, sizes)


def tracked_peak(step, i, model, opt):
    """The peak of the live tensor bytes over one step (parameters, gradients, optimizer
    state, activations, temporaries) as torch.distributed._tools.mem_tracker.MemTracker counts
    them on this rank."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        step(i)
    return max(v.get("Total", 0) for v in mt.get_tracker_snapshot("peak").values())


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def build(a, g, world, links):
    """{layout: (step function, parameters on this rank)}: the four models, the same
    initialisation seed, each rank's share of the same global batch."""
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    expert = axonn_c.models.GPT(Config(a.vocab, a.seq, a.hidden, a.layers, a.heads))
    torch.manual_seed(0)
    with axonn_c.auto_parallelize():
        easy = PlainGPT(GPTConfig(a.vocab, a.seq, a.layers, a.heads, a.hidden))
    torch.manual_seed(0)
    plain = PlainGPT(GPTConfig(a.vocab, a.seq, a.layers, a.heads, a.hidden))
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    ddp.register_comm_hook(None, ddp_hook(links["ddp"], world))
    tp = g.G_intra_r * g.G_intra_c
    tp_model, dp_group, tp_mode = build_torch_tp(a, tp, world, links["torch_tp"])
    dp_rank = g.rank // tp  # (the mesh (dp, tp) in rank order)
    shards = {"expert": (g.G_data * g.G_intra_d, g.data_rank * g.G_intra_d + g.depth_rank),
              "easy": (world, g.rank), "ddp": (world, g.rank), "torch_tp": (world // tp, dp_rank)}
    models = {"expert": expert, "easy": easy, "ddp": ddp, "torch_tp": tp_model}
    steps = {}
    for name, model in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        n, me = shards[name]
        n = a.batch // n

        def step(i, name=name, model=model, opt=opt, n=n, me=me):
            x = batch(i, a)[me * n:(me + 1) * n]
            opt.zero_grad(set_to_none=True)
            if name == "expert":
                loss = model(x, labels=x).loss
            elif name == "torch_tp":
                with tp_mode, loss_parallel():
                    loss = plain_loss(model, x, a.vocab)
                    loss.backward()
                    if world > tp:  # data parallel over the rest: each gradient's mean
                        for p in model.parameters():
                            dist.all_reduce(local(p.grad).div_(world // tp), group=dp_group)
                            links["torch_tp"].count(2 * (world // tp - 1) / (world // tp)
                                                    * local(p.grad).numel() * 4)
                opt.step()
                return local(loss).item()
            else:
                loss = plain_loss(model, x, a.vocab)
            loss.backward()
            if name in ("expert", "easy"):  # (DDP summed during backward)
                axonn_c.sync_gradients(model, mean=True)
            opt.step()
            return loss.item()

        params = sum(local(p).numel() for p in model.parameters())
        steps[name] = (step, params, model, opt)
    return steps, expert


def run(a, sizes, world):
    """The layouts' steps interleaved (step i of each in turn), so that a machine shared with
    other jobs loads them alike; axonn_c's byte counters read around each axonn_c step."""
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3],
                     overlap=a.overlap)
    links = {name: SimLink(a.sim_gbps, a.sim_us) for name in ("ddp", "torch_tp")}
    steps, expert = build(a, g, world, links)
    times = {name: [] for name in steps}
    sent = {name: [0, 0] for name in steps}
    loss = {}
    for i in range(a.warmup + a.steps):
        for name, (step, *_) in steps.items():
            axonn_c.reset_comm_stats()
            link = links.get(name)
            if link is not None:
                link.sent = link.calls = 0
            t0 = time.perf_counter()
            loss[name] = step(i)
            dt = time.perf_counter() - t0
            if i >= a.warmup:
                times[name].append(dt)
                b, c = (link.sent, link.calls) if link is not None else sent_and_calls()
                sent[name][0] += b
                sent[name][1] += c
    out = {}
    # peak memory: one more step of each under torch's MemTracker (after the timed ones: its
    # dispatch mode slows a step)
    tracked = {name: tracked_peak(step, a.warmup + a.steps, model, opt)
               for name, (step, _, model, opt) in steps.items()}
    for name, (_, params, *_) in steps.items():
        out[name] = dict(step_s=statistics.median(times[name]), last_loss=loss[name],
                         params_per_rank=params,
                         bytes_sent_per_step=sent[name][0] / a.steps,
                         collectives_per_step=sent[name][1] / a.steps,
                         peak_mb=tracked[name] / 1e6)
    # the communication model's bytes for the expert layout's step (equal to the counters)
    pred = axonn_c._C.model_volume(tuple(sizes), g.rank, axonn_plan.step_layers(
        expert, seq=a.seq), dict(tokens=a.batch * a.seq, grad_acc=1, recompute=0,
                                 dtype="float32", grad_dtype="float32"))
    out["expert"]["predicted_bytes_sent_per_step"] = sum(pred["sent"].values())
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
    ap.add_argument("--sim-gbps", type=float, default=0.0,
                    help="simulated link bandwidth in GB/s for every layout (0: off)")
    ap.add_argument("--sim-us", type=float, default=0.0,
                    help="simulated link latency per collective in microseconds (0: off)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    # read by the shm backend at axonn_c.init
    os.environ["AXONN_C_SIM_GBPS"] = repr(a.sim_gbps)
    os.environ["AXONN_C_SIM_US"] = repr(a.sim_us)
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
        load = os.getloadavg()
        print(f"GPT {a.layers}x{a.hidden} ({a.heads} heads, vocab {a.vocab}), global batch "
              f"{a.batch}x{a.seq} tokens, {world} ranks, grid {a.grid}, overlap={a.overlap}, "
              f"simulated link {a.sim_gbps} GB/s + {a.sim_us} us, load average "
              f"{load[0]:.1f} on {os.cpu_count()} cores")
        print(f"{'layout':9s} {'step (s)':>9s} {'tokens/s':>10s} {'MB sent/rank/step':>18s} "
              f"{'collectives':>11s} {'params/rank':>12s} {'peak MB':>8s} {'loss':>8s}")
        for name, r in results.items():
            print(f"{name:9s} {r['step_s']:9.4f} {r['tokens_per_s']:10.0f} "
                  f"{r['bytes_sent_per_step'] / 1e6:18.3f} "
                  f"{r['collectives_per_step']:11.0f} {r['params_per_rank']:12d} "
                  f"{r['peak_mb']:8.2f} {r['last_loss']:8.4f}", flush=True)
        print(f"expert: the communication model predicts "
              f"{results['expert']['predicted_bytes_sent_per_step'] / 1e6:.3f} MB sent per step")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(config=vars(a), world=world, results=results, load_average=load,
                               cpus=os.cpu_count(), torch=torch.__version__), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
