"""Ranks for the issue-28 regression tests (tests/test_hardening.py): one scenario per argv[1].
Each scenario prints "OK <scenario>" on every rank when the behaviour is right."""
import os
import sys

import torch
import torch.distributed as dist

import axonn_c


def world() -> int:
    return int(os.environ["WORLD_SIZE"])


def bad_timeout_with_pg():
    """Item 1: nonsense timeouts are refused on every rank before any rank touches the store
    (with a torch process group, whose store rank 0 would otherwise wait on forever)."""
    dist.init_process_group("gloo")
    for bad in (float("nan"), float("inf"), 1e300, 2**63, -1.0, 0, "5"):
        try:
            axonn_c.init(G_intra_c=world(), timeout=bad)
        except (ValueError, TypeError) as e:
            assert "timeout" in str(e), e
        else:
            raise AssertionError(f"init(timeout={bad!r}) was accepted")
        assert not axonn_c.is_initialized()
    g = axonn_c.init(G_intra_c=world(), timeout=60)  # the store is still usable
    x = torch.ones(4)
    axonn_c.comm.all_reduce(x)
    assert torch.equal(x, torch.full((4,), float(g.world_size)))
    axonn_c.finalize()
    dist.destroy_process_group()


def one_rank_fails_init():
    """Item 1: an init failing on one rank (here rank 1's segment settings differ) fails init on
    every rank at once, naming the failing rank, instead of rank 0 waiting out the timeout."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        os.environ["AXONN_C_SHM_SLOT_KB"] = "128"
    try:
        axonn_c.init(G_intra_c=world(), backend="shm", timeout=120)
    except (axonn_c.CommError, ValueError, RuntimeError) as e:
        msg = str(e)
        if rank == 0:
            assert "init failed on another rank" in msg and "rank 1" in msg, msg
        else:
            assert "does not match this job" in msg, msg
    else:
        raise AssertionError("init succeeded with mismatched segment settings")
    assert not axonn_c.is_initialized()
    os.environ.pop("AXONN_C_SHM_SLOT_KB", None)
    axonn_c.init(G_intra_c=world(), backend="shm", timeout=60)  # the next init works
    axonn_c.comm.barrier()
    axonn_c.finalize()


def resize_during_async():
    """Item 4: resizing the output (or the input) while an async collective writes into it (or
    reads from it) cannot corrupt memory: the collective works on a private copy taken at the
    call, and wait() puts the result into the output's current memory (its first elements
    after a resize_)."""
    g = axonn_c.init(G_intra_c=world(), timeout=60)
    n = 1 << 18
    expect = torch.cat([torch.full((n,), float(r + 1)) for r in range(g.world_size)])
    for i in range(12):
        x = torch.full((n,), float(g.rank + 1))
        out = torch.empty(n * g.world_size)
        work = axonn_c.comm.all_gather(out, x, async_op=True)
        moved = out if i % 2 == 0 else x
        moved.resize_(1 << 22)  # torch frees the old memory now
        moved.fill_(-1.0)
        work.wait()
        assert torch.equal(out[:n * g.world_size], expect)
        y = torch.ones(n)
        axonn_c.comm.all_reduce(y, async_op=True).wait()
        assert torch.equal(y, torch.full((n,), float(g.world_size)))
    for _ in range(6):  # in place: the same tensor is output and input
        t = torch.ones(n)
        work = axonn_c.comm.all_reduce(t, async_op=True)
        t.resize_(1 << 22)
        del work  # a dropped handle completes the work too
        assert torch.equal(t[:n], torch.full((n,), float(g.world_size)))
    axonn_c.comm.barrier()
    axonn_c.finalize()


def nested_and_overlapping():
    """Item 6: nested tensors and partially overlapping input/output views are refused with a
    named error on every rank (no scrambled result); the exact in-place all_reduce still works."""
    g = axonn_c.init(G_intra_c=world(), timeout=60)
    G = g.world_size
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    for args in ((nested, torch.ones(4)), (torch.ones(4 * G), nested)):
        try:
            axonn_c.comm.all_gather(*args)
        except TypeError as e:
            assert "nested" in str(e), e
        else:
            raise AssertionError("a nested tensor was accepted")
    buf = torch.zeros(5 * G)
    for out, inp in ((buf[:4 * G], buf[4 * G - 2:4 * G + 2]),  # partial overlap
                     (buf[1:1 + 4 * G], buf[:4])):
        try:
            axonn_c.comm.all_gather(out, inp)
        except ValueError as e:
            assert "overlap" in str(e), e
        else:
            raise AssertionError("overlapping views were accepted")
    t = torch.ones(8)
    axonn_c.comm.all_reduce(t)
    assert torch.equal(t, torch.full((8,), float(G)))
    axonn_c.finalize()


def init_cycles(n="100"):
    """Item 10: many init/finalize cycles without a torch process group (the store comes from
    MASTER_ADDR/MASTER_PORT) keep working."""
    for i in range(int(n)):
        g = axonn_c.init(G_intra_c=world(), timeout=60)
        x = torch.full((4,), float(i))
        axonn_c.comm.all_reduce(x)
        assert torch.equal(x, torch.full((4,), float(i * g.world_size))), (i, x)
        axonn_c.finalize()


def bench_skip_comm():
    """Item 13: AXONN_C_BENCH_SKIP=comm (set by the test) on the easy layout runs the layer
    without communication instead of reading an unfilled token-count array."""
    assert os.environ.get("AXONN_C_BENCH_SKIP") == "comm"
    for sizes in (dict(G_intra_c=world()), dict(G_intra_r=world()),
                  dict(G_intra_d=world())):
        axonn_c.init(timeout=60, **sizes)
        layer = axonn_c.Linear(16, 16)
        for rows in (4, 3):
            x = torch.randn(rows, 16, requires_grad=True)
            y = layer(x)
            assert y.shape == (rows, 16), y.shape
            y.sum().backward()
        axonn_c.finalize()


def stale_segment_swept(name):
    """Item 12: a segment left in /dev/shm by a dead rank 0 (the test made `name`, with a dead
    pid in it) is removed by the next init; live processes' segments are not touched."""
    axonn_c.init(G_intra_c=world(), timeout=60)
    axonn_c.comm.barrier()  # rank 0 swept before it published its segment
    assert not os.path.exists(f"/dev/shm/{name}"), name
    axonn_c.finalize()


def no_common_seed():
    """Item 5: ranks whose random streams differ when the model is built (no common seed) end
    with one model: full_state_dict is the same on every rank and the outputs are the serial
    model's (loaded from it), for the Linear's replicated bias and a plain LayerNorm."""
    for sizes in (dict(G_intra_c=world()), dict(G_intra_r=world()), dict(G_data=world())):
        g = axonn_c.init(timeout=60, **sizes)
        torch.manual_seed(1000 + g.rank)  # different on every rank
        torch.randn(g.rank * 7 + 1)  # and a rank-dependent number of draws
        model = torch.nn.Sequential(axonn_c.Linear(8, 16), torch.nn.LayerNorm(16),
                                    axonn_c.Linear(16, 8, transpose=True))
        with torch.no_grad():  # LayerNorm differs per rank, as after rank-dependent init
            model[1].weight.add_(torch.randn(16))
        x = torch.ones(4, 8) * torch.arange(8.0)
        model(x).sum().backward()
        axonn_c.sync_gradients(model)
        sd = axonn_c.full_state_dict(model)
        for k, v in sd.items():
            ref = v.clone().contiguous()
            axonn_c.comm.broadcast(ref, src=0)
            assert torch.equal(ref, v), (sizes, k, (ref - v).abs().max())
        serial = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                     torch.nn.Linear(16, 8))
        serial.load_state_dict(sd)
        with torch.no_grad():
            assert torch.allclose(model(x), serial(x), atol=1e-5), sizes
        axonn_c.finalize()


SCENARIOS = {f.__name__: f for f in (bad_timeout_with_pg, one_rank_fails_init,
                                     resize_during_async, nested_and_overlapping, init_cycles,
                                     bench_skip_comm, stale_segment_swept, no_common_seed)}


def main():
    name = sys.argv[1]
    SCENARIOS[name](*sys.argv[2:])
    print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
