"""A 4-rank CPU demo of the foundation: the 4D grid and collectives over its groups.

    torchrun --standalone --nproc_per_node 4 examples/demo_collectives.py

Each rank prints its coordinates and groups, then runs one collective per group and checks the
result against what the group's members contributed.
"""
import argparse

import torch

import axonn_c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--G-data", type=int, default=1)
    p.add_argument("--G-intra-r", type=int, default=2)
    p.add_argument("--G-intra-c", type=int, default=2)
    p.add_argument("--G-intra-d", type=int, default=1)
    a = p.parse_args()
    g = axonn_c.init(G_data=a.G_data, G_intra_r=a.G_intra_r, G_intra_c=a.G_intra_c,
                     G_intra_d=a.G_intra_d)
    for r in range(g.world_size):  # print in rank order
        if r == g.rank:
            print(f"rank {g.rank}: data={g.data_rank} depth={g.depth_rank} row={g.row_rank} "
                  f"col={g.col_rank}  col group {g.members('col')}  row group {g.members('row')}"
                  f"  backend {g.backends}", flush=True)
        axonn_c.comm.barrier()

    # all_reduce over the column group: the sum of the members' ranks
    x = torch.full((1000,), float(g.rank))
    axonn_c.comm.all_reduce(x, group="col")
    assert torch.all(x == sum(g.members("col")))

    # all_gather over the row group, asynchronously
    mine = torch.full((3,), float(g.rank))
    out = torch.empty(3 * g.G_intra_r)
    work = axonn_c.comm.all_gather(out, mine, group="row", async_op=True)
    work.wait()
    assert out.view(g.G_intra_r, 3)[:, 0].tolist() == [float(m) for m in g.members("row")]

    # reduce_scatter over the world: each rank gets its piece of the sum
    full = torch.arange(4 * g.world_size, dtype=torch.float32)
    piece = torch.empty(4)
    axonn_c.comm.reduce_scatter(piece, full, group="world")
    assert torch.equal(piece, full.view(g.world_size, 4)[g.rank] * g.world_size)

    axonn_c.comm.barrier()
    if g.rank == 0:
        print("\nbytes sent by rank 0 per group (ring volumes):")
        for name, s in axonn_c.comm_stats().items():
            print(f"  {name:<6} {s['bytes_sent']:>8} B in {s['calls']} calls")
        print("all collectives matched the expected values")
    axonn_c.finalize()


if __name__ == "__main__":
    main()
