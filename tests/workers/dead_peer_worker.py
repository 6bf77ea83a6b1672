"""Ranks for the dead-peer tests. The victim (last rank) either sleeps inside the job, so the
test can SIGKILL it mid-collective, or never joins the collective. Survivors must raise.
kill_concurrent: the survivors train with concurrent micro-batches (grid 2 x col 2, the caller
summing gradients over data meanwhile), so the failure reaches micro-batch threads and the
reducer on several channels at once."""
import os
import sys
import time

import torch

import axonn_c


def concurrent_steps(g):
    """Training steps with two concurrent micro-batches until something raises."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(axonn_c.Linear(64, 128, expert_mode=True),
                                axonn_c.Linear(128, 64, transpose=True, expert_mode=True))
    x = torch.randn(8, 64 // g.G_intra_c)
    for _ in range(100000):
        axonn_c.run_concurrent(lambda xb: model(xb).sum().backward(), x, model=model)
        axonn_c.sync_gradients(model)


def raises_comm_error(call):
    """0 (and the error printed) when call() raises CommError, else 1."""
    try:
        call()
    except axonn_c.CommError as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
        axonn_c.finalize()
        return 0
    print("NO ERROR", flush=True)
    return 1


def out_of_step(timeout):
    """Rank 1 feeds a different number of tokens to an expert-layout layer: the forward
    all-reduces of the column group differ in length. Every rank raises at once, naming both
    calls (not after the timeout, not with mixed data)."""
    g = axonn_c.init(G_intra_c=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    layer = axonn_c.Linear(64, 64, expert_mode=True)
    x = torch.ones(4 + 2 * (g.rank == 1), 64 // g.G_intra_c)
    layer(torch.ones(4, 64 // g.G_intra_c))  # in step
    return raises_comm_error(lambda: layer(x))


def other_grads(timeout):
    """Rank 1 has a gradient for another parameter of the same size than rank 0 (a branch the
    other rank did not run): sync_gradients' packed sums have the same length on both ranks,
    and would sum the two parameters' gradients into each other. Every rank raises at once,
    naming the mismatch, instead (shm compares what the buckets hold)."""
    g = axonn_c.init(G_data=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4),
                                 "c": torch.nn.Linear(4, 4)})
    branch = model["b"] if g.rank == 0 else model["c"]
    branch(model["a"](torch.ones(2, 4))).sum().backward()
    return raises_comm_error(lambda: axonn_c.sync_gradients(model))


def other_grads_overlap(timeout):
    """As other_grads, with the data overlap on: backward's own sums (buckets filled by the
    gradient hooks, which name each parameter alike on every rank) would sum rank 0's b into
    rank 1's c. Every rank raises, naming the mismatch, instead."""
    g = axonn_c.init(G_data=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4),
                                 "c": torch.nn.Linear(4, 4)})

    def step(layers):
        model.zero_grad(set_to_none=True)
        x = torch.ones(2, 4)
        for name in layers:
            x = model[name](x)
        with axonn_c.optimize_communication(overlap_data=True):
            x.sum().backward()
        axonn_c.sync_gradients(model)

    step("abc")  # in step: every parameter gets its gradient hook, in the same order
    step("abc")  # (summed during backward)
    return raises_comm_error(lambda: step("ab" if g.rank == 0 else "ac"))


def other_models_overlap(timeout):
    """As other_grads_overlap, across two models synced by separate sync_gradients calls (a GAN's
    generator and discriminator, say): rank 0 back-propagates through one model, rank 1 through
    the other, parameters of the same sizes in the same order. Their names in backward's
    buckets are unique in the process (was: each sync named its parameters by their position in
    its list, so the two models' names collided and the ranks summed one model's gradients into
    the other's without an error)."""
    g = axonn_c.init(G_data=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
              for _ in range(2)]

    def step(which):
        x = torch.ones(2, 4)
        for i in which:
            models[i].zero_grad(set_to_none=True)
            with axonn_c.optimize_communication(overlap_data=True):
                models[i](x).sum().backward()
        for m in models:
            axonn_c.sync_gradients(m)

    step((0, 1))  # in step: every parameter gets its gradient hook and its name
    step((0, 1))  # (summed during backward)
    return raises_comm_error(lambda: step((0,) if g.rank == 0 else (1,)))


def other_group(timeout):
    """Issue 28 item 11: rank 0 all-reduces over the col group, rank 1 over the world group, the
    same two ranks under another name (grid 1x1x2x1). Every rank raises at once, naming both
    calls and both groups (not after the timeout)."""
    g = axonn_c.init(G_intra_c=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    x = torch.ones(16)
    axonn_c.comm.all_reduce(x, group="world")  # in step
    return raises_comm_error(lambda: axonn_c.comm.all_reduce(x, group="col" if g.rank == 0
                                                          else "world"))


def main():
    mode, timeout = sys.argv[1], float(sys.argv[2])
    world = int(os.environ["WORLD_SIZE"])
    if mode == "out_of_step":
        return out_of_step(timeout)
    if mode == "other_group":
        return other_group(timeout)
    if mode == "other_grads":
        return other_grads(timeout)
    if mode == "other_grads_overlap":
        return other_grads_overlap(timeout)
    if mode == "other_models_overlap":
        return other_models_overlap(timeout)
    if mode == "kill_concurrent":
        g = axonn_c.init(G_data=2, G_intra_c=world // 2, timeout=timeout,
                         concurrent_microbatches=2)
    else:
        g = axonn_c.init(G_data=1, G_intra_r=1, G_intra_c=world, G_intra_d=1, timeout=timeout)
    x = torch.ones(1 << 20)
    axonn_c.comm.all_reduce(x)  # everyone is alive here
    victim = g.world_size - 1
    if g.rank == victim:
        print("VICTIM READY", flush=True)
        time.sleep(600)  # killed by the test (mode=kill) or simply absent (mode=absent)
        return 0
    t0 = time.monotonic()
    try:
        if mode == "kill_concurrent":
            concurrent_steps(g)
        for _ in range(1000):
            axonn_c.comm.all_reduce(x, group="col")
    except axonn_c.CommError as e:
        elapsed = time.monotonic() - t0
        print(f"RAISED {type(e).__name__} after {elapsed:.2f}s: {e}", flush=True)
        try:  # the communicator stays failed and says so
            axonn_c.comm.all_reduce(x, group="col")
            print("SECOND CALL DID NOT RAISE", flush=True)
        except axonn_c.CommError:
            pass
        axonn_c.finalize()
        return 0
    print("NO ERROR", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
