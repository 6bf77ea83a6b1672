"""GPU tests: the nccl backend at world size 1 in this process, and the shm backend with CUDA
tensors across several ranks on one GPU (torchrun). Skipped, with the reason shown, without CUDA.

Run: pytest -m gpu -v tests/test_gpu.py   (benchmarks/gpu_suite.sh does this on the GPU machine)
"""
import ctypes
import os
import subprocess
import sys

import pytest
import torch

import axonn_c
from axonn_c.state import GROUPS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "gpu_shm_worker.py")


def _clear_dist_env(monkeypatch):
    """A world of one in this process, whatever launched pytest."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def nccl1(monkeypatch):
    _clear_dist_env(monkeypatch)
    if axonn_c.is_initialized():
        axonn_c.finalize()
    g = axonn_c.init(backend="nccl", timeout=60)
    try:
        yield g
    finally:
        axonn_c.finalize()


def _input(dtype, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=gen).to(dtype)
    else:
        lo, hi = (-100, 100) if dtype == torch.int8 else (0, 250)
        x = torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64).to(dtype)
    return x.cuda()


def _same(got, want):
    torch.cuda.synchronize()
    assert got.dtype == want.dtype and got.device == want.device
    assert torch.equal(got, want), (got.flatten()[:8].tolist(), want.flatten()[:8].tolist())


def test_build_info_reports_cuda_and_nccl():
    info = axonn_c.build_info()
    print(info)
    assert info["cuda_compiled"], info
    assert info["nccl_compiled"], info
    assert isinstance(info["cuda_runtime"], int) and info["cuda_runtime"] > 0, info
    assert isinstance(info["nccl_runtime"], int), info
    # the libnccl this process loaded (the one torch linked), asked directly: the version torch
    # reports may be the one it was built against
    loaded = [line.split()[-1] for line in open("/proc/self/maps")
              if "/" in line and os.path.basename(line.split()[-1]).startswith("libnccl.so")]
    assert loaded, "no libnccl loaded in this process"
    version = ctypes.c_int(0)
    assert ctypes.CDLL(loaded[0]).ncclGetVersion(ctypes.byref(version)) == 0
    assert info["nccl_runtime"] == version.value, (info["nccl_runtime"], version.value, loaded[0])


def test_init_uses_nccl(nccl1):
    assert "nccl" in nccl1.backends, nccl1.backends
    assert nccl1.world_size == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_collective_every_group(nccl1, dtype):
    """With one rank every collective returns its input (sum, avg and max of one value too)."""
    axonn_c.reset_comm_stats()
    sizes = (1, 7, 1000) + ((1_000_003,) if dtype == torch.float32 else ())
    calls = 0
    for group in GROUPS:
        for n in sizes:
            x = _input(dtype, n, seed=n)
            for op in ("sum", "avg", "max"):
                y = x.clone()
                axonn_c.comm.all_reduce(y, group=group, op=op)
                _same(y, x)
                calls += 1
            out = torch.full_like(x, 7)
            axonn_c.comm.all_gather(out, x, group=group)
            _same(out, x)
            for op in ("sum", "avg", "max"):
                out = torch.full_like(x, 7)
                axonn_c.comm.reduce_scatter(out, x, group=group, op=op)
                _same(out, x)
                calls += 1
            out = torch.full_like(x, 7)
            axonn_c.comm.all_to_all(out, x, group=group)
            _same(out, x)
            y = x.clone()
            axonn_c.comm.broadcast(y, src=0, group=group)
            _same(y, x)
            calls += 3
        axonn_c.comm.barrier(group=group)
        calls += 1
    stats = axonn_c.comm_stats()
    total = 0
    for group in GROUPS:
        assert stats[group]["bytes_sent"] == 0, (group, stats[group])
        assert stats[group]["bytes_recv"] == 0, (group, stats[group])
        total += stats[group]["calls"]
    assert total == calls, (total, calls, stats)


def test_async_handles_and_streams(nccl1):
    """Async ops on a side stream: wait() orders the current stream after them (no host sync)."""
    side = torch.cuda.Stream()
    xs = [_input(torch.float32, 1 << 16, seed=i) for i in range(12)]
    ys = [x.clone() for x in xs]
    works = []
    side.wait_stream(torch.cuda.current_stream())  # the inputs were written on the current stream
    with torch.cuda.stream(side):
        for i, y in enumerate(ys):
            y.mul_(2)  # queued on `side` before the collective: the fork must order after it
            works.append(axonn_c.comm.all_reduce(y, group=GROUPS[i % len(GROUPS)], op="sum",
                                                 async_op=True))
        for w in works:
            w.wait()
        for y in ys:
            y.add_(1)  # on `side`, after the join
    side.synchronize()
    for w in works:
        assert w.is_completed()
        w.wait()  # waiting twice is harmless
    for x, y in zip(xs, ys):
        _same(y, x * 2 + 1)


def test_many_in_flight(nccl1):
    """More outstanding works than one would pool: all complete, in any wait order."""
    xs = [_input(torch.bfloat16, 4099, seed=i) for i in range(200)]
    ys = [x.clone() for x in xs]
    works = [axonn_c.comm.all_reduce(y, group="world", async_op=True) for y in ys]
    for w in reversed(works):
        w.wait()
    for x, y in zip(xs, ys):
        _same(y, x)


def test_cpu_tensor_is_refused_with_nccl(nccl1):
    x = torch.ones(4)
    with pytest.raises(Exception) as e:
        axonn_c.comm.all_reduce(x)
    assert str(e.value), "the error must say why"


def test_init_finalize_repeat(monkeypatch):
    _clear_dist_env(monkeypatch)
    if axonn_c.is_initialized():
        axonn_c.finalize()
    for i in range(3):
        g = axonn_c.init(backend="nccl", timeout=60)
        assert "nccl" in g.backends
        x = _input(torch.float16, 513, seed=i)
        y = x.clone()
        axonn_c.comm.all_reduce(y, op="max")
        _same(y, x)
        axonn_c.finalize()
    assert not axonn_c.is_initialized()


def test_auto_backend_picks_nccl_for_cuda(monkeypatch):
    _clear_dist_env(monkeypatch)
    if axonn_c.is_initialized():
        axonn_c.finalize()
    g = axonn_c.init(timeout=60)
    try:
        assert "nccl" in g.backends, g.backends
        x = _input(torch.float32, 100)
        y = x.clone()
        axonn_c.comm.all_reduce(y)
        _same(y, x)
    finally:
        axonn_c.finalize()


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, 4])
def test_shm_with_cuda_tensors_multirank(nproc, tmp_path):
    """Several ranks share the GPU; the shm backend stages CUDA tensors through host memory.
    Every grid, group, collective and dtype equals the serial result."""
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", WORKER, "--backend", "shm", "--sizes", "1,7,1000"]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    assert proc.returncode == 0, out[-8000:]
    assert f"world {nproc}, backend shm" in out and "all equal to the serial result" in out, out


def test_collective_under_cuda_graph_capture(nccl1):
    """A collective issued on a capturing stream: a world of one moves nothing (it may be
    captured and replayed), a real NCCL call is refused naming the capture
    (csrc/tests/mock/test_nccl_mock.c covers the refusal itself); never a broken job."""
    x = _input(torch.float32, 64)
    y = x.clone()
    axonn_c.comm.all_reduce(y)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            axonn_c.comm.all_reduce(y)
    except Exception as e:
        assert "CUDA graph" in str(e), str(e)
    else:
        graph.replay()
    axonn_c.comm.all_reduce(y)  # the backend is still healthy
    _same(y, x)


def test_run_concurrent_refuses_cuda(monkeypatch):
    """run_concurrent is CPU only: CUDA inputs, a CUDA model, or a micro-batch that fn moves to
    the GPU itself are refused before any collective."""
    _clear_dist_env(monkeypatch)
    if axonn_c.is_initialized():
        axonn_c.finalize()
    axonn_c.init(backend="shm", concurrent_microbatches=2, timeout=60)
    try:
        lin = axonn_c.Linear(8, 8).cuda()
        x = torch.randn(4, 8)
        for call in (lambda: axonn_c.run_concurrent(lin, x.cuda()),
                     lambda: axonn_c.run_concurrent(lambda xb: xb, x, model=lin),
                     lambda: axonn_c.run_concurrent(lambda xb: lin(xb.cuda()), x)):
            with pytest.raises(NotImplementedError, match="CPU micro-batches only"):
                call()
    finally:
        axonn_c.finalize()


def test_codec_kernels_bytes_equal_cpu():
    """The CUDA codec kernels write the CPU reference's bytes (encode, with and without error
    feedback) and decode (and decode-accumulate) to the same floats, and the owner's error
    feedback gives the same residual, for every codec, block sizes of one to eight warps and
    more, and several lengths, with zeros, outliers and non-finite values (with
    AXONN_C_CODEC_KERNELS=warp too: benchmarks/gpu_suite.sh)."""
    from axonn_c import _C

    assert _C.codec_cuda_compiled(), "built without nvcc: no CUDA codec kernels"
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 1000, 65537):
        x = torch.randn(n, generator=gen) * 10.0 ** (-3 * torch.rand(n, generator=gen))
        x[::97] = 0
        x[5 % n] = 300.0
        if n > 600:
            x[300], x[600] = float("inf"), float("nan")
        res = torch.randn(n, generator=gen) * 1e-3
        for codec in ("none", "bf16", "fp8", "int8", "int4"):
            for block in (32, 64, 128, 256, 4096):
                nbytes = _C.codec_encoded_bytes(codec, n, block)
                for residual in (None, res):
                    cpu_enc = torch.empty(nbytes, dtype=torch.uint8)
                    cpu_res = None if residual is None else residual.clone()
                    _C.codec_encode(codec, block, x, cpu_enc, cpu_res)
                    gpu_enc = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                    gpu_res = None if residual is None else residual.cuda()
                    _C.codec_encode(codec, block, x.cuda(), gpu_enc, gpu_res, stream)
                    what = f"{codec}/{block} n={n} ef={residual is not None}"
                    assert torch.equal(gpu_enc.cpu(), cpu_enc), what
                    if residual is not None:
                        assert torch.equal(gpu_res.cpu().view(torch.int32),
                                           cpu_res.view(torch.int32)), what
                acc = torch.randn(n, generator=gen)
                cpu_out = acc.clone()
                _C.codec_decode(codec, block, cpu_enc, cpu_out, True)
                gpu_out = acc.cuda()
                _C.codec_decode(codec, block, cpu_enc.cuda(), gpu_out, True, stream)
                assert torch.equal(gpu_out.cpu().view(torch.int32), cpu_out.view(torch.int32))
                cpu_fb = res.clone()
                _C.codec_feedback(codec, block, x, cpu_out, cpu_fb, 0.5)
                gpu_fb = res.cuda()
                _C.codec_feedback(codec, block, x.cuda(), gpu_out, gpu_fb, 0.5, stream)
                assert torch.equal(gpu_fb.cpu().view(torch.int32), cpu_fb.view(torch.int32)), (
                    f"feedback {codec}/{block} n={n}")


def test_compressed_collectives_nccl_one_rank(nccl1):
    """A compressed collective of CUDA tensors on NCCL: a group of one copies exactly, counts no
    wire bytes, and bad calls are refused by name."""
    x = torch.randn(1001, device="cuda")
    want = x.clone()
    axonn_c.reset_comm_stats()
    axonn_c.comm.all_reduce(x, group="data", compression="int4")
    out = torch.empty(1001, device="cuda")
    axonn_c.comm.all_gather(out, x, group="depth", compression={"codec": "fp8", "block": 64})
    torch.cuda.synchronize()
    assert torch.equal(x, want) and torch.equal(out, want)
    stats = axonn_c.comm_stats()
    assert stats["data"]["compressed_calls"] == 1 and stats["data"]["bytes_sent"] == 0
    with pytest.raises(ValueError, match="not max"):
        axonn_c.comm.all_reduce(x, op="max", compression="int8")
