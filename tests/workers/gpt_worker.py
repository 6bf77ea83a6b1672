"""The example GPT built inside auto_parallelize trains on every rank's own micro-batch; its
per-step global-mean losses must equal a single-process run of the same model on the
concatenation of all ranks' micro-batches (computed here on rank 0, same seed, same AdamW).
--concurrent N: each rank's batch runs as N concurrent micro-batches (axonn_c.run_concurrent).
"""
import argparse
import os
import sys

import torch

import axonn_c

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from gpt import GPT, CharData, GPTConfig, make_corpus  # noqa: E402
from train_gpt import forward_backward  # noqa: E402


def train(model, data, steps, batch, rank, world, lr, clip, parallel, concurrent=1):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for step in range(steps):
        xg, yg = data.batch(step, batch * world)
        if parallel:
            sl = slice(rank * batch, (rank + 1) * batch)
            x, y = xg[sl], yg[sl]
        else:
            x, y = xg, yg
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model, x, y, concurrent)
        if parallel:
            axonn_c.sync_gradients(model, mean=True)
            axonn_c.clip_grad_norm_(model.parameters(), clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        val = loss.detach().reshape(1).clone()
        if parallel:
            axonn_c.comm.all_reduce(val, group="world", op="avg")
        losses.append(val.item())
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="1,2,2,1")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--concurrent", type=int, default=1)
    args = ap.parse_args()
    sizes = [int(v) for v in args.grid.split(",")]
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2],
                     G_intra_d=sizes[3], overlap=args.overlap,
                     concurrent_microbatches=args.concurrent)
    world, rank = g.world_size, g.rank
    data = CharData(make_corpus(8000), block_size=16)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=16, n_layer=2, n_head=4, n_embd=32)

    torch.manual_seed(1)
    with axonn_c.auto_parallelize():
        par = GPT(cfg)
    n_sharded = sum(isinstance(m, axonn_c.Linear) for m in par.modules())
    assert n_sharded == 4 * cfg.n_layer + 1, f"only {n_sharded} layers were sharded"
    full0 = axonn_c.full_state_dict(par)

    if rank == 0:
        torch.manual_seed(1)
        ser = GPT(cfg)
        ref0 = ser.state_dict()
        assert list(ref0) == list(full0), (list(ref0), list(full0))
        for k in ref0:
            torch.testing.assert_close(full0[k], ref0[k], rtol=0, atol=0, msg=k)
        ref = train(ser, data, args.steps, args.batch, rank, world, 3e-3, args.clip, False)

    got = train(par, data, args.steps, args.batch, rank, world, 3e-3, args.clip, True,
                args.concurrent)
    full = axonn_c.full_state_dict(par)
    if rank == 0:
        worst = 0.0
        for step, (a, b) in enumerate(zip(got, ref)):
            rel = abs(a - b) / abs(b)
            worst = max(worst, rel)
            print(f"step {step:3d} parallel {a:.6f} serial {b:.6f} rel {rel:.2e}", flush=True)
            assert rel <= 1e-4, f"step {step}: loss {a} vs serial {b} (rel {rel:.2e})"
        wdiff = max((full[k] - v).abs().max().item() for k, v in ser.state_dict().items())
        print(f"max weight difference after {args.steps} steps: {wdiff:.2e}", flush=True)
        assert got[-1] < got[0], "the loss did not go down"
        print(f"LOSSES MATCH worst rel {worst:.2e}", flush=True)
    axonn_c.finalize()


if __name__ == "__main__":
    main()
