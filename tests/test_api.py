"""Single-process API: init/finalize, the grid, errors that name the numbers, world-1
collectives, argument validation, build info."""
import os
import threading
import time

import pytest
import torch

import axonn_c


pytestmark = pytest.mark.usefixtures("world_of_one")


def test_world_of_one_grid_and_members():
    g = axonn_c.init()
    assert (g.G_data, g.G_intra_r, g.G_intra_c, g.G_intra_d) == (1, 1, 1, 1)
    assert (g.rank, g.data_rank, g.depth_rank, g.row_rank, g.col_rank) == (0, 0, 0, 0, 0)
    assert "shm" in g.backends
    for name in ("col", "row", "depth", "data", "intra", "world"):
        assert g.members(name) == [0]
    assert axonn_c.grid() == g
    assert axonn_c.is_initialized()


def test_members_follow_column_fastest_order():
    # pure grid math for a 2x2x2x2 grid, seen from rank 13 = (data 1, depth 1, row 0, col 1)
    members = lambda name: axonn_c._C.grid_members(2, 2, 2, 2, 13, name)  # noqa: E731
    assert members("col") == [12, 13]
    assert members("row") == [13, 15]
    assert members("depth") == [9, 13]
    assert members("data") == [5, 13]
    assert members("intra") == list(range(8, 16))
    assert members("world") == list(range(16))
    with pytest.raises(ValueError, match="unknown group 'rows'"):
        members("rows")


@pytest.mark.parametrize("sizes,message", [
    (dict(G_intra_r=2), r"= 2 ranks does not match the world size 1"),
    (dict(G_data=0), r"G_data=0"),
    (dict(G_intra_c=-2), r"G_intra_c=-2"),
    (dict(G_inter=2), r"G_inter=2"),
])
def test_bad_grids_raise_with_the_numbers(sizes, message):
    with pytest.raises(ValueError, match=message):
        axonn_c.init(**sizes)
    assert not axonn_c.is_initialized()


def test_wrong_types_and_backend():
    with pytest.raises(TypeError, match="G_data must be an int"):
        axonn_c.init(G_data=1.0)
    with pytest.raises(ValueError, match="backend='gloo'"):
        axonn_c.init(backend="gloo")
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        axonn_c.init(timeout=0)


def test_use_before_init_raises():
    with pytest.raises(RuntimeError, match="not initialised"):
        axonn_c.grid()
    with pytest.raises(RuntimeError, match="not initialised"):
        axonn_c.comm.all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError, match="not initialised"):
        axonn_c.comm_stats()


def test_init_twice_same_is_noop_different_raises(monkeypatch):
    axonn_c.init()
    axonn_c.init()  # same sizes: fine
    with pytest.raises(RuntimeError, match=r"already initialised .* G_data=1"):
        axonn_c._C.init(rank=0, world_size=2, local_rank=0, local_world_size=2, G_data=2,
                        G_intra_r=1, G_intra_c=1, G_intra_d=1, G_inter=1, backend=None,
                        job_id="", timeout=1.0, cuda_device=-1, store_set=None, store_get=None)


def test_reinit_with_another_transport_raises():
    """A repeated init keeps the communicators, so asking for another backend or timeout is an
    error naming both (not the old ones in silence); leaving them out keeps the first's."""
    axonn_c.init(timeout=30)
    axonn_c.init()  # (no timeout asked for: the first's stands)
    axonn_c.init(timeout=30, backend=axonn_c.grid().backends)
    with pytest.raises(RuntimeError, match=r"timeout=30 s; .*finalize\(\).*timeout=60 s"):
        axonn_c.init(timeout=60)
    with pytest.raises(RuntimeError, match=r"backend=None \(in use: 'shm'\).*backend='nccl'"):
        axonn_c.init(backend="nccl")
    axonn_c.finalize()
    axonn_c.init(timeout=60)  # (after finalize: anything)


@pytest.mark.parametrize("kw, match", [
    (dict(prefetch=True), "prefetch .* must be an int, got bool"),
    (dict(fwd_chunks=True), "fwd_chunks must be an int, got bool"),
    (dict(prefetch_budget=1.5), "prefetch_budget .* must be an int, got float"),
    (dict(prefetch_budget=0), r"prefetch_budget .* must be >= 1, got 0"),
    (dict(fwd_chunks=65), r"fwd_chunks must be in \[1, 64\], got 65")])
def test_init_knobs_refuse_bools_and_out_of_range(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        axonn_c.init(**kw)
    assert not axonn_c._C.is_initialized()


@pytest.mark.parametrize("kw, match", [
    (dict(expert_mode="False"), "sync_gradients: expert_mode must be a bool or None, got 'False'"),
    (dict(mean="no"), "sync_gradients: mean must be a bool, got 'no'"),
    (dict(vectorize=1), "sync_gradients: vectorize must be a bool, got 1")])
def test_sync_gradients_refuses_non_bool_flags(kw, match):
    """(was: bool(value), so the string "False" chose the expert layout)"""
    axonn_c.init()
    with pytest.raises(TypeError, match=match):
        axonn_c.sync_gradients(torch.nn.Linear(2, 2), **kw)


def test_bool_flags_take_numpy_bools():
    """A numpy bool (a flag read from a config array) is a bool; a numpy int is not."""
    import numpy as np

    axonn_c.init()
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    axonn_c.sync_gradients(model, mean=np.bool_(True), vectorize=np.bool_(False))
    with pytest.raises(TypeError, match="sync_gradients: mean must be a bool, got"):
        axonn_c.sync_gradients(model, mean=np.int64(1))


def test_broadcast_src_refuses_a_bool():
    axonn_c.init()
    with pytest.raises(TypeError, match="broadcast src .* must be an int, got bool"):
        axonn_c.comm.broadcast(torch.ones(2), src=True)


def test_init_inside_a_context_is_not_undone_on_exit():
    """A repeated init() on the same grid inside optimize_communication sets its own settings;
    the context's exit does not put the ones from before it back (was: only a new grid's init
    counted, so the inner init's compression and scheduler settings were undone)."""
    from axonn_c.state import session

    axonn_c.init(compression=None, prefetch=1)
    with axonn_c.optimize_communication(compression={"data": "int4"}):
        axonn_c.init(compression={"data": "int8", "depth": "bf16"}, prefetch=3)
    assert session.compression["data"][0] == "int8" and session.compression["depth"][0] == "bf16"
    assert session.sched_config[0] == 3
    with axonn_c.optimize_communication(compression={"data": "int4"}):
        assert session.compression["data"][0] == "int4"
    assert session.compression["data"][0] == "int8"  # (no init inside: restored)


def test_concurrent_init_waits_for_the_first(monkeypatch):
    """A second thread's init() while the first waits for the ranks (the C init lets go of the
    interpreter lock) waits for the first's outcome and returns the same grid; it does not
    open a communicator of its own."""
    real_init = axonn_c._C.init
    opened_while_closed, second_started = [], threading.Event()

    def slow_init(**kw):
        opened_while_closed.append(not axonn_c._C.is_initialized())
        if len(opened_while_closed) == 1:  # the first caller: let the second one in meanwhile
            second_started.wait(30)
            time.sleep(0.3)
        return real_init(**kw)

    monkeypatch.setattr(axonn_c._C, "init", slow_init)
    grids, errors = [None, None], []

    def call(i):
        try:
            if i == 1:
                second_started.set()
            grids[i] = axonn_c.init()
        except BaseException as e:  # (reported below)
            errors.append(e)

    first = threading.Thread(target=call, args=(0,))
    first.start()
    while not opened_while_closed and first.is_alive():
        time.sleep(0.01)
    second = threading.Thread(target=call, args=(1,))
    second.start()
    first.join(60), second.join(60)
    assert not errors, errors
    assert opened_while_closed == [True, False], opened_while_closed  # one communicator
    assert grids[0] == grids[1] == axonn_c.grid()


def test_init_finalize_repeat():
    for _ in range(5):
        axonn_c.init()
        x = torch.arange(4.0)
        axonn_c.comm.all_reduce(x)
        assert torch.equal(x, torch.arange(4.0))
        axonn_c.finalize()
        assert not axonn_c.is_initialized()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   torch.uint8])
def test_world_one_collectives_are_identity(dtype):
    axonn_c.init()
    x = (torch.arange(7) % 5).to(dtype)
    for op in ("sum", "avg", "max"):
        y = x.clone()
        axonn_c.comm.all_reduce(y, group="depth", op=op)
        assert torch.equal(y, x)
    out = torch.empty_like(x)
    axonn_c.comm.all_gather(out, x, group="col")
    assert torch.equal(out, x)
    axonn_c.comm.reduce_scatter(out, x, group="row")
    assert torch.equal(out, x)
    axonn_c.comm.all_to_all(out, x, group="data")
    assert torch.equal(out, x)
    y = x.clone()
    work = axonn_c.comm.broadcast(y, src=0, group="intra", async_op=True)
    assert isinstance(work, axonn_c.Work)
    work.wait()
    assert work.is_completed() and torch.equal(y, x)
    axonn_c.comm.barrier()
    stats = axonn_c.comm_stats()
    assert set(stats) == {"col", "row", "depth", "data", "intra", "world"}
    assert all(s["bytes_sent"] == 0 and s["bytes_recv"] == 0 for s in stats.values())
    assert stats["depth"]["calls"] == 3
    axonn_c.reset_comm_stats()
    assert axonn_c.comm_stats()["depth"]["calls"] == 0


def test_bad_tensors_are_rejected_with_reasons():
    axonn_c.init()
    with pytest.raises(ValueError, match="contiguous"):
        axonn_c.comm.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="float64|dtype"):
        axonn_c.comm.all_reduce(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="same dtype"):
        axonn_c.comm.all_gather(torch.empty(3), torch.ones(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="output has 5 elements, expected 3"):
        axonn_c.comm.all_gather(torch.empty(5), torch.ones(3))
    with pytest.raises(ValueError, match="unsupported reduction 'min'"):
        axonn_c.comm.all_reduce(torch.ones(3), op="min")
    with pytest.raises(ValueError, match="unknown group"):
        axonn_c.comm.all_reduce(torch.ones(3), group="pipeline")
    with pytest.raises(ValueError, match="root 1 is outside the world group of size 1"):
        axonn_c.comm.broadcast(torch.ones(3), src=1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        axonn_c.comm.all_reduce([1.0, 2.0])


def test_build_info_reports_what_was_compiled():
    info = axonn_c.build_info()
    for key in ("summary", "cuda_compiled", "nccl_compiled", "cuda_runtime", "nccl_runtime",
                "torch"):
        assert key in info
    assert info["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert "unavailable" in str(info["cuda_runtime"])


def test_refused_reinit_changes_no_setting():
    from axonn_c.state import session

    axonn_c.init()
    defaults, buckets = dict(session.overlap_defaults), session.bucket_bytes
    c_buckets = axonn_c._C.grad_bucket_bytes()
    with pytest.raises(RuntimeError, match="already initialised"):
        axonn_c.init(G_data=2, overlap=True, bucket_size=123)
    assert session.overlap_defaults == defaults and session.bucket_bytes == buckets
    assert axonn_c._C.grad_bucket_bytes() == c_buckets
    axonn_c.init(overlap=True, bucket_size=1 << 20)  # the same grid: the new settings apply
    assert session.overlap_defaults["overlap_data"] and session.bucket_bytes == 1 << 20
