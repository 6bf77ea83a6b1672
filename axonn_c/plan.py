"""The grid planner: ranks every (G_data, G_intra_r, G_intra_c, G_intra_d) for a model and a
machine by the communication model of the C core (csrc/core/model.c, docs/model.md).

    python -m axonn_c.plan --layers 42 --hidden 12288 --heads 96 --seq 2048 \\
        --global-batch 2048 --gpus 1024 --machine perlmutter --top 10
    python -m axonn_c.plan --hf-config gpt2-xl.json --global-batch 512 --gpus 64

From Python: ``choose_grid(world_size, model=..., machine=..., seq=..., global_batch=...)`` gives
the fitting grids best first; ``auto_grid`` the best one (used by ``axonn_c.init(plan="auto")``).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from types import MappingProxyType

# every group the communication model reports (state.GROUPS): the outputs' per-group columns
# add up to comm_time_s
GROUPS = ("col", "row", "depth", "data", "intra", "world")
DEFAULT_MACHINE = "perlmutter"
_DTYPES = MappingProxyType({"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                            "float16": "float16", "fp32": "float32", "float32": "float32"})

# keys of a transformer description (the C side reads the same names)
_TRANSFORMER_KEYS = ("blocks", "hidden", "heads", "ffn", "vocab")
_COMMON_KEYS = ("seq", "global_batch", "grad_acc", "micro_batch", "recompute", "dtype",
                "grad_dtype", "fwd_chunks", "ratio", "optimizer_states", "cache_weights",
                "compression", "bucket_bytes", "bucket_reverse")


def _C():
    from . import _C as c  # lazy: `python -m axonn_c.plan --help` works without the build

    return c


# ------------------------------------------------------------------------------ inputs


def _dtype(name: str, what: str) -> str:
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"{what}={name!r}: expected one of bf16, fp16, fp32") from None


def load_machine(spec=None) -> dict:
    """A machine profile as a dict: a built-in name, a path to a JSON profile, or a dict."""
    if spec is None:
        spec = os.environ.get("AXONN_C_MACHINE", DEFAULT_MACHINE)
    if isinstance(spec, dict):
        return _C().model_machine(spec)
    spec = str(spec)
    if spec in _C().model_machines():
        return _C().model_machine(spec)
    if spec.endswith(".json") or os.path.sep in spec or os.path.exists(spec):
        if not os.path.isfile(spec):
            raise ValueError(f"machine profile file {spec!r} does not exist")
        with open(spec, encoding="utf-8") as f:
            try:
                prof = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"machine profile {spec!r} is not valid JSON: {e}") from None
        if not isinstance(prof, dict):
            raise ValueError(f"machine profile {spec!r} must hold a JSON object")
        prof.setdefault("name", os.path.splitext(os.path.basename(spec))[0])
        return _C().model_machine(prof)
    return _C().model_machine(spec)  # raises: unknown machine, naming the built-in ones


def model_layers(model) -> list[dict]:
    """The linear layers of an nn.Module (nn.Linear, axonn_c.Linear and anything with
    in_features/out_features and a 2-D weight), grouped by shape with counts."""
    import torch.nn as nn

    if not isinstance(model, nn.Module):  # (a config, say: models.GPT takes one, the planner not)
        raise TypeError(f"the planner's model= must be an nn.Module (the model to plan for, made "
                        f"before init: its layers' shapes), got {type(model).__name__}; to plan "
                        "from a description instead, pass blocks=, hidden=, heads=")
    counts: dict[tuple, int] = {}
    for mod in model.modules():
        if isinstance(mod, nn.Linear) or (
                hasattr(mod, "in_features") and hasattr(mod, "out_features")
                and hasattr(mod, "weight")):
            key = (int(mod.in_features), int(mod.out_features),
                   int(bool(getattr(mod, "transpose", False))),
                   int(getattr(mod, "bias", None) is not None))
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        raise ValueError(f"the model ({type(model).__name__}) has no nn.Linear/axonn_c.Linear "
                         "layers to plan for")
    return [dict(in_features=i, out_features=o, transpose=t, bias=b, count=n)
            for (i, o, t, b), n in counts.items()]


def step_layers(model, tied_loss: bool = False, seq: int | None = None) -> list[dict]:
    """Every part of an axonn_c model that communicates in a training step, as layer dicts
    for the communication model (`_C.model_volume(grid, rank, layers, step)`): each
    axonn_c.Linear (its layout), axonn_c.Embedding (expert layout; `tied_loss`: its
    cross_entropy also runs once per forward), each expert-layout axonn_c.LayerNorm/RMSNorm,
    and one "replicated" entry for the parameters every rank holds whole (summed by
    sync_gradients over world in the easy layout, over depth and data in the expert one).
    An axonn_c.models.GPT needs `seq` (tokens per sequence): its positional table looks up
    `seq` rows a rank, its tied token table's loss is shifted (one row a sequence fewer); its
    attention itself moves nothing (whole heads and whole sequences on each rank).
    Exact when the gradients summed over a group divide over it (bucket packing is then
    additive); the first sync_gradients's broadcast of the replicated state is not counted."""
    from .conv import Conv2d
    from .embedding import Embedding
    from .linear import Linear
    from .models import GPT
    from .norm import LayerNorm, RMSNorm

    layers, owned, expert = [], set(), False
    embeddings = [m for m in model.modules() if isinstance(m, Embedding) and m.expert_mode]
    tied = positions = None
    if isinstance(model, GPT):
        if seq is None or int(seq) < 1:
            raise ValueError(f"step_layers: an axonn_c.models.GPT needs seq (tokens per "
                             f"sequence, >= 1), got {seq!r}")
        tied, positions = model.transformer.wte, model.transformer.wpe
    elif tied_loss and len(embeddings) > 1:
        raise NotImplementedError(
            f"step_layers(tied_loss=True): the model has {len(embeddings)} expert-layout "
            "Embeddings; which one is the tied output layer is not known (describe the layers "
            "yourself, with tied=1 on that one)")
    elif tied_loss and embeddings:
        tied = embeddings[0]
    for mod in model.modules():
        own = [p for p in mod.parameters(recurse=False)]
        if isinstance(mod, Conv2d):  # (rows are N*H'*W' per image: not the step's tokens)
            raise NotImplementedError(
                f"step_layers: {mod!r} is a convolution, which the communication model does "
                "not describe yet (its GEMM rows are the output pixels, not the step's tokens)")
        if isinstance(mod, Linear):
            expert |= mod.expert_mode
            layers.append(dict(in_features=mod.in_features, out_features=mod.out_features,
                               transpose=int(mod.transpose), bias=int(mod.bias is not None),
                               easy=int(not mod.expert_mode)))
            codecs = mod.__dict__.get("_own_compression")  # Linear.compression
            if codecs:
                layers[-1]["compression"] = {dim: (spec[0], spec[1]) if spec else ("none", 0)
                                             for dim, spec in codecs.items()}
        elif isinstance(mod, Embedding):
            layers.append(dict(kind="embedding", in_features=mod.num_embeddings,
                               out_features=mod.embedding_dim, transpose=int(mod.transpose),
                               tied=int(mod is tied), easy=int(not mod.expert_mode),
                               rows=int(seq) if mod is positions else 0,
                               seq=int(seq) if mod is tied and positions is not None else 0))
        elif isinstance(mod, (LayerNorm, RMSNorm)) and mod.expert_mode:
            layers.append(dict(kind="norm", out_features=mod.hidden, transpose=int(mod.transpose),
                               stats=2 if isinstance(mod, LayerNorm) else 1,
                               params=sum(p.numel() for p in own) * (mod.hidden // mod.local)))
        else:
            continue
        owned.update(id(p) for p in own)
    rest = sum(p.numel() for p in model.parameters() if id(p) not in owned)
    if rest:
        layers.append(dict(kind="replicated", params=rest, easy=int(not expert)))
    return layers


def codecs_of(compression) -> dict:
    """init(compression=...)'s policy (None, a codec name or spec: data's, or a dict by
    dimension; axonn_c/compression.py checks it) as the model's {group: (codec, block)}."""
    from .compression import parse_policy

    return {dim: (codec, block) for dim, (codec, block, _) in parse_policy(compression).items()}


def parse_cli_compression(items) -> dict:
    """--compression's DIM=CODEC[:BLOCK] items (also comma-separated) as a policy dict."""
    policy: dict = {}
    for item in (part for arg in items or () for part in arg.split(",") if part):
        dim, sep, spec = item.partition("=")
        if not sep or not spec:
            raise ValueError(f"--compression {item!r}: expected DIM=CODEC[:BLOCK], e.g. "
                             "data=int4 or depth=int8:128")
        codec, _, block = spec.partition(":")
        try:
            policy[dim] = {"codec": codec, "block": int(block) if block else 0}
        except ValueError:
            raise ValueError(f"--compression {item!r}: the block size {block!r} is not an "
                             "integer") from None
    return policy


def step_volume(model, grid, rank: int, tokens: int, *, compression=None, overlap=False,
                bucket_bytes=None, tied_loss=False, layers=None, **step) -> dict:
    """What global rank `rank` sends and receives per group in one training step (forward,
    backward, sync_gradients) of `model` on `grid` (G_data, G_intra_r, G_intra_c, G_intra_d):
    {"sent": {group: bytes}, "recv": ..., "calls": ..., "hops": ...}, the wire bytes that
    comm_stats() counts. `tokens`: of the whole job in the step. `compression`: init's policy
    (the depth/row/col codecs apply to the Linear layers' own collectives; the data codec to
    the gradient buckets, whose packing decides the wire bytes). `overlap`: init(overlap=):
    backward sums the data gradients in buckets of `bucket_bytes` (init(bucket_size=), 4 MiB
    by default), last layer first, and the scheduler keeps the last Linear's forward gather
    for its backward (docs/scheduler.md); else sync_gradients sums them, in model order, in
    buckets of grads.SYNC_BUCKET_BYTES. `step`: grad_acc, recompute, dtype, grad_dtype, fwd_chunks.
    `layers`: step_layers(model, tied_loss) unless given."""
    from .grads import SYNC_BUCKET_BYTES
    from .state import Session

    if bucket_bytes is None:
        bucket_bytes = Session.bucket_bytes if overlap else SYNC_BUCKET_BYTES
    if layers is None:
        layers = step_layers(model, tied_loss=tied_loss)
    if overlap:  # the scheduler keeps the last forward layer's gather for its backward
        last = max((i for i, l in enumerate(layers) if l.get("kind", "linear") == "linear"),
                   default=None)
        if last is not None:
            layers = list(layers)
            layers[last] = dict(layers[last], cache_weights=1)
    desc = dict(step, tokens=tokens, compression=codecs_of(compression),
                bucket_bytes=bucket_bytes, bucket_reverse=int(bool(overlap)))
    for k in ("dtype", "grad_dtype"):
        if k in desc:
            desc[k] = _dtype(desc[k], k)
    return _C().model_volume(tuple(grid), rank, layers, desc)


def make_desc(*, model=None, layers=None, **kw) -> dict:
    """Builds the description dict the C planner reads. Keyword names: blocks (or n_layers),
    hidden, heads, ffn, vocab, seq, global_batch, grad_acc, micro_batch, recompute
    ('full'/'none' or bool), dtype, grad_dtype ('bf16'/'fp16'/'fp32'), fwd_chunks, ratio
    ({group: codec ratio}, an estimate), compression (init(compression=...)'s policy: exact
    wire bytes), bucket_bytes and bucket_reverse (how the data gradients are packed:
    step_volume), cache_weights, optimizer ('adam'/'sgd')."""
    desc: dict = {}
    if "n_layers" in kw:
        kw["blocks"] = kw.pop("n_layers")
    if kw.get("compression") is not None:
        kw["compression"] = codecs_of(kw["compression"])
    opt = kw.pop("optimizer", "adam")
    if opt not in ("adam", "sgd"):
        raise ValueError(f"optimizer={opt!r}: expected 'adam' or 'sgd'")
    desc["optimizer_states"] = 2 if opt == "adam" else 0
    unknown = set(kw) - set(_TRANSFORMER_KEYS) - set(_COMMON_KEYS)
    if unknown:
        raise TypeError(f"unknown planner arguments {sorted(unknown)}; expected some of "
                        f"{sorted(_TRANSFORMER_KEYS + _COMMON_KEYS)}")
    for k, v in kw.items():
        if v is None:
            continue
        if k in ("dtype", "grad_dtype"):
            v = _dtype(v, k)
        elif k == "recompute":
            if isinstance(v, str):
                if v not in ("full", "none"):
                    raise ValueError(f"recompute={v!r}: expected 'full' or 'none'")
                v = v == "full"
            v = int(bool(v))
        elif k == "cache_weights":
            v = int(bool(v))
        elif k == "ratio":
            if not isinstance(v, dict):
                raise TypeError("ratio/compression must be a dict {group: ratio}")
            v = {g: (1.0 if r is None else float(r)) for g, r in v.items()}
        desc[k] = v
    if model is not None:
        layers = model_layers(model)
    if layers is not None:
        desc["layers"] = list(layers)
    else:
        missing = [k for k in ("blocks", "hidden", "heads") if not desc.get(k)]
        if missing:
            raise ValueError("a transformer description needs layers (--layers), hidden and "
                             f"heads; missing: {', '.join(missing)} (or pass model=...)")
    for k in ("seq", "global_batch"):
        if desc.get(k) is None:
            raise ValueError(f"the planner needs {k} (tokens per sample and samples per step)")
    return desc


# ------------------------------------------------------------------------------ planning


def plan(world_size: int, *, model=None, machine=None, layers=None, **desc_kw) -> list[dict]:
    """Every grid for `world_size` GPUs, ranked: fitting grids by predicted communication time,
    then grids that do not fit in memory, then grids that do not divide (with a reason)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"number of GPUs must be >= 1, got {world_size}")
    desc = make_desc(model=model, layers=layers, **desc_kw)
    prof = load_machine(machine)
    entries = _C().model_plan(world_size, desc, prof)
    for e in entries:
        e["grid"] = (e["G_data"], e["G_intra_r"], e["G_intra_c"], e["G_intra_d"])
        e["machine"] = prof["name"]
    return entries


def choose_grid(world_size: int, *, model=None, machine=None, **transformer_desc) -> list[dict]:
    """The grids that fit, best first (each entry has 'grid' = (G_data, G_intra_r, G_intra_c,
    G_intra_d), 'comm_time_s', 'bytes', 'mem_gib', ...). Raises ValueError when none fits,
    naming why the best candidates were rejected."""
    entries = plan(world_size, model=model, machine=machine, **transformer_desc)
    fitting = [e for e in entries if e["fits"]]
    if not fitting:
        reasons = sorted({e["reason"] for e in entries})[:5]
        raise ValueError(f"no grid of {world_size} GPUs fits this model on "
                         f"{entries[0]['machine'] if entries else machine}: "
                         + "; ".join(reasons))
    return fitting


def describe(e: dict) -> str:
    return (f"G_data={e['G_data']} G_intra_r={e['G_intra_r']} G_intra_c={e['G_intra_c']} "
            f"G_intra_d={e['G_intra_d']} (grad_acc {e['grad_acc']}): predicted communication "
            f"{e['comm_time_s']:.3f} s/step, {e['mem_gib']:.1f} GiB/GPU")


def auto_grid(world_size: int, *, model=None, machine=None, verbose: bool = False,
              **transformer_desc) -> tuple[int, int, int, int]:
    """The best fitting grid as (G_data, G_intra_r, G_intra_c, G_intra_d); with verbose, prints
    the choice and the runner-up."""
    ranked = choose_grid(world_size, model=model, machine=machine, **transformer_desc)
    if verbose:
        which = ("given" if machine is not None else
                 "from AXONN_C_MACHINE" if os.environ.get("AXONN_C_MACHINE") else "the default")
        print(f"axonn_c: plan='auto' on {world_size} GPUs with the machine profile "
              f"{ranked[0]['machine']!r} ({which}; pick another with init(plan='auto', "
              f"machine=...) or AXONN_C_MACHINE: {', '.join(_C().model_machines())} or a JSON "
              f"profile from `python -m axonn_c.plan --calibrate`): chose {describe(ranked[0])}",
              flush=True)
        if len(ranked) > 1:
            print(f"axonn_c:   runner-up {describe(ranked[1])}", flush=True)
    return ranked[0]["grid"]


# ------------------------------------------------------------------------------ output


def _fmt_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


_WIDTH = MappingProxyType({"col": 7, "row": 7, "depth": 8, "data": 7, "intra": 7,
                           "world": 7})  # table columns


def format_table(entries: list[dict], top: int) -> str:
    head = (f"{'#':>3} {'G_data':>6} {'G_r':>4} {'G_c':>4} {'G_d':>5} {'acc':>4} "
            f"{'comm s':>8} " + " ".join(f"{g + ' s':>{_WIDTH[g]}}" for g in GROUPS) +
            f" {'sent/GPU':>9} {'mem GiB':>8} fits")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(entries[:top]):
        if e["valid"]:
            t = e["time_s"]
            total = sum(e["bytes"].values())
            lines.append(
                f"{i + 1:>3} {e['G_data']:>6} {e['G_intra_r']:>4} {e['G_intra_c']:>4} "
                f"{e['G_intra_d']:>5} {e['grad_acc']:>4} {e['comm_time_s']:>8.3f} "
                + " ".join(f"{t[g]:>{_WIDTH[g]}.3f}" for g in GROUPS) +
                f" {_fmt_bytes(total):>9} {e['mem_gib']:>8.1f} {'yes' if e['fits'] else 'NO'}")
        else:
            lines.append(f"{i + 1:>3} {e['G_data']:>6} {e['G_intra_r']:>4} {e['G_intra_c']:>4} "
                         f"{e['G_intra_d']:>5}  invalid: {e['reason']}")
    return "\n".join(lines)


def write_json(entries: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f, indent=1)
        f.write("\n")


def write_csv(entries: list[dict], path: str) -> None:
    cols = ["rank", "G_data", "G_intra_r", "G_intra_c", "G_intra_d", "grad_acc", "valid", "fits",
            "comm_time_s"] + [f"time_{g}_s" for g in GROUPS] + [f"bytes_{g}" for g in GROUPS] + \
        ["mem_gib", "reason"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i, e in enumerate(entries):
            w.writerow([i + 1, e["G_data"], e["G_intra_r"], e["G_intra_c"], e["G_intra_d"],
                        e["grad_acc"], int(e["valid"]), int(e["fits"]),
                        "" if e["comm_time_s"] is None else f"{e['comm_time_s']:.6g}"]
                       + [f"{e['time_s'][g]:.6g}" for g in GROUPS]
                       + [e["bytes"][g] for g in GROUPS]
                       + ["" if e["mem_gib"] is None else f"{e['mem_gib']:.3f}", e["reason"]])


def write_plot(entries: list[dict], path: str, top: int, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [e for e in entries if e["valid"]][:top]
    if not shown:
        raise SystemExit("--plot: no valid grid to plot")
    labels = [f"{e['G_data']}×{e['G_intra_r']}×{e['G_intra_c']}×{e['G_intra_d']}"
              + ("" if e["fits"] else "  (does not fit)") for e in shown]
    colors = {"col": "#4C72B0", "row": "#DD8452", "depth": "#55A868", "data": "#C44E52",
              "intra": "#8172B3", "world": "#937860"}
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.42 * len(shown)), dpi=120)
    y = list(range(len(shown)))[::-1]
    left = [0.0] * len(shown)
    for g in GROUPS:
        vals = [e["time_s"][g] for e in shown]
        ax.barh(y, vals, left=left, color=colors[g], label=f"{g} group", height=0.7)
        left = [a + b for a, b in zip(left, vals)]
    for yi, e, tot in zip(y, shown, left):
        ax.text(tot, yi, f" {tot:.2f} s · {e['mem_gib']:.0f} GiB", va="center", fontsize=8)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=9)
    ax.set_xlabel("predicted communication time per step (s)")
    ax.set_ylabel("G_data × G_intra_r × G_intra_c × G_intra_d")
    ax.set_xlim(0, max(left) * 1.25)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1.2 + 0.42 * len(shown))),
              ncol=len(GROUPS), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:  # a missing folder, no permission, an unknown suffix
        raise SystemExit(f"--plot: cannot write {path}: {e}") from None
    finally:
        plt.close(fig)
    print(f"wrote the plot of the top {len(shown)} grids to {os.path.abspath(path)}")


# ------------------------------------------------------------------------------ CLI


class _HelpWithDefaults(argparse.HelpFormatter):
    """--help names the default of every option that has one (unless its help says it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


# transformers config keys -> the CLI's model sizes (GPT-2's names, then the Llama-style ones)
_HF_KEYS = (("layers", ("n_layer", "num_hidden_layers")), ("hidden", ("n_embd", "hidden_size")),
            ("heads", ("n_head", "num_attention_heads")), ("ffn", ("n_inner", "intermediate_size")),
            ("vocab", ("vocab_size",)), ("seq", ("n_positions", "max_position_embeddings")))


def hf_config_sizes(path: str) -> dict:
    """The model sizes of a transformers config.json (GPT-2 or Llama-style names): {layers,
    hidden, heads, ffn, vocab, seq: (value, the config's key)}, the ones the file has (GPT-2's
    n_inner: null is left out, i.e. 4 * hidden). seq is the longest sequence the model takes
    (n_positions, max_position_embeddings), not the one it trains on."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--hf-config {path!r}: cannot read a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--hf-config {path!r}: expected a JSON object")
    out = {}
    for name, keys in _HF_KEYS:
        for k in keys:
            if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool):
                out[name] = (cfg[k], k)
                break
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m axonn_c.plan", formatter_class=_HelpWithDefaults,
        description="Rank every 4D grid (G_data x G_intra_r x G_intra_c x G_intra_d) for a "
                    "transformer on a machine by predicted communication time and memory.")
    m = p.add_argument_group("model")
    m.add_argument("--hf-config", metavar="CONFIG.json",
                   help="take the model sizes (layers, hidden, heads, ffn, vocab, seq) from a "
                        "transformers config.json; flags given as well win (its seq is the "
                        "longest the model takes: pass --seq for the training length)")
    m.add_argument("--layers", type=int, help="transformer blocks")
    m.add_argument("--hidden", type=int, help="hidden size")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--ffn", type=int, default=None, help="FFN width (default 4*hidden)")
    m.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: no "
                   "vocabulary projection)")
    m.add_argument("--seq", type=int, help="sequence length")
    m.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    m.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per data-parallel replica per micro-batch (sets grad-acc "
                        "per grid)")
    m.add_argument("--grad-acc", type=int, default=1, help="micro-batches per step")
    r = p.add_argument_group("run")
    r.add_argument("--gpus", type=int, help="number of GPUs")
    r.add_argument("--machine", default=DEFAULT_MACHINE,
                   help="perlmutter, frontier, dgx-h100, or a JSON profile path")
    r.add_argument("--recompute", choices=("full", "none"), default="full",
                   help="activation recomputation in backward")
    r.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="weights and activations")
    r.add_argument("--grad-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="data-parallel gradients")
    r.add_argument("--cache-weights", action="store_true",
                   help="keep gathered weights from forward to backward")
    r.add_argument("--compress-data", type=float, default=1.0, metavar="RATIO",
                   help="estimated codec ratio (compressed/raw bytes) of the data-parallel "
                   "gradients (--compression gives exact bytes)")
    r.add_argument("--compression", nargs="+", metavar="DIM=CODEC[:BLOCK]",
                   help="init(compression=...)'s policy, e.g. data=int4 depth=bf16 "
                   "row=int8:128 (codecs none bf16 fp8 int8 int4; BLOCK a power of two, "
                   "default the codec's): exact wire bytes")
    r.add_argument("--bucket-size", type=int, default=None, metavar="BYTES",
                   help="data gradient bucket size (init(bucket_size=)); with --compression "
                   "the packing decides the data group's wire bytes (default: "
                   "sync_gradients' 16 MiB buckets, model order)")
    r.add_argument("--fwd-chunks", type=int, default=1,
                   help="over-decomposition of the forward all-reduce")
    r.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="optimizer state counted in memory")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="rows of the table (and bars of --plot)")
    o.add_argument("--json", metavar="PATH", help="write every evaluated grid as JSON")
    o.add_argument("--csv", metavar="PATH", help="write every evaluated grid as CSV")
    o.add_argument("--plot", metavar="PATH.png", help="bar chart of the top grids' time split")
    c = p.add_argument_group("calibration")
    c.add_argument("--calibrate", action="store_true",
                   help="measure bandwidths with the active backend (run under torchrun) and "
                        "write a profile to --out")
    c.add_argument("--out", default="machine.json", help="profile written by --calibrate")
    return p


def main(argv=None) -> int:
    from .grads import SYNC_BUCKET_BYTES  # (lazy, as in step_volume)

    args = _parser().parse_args(argv)
    seq_from = "--seq"
    if args.hf_config:
        try:
            sizes = hf_config_sizes(args.hf_config)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for name, (value, key) in sizes.items():
            if getattr(args, name) in (None, 0):  # (--vocab's default is 0: none)
                setattr(args, name, value)
                if name == "seq":  # (the longest the model takes: training is often shorter)
                    seq_from = (f"the config's {key}, the longest the model takes; "
                                "--seq for the training length")
    if args.calibrate:  # (a program of its own: it runs the communicators, this one only models)
        os.execv(sys.executable, [sys.executable, "-m", "axonn_c.calibrate", "--out", args.out])
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads", "seq",
                                                      "global_batch", "gpus")
               if getattr(args, n) is None]
    if missing:
        print(f"error: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    bad = _bad_cli_numbers(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        t0 = time.perf_counter()
        entries = plan(args.gpus, machine=args.machine, blocks=args.layers, hidden=args.hidden,
                       heads=args.heads, ffn=args.ffn, vocab=args.vocab, seq=args.seq,
                       global_batch=args.global_batch,
                       micro_batch=args.micro_batch or None,
                       grad_acc=None if args.micro_batch else args.grad_acc,
                       recompute=args.recompute, dtype=args.dtype, grad_dtype=args.grad_dtype,
                       cache_weights=args.cache_weights, fwd_chunks=args.fwd_chunks,
                       ratio={"data": args.compress_data}, optimizer=args.optimizer,
                       compression=parse_cli_compression(args.compression) or None,
                       bucket_bytes=args.bucket_size or SYNC_BUCKET_BYTES)
        dt = time.perf_counter() - t0
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prof = load_machine(args.machine)
    n_fit = sum(e["fits"] for e in entries)
    n_valid = sum(e["valid"] for e in entries)
    ffn = args.ffn or 4 * args.hidden
    params = args.layers * (4 * args.hidden ** 2 + 2 * args.hidden * ffn) + \
        args.hidden * args.vocab
    print(f"model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}, ffn {ffn}, "
          f"vocab {args.vocab or 'none'} ({params / 1e9:.1f}B params in linear layers); "
          f"seq {args.seq} ({seq_from}), global batch {args.global_batch}; "
          f"recompute {args.recompute}, "
          f"{args.dtype} weights, {args.grad_dtype} data-parallel gradients"
          + (f"; compression {' '.join(args.compression)}" if args.compression else ""))
    print(f"machine: {prof['name']} ({prof['gpus_per_node']} GPUs/node, {prof['mem_gib']:g} GiB, "
          f"{prof['inter_node_gbps']:g} GB/s per node); {args.gpus} GPUs: {len(entries)} grids, "
          f"{n_valid} divide, {n_fit} fit in memory ({dt * 1e3:.0f} ms)")
    print(format_table(entries, args.top))
    if not n_fit:
        print("no grid fits in memory; the table shows the closest ones", file=sys.stderr)
    try:
        if args.json:
            write_json(entries, args.json)
        if args.csv:
            write_csv(entries, args.csv)
        if args.plot:
            write_plot(entries, args.plot, args.top,
                       f"{params / 1e9:.0f}B-parameter transformer on {args.gpus} GPUs of "
                       f"{prof['name']}: predicted communication per step")
    except OSError as e:
        print(f"error: cannot write the output: {e}", file=sys.stderr)
        return 2
    return 0 if n_fit else 1


# (name, lowest, highest) of the CLI's integer options; the model computes in int64, so sizes are
# bounded well below its overflow
_CLI_INT_RANGES = (("layers", 1, 2**20), ("hidden", 1, 2**24), ("heads", 1, 2**20),
                   ("ffn", 1, 2**26), ("vocab", 0, 2**26), ("seq", 1, 2**24),
                   ("global_batch", 1, 2**30), ("micro_batch", 0, 2**30), ("grad_acc", 1, 2**20),
                   ("gpus", 1, 2**20), ("fwd_chunks", 1, 64), ("top", 1, 2**20))


def _bad_cli_numbers(args) -> str | None:
    """What is wrong with the CLI's numbers (named as the option), or None."""
    for name, lo, hi in _CLI_INT_RANGES:
        value = getattr(args, name)
        if value is not None and not lo <= value <= hi:
            return f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {value}"
    if not (math.isfinite(args.compress_data) and args.compress_data > 0):
        return f"--compress-data must be a finite ratio > 0, got {args.compress_data}"
    if args.bucket_size is not None and args.bucket_size < 4:
        return f"--bucket-size must be >= 4 bytes, got {args.bucket_size}"
    return None


if __name__ == "__main__":
    sys.exit(main())
