"""init(overlap=True) with CUDA tensors and several ranks sharing one GPU (shm backend: each
group's lane stages through pinned host memory), launched by torchrun.

An expert-layout MLP (Linear(H, 2H) -> tanh -> Linear(2H, H, transpose=True), with biases) is
trained for three SGD steps on several grids with everything on: prefetched depth all-gathers
(buffers from torch's caching allocator), deferred reduce-scatters, data-parallel buckets, chunked
all-reduces, deferred dW GEMMs, the biases' gradient hooks. After each backward (before sync_gradients) every
gradient must already equal serial PyTorch's on the CPU, and the weights must follow the serial
ones step by step (a stale prefetched weight would not). Usage:
torchrun --standalone --nproc_per_node N gpu_overlap_worker.py (AXONN_C_TEST_DEVICE=cpu runs the
same checks on CPU tensors, to check the checks on a machine without a GPU).
"""
import ctypes
import os
import sys

import torch
from torch import nn

import axonn_c
from linear_worker import shard_of

H = 64
DEV = os.environ.get("AXONN_C_TEST_DEVICE", "cuda")


def torch_allocator_in_shim():
    """Whether this torch's C shim exports its CUDA caching allocator (torch >= 2.10), which
    the scheduler then allocates gathered weights from."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
    try:
        return hasattr(ctypes.CDLL(lib), "aoti_torch_cuda_caching_allocator_raw_alloc")
    except OSError:
        return False


def close(got, want, what):
    """cuBLAS may round differently from the CPU (TF32 included): relative to the tensor's
    scale, 5e-3; a one-step-stale weight moves by ~1e-1 of it."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = want.abs().max().clamp_min(1e-12)
    if not torch.allclose(got / scale, want / scale, rtol=5e-3, atol=5e-3):
        raise AssertionError(f"{what}: max |diff| {(got - want).abs().max().item():.3e}, "
                             f"scale {scale.item():.3e}")


def check_grid(sizes):
    g = axonn_c.init(*sizes, backend="shm", overlap=True, bucket_size=H * H * 4)
    what = f"grid {'x'.join(map(str, sizes))} rank {g.rank}"
    torch.manual_seed(7)
    fc1 = axonn_c.Linear(H, 2 * H, expert_mode=True, device=DEV)
    fc2 = axonn_c.Linear(2 * H, H, transpose=True, expert_mode=True, device=DEV)
    model = nn.Sequential(fc1, nn.Tanh(), fc2)
    ref = nn.Sequential(nn.Linear(H, 2 * H), nn.Tanh(), nn.Linear(2 * H, H))
    with torch.no_grad():
        for r, layer in ((ref[0], fc1), (ref[2], fc2)):
            r.weight.copy_(layer.full_weight().cpu())
            r.bias.copy_(layer.full_bias().cpu())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    shards = g.G_data * g.G_intra_d
    blk = g.data_rank * g.G_intra_d + g.depth_rank
    s1 = fc1._shapes
    kin = slice(s1["gin_rank"] * s1["k_local"], (s1["gin_rank"] + 1) * s1["k_local"])
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        m = 4
        X = torch.randn(shards * m, H, generator=gen)
        dY = torch.randn(shards * m, H, generator=gen)
        tok = slice(blk * m, (blk + 1) * m)
        opt.zero_grad()
        ref_opt.zero_grad()
        model(X[tok][:, kin].to(DEV)).backward(dY[tok][:, kin].to(DEV))
        ref(X).backward(dY)
        for layer, r in ((fc1, ref[0]), (fc2, ref[2])):
            close(layer.weight.grad, shard_of(r.weight.grad, layer), f"{what} step {step} dW")
            rows, _ = layer._block_slices()
            close(layer.bias.grad, r.bias.grad[rows], f"{what} step {step} db")
        axonn_c.sync_gradients(model)
        opt.step()
        ref_opt.step()
    if DEV == "cuda":
        torch.cuda.synchronize()
    for layer, r in ((fc1, ref[0]), (fc2, ref[2])):
        close(layer.full_weight(), r.weight, f"{what} trained weight")
    stats = axonn_c.scheduler_stats()
    if g.G_intra_d > 1:
        assert stats["prefetches"] > 0, f"{what}: nothing was prefetched: {stats}"
        if DEV == "cuda" and torch_allocator_in_shim():  # else cudaMallocAsync (torch < 2.10)
            assert stats["torch_buffers"] > 0, \
                f"{what}: no gathered weight came from torch's caching allocator: {stats}"
    if g.G_data > 1 or g.G_intra_d > 1:
        assert stats["deferred"] > 0, f"{what}: nothing was deferred: {stats}"
    # defer_wgrad: on a tensor-parallel grid without depth, fc2's dW GEMM waits as a scheduler
    # task for the next dX reduction (fc1 has no dX to reduce: its input needs no gradient), so
    # one task per step
    if g.G_intra_d == 1 and g.G_intra_r * g.G_intra_c > 1:
        assert stats["tasks"] == 3 and stats["tasks_run"] == 3, \
            f"{what}: expected 3 deferred dW GEMMs (fc2's, one per step), all run: {stats}"
    axonn_c.finalize()


def main():
    world = int(os.environ["WORLD_SIZE"])
    grids = [(1, 1, 1, world), (world, 1, 1, 1), (1, 1, world, 1), (1, world, 1, 1)]
    if world % 2 == 0 and world > 2:
        grids += [(2, 1, 1, world // 2), (1, 2, 1, world // 2), (2, 1, world // 2, 1)]
    for sizes in grids:
        check_grid(sizes)
    if int(os.environ["RANK"]) == 0:
        print(f"world {world}: overlap with {DEV} tensors matches serial PyTorch on {len(grids)} grids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
