"""Per-rank memory of a vocabulary-parallel embedding + tied output layer against serial
(issue 24's acceptance: vocabulary 50,304, hidden 1,024, a 2 x 2 grid).

Run: torchrun --nproc_per_node 4 benchmarks/bench_vocab_memory.py [--vocab 50304 --hidden 1024
     --tokens 512 --grid 1,2,2,1]

Counts, on every rank, the elements of the embedding's parameter (the tied output layer shares
it) and of the largest logits tensor the expert-layout loss step holds (`Embedding.logits`),
and checks the loss against the serial F.cross_entropy on rank 0's copy of the full table.
Prints one line per rank and a summary on rank 0; --json writes the numbers."""
import argparse
import json

import torch
import torch.nn.functional as F

import axonn_c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--grid", default="1,2,2,1")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sizes = [int(v) for v in a.grid.split(",")]
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3])
    V, H, T = a.vocab, a.hidden, a.tokens
    torch.manual_seed(0)
    emb = axonn_c.Embedding(V, H, expert_mode=True)
    gen = torch.Generator().manual_seed(1 + g.data_rank * g.G_intra_d + g.depth_rank)
    ids = torch.randint(0, V, (T,), generator=gen)
    target = torch.randint(0, V, (T,), generator=gen)
    x = emb(ids)
    logits = emb.logits(x)
    loss = axonn_c.parallel_cross_entropy(logits, target)
    loss.backward()
    full = emb.full_weight()  # (collective) for the serial check
    row = {"rank": g.rank, "param_elems": emb.weight.numel(), "logits_elems": logits.numel(),
           "serial_param_elems": V * H, "serial_logits_elems": T * V}
    print(f"rank {g.rank}: embedding+output parameter {row['param_elems']} elements "
          f"({row['param_elems'] / (V * H):.4f} of serial), logits {list(logits.shape)} "
          f"({row['logits_elems'] / (T * V):.4f} of serial)", flush=True)
    if g.rank == 0:
        xs = F.embedding(ids, full)
        want = F.cross_entropy(xs @ full.t(), target)
        assert torch.allclose(loss, want, rtol=1e-4), (loss.item(), want.item())
        out = dict(vocab=V, hidden=H, tokens=T, grid=sizes, loss=loss.item(),
                   serial_loss=want.item(), **row)
        print(f"grid {a.grid}: V={V} H={H} T={T}: per-rank parameter "
              f"{row['param_elems'] / (V * H):.4f} and logits {row['logits_elems'] / (T * V):.4f}"
              f" of serial; loss {loss.item():.6f} = serial {want.item():.6f}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    axonn_c.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
