"""axonn_c.Sequential (cross-layer chunk pipelining) against serial PyTorch: outputs, input
gradients and parameter gradients over two SGD steps and a retained graph's second backward, on
grids where it pipelines and where it falls back to nn.Sequential; how many reductions were
held and that all were awaited; a nested block's Linears hold nothing; an in-place activation after a Linear; a backward that raises
midway, then a clean step; inference under no_grad. Run with a slow simulated link
(AXONN_C_SIM_US) so that a reduction that nobody awaited would be read unfinished."""
import os
import sys

import torch
import torch.utils.checkpoint
from torch import nn

import axonn_c
from axonn_c import chunking
from common import CallCount
from linear_worker import shard_of

H = 32


def close(got, want, what, tol=2e-5):
    got, want = got.double(), want.double()
    scale = want.abs().max().clamp_min(1e-12)
    if not torch.allclose(got / scale, want / scale, rtol=5 * tol, atol=tol):
        raise AssertionError(f"{what}: max |diff| {(got - want).abs().max().item():.3e}, "
                             f"scale {scale.item():.3e}")


class Boom(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("boom")
        return g


def build(chunks):
    """Linear(H, 2H) GELU Linear(2H, H, T) | a nested block | Linear(H, 2H) ReLU(inplace)
    Boom Linear(2H, H, T)."""
    torch.manual_seed(5)

    def lin(i, o, t=False):
        return axonn_c.Linear(i, o, transpose=t, expert_mode=True)
    return axonn_c.Sequential(
        lin(H, 2 * H), nn.GELU(), lin(2 * H, H, True),
        nn.Sequential(lin(H, 2 * H), nn.Tanh(), lin(2 * H, H, True)),
        lin(H, 2 * H), nn.ReLU(inplace=True), _BoomModule(), lin(2 * H, H, True),
        chunks=chunks)


class _BoomModule(nn.Module):
    def forward(self, x):
        return Boom.apply(x)


def serial_of(model):
    def lin(m):
        r = nn.Linear(m.in_features, m.out_features)
        with torch.no_grad():
            r.weight.copy_(m.full_weight())
            r.bias.copy_(m.full_bias())
        return r
    return nn.Sequential(lin(model[0]), nn.GELU(), lin(model[2]),
                         nn.Sequential(lin(model[3][0]), nn.Tanh(), lin(model[3][2])),
                         lin(model[4]), nn.ReLU(), lin(model[7]))


def linears(model):
    return [model[0], model[2], model[3][0], model[3][2], model[4], model[7]]


def expected_holds(model, chunks, pipelines):
    """(forward, backward) reductions held per step: a direct Linear child holds its forward
    all-reduce per chunk when its input group has several ranks, and its dX all-reduce (the
    input requires a gradient here) when its output group has."""
    if not pipelines:
        return 0, 0
    fwd = bwd = 0
    for i in (0, 2, 4, 7):
        s = model[i]._shapes
        fwd += chunks * (s["gin_size"] > 1)
        bwd += chunks * (s["gout_size"] > 1)
    return fwd, bwd


def check(g, chunks):
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} chunks {chunks} " \
           f"rank {g.rank}"
    model = build(chunks)
    ref = serial_of(model)
    pipelines = model._pipelines(torch.zeros(5, 1))
    assert pipelines == (g.G_intra_d == 1 and g.G_intra_r * g.G_intra_c > 1 and chunks > 1
                         and axonn_c.state.session.overlap_defaults["overlap_all_reduce"]), what
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    s0, s7 = model[0]._shapes, model[7]._shapes
    kin = slice(s0["gin_rank"] * s0["k_local"], (s0["gin_rank"] + 1) * s0["k_local"])
    kout = slice(s7["gout_rank"] * s7["n_local"], (s7["gout_rank"] + 1) * s7["n_local"])
    shards = g.G_data * g.G_intra_d
    T = 5 * shards  # 5 rows per rank: chunks of unequal size
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    tok = slice(blk * 5, (blk + 1) * 5)
    want_fwd, want_bwd = expected_holds(model, chunks, pipelines)
    for step in range(2):
        gen = torch.Generator().manual_seed(40 + step)
        X, dY = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
        x = X[tok][:, kin].clone().requires_grad_()
        h0 = axonn_c.scheduler_stats()["results_held"]
        y = model(x)
        h1 = axonn_c.scheduler_stats()["results_held"]
        assert h1 - h0 == want_fwd, f"{what}: forward held {h1 - h0}, expected {want_fwd}"
        y.backward(dY[tok][:, kout])
        st = axonn_c.scheduler_stats()
        assert st["results_held"] - h1 == want_bwd, \
            f"{what}: backward held {st['results_held'] - h1}, expected {want_bwd}"
        assert (st["results_done"] == st["results_held"] and not st["kept_results"]
                and not st["kept_outputs"]), \
            f"{what}: not every held result awaited: {st}"
        axonn_c.sync_gradients(model)
        Xr = X.clone().requires_grad_()
        yr = ref(Xr)
        yr.backward(dY)
        close(y, yr[tok][:, kout], f"{what} step {step} y")
        close(x.grad, Xr.grad[tok][:, kin], f"{what} step {step} dX")
        for m, r in zip(linears(model), [ref[0], ref[2], ref[3][0], ref[3][2], ref[4], ref[6]]):
            close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} step {step} dW")
            s = m._shapes
            rows = slice(s["gout_rank"] * s["n_local"], (s["gout_rank"] + 1) * s["n_local"])
            close(m.bias.grad, r.bias.grad[rows], f"{what} step {step} db")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # a retained graph's second backward: each pass sums its own chunks (2x the gradient)
    x = X[tok][:, kin].clone().requires_grad_()
    y = model(x)
    for _ in range(2):
        y.backward(dY[tok][:, kout], retain_graph=True)
    axonn_c.sync_gradients(model)
    Xr = X.clone().requires_grad_()
    yr = ref(Xr)
    for _ in range(2):
        yr.backward(dY, retain_graph=True)
    close(x.grad, Xr.grad[tok][:, kin], f"{what} twice dX")
    for m, r in zip(linears(model), [ref[0], ref[2], ref[3][0], ref[3][2], ref[4], ref[6]]):
        close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} twice dW")
    opt.zero_grad()
    ref_opt.zero_grad()
    # inference: nothing left held, same output as serial
    with torch.no_grad():
        y = model(X[tok][:, kin])
        close(y, ref(X)[tok][:, kout], f"{what} no_grad y")
    st = axonn_c.scheduler_stats()
    assert st["results_done"] == st["results_held"], f"{what}: no_grad left {st}"
    # a backward that raises midway (before the first children's dX were awaited), then a
    # clean step: nothing stale, nothing left in flight
    Boom.armed = True
    x = X[tok][:, kin].clone().requires_grad_()
    try:
        model(x).backward(dY[tok][:, kout])
        raise AssertionError(f"{what}: the backward did not raise")
    except RuntimeError as e:
        assert "boom" in str(e), e
    finally:
        Boom.armed = False
    opt.zero_grad()
    ref_opt.zero_grad()
    y = model(x)
    y.backward(dY[tok][:, kout])
    axonn_c.sync_gradients(model)
    Xr = X.clone().requires_grad_()
    ref(Xr).backward(dY)
    st = axonn_c.scheduler_stats()
    assert (st["results_done"] == st["results_held"] and not st["kept_results"]
            and not st["kept_outputs"]), f"{what}: after the raised backward: {st}"
    for m, r in zip(linears(model), [ref[0], ref[2], ref[3][0], ref[3][2], ref[4], ref[6]]):
        close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} after raise dW")


REFS = (0, 2, (3, 0), (3, 2), 4, 6)  # serial_of's Linears, in linears() order


def ref_linears(ref):
    return [ref[i] if isinstance(i, int) else ref[i[0]][i[1]] for i in REFS]


def setup(g, chunks, rows_of=lambda data_rank: 5, dtype=None):
    """(model, serial, sharded input slice, output slice, token slice, T) for this rank; the data
    ranks' token counts come from rows_of."""
    model = build(chunks)
    if dtype is not None:
        model.to(dtype)
    ref = serial_of(model)
    s0, s7 = model[0]._shapes, model[7]._shapes
    kin = slice(s0["gin_rank"] * s0["k_local"], (s0["gin_rank"] + 1) * s0["k_local"])
    kout = slice(s7["gout_rank"] * s7["n_local"], (s7["gout_rank"] + 1) * s7["n_local"])
    counts = [rows_of(d) for d in range(g.G_data) for _ in range(g.G_intra_d)]
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    start = sum(counts[:blk])
    return model, ref, kin, kout, slice(start, start + counts[blk]), sum(counts)


def chain(seed, chunks):
    """Four expert Linear children, each pair normal then transposed, no activation between."""
    torch.manual_seed(seed)

    def lin(i, o, t=False):
        return axonn_c.Linear(i, o, transpose=t, expert_mode=True)
    return axonn_c.Sequential(lin(H, 2 * H), lin(2 * H, H, True), lin(H, 2 * H),
                              lin(2 * H, H, True), chunks=chunks)


def chain_case(seed, chunks):
    """chain(), its serial copy, and this rank's input and output feature slices."""
    model = chain(seed, chunks)
    ref = nn.Sequential(*(nn.Linear(m.in_features, m.out_features) for m in model))
    with torch.no_grad():
        for r, m in zip(ref, model):
            r.weight.copy_(m.full_weight())
            r.bias.copy_(m.full_bias())
    s0, s3 = model[0]._shapes, model[3]._shapes
    kin = slice(s0["gin_rank"] * s0["k_local"], (s0["gin_rank"] + 1) * s0["k_local"])
    kout = slice(s3["gout_rank"] * s3["n_local"], (s3["gout_rank"] + 1) * s3["n_local"])
    return model, ref, kin, kout


def check_interleave(g):
    """In a chain of Linear children, a chunk's dX all-reduce is awaited only after the other
    chunk's backward of the same layer has started its own: two in flight at some await. (An
    await right after each layer's backward, e.g. with the awaiting node made just before the
    child runs, never has two: autograd runs the newest ready node first.)"""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} interleave rank {g.rank}"
    model = chain(8, chunks=2)
    x = torch.randn(6, model[0]._shapes["k_local"], requires_grad=True)
    y = model(x)
    in_flight = []  # at each backward await: dX all-reduces held and not yet awaited
    real_await = chunking._await

    def logged(t):
        held, done = axonn_c._C.sched_counters()[1:]
        in_flight.append(held - done)
        real_await(t)
    chunking._await = logged
    try:
        y.square().sum().backward()
    finally:
        chunking._await = real_await
    assert in_flight and max(in_flight) >= 2, f"{what}: not interleaved: {in_flight}"


def check_chunk_records(g):
    """The chunks of a pass accumulate each weight's gradient in the dW GEMM: nothing reaches
    autograd for the weights, and on a data grid a full bucket starts its sum during backward,
    as soon as the last chunk of its layers has written (not only when backward ends). A
    regulariser on one weight (an autograd gradient in the same pass) is added, not lost."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} records rank {g.rank}"
    model, ref, kin, kout = chain_case(12, chunks=3)
    gen = torch.Generator().manual_seed(13)
    T = 7 * g.G_data
    X, dY = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    R = torch.randn(ref[1].weight.shape, generator=gen)
    tok = slice(g.data_rank * 7, (g.data_rank + 1) * 7)
    autograd_dw = []
    handles = [m.weight.register_hook(lambda d: autograd_dw.append(d is not None) or None)
               for m in model]
    finishes = CallCount(axonn_c._C.grad_finishes)
    # buckets whose sums started at their pass's last chunk (before finish(), not by it)
    after_holds = axonn_c.scheduler_stats()["buckets_after_holds"]
    finishes.clear()
    try:
        y = model(X[tok][:, kin].clone().requires_grad_())
        reg = (model[1].weight * shard_of(R, model[1])).sum() / g.G_data
        ((y * dY[tok][:, kout]).sum() + reg).backward()
        # once, at the end: no chunk call found its record closed (a lost chunk count)
        assert len(finishes) == 1, f"{what}: finish() ran {len(finishes)} times in backward"
    finally:
        for h in handles:
            h.remove()
    early = axonn_c.scheduler_stats()["buckets_after_holds"] - after_holds
    axonn_c.sync_gradients(model)
    ((ref(X) * dY).sum() + (ref[1].weight * R).sum()).backward()
    for m, r in zip(model, ref):
        close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} dW")
    # (the regulariser's gradient is the one autograd hands to a weight hook)
    assert sum(autograd_dw) <= 1, f"{what}: chunk dW reached autograd: {autograd_dw}"
    if g.G_data > 1:
        assert early > 0, f"{what}: no weight bucket's sum started at its last chunk"
    assert axonn_c.scheduler_stats()["chunk_records_open"] == 0, what
    assert axonn_c._C.grad_buckets_open() == 0, what


def check_checkpoint(g):
    """The container inside torch.utils.checkpoint(use_reentrant=False) pipelines, in the
    forward and in backward's recomputation, with the recomputation's early stop on and off:
    the gradients are the serial ones, and each weight's chunk record completes at its last
    chunk's backward (the recomputation's calls are not counted). The early stop raises from
    autograd's Function.apply after a child's forward issued its held all-reduce: the output
    being dropped must not be freed while that all-reduce writes it (it corrupted memory on the
    row grid)."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} checkpoint rank {g.rank}"
    gen = torch.Generator().manual_seed(15)
    X, dY = torch.randn(5 * g.G_data, H, generator=gen), torch.randn(5 * g.G_data, H, generator=gen)
    tok = slice(g.data_rank * 5, (g.data_rank + 1) * 5)
    completed = []  # chunk records completed during backward (not left to finish())
    real_backward = axonn_c.linear._backward_impl

    def backward(*args, **kwargs):
        out = real_backward(*args, **kwargs)
        param = args[6] if len(args) > 6 else kwargs.get("param")
        hold = args[5] if len(args) > 5 else kwargs.get("hold", 0)
        if param is not None and hold & axonn_c.linear.HOLD_CHUNK:  # a chunk call's deferred
            completed.append(not axonn_c.grads.chunk_open(param))  # gradient: its part is done
        return out

    for early_stop in (True, False, True):
        model, ref, kin, kout = chain_case(14, chunks=2)
        held = axonn_c.scheduler_stats()["results_held"]
        completed.clear()
        axonn_c.linear._backward_impl = backward
        try:
            with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
                y = torch.utils.checkpoint.checkpoint(model, X[tok][:, kin], use_reentrant=False)
                (y * dY[tok][:, kout]).sum().backward()
        finally:
            axonn_c.linear._backward_impl = real_backward
        axonn_c.sync_gradients(model)
        assert axonn_c.scheduler_stats()["results_held"] > held, f"{what}: not pipelined"
        # (the recomputation's chunk calls do not count: each record completes at its last
        # chunk's backward)
        assert sum(completed) == len(model), f"{what}: records completed early: {completed}"
        (ref(X) * dY).sum().backward()
        for m, r in zip(model, ref):
            assert m.weight.grad is not None, f"{what}: no dW"
            close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} early_stop={early_stop} dW")
    assert not axonn_c.scheduler_stats()["kept_outputs"], f"{what}: outputs still kept"


def check_uses(g):
    """Uses the container cannot see: a forward hook that replaces a Linear child's output (that
    child then holds nothing), a second consumer of an intermediate (an auxiliary loss on the
    GELU's output: its gradient joins the child's dX, which must be awaited first), two
    forwards before one backward, and uneven data-parallel batches (a rank with one row)."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} uses rank {g.rank}"
    model, ref, kin, kout, tok, T = setup(g, 2, rows_of=lambda d: 5 if d == 0 else 1)
    gen = torch.Generator().manual_seed(77)
    X1, X2 = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    D1, D2 = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    aux, aux_ref = [], []
    model[1].register_forward_hook(lambda m, i, o: aux.append(o))
    ref[1].register_forward_hook(lambda m, i, o: aux_ref.append(o))
    model[4].register_forward_hook(lambda m, i, o: o * 1.0)
    if g.rank == 0:  # a hook on one rank only (activation statistics): the chunk order must
        model[0].register_forward_hook(lambda m, i, o: None)  # not change with it
    x1 = X1[tok][:, kin].clone().requires_grad_()
    x2 = X2[tok][:, kin].clone()
    y1, y2 = model(x1), model(x2)
    a = torch.cat(aux)
    ((y1 * D1[tok][:, kout]).sum() + (y2 * D2[tok][:, kout]).sum()
     + 0.1 * a.square().sum()).backward()
    axonn_c.sync_gradients(model)
    Xr = X1.clone().requires_grad_()
    yr1, yr2 = ref(Xr), ref(X2)
    ar = torch.cat(aux_ref)
    ((yr1 * D1).sum() + (yr2 * D2).sum() + 0.1 * ar.square().sum()).backward()
    close(y1, yr1[tok][:, kout], f"{what} y")
    close(x1.grad, Xr.grad[tok][:, kin], f"{what} dX")
    for m, r in zip(linears(model), ref_linears(ref)):
        close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} dW")
    st = axonn_c.scheduler_stats()
    assert st["results_done"] == st["results_held"], f"{what}: {st}"
    # the same layers unchunked (their weights now carry the data-sum hook of the chunked path,
    # and take the deferred-gradient path again)
    model.chunks = 1
    model.zero_grad()
    ref.zero_grad()
    y1 = model(x1)
    (y1 * D1[tok][:, kout]).sum().backward()
    axonn_c.sync_gradients(model)
    ref(Xr).mul(D1).sum().backward()
    for m, r in zip(linears(model), ref_linears(ref)):
        close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} unchunked after chunked dW")


def check_sync_then_no_sync(g):
    """A backward whose gradients are summed over data while it runs, then a micro-batch under
    no_grad_sync, then sync_gradients: the unsummed second part joins sums already made (the
    gradient hook of the chunked path un-sums them before autograd adds to them; the deferred
    path sums the new part too)."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} no_sync rank {g.rank}"
    model, ref, kin, kout, tok, T = setup(g, 2)
    gen = torch.Generator().manual_seed(79)
    for k in range(2):
        X, dY = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
        if k == 0:
            model(X[tok][:, kin]).backward(dY[tok][:, kout])
        else:
            with axonn_c.no_grad_sync():
                model(X[tok][:, kin]).backward(dY[tok][:, kout])
        ref(X).backward(dY)
    axonn_c.sync_gradients(model)
    for m, r in zip(linears(model), ref_linears(ref)):
        close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} dW")
        s = m._shapes
        rows = slice(s["gout_rank"] * s["n_local"], (s["gout_rank"] + 1) * s["n_local"])
        close(m.bias.grad, r.bias.grad[rows], f"{what} db")


def check_forward_backward(g):
    """axonn_c.forward_backward in 2 and 3 micro-batches against one serial backward of the whole
    batch (uneven data ranks: one has a single row, so some of its pieces are empty): the loss,
    every .grad after sync_gradients, and every held reduction awaited. Where the container
    pipelines, the next piece's forward runs inside the backward (child calls counted there);
    a backward that raises with the next forward half done, then a clean step."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} fwd_bwd rank {g.rank}"
    model, ref, kin, kout, tok, T = setup(g, 2, rows_of=lambda d: 7 if d == 0 else 1)
    gen = torch.Generator().manual_seed(81)
    inside, real_next = [], chunking._Lookahead._next
    finishes = CallCount(axonn_c._C.grad_finishes)

    def counted(self):
        inside.append(torch._C._current_graph_task_id() != -1)
        return real_next(self)

    chunking._Lookahead._next = counted  # (finishes: what the end of backward calls)
    # container hooks: a forward hook on rank 0 only (statistics), which must not change the
    # collectives' order, and a pre-hook on every rank that replaces the input (x 2, of an
    # input halved below), which every piece must see
    seen = []
    hooks = [model.register_forward_pre_hook(lambda m, args: (args[0] * 2,))]
    if g.rank == 0:
        hooks.append(model.register_forward_hook(lambda m, args, out: seen.append(out.shape[0])))
    try:
        for micro in (2, 3, 1):
            X, dY = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
            model.zero_grad()
            ref.zero_grad()
            inside.clear()
            finishes.clear()
            seen.clear()
            x2 = X[tok][:, kin] / 2
            loss = axonn_c.forward_backward(model, (x2, dY[tok][:, kout]),
                                            lambda y, d: (y * d).sum(), micro_batches=micro)
            assert g.rank != 0 or len(seen) == micro, f"{what}: forward hook ran {seen}"
            # once per pass: the chunk calls made ahead count for the next pass, not this one
            # (miscounted, a weight's record would complete early and its next chunk finish all)
            assert len(finishes) == micro, f"{what}: finish() ran {len(finishes)} times"
            axonn_c.sync_gradients(model)
            ref_loss = (ref(X) * dY).sum()
            ref_loss.backward()
            case = f"{what} micro={micro}"
            if g.G_intra_r * g.G_intra_c == 1:  # (the loss is summed over the output group)
                axonn_c.comm.all_reduce(loss, "world")
                close(loss, ref_loss.detach(), f"{case} loss")
            for m, r in zip(linears(model), ref_linears(ref)):
                close(m.weight.grad, shard_of(r.weight.grad, m), f"{case} dW")
            st = axonn_c.scheduler_stats()
            assert st["results_done"] == st["results_held"], f"{case}: {st}"
            if micro > 1 and model._pipelines(X[tok][:, kin]):
                assert any(inside), f"{case}: no forward ran inside a backward: {inside}"
            else:
                assert not inside, f"{case}: looked ahead where it does not pipeline"
    finally:
        chunking._Lookahead._next = real_next
        for h in hooks:
            h.remove()
    X, dY = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    Boom.armed = True
    try:
        axonn_c.forward_backward(model, (X[tok][:, kin], dY[tok][:, kout]),
                                 lambda y, d: (y * d).sum(), micro_batches=2)
        raise AssertionError(f"{what}: the backward did not raise")
    except RuntimeError as e:
        assert "boom" in str(e), e
    finally:
        Boom.armed = False
    st = axonn_c.scheduler_stats()
    assert st["results_done"] == st["results_held"], f"{what} after boom: {st}"
    assert getattr(axonn_c.state.session.thread, "pass_", None) is None, f"{what}: tag left set after boom"
    model.zero_grad()
    ref.zero_grad()
    axonn_c.forward_backward(model, (X[tok][:, kin], dY[tok][:, kout]),
                             lambda y, d: (y * d).sum(), micro_batches=2)
    axonn_c.sync_gradients(model)
    (ref(X) * dY).sum().backward()
    for m, r in zip(linears(model), ref_linears(ref)):
        close(m.weight.grad, shard_of(r.weight.grad, m), f"{what} after boom dW")


class _OtherBackward(torch.autograd.Function):
    """Identity whose backward first runs `run` (once): another graph's forward and backward,
    run while forward_backward's backward is running."""
    run = None

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        run, _OtherBackward.run = _OtherBackward.run, None
        if run is not None:
            with torch.enable_grad():
                run()
        return g


def check_lookahead_own_pass(g):
    """A backward of another graph (its own axonn_c.Sequential) run from inside the first
    micro-batch's backward leaves the look-ahead alone: only the micro-batch's own backward
    advances the next one's forward. Run as a plain backward, and as a forward_backward of its
    own (nested: it looks ahead too, advancing only its own). Both graphs' gradients right."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} own pass rank {g.rank}"
    model, ref, kin, kout, tok, T = setup(g, 2)
    other, other_ref, okin, okout = chain_case(83, 2)
    gen = torch.Generator().manual_seed(84)
    blocks = g.G_data * g.G_intra_d  # (token shards: 4 rows each, as in setup)
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    mine = slice(4 * blk, 4 * (blk + 1))
    advanced, real_advance = [], chunking._Lookahead.advance

    def counted(self):
        advanced.append(self)
        real_advance(self)
    chunking._Lookahead.advance = counted
    try:
        for nested in (False, True):
            case = f"{what} nested={nested}"
            X, dY = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
            Xo = torch.randn(4 * blocks, H, generator=gen)
            dYo = torch.randn(4 * blocks, H, generator=gen)
            for m in (model, ref, other, other_ref):
                m.zero_grad()
            window = []  # (first, end) of the advances made while the other graph ran

            def other_step():
                first = len(advanced)
                if nested:
                    axonn_c.forward_backward(other, (Xo[mine][:, okin], dYo[mine][:, okout]),
                                             lambda y, d: (y * d).sum(), micro_batches=2)
                else:
                    other(Xo[mine][:, okin]).backward(dYo[mine][:, okout])
                window.append((first, len(advanced)))
            advanced.clear()
            _OtherBackward.run = other_step
            axonn_c.forward_backward(model, (X[tok][:, kin], dY[tok][:, kout]),
                                     lambda y, d: (_OtherBackward.apply(y) * d).sum(),
                                     micro_batches=2)
            assert len(window) == 1, f"{case}: the other graph ran {len(window)} times"
            assert getattr(axonn_c.state.session.thread, "pass_", None) is None, f"{case}: tag left set"
            a, b = window[0]
            inside, outside = advanced[a:b], advanced[:a] + advanced[b:]
            assert not {id(x) for x in inside} & {id(x) for x in outside}, \
                f"{case}: the other graph's backward advanced this one's look-ahead"
            if model._pipelines(X[tok][:, kin]):
                assert outside, f"{case}: the own backward never advanced the look-ahead"
                assert bool(inside) == nested, f"{case}: {len(inside)} advances inside"
            axonn_c.sync_gradients(model)
            axonn_c.sync_gradients(other)
            (ref(X) * dY).sum().backward()
            other_ref(Xo).backward(dYo)
            for m, r in zip(linears(model), ref_linears(ref)):
                close(m.weight.grad, shard_of(r.weight.grad, m), f"{case} dW")
            for m, r in zip(other, other_ref):
                close(m.weight.grad, shard_of(r.weight.grad, m), f"{case} other dW")
    finally:
        chunking._Lookahead.advance = real_advance
        _OtherBackward.run = None


def check_easy_uneven(g):
    """Easy-layout children (the default layout: every rank its own tokens, counts may differ):
    each rank splits its rows into exactly `chunks` pieces, some empty, so every rank makes the
    same calls."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} easy rank {g.rank}"
    torch.manual_seed(9)
    l1, l2 = axonn_c.Linear(H, 2 * H), axonn_c.Linear(2 * H, H)
    model = axonn_c.Sequential(l1, nn.GELU(), l2, chunks=3)
    ref = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
    with torch.no_grad():
        for r, m in ((ref[0], l1), (ref[2], l2)):
            r.weight.copy_(m.full_weight())
            r.bias.copy_(m.full_bias())
    x = torch.randn(1 + g.rank % 3, H, generator=torch.Generator().manual_seed(g.rank))
    close(model(x), ref(x), f"{what} y")


def check_autocast(g):
    """bfloat16 weights, a float32 input under autocast: the Linear child at position 1 casts
    its input, so it must not hold dX (autograd's cast reads dX before anyone could await it)."""
    what = f"grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} autocast rank {g.rank}"
    torch.manual_seed(6)
    l1 = axonn_c.Linear(H, 2 * H, expert_mode=True, dtype=torch.bfloat16)
    l2 = axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True, dtype=torch.bfloat16)
    model = axonn_c.Sequential(nn.Identity(), l1, nn.GELU(), l2, chunks=2)
    ref = serial_of_pair(l1, l2)
    s1, s2 = l1._shapes, l2._shapes
    kin = slice(s1["gin_rank"] * s1["k_local"], (s1["gin_rank"] + 1) * s1["k_local"])
    kout = slice(s2["gout_rank"] * s2["n_local"], (s2["gout_rank"] + 1) * s2["n_local"])
    gen = torch.Generator().manual_seed(78)
    X, dY = torch.randn(6, H, generator=gen), torch.randn(6, H, generator=gen)
    x = X[:, kin].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    (y.float() * dY[:, kout]).sum().backward()
    Xr = X.clone().requires_grad_()
    (ref(Xr) * dY).sum().backward()
    close(x.grad, Xr.grad[:, kin], f"{what} dX", tol=3e-2)


def serial_of_pair(l1, l2):
    def lin(m):
        r = nn.Linear(m.in_features, m.out_features)
        with torch.no_grad():
            r.weight.copy_(m.full_weight().float())
            r.bias.copy_(m.full_bias().float())
        return r
    return nn.Sequential(lin(l1), nn.GELU(), lin(l2))


def main():
    world = int(os.environ["WORLD_SIZE"])
    grids = [(1, 1, world, 1), (1, world, 1, 1), (world, 1, 1, 1), (1, 1, 1, world)]
    if world == 4:
        grids += [(1, 2, 2, 1), (2, 1, 2, 1), (1, 2, 1, 2)]
    for sizes in grids:
        g = axonn_c.init(*sizes, overlap=True, bucket_size=H * H * 4)
        for chunks in (2, 3):
            check(g, chunks)
        check_uses(g)
        check_forward_backward(g)
        check_lookahead_own_pass(g)
        check_easy_uneven(g)
        if g.G_data > 1:
            check_sync_then_no_sync(g)
        if g.G_intra_d == 1 and g.G_intra_r * g.G_intra_c > 1:
            check_interleave(g)
            check_chunk_records(g)
            check_checkpoint(g)
        if g.G_data == 1 and g.G_intra_d == 1:
            check_autocast(g)
        axonn_c.finalize()
    g = axonn_c.init(1, 1, world, 1, overlap=False)  # overlap off: plain nn.Sequential
    check(g, 2)
    axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print(f"world {world}: pipeline checks pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
