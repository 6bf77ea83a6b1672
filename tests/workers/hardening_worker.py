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


SCENARIOS = {f.__name__: f for f in (bad_timeout_with_pg, one_rank_fails_init)}


def main():
    name = sys.argv[1]
    SCENARIOS[name](*sys.argv[2:])
    print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
