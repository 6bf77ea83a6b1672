"""Compressed training steps: the wire bytes the transport counts on this rank, per group, equal
axonn_c.plan.step_volume's prediction for the same policy (issue 22 item 5), on every grid of the
world size: data gradients int8/int4 (block scales, the per-rank split of the one-shot
reduce-scatter, the bucket packing), the Linear layers' own depth/row/col collectives with
codecs of their own; sync_gradients' buckets (overlap off) and backward's (overlap on, also with
buckets small enough that the packing splits them).

The model: expert-layout Linears (normal/transposed pairs, biases), a split LayerNorm and a
replicated parameter, odd sizes (pieces not a multiple of a codec block or of the group size).
Launched by tests/test_compress_multiproc.py under torchrun.
"""
import os

import torch
import torch.nn.functional as F

import axonn_c
from axonn_c import plan
from common import assert_bytes_equal, grids

H = 24
T = 5  # tokens per rank
STEP = dict(grad_acc=1, recompute=0, dtype="float32", grad_dtype="float32")
# (policy, overlap, bucket_size or None[, {layer name: its own compression}])
SETTINGS = [
    ({"data": "int8"}, False, None),
    ({"data": "int4", "depth": "int8", "row": "bf16", "col": {"codec": "int4", "block": 32}},
     False, None),
    ({"data": {"codec": "int4", "block": 64}, "depth": "bf16", "row": "int8", "col": "fp8"},
     True, None),
    ({"data": "int8"}, True, 1024),  # 256 elements: several buckets per pass
    # layers with their own codecs (Linear.compression) over init's policy
    ({"data": "int8", "row": "bf16", "depth": "int4"}, True, None,
     {"fc1": {"depth": None, "col": {"codec": "int8", "block": 32}}, "fc3": {"row": "int4"}}),
]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = axonn_c.Linear(H, 2 * H, expert_mode=True)
        self.fc2 = axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True)
        self.norm = axonn_c.LayerNorm(H, expert_mode=True)
        self.fc3 = axonn_c.Linear(H, 3 * H, expert_mode=True)
        self.gain = torch.nn.Parameter(torch.ones(7))  # replicated: over depth then data

    def forward(self, x):
        x = self.fc2(F.gelu(self.fc1(x))) * self.gain.mean()
        return self.fc3(self.norm(x)).square().mean()


def check(g, grid4, compression, overlap, bucket_size, own):
    what = f"grid {grid4} {compression} overlap {overlap} bucket {bucket_size} layers {own}"
    torch.manual_seed(0)
    model = Net()
    for name, policy in own.items():
        getattr(model, name).compression = policy
    x = torch.randn(T, model.fc1._shapes["k_local"], requires_grad=True)  # (dX: as modelled)
    for step in range(2):  # (the first sync_gradients registers hooks, broadcasts)
        axonn_c.reset_comm_stats()
        model(x).backward()
        axonn_c.sync_gradients(model, mean=True)
        model.zero_grad(set_to_none=True)
    stats = axonn_c.comm_stats()
    kw = {} if bucket_size is None else {"bucket_bytes": bucket_size}
    pred = plan.step_volume(model, grid4, g.rank, g.G_data * g.G_intra_d * T,
                            compression=compression, overlap=overlap, **kw, **STEP)
    assert_bytes_equal(stats, pred, f"rank {g.rank} {what}", unit="wire bytes",
                       show_counters=True)
    dims = [d for d in compression if {"data": g.G_data, "depth": g.G_intra_d,
                                       "row": g.G_intra_r, "col": g.G_intra_c}[d] > 1]
    for d in dims:  # (the check can fail: compression changed the bytes)
        assert stats[d]["bytes_sent"] < stats[d]["logical_bytes_sent"], (what, d, stats[d])


def main():
    world = int(os.environ["WORLD_SIZE"])
    checked = 0
    for grid4 in grids(world):
        for compression, overlap, bucket_size, *own in SETTINGS:
            kw = dict(overlap=overlap, compression=compression)
            if overlap:
                kw["fwd_chunks"] = 1  # (the model's default; init(overlap=True) picks by size)
            if bucket_size:
                kw["bucket_size"] = bucket_size
            g = axonn_c.init(*grid4, **kw)
            try:
                check(g, grid4, compression, overlap, bucket_size, own[0] if own else {})
            finally:
                axonn_c.finalize()
        checked += 1
    if int(os.environ["RANK"]) == 0:
        print(f"compress_bytes_worker: {checked} grids equal on world {world}", flush=True)


if __name__ == "__main__":
    main()
