"""AxoNN's names in axonn_c's compatibility layer, on 4 ranks (launched by
tests/test_axonn_compat.py): axonn.init again with other sizes, comm_handle's groups laid out
like the grid, Drop/Gather, sync_gradients_depth_parallel, clear_weights_cache,
intra_layer.Embedding in AxoNN's layouts, and intra_layer.Conv2d against nn.Conv2d."""
import os
import sys

import torch
import torch.distributed as dist

import axonn_c
from axonn_c import axonn as ax
from axonn_c.intra_layer import (Conv2d, Drop, Embedding, Gather, Linear, clear_weights_cache,
                                 sync_gradients, sync_gradients_depth_parallel)
from axonn_c.intra_layer.communication import _drop, _gather

RANK = int(os.environ["RANK"])
KINDS = {"inner_intra_layer_parallel_group": "col", "outer_intra_layer_parallel_group": "row",
         "depth_intra_layer_parallel_group": "depth", "data_parallel_group": "data",
         "intra_layer_group": "intra"}


def check(cond, what):
    if not cond:
        print(f"rank {RANK}: FAILED {what}", file=sys.stderr, flush=True)
        sys.exit(1)


def check_groups(sizes):
    g = ax.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3])
    check((ax.config.G_data, ax.config.G_intra_r, ax.config.G_intra_c, ax.config.G_intra_d)
          == sizes, f"config after init{sizes}")
    check(ax.config.intra_layer_row_parallel_rank == g.row_rank, "config row rank")
    for attr, kind in KINDS.items():
        pg = getattr(ax.comm_handle, attr)
        check(dist.get_process_group_ranks(pg) == g.members(kind),
              f"{attr} on {sizes}: {dist.get_process_group_ranks(pg)} != {g.members(kind)}")
        check(getattr(ax.comm_handle, attr) is pg, f"{attr} made once")
    return g


def check_drop_gather():
    outer = ax.comm_handle.outer_intra_layer_parallel_group
    x = torch.arange(24.0).view(4, 6).requires_grad_()
    y = Gather.apply(Drop.apply(x, outer, 1), outer, 1)
    check(torch.equal(y, x), "Gather(Drop(x)) == x")
    y.backward(torch.ones_like(y))
    check(torch.equal(x.grad, torch.ones_like(x)), "Drop/Gather backward")
    n = dist.get_world_size(outer)
    check(_drop(x, 1, outer).shape == (4, 6 // n), "_drop shape")
    check(torch.equal(_gather(_drop(x.detach(), 0), 0), x.detach()), "_gather(_drop) world")


def check_depth_sync():
    """Expert Linear with bias on data 2 x depth 2: the depth-only sum, then sync_gradients,
    equals the serial gradients (the bias is not summed over depth twice)."""
    g = ax.init(G_data=2, G_intra_d=2)
    torch.manual_seed(3)
    X, dY = torch.randn(8, 6), torch.randn(8, 4)
    ref = torch.nn.Linear(6, 4)
    layer = Linear(6, 4, expert_mode=True)
    layer.load_state_dict(ref.state_dict())
    rows = slice((g.data_rank * 2 + g.depth_rank) * 2, (g.data_rank * 2 + g.depth_rank + 1) * 2)
    layer(X[rows]).backward(dY[rows])
    ref(X).backward(dY)
    sync_gradients_depth_parallel(layer)
    sync_gradients(layer)
    check(torch.allclose(layer.bias.grad, ref.bias.grad, atol=1e-6), "bias grad after depth "
          f"sync + sync_gradients: {layer.bias.grad} vs {ref.bias.grad}")
    full = _gather(layer.weight.grad, 0, ax.comm_handle.depth_intra_layer_parallel_group)
    check(torch.allclose(full.view(4, 6), ref.weight.grad, atol=1e-6), "weight grad")


def check_clear_cache():
    ax.init(G_intra_d=4)
    layer = Linear(8, 8)
    with axonn_c.optimize_communication(cache_weights=True):
        with torch.no_grad():
            layer(torch.randn(2, 8))
    clear_weights_cache()
    check(axonn_c.scheduler_stats()["alive_bytes"] == 0, "clear_weights_cache frees them")


def check_embedding(sizes, expert):
    """AxoNN's layouts: ids the same over the plane; expert output split over the row group
    (column group with transpose=True)."""
    g = ax.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2], G_intra_d=sizes[3])
    for transpose in (False, True):
        torch.manual_seed(5)
        ref = torch.nn.Embedding(13, 8)
        layer = Embedding(13, 8, expert_mode=expert, transpose=transpose,
                          init_method=lambda w: torch.nn.init.uniform_(w, -1, 1))
        full = layer.full_weight()
        check(float(full.abs().max()) <= 1 and float(full.std()) > 0.3, "init_method applied")
        layer.load_state_dict(ref.state_dict())
        ids = torch.randint(0, 13, (2 * g.G_intra_d * g.G_data, 3))
        shard = g.data_rank * g.G_intra_d + g.depth_rank
        mine = ids[2 * shard:2 * shard + 2]
        out = layer(mine)
        want = ref(mine).detach()
        if expert:
            grp = "col" if transpose else "row"
            n = {"row": g.G_intra_r, "col": g.G_intra_c}[grp]
            k = {"row": g.row_rank, "col": g.col_rank}[grp]
            want = want[..., k * 8 // n:(k + 1) * 8 // n]
        check(torch.allclose(out, want), f"Embedding expert={expert} transpose={transpose} on "
              f"{sizes}")
        check(layer.local_out_features == 8 and layer.local_in_features == layer.vocab_local,
              "Embedding local_in/out_features")


def check_conv():
    ax.init(G_intra_r=2, G_intra_c=2)
    torch.manual_seed(7)
    layer = Conv2d(4, 8, 3, padding=1)
    ref = torch.nn.Conv2d(4, 8, 3, padding=1)
    ref.load_state_dict(axonn_c.full_state_dict(layer))
    x = torch.randn(2, 4, 6, 6)  # the same on every rank (AxoNN's scatter_input)
    y = layer(x)
    check(torch.allclose(y, ref(x), atol=1e-5), "Conv2d easy forward vs nn.Conv2d")
    check((layer.local_in_channels, layer.local_out_channels) == (2, 4), "local channels")
    try:  # AxoNN's layer takes a batch; an unbatched input is refused, not split wrongly
        layer(x[0])
        check(False, "an unbatched input to intra_layer.Conv2d raises")
    except ValueError as e:
        check("[N, C, H, W]" in str(e), f"the message names the expected shape: {e}")
    return "conv: compared with nn.Conv2d"


def main():
    for sizes in ((1, 2, 2, 1), (1, 1, 2, 2), (2, 2, 1, 1), (1, 1, 1, 4), (4, 1, 1, 1)):
        check_groups(sizes)  # each a re-init with other sizes
        check_drop_gather()
    check_depth_sync()
    check_clear_cache()
    for sizes in ((1, 2, 2, 1), (1, 2, 1, 2), (2, 1, 2, 1)):
        for expert in (False, True):
            check_embedding(sizes, expert)
    conv = check_conv()
    axonn_c.finalize()
    dist.barrier()
    dist.destroy_process_group()
    if RANK == 0:
        print(f"axonn_compat_worker: ok ({conv})", flush=True)


if __name__ == "__main__":
    main()
