"""Compressed data-parallel gradients (init(compression=...)), launched by torchrun.

Trains the same small model once per compression setting on this grid (every rank its own
tokens, sync_gradients(mean=True), AdamW) and checks: the replicas of every parameter stay
bitwise identical on the data group; the final loss is within the setting's tolerance of the
uncompressed run's; the data group's wire bytes are the stated fraction of the logical ones; the
error-feedback residuals exist exactly where error feedback is on, and round-trip.
Usage: torchrun --nproc_per_node N grad_compress_worker.py --grid D,R,C,Z [--overlap 0|1]
       [--steps 150]
"""
import argparse
import os
import warnings

import torch
from torch import nn

import axonn_c

# setting -> (loss tolerance relative to the uncompressed final loss, min logical/wire ratio)
SETTINGS = [
    ("none", None, 0.0, 1.0),
    ("bf16", "bf16", 0.01, 1.9),
    ("int8", "int8", 0.015, 3.5),
    ("int4", "int4", 0.03, 6.5),
    ("int4, no error feedback", {"codec": "int4", "error_feedback": False}, None, 6.5),
]
# the layers' own collectives (row, col, depth), on grids that have them: the paper's hybrid
# (hard on data, mild on tensor parallelism) within tolerance; the naive "int4 everywhere"
# only runs (its loss is what the hybrid avoids)
LAYER_SETTINGS = [
    ("hybrid: int8 data, bf16 row/col/depth",
     {"data": "int8", "row": "bf16", "col": "bf16", "depth": "bf16"}, 0.015),
    ("naive: int4 everywhere", {"data": "int4", "row": "int4", "col": "int4", "depth": "int4"},
     None),
]


def model_of(h):
    torch.manual_seed(0)  # the same full weights on every rank and for every setting
    return nn.Sequential(axonn_c.Linear(32, h), nn.GELU(), axonn_c.Linear(h, h), nn.GELU(),
                         nn.LayerNorm(h), axonn_c.Linear(h, 8))


def train(args, sizes, compression):
    g = axonn_c.init(*sizes, overlap=bool(args.overlap), compression=compression)
    model = model_of(64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    teacher = torch.Generator().manual_seed(99)
    W1, W2 = torch.randn(32, 48, generator=teacher), torch.randn(48, 8, generator=teacher) / 7
    gen = torch.Generator().manual_seed(1000 + g.rank)  # this rank's tokens
    axonn_c.reset_comm_stats()
    losses = []
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        y = torch.tanh(x @ W1) @ W2
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        axonn_c.sync_gradients(model, mean=True)
        opt.step()
        t = loss.detach().reshape(1).clone()
        axonn_c.comm.all_reduce(t, group="world", op="avg")
        losses.append(t.item())
    stats = axonn_c.comm_stats()
    # replicas identical over the data group: every rank's parameters against rank 0's
    for name, p in model.named_parameters():
        mine = p.detach().reshape(-1).contiguous()
        every = torch.empty(g.G_data * mine.numel())
        axonn_c.comm.all_gather(every, mine, group="data")
        for r, other in enumerate(every.view(g.G_data, -1)):
            assert torch.equal(other, mine), f"{compression}: {name} differs on data rank {r}"
    # (with the model: "depth" int8/int4 keeps a residual per Linear, named by module)
    state = axonn_c.compression_state(model)
    axonn_c.load_compression_state(state, model)  # (round trip: the same residuals, copied back)
    again_all = axonn_c.compression_state(model)
    again = again_all["residuals"]
    assert state["residuals"].keys() == again.keys() and all(
        torch.equal(state["residuals"][k], again[k]) for k in again), "residuals round trip"
    assert state["depth"].keys() == again_all["depth"].keys() and all(
        torch.equal(state["depth"][k], again_all["depth"][k]) for k in state["depth"])
    if args.ckpt_dir and compression == "int8":  # a checkpoint keeps each rank's residuals
        import axonn_c.checkpoint as ckpt
        path = os.path.join(args.ckpt_dir, f"ckpt_{args.grid}")
        ckpt.save(path, model, opt)
        axonn_c.load_compression_state({"residuals": {}})
        ckpt.load(path, model, opt)
        back = axonn_c.compression_state()["residuals"]
        assert back.keys() == again.keys() and all(
            torch.equal(back[k], again[k]) for k in again), "residuals through a checkpoint"
        # a checkpoint from before any compressed sum, loaded on the same grid later (a
        # rollback): the residuals are its (none), not the ones held since
        axonn_c.load_compression_state({"residuals": {}}, model)
        ckpt.save(path + "_clean", model, opt)
        ckpt.load(path, model, opt)
        held = axonn_c.compression_state(model)
        # (G_data > 1: data residuals; a grid with a compressed depth sum: depth ones)
        assert (g.G_data == 1 or held["residuals"]) and held["depth"].keys() == state["depth"].keys()
        ckpt.load(path + "_clean", model, opt)
        left = axonn_c.compression_state(model)
        assert not left["residuals"] and not left["depth"], "a rollback kept later residuals"
        print(f"rollback dropped {len(held['residuals'])} + {len(held['depth'])} residuals")
    axonn_c.finalize()
    return sum(losses[-10:]) / 10, stats, state["residuals"]


def check_sync_fingerprints(sizes):
    """sync_gradients' buckets (one parameter each here; vectorize=False: one pass each): a
    parameter without a gradient in the second step moves the others up a place, and none of
    them takes the residual of the one that was there (they start from zeros: their zero
    gradients sum to exactly zero; was: each got the previous parameter's residual)."""
    for vectorize in (False, True):
        g = axonn_c.init(*sizes, compression={"data": "int8"}, bucket_size=64 * 64 * 4)
        model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(3)])
        ps = list(model.parameters())
        for p in ps:
            p._axonn_grad_groups = ("data",)
        gen = torch.Generator().manual_seed(1 + g.rank)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        axonn_c.sync_gradients(model, vectorize=vectorize)
        assert axonn_c.compression_state()["residuals"], "no residuals kept"
        ps[0].grad = None
        for p in ps[1:]:
            p.grad = torch.zeros(p.shape)
        axonn_c.sync_gradients(model, vectorize=vectorize)
        for i, p in enumerate(ps[1:], 1):
            assert not p.grad.any(), (f"vectorize={vectorize}: parameter {i} got another's "
                                      f"residual: max |grad| {p.grad.abs().max().item():.3e}")
        axonn_c.finalize()


def check_pass_limit_warning(sizes):
    """Backward passes with compressed, error-fed sums and no sync_gradients (which ends a
    step) keep a residual set per pass; past 64 passes later ones get none: said once, as a
    RuntimeWarning naming the remedy (was: silent)."""
    axonn_c.init(*sizes, overlap=True, compression="int8")
    model = model_of(16)
    x = torch.randn(4, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(66):
            model(x).sum().backward()
    said = [str(w.message) for w in caught
            if w.category is RuntimeWarning and "64 backward passes" in str(w.message)]
    assert len(said) == 1 and "sync_gradients" in said[0], [str(w.message) for w in caught]
    assert axonn_c.scheduler_stats()["ef_cutoffs"] == 1
    axonn_c.sync_gradients(model)
    axonn_c.finalize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", required=True)
    ap.add_argument("--overlap", type=int, default=1)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--ckpt-dir", default="")
    args = ap.parse_args()
    sizes = tuple(int(v) for v in args.grid.split(","))
    base = None
    for name, compression, tol, ratio in SETTINGS:
        loss, stats, residuals = train(args, sizes, compression)
        data = stats["data"]
        if base is None:
            base = loss
        wire, logical = data["bytes_sent"], data["logical_bytes_sent"]
        got = logical / wire if wire else float("inf")
        ef = name in ("int8", "int4")
        if sizes[0] > 1:
            assert got >= ratio, f"{name}: data-group bytes only {got:.2f}x fewer, expected " \
                                 f">= {ratio}x"
            assert bool(residuals) == ef, f"{name}: residuals {list(residuals)} (EF {ef})"
        else:
            assert not residuals and data["compressed_calls"] == 0, name
        if tol is not None:
            assert abs(loss - base) <= tol * base, \
                f"{name}: final loss {loss:.5f} vs uncompressed {base:.5f} (tolerance {tol:.1%})"
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"grid {args.grid} overlap {args.overlap} {name}: final loss {loss:.5f} "
                  f"(uncompressed {base:.5f}), data bytes {got:.2f}x fewer", flush=True)
    layer_groups = [n for n, size in zip(("row", "col", "depth"), sizes[1:]) if size > 1]
    for name, compression, tol in LAYER_SETTINGS if layer_groups else ():
        loss, stats, _ = train(args, sizes, compression)
        for group in layer_groups:  # the layers' collectives over it were compressed
            s = stats[group]
            assert s["compressed_calls"] > 0 and s["bytes_sent"] < s["logical_bytes_sent"], \
                f"{name}: the {group} group's collectives were not compressed: {s}"
        if tol is not None:
            assert abs(loss - base) <= tol * base, \
                f"{name}: final loss {loss:.5f} vs uncompressed {base:.5f} (tolerance {tol:.1%})"
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"grid {args.grid} overlap {args.overlap} {name}: final loss {loss:.5f} "
                  f"(uncompressed {base:.5f}); compressed groups {layer_groups}", flush=True)
    if sizes[0] > 1:
        check_sync_fingerprints(sizes)
    if sizes[0] > 1 and args.overlap:
        check_pass_limit_warning(sizes)
    print(f"grid {args.grid} overlap {args.overlap}: compressed gradients ok", flush=True)


if __name__ == "__main__":
    main()
