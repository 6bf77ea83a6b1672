"""Training throughput of one GPT on one device: axonn_c at a world of one against the same model
in plain PyTorch (eager, and torch.compile), bf16 autocast with fp32 master weights and
gradients, fused AdamW, in one process, rounds interleaved (the best round of each is kept).

    python benchmarks/bench_train_gpu.py --preset 350m --json gpt_train.json      # GPU
    python benchmarks/bench_train_gpu.py --preset tiny --device cpu --steps 2     # CPU smoke run

The model is examples/gpt.py's (pre-LayerNorm blocks, scaled_dot_product_attention, untied head);
axonn_c's copy is built inside axonn_c.auto_parallelize(), so every nn.Linear is an
axonn_c.Linear (its GEMMs through cuBLASLt, its gradients through the C buckets). Reports
tokens/s and MFU: model FLOPs per token 6 N + 12 n_layer n_embd T (N: the parameters outside
the embeddings; T: the sequence length), over the peak dense bf16 FLOP/s of the device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

PRESETS = {  # name: (n_layer, n_head, n_embd, block, batch)
    "tiny": (2, 4, 64, 64, 4),
    "125m": (12, 12, 768, 1024, 16),
    "350m": (24, 16, 1024, 1024, 8),
    "760m": (24, 16, 1536, 1024, 8),
    "1.3b": (24, 16, 2048, 1024, 16),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, SXM


def peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def build(variant: str, cfg: GPTConfig, device: str):
    torch.manual_seed(0)
    if variant.startswith("axonn_c"):
        import axonn_c

        with axonn_c.auto_parallelize():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    fwd = torch.compile(model) if variant.endswith("compile") else model
    return model, fwd, opt


def run(variant, cfg, batch, steps, warmup, device, sync_grads):
    model, fwd, opt = build(variant, cfg, device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen).to(device)
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device, dtype=dtype):
            _, loss = fwd(x, y)
        loss.backward()
        if sync_grads is not None:
            sync_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    n_total = sum(p.numel() for p in model.parameters())
    del model, fwd, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return dt, loss.item(), warm_s, n_total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="350m", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="torch,axonn_c,torch_compile")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    n_layer, n_head, n_embd, block, batch = PRESETS[args.preset]
    vocab = args.vocab if args.preset != "tiny" else 64
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    variants = [v for v in args.variants.split(",") if v]
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    import axonn_c

    axonn_c.init(overlap=False)  # a world of one: every Linear is local
    sync = lambda m: axonn_c.sync_gradients(m, mean=True)  # noqa: E731  (as a user's loop does)
    nonemb = None
    best: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for v in variants:
            if v.endswith("compile") and rnd > 0:  # one round: its compilation costs minutes
                continue
            try:
                dt, loss, warm_s, n_total = run(v, cfg, batch, args.steps, args.warmup,
                                                args.device, sync if v.startswith("axonn_c")
                                                else None)
            except Exception as e:  # noqa: BLE001  (a variant that cannot run is reported)
                best[v] = {"variant": v, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"round {rnd} {v}: FAILED {best[v]['error']}", flush=True)
                continue
            nonemb = n_total - (cfg.vocab_size + cfg.block_size) * cfg.n_embd
            tokens = batch * cfg.block_size
            flops = tokens * (6 * nonemb + 12 * n_layer * n_embd * cfg.block_size)
            row = {"variant": v, "step_ms": round(dt * 1e3, 3),
                   "tokens_per_s": round(tokens / dt, 1), "loss": round(loss, 4),
                   "warmup_s": round(warm_s, 1), "model_tflops_per_s": round(flops / dt / 1e12, 2)}
            peak = peak_flops(args.device)
            if peak:
                row["mfu"] = round(flops / dt / peak, 4)
            print(f"round {rnd} {v}: {row}", flush=True)
            if v not in best or "error" in best[v] or row["step_ms"] < best[v]["step_ms"]:
                best[v] = row
    axonn_c.finalize()
    base = best.get("torch", {}).get("tokens_per_s")
    for row in best.values():
        if base and "tokens_per_s" in row:
            row["vs_torch_eager"] = round(row["tokens_per_s"] / base, 4)
    meta = {"preset": args.preset, "params": nonemb, "batch": batch, "seq": cfg.block_size,
            "vocab": cfg.vocab_size, "device": torch.cuda.get_device_name(0)
            if args.device == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "steps": args.steps, "rounds": args.rounds,
            "peak_bf16_flops": peak_flops(args.device)}
    print(json.dumps(meta))
    print(f"{'variant':<16} {'step ms':>9} {'tokens/s':>11} {'vs eager':>9} {'MFU':>7}")
    for row in best.values():
        if "error" in row:
            print(f"{row['variant']:<16} {row['error']}")
        else:
            print(f"{row['variant']:<16} {row['step_ms']:>9} {row['tokens_per_s']:>11} "
                  f"{row.get('vs_torch_eager', ''):>9} {row.get('mfu', ''):>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": list(best.values())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
