"""axonn_c.checkpoint under torchrun (tests/test_checkpoint.py).

--mode save: trains the example GPT (auto_parallelize) a few steps, saves (model, AdamW, extra)
  and the same asynchronously to a second path, trains on (the async save writes meanwhile) and
  prints the losses after the save; rank 0 checks that both checkpoints export to the model's
  full_state_dict at the save, bitwise.
--mode resume: builds the model from another seed, loads the checkpoint on this grid and world
  size, trains the same steps and prints their losses (the test compares them with save's).
--mode errors: missing, truncated, foreign and mismatched checkpoints raise CheckpointError on
  every rank.
--mode kill: saves, trains a step, saves again to the same path and rank 1 dies while writing.
"""
import argparse
import os
import shutil
import sys

import torch

import axonn_c
import axonn_c.checkpoint as ckpt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from gpt import GPT, CharData, GPTConfig, make_corpus  # noqa: E402

GLOBAL_BATCH = 24  # divides by every world size the tests use (2, 3, 4, 8)


def build(seed, n_embd=10):
    torch.manual_seed(seed)
    data = CharData(make_corpus(4000), block_size=8)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=8, n_layer=1, n_head=2,
                    n_embd=n_embd)
    with axonn_c.auto_parallelize():
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, data


def step(model, opt, data, i):
    g = axonn_c.grid()
    per = GLOBAL_BATCH // g.world_size
    x, y = data.batch(i, GLOBAL_BATCH)
    x, y = x[g.rank * per:(g.rank + 1) * per], y[g.rank * per:(g.rank + 1) * per]
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    axonn_c.sync_gradients(model, mean=True)
    axonn_c.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    val = loss.detach().reshape(1).clone()
    axonn_c.comm.all_reduce(val, group="world", op="avg")
    return val.item()


def report(rank, i, loss):
    if rank == 0:
        print(f"LOSS {i} {float(loss).hex()}", flush=True)


def max_boxes(model):
    n = max(len(m.weight_boxes()) for m in model.modules() if isinstance(m, axonn_c.Linear))
    out = torch.tensor([n], dtype=torch.int64)
    axonn_c.comm.all_reduce(out, group="world", op="max")
    return int(out)


def mode_save(args, rank):
    model, opt, data = build(1)
    for i in range(args.before):
        step(model, opt, data, i)
    full = {k: v.clone() for k, v in axonn_c.full_state_dict(model).items()}
    path, path_async = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "ckpt_async")
    assert ckpt.save(path, model, opt, extra={"step": args.before, "tag": "t"}) == path
    handle = ckpt.save(path_async, model, opt, extra={"step": args.before}, async_save=True)
    for i in range(args.before, args.before + args.after):
        report(rank, i, step(model, opt, data, i))
        if i == args.before:
            handle.wait()  # (collective) after one step of training under the writes
    assert handle.done() and not os.path.exists(path_async + ".partial")
    if rank == 0:
        for p in (path, path_async):
            got = ckpt.export(p)
            assert list(got) == list(full), (list(got), list(full))
            for k, v in full.items():
                assert torch.equal(got[k], v), k
        print("EXPORT MATCH", flush=True)
    print(f"MAX BOXES {max_boxes(model)}", flush=True)


def mode_resume(args, rank):
    model, opt, data = build(99)  # other weights: the load must replace them
    extra = ckpt.load(os.path.join(args.dir, args.name), model, opt)
    assert extra["step"] == args.before, extra
    for i in range(args.before, args.before + args.after):
        report(rank, i, step(model, opt, data, i))
    print(f"MAX BOXES {max_boxes(model)}", flush=True)


def expect_error(rank, case, fn, *words):
    try:
        fn()
    except ckpt.CheckpointError as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        assert not missing, (case, missing, msg)
        print(f"RAISED {case} rank {rank}: {msg[:300]}", flush=True)
    else:
        raise AssertionError(f"{case}: no error on rank {rank}")
    axonn_c.comm.barrier()


def mode_errors(args, rank):
    model, opt, data = build(1)
    step(model, opt, data, 0)
    good = os.path.join(args.dir, "good")
    ckpt.save(good, model, opt)
    d = args.dir
    if rank == 0:
        shutil.copytree(good, os.path.join(d, "trunc"))
        f = os.path.join(d, "trunc", "__1_0.distcp")  # written by rank 1
        os.truncate(f, os.path.getsize(f) // 2)
        shutil.copytree(good, os.path.join(d, "badmeta"))
        m = os.path.join(d, "badmeta", ".metadata")
        os.truncate(m, os.path.getsize(m) // 2)
        shutil.copytree(good, os.path.join(d, "nofile"))
        os.remove(os.path.join(d, "nofile", "__0_0.distcp"))
        import torch.distributed.checkpoint as dcp
        dcp.save({"w": torch.ones(3)}, checkpoint_id=os.path.join(d, "foreign"), no_dist=True)
        os.makedirs(os.path.join(d, "userdata"))
        open(os.path.join(d, "userdata", "notes.txt"), "w").write("keep me")
    axonn_c.comm.barrier()
    expect_error(rank, "missing", lambda: ckpt.load(os.path.join(d, "nothere"), model),
                 "no checkpoint at", "nothere")
    expect_error(rank, "truncated", lambda: ckpt.load(os.path.join(d, "trunc"), model, opt),
                 "__1_0.distcp is truncated")
    expect_error(rank, "badmeta", lambda: ckpt.load(os.path.join(d, "badmeta"), model),
                 ".metadata is truncated")
    expect_error(rank, "nofile", lambda: ckpt.load(os.path.join(d, "nofile"), model),
                 "__0_0.distcp is missing")
    expect_error(rank, "foreign", lambda: ckpt.load(os.path.join(d, "foreign"), model),
                 "not written by axonn_c")
    other, _, _ = build(1, n_embd=12)
    expect_error(rank, "mismatch", lambda: ckpt.load(good, other), "other shapes",
                 "blocks.0.attn.qkv.weight: checkpoint [30, 10], model [36, 12]")
    del other.head
    expect_error(rank, "unexpected", lambda: ckpt.load(good, other), "unexpected keys",
                 "head.weight")
    expect_error(rank, "userdata", lambda: ckpt.save(os.path.join(d, "userdata"), model),
                 "exists and is not a checkpoint")
    assert open(os.path.join(d, "userdata", "notes.txt")).read() == "keep me"
    ckpt.load(good, model, opt)  # still fine after all that
    print(f"ERRORS DONE rank {rank}", flush=True)


def mode_kill(args, rank):
    model, opt, data = build(1)
    for i in range(args.before):
        step(model, opt, data, i)
    path = os.path.join(args.dir, "ckpt")
    ckpt.save(path, model, opt, extra={"step": args.before})
    for i in range(args.before, args.before + args.after):  # what resuming must give
        report(rank, i, step(model, opt, data, i))
    if rank == 1:  # dies in the middle of writing its file of the next save
        import torch.distributed.checkpoint.filesystem as fs
        real = fs._write_item
        count = [0]

        def dying(*a, **k):
            count[0] += 1
            if count[0] == 3:
                os._exit(17)
            return real(*a, **k)
        fs._write_item = dying
    print(f"SAVING AGAIN rank {rank}", flush=True)
    ckpt.save(path, model, opt, extra={"step": args.before + args.after})
    print("UNREACHABLE", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--grid", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", default="ckpt")
    ap.add_argument("--before", type=int, default=3)
    ap.add_argument("--after", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(v) for v in args.grid.split(",")]
    g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2],
                     G_intra_d=sizes[3])
    {"save": mode_save, "resume": mode_resume, "errors": mode_errors,
     "kill": mode_kill}[args.mode](args, g.rank)
    axonn_c.finalize()


if __name__ == "__main__":
    main()
