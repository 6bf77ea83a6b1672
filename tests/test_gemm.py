"""The device compute layer (csrc/device/gemm.c, cublaslt.c) against torch: GEMM over dtypes,
transposes, odd shapes, padded leading dimensions, alpha/beta/bias; bias gradient; 2-D copy; zero.
Runs on the CPU always and on CUDA when a GPU is present."""
import math
import time

import pytest
import torch

from axonn_c import _C

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# (rtol, atol per sqrt(K)) against a float64 reference of the same (rounded) inputs
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def dev_index(device):
    return -1 if device == "cpu" else torch.device(device).index or 0


def stream_of(device):
    return 0 if device == "cpu" else torch.cuda.current_stream().cuda_stream


def sync(device):
    if device != "cpu":
        torch.cuda.synchronize()


def stored(rows, cols, pad, dtype, device, gen):
    """A rows x cols matrix inside a rows x (cols + pad) buffer: (buffer, view, ld)."""
    buf = torch.randn(rows, cols + pad, generator=gen).to(device=device, dtype=dtype)
    return buf, buf[:, :cols], cols + pad


def call_gemm(device, dtype, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, alpha, beta, bias):
    _C.gemm(dev_index(device), stream_of(device), DTYPES[dtype], ta, tb, M, N, K,
            A.data_ptr(), lda, B.data_ptr(), ldb, C.data_ptr(), ldc, alpha, beta,
            0 if bias is None else bias.data_ptr())
    sync(device)


def check_gemm(device, dtype, M, N, K, ta, tb, pad, alpha, beta, with_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a_buf, a_view, lda = stored(K if ta else M, M if ta else K, pad, dtype, device, gen)
    b_buf, b_view, ldb = stored(N if tb else K, K if tb else N, pad + 1, dtype, device, gen)
    c_buf, c_view, ldc = stored(M, N, pad + 2, dtype, device, gen)
    if beta == 0:
        c_view.fill_(float("nan"))  # beta == 0 must not read C
    bias = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if with_bias else None
    op_a = a_view.t() if ta else a_view
    op_b = b_view.t() if tb else b_view
    ref = alpha * (op_a.double() @ op_b.double())
    if beta != 0:
        ref = ref + beta * c_view.double()
    if bias is not None:
        ref = ref + bias.double()
    before = c_buf.clone()
    call_gemm(device, dtype, ta, tb, M, N, K, a_buf, lda, b_buf, ldb, c_buf, ldc, alpha, beta, bias)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(c_view.double(), ref, rtol=rtol, atol=atol * math.sqrt(max(K, 1)))
    # padding columns of C untouched
    assert torch.equal(c_buf[:, N:].cpu(), before[:, N:].cpu())


SHAPES = [(1, 1, 1), (7, 13, 5), (127, 255, 63)]
COEFFS = [(1.0, 0.0, False), (0.5, 0.0, True), (1.0, 1.0, False), (-1.5, 0.25, True),
          (2.0, 0.0, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("coeffs", COEFFS, ids=lambda c: f"a{c[0]}b{c[1]}{'bias' if c[2] else ''}")
def test_gemm_matches_torch(device, dtype, shape, ta, tb, pad, coeffs):
    M, N, K = shape
    alpha, beta, with_bias = coeffs
    check_gemm(device, dtype, M, N, K, ta, tb, pad, alpha, beta, with_bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("beta,with_bias", [(0.0, False), (0.0, True), (0.5, True), (2.0, False)])
def test_gemm_k_zero(device, dtype, beta, with_bias):
    """K == 0: C = beta*C (+ bias)."""
    M, N = 5, 9
    gen = torch.Generator().manual_seed(1)
    c = torch.randn(M, N, generator=gen).to(device=device, dtype=dtype)
    if beta == 0:
        c.fill_(float("nan"))
    bias = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if with_bias else None
    ref = torch.zeros(M, N, dtype=torch.float64, device=device)
    if beta != 0:
        ref += beta * c.double()
    if bias is not None:
        ref += bias.double()
    a = torch.zeros(1, device=device, dtype=dtype)
    call_gemm(device, dtype, 0, 0, M, N, 0, a, 1, a, N, c, N, 1.0, beta, bias)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(c.double(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_empty_is_noop(device):
    c = torch.full((3, 4), 7.0, device=device)
    a = torch.zeros(1, device=device)
    call_gemm(device, torch.float32, 0, 0, 0, 4, 3, a, 3, a, 4, c, 4, 1.0, 0.0, None)
    call_gemm(device, torch.float32, 0, 0, 3, 0, 3, a, 3, a, 1, c, 4, 1.0, 0.0, None)
    assert torch.all(c == 7.0)


def test_gemm_f32_bitwise_equals_torch_mm():
    """The CPU path runs torch's own kernel: same views, same bits."""
    gen = torch.Generator().manual_seed(2)
    for ta, tb in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        M, N, K = 96, 80, 112
        a = torch.randn(K if ta else M, M if ta else K, generator=gen)
        b = torch.randn(N if tb else K, K if tb else N, generator=gen)
        c = torch.empty(M, N)
        call_gemm("cpu", torch.float32, ta, tb, M, N, K, a, a.shape[1], b, b.shape[1], c, N,
                  1.0, 0.0, None)
        ref = torch.mm(a.t() if ta else a, b.t() if tb else b)
        assert torch.equal(c, ref), (ta, tb)


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_rejects_bad_arguments(device):
    a = torch.zeros(16, device=device)
    with pytest.raises(ValueError, match="lda"):
        call_gemm(device, torch.float32, 0, 0, 2, 2, 4, a, 3, a, 2, a, 2, 1.0, 0.0, None)
    with pytest.raises(ValueError, match="ldb"):
        call_gemm(device, torch.float32, 0, 1, 2, 2, 4, a, 4, a, 3, a, 2, 1.0, 0.0, None)
    with pytest.raises(ValueError, match="ldc"):
        call_gemm(device, torch.float32, 0, 0, 2, 3, 1, a, 1, a, 3, a, 2, 1.0, 0.0, None)
    with pytest.raises(ValueError, match="not supported"):
        _C.gemm(dev_index(device), 0, "int32", 0, 0, 1, 1, 1, a.data_ptr(), 1, a.data_ptr(), 1,
                a.data_ptr(), 1, 1.0, 0.0, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
# (on CUDA up to 1024 rows take the bias-gradient kernel, more the cuBLASLt GEMV)
@pytest.mark.parametrize("M,N,pad", [(1, 1, 0), (7, 13, 2), (300, 513, 5), (0, 4, 0),
                                     (1024, 40, 1), (1500, 33, 3)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_bias_grad(device, dtype, M, N, pad, accumulate):
    gen = torch.Generator().manual_seed(3)
    dy_buf = torch.randn(max(M, 1), N + pad, generator=gen).to(device=device, dtype=dtype)
    db = torch.randn(N, generator=gen).to(device=device, dtype=dtype)
    ref = dy_buf[:M, :N].double().sum(0)
    if accumulate:
        ref = ref + db.double()
    _C.gemm_bias_grad(dev_index(device), stream_of(device), DTYPES[dtype], dy_buf.data_ptr(), M, N,
                      N + pad, db.data_ptr(), accumulate)
    sync(device)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(db.double(), ref, rtol=rtol, atol=atol * math.sqrt(max(M, 1)))


@pytest.mark.parametrize("device", DEVICES)
def test_copy2d_and_zero(device):
    src = torch.arange(10 * 37, dtype=torch.uint8, device=device).reshape(10, 37)
    dst = torch.full((10, 50), 255, dtype=torch.uint8, device=device)
    _C.gemm_copy2d(dev_index(device), stream_of(device), dst.data_ptr() + 3, 50,
                   src.data_ptr() + 1, 37, 30, 10)
    sync(device)
    expect = torch.full((10, 50), 255, dtype=torch.uint8)
    expect[:, 3:33] = src.cpu()[:, 1:31]
    assert torch.equal(dst.cpu(), expect)
    # contiguous rows take the one-copy path
    dst2 = torch.empty(370, dtype=torch.uint8, device=device)
    _C.gemm_copy2d(dev_index(device), stream_of(device), dst2.data_ptr(), 37, src.data_ptr(), 37,
                   37, 10)
    sync(device)
    assert torch.equal(dst2.cpu(), src.cpu().reshape(-1))
    with pytest.raises(ValueError, match="pitch"):
        _C.gemm_copy2d(dev_index(device), 0, dst.data_ptr(), 10, src.data_ptr(), 37, 30, 2)
    # zero a middle range
    t = torch.ones(100, dtype=torch.float32, device=device)
    _C.gemm_zero(dev_index(device), stream_of(device), t.data_ptr() + 40, 200)
    sync(device)
    expect = torch.ones(100)
    expect[10:60] = 0
    assert torch.equal(t.cpu(), expect)


def _time_pair(f, g, reps):
    """Best-of-`reps` seconds of f and g, interleaved so that machine noise hits both alike."""
    f()
    g()
    best_f = best_g = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t1 = time.perf_counter()
        g()
        t2 = time.perf_counter()
        best_f, best_g = min(best_f, t1 - t0), min(best_g, t2 - t1)
    return best_f, best_g


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_speed_vs_torch_matmul(device, capsys):
    """Y = X @ W^T with X [1024, 4096], W [4096, 4096], f32: time only, no assertion on speed."""
    M, N, K = 1024, 4096, 4096
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(M, K, generator=gen).to(device)
    w = torch.randn(N, K, generator=gen).to(device)
    y = torch.empty(M, N, device=device)
    ref = torch.empty(M, N, device=device)

    def ours():
        call_gemm(device, torch.float32, 0, 1, M, N, K, x, K, w, K, y, N, 1.0, 0.0, None)

    def theirs():
        torch.matmul(x, w.t(), out=ref)
        sync(device)

    reps = 4 if device == "cpu" else 20
    t_ours, t_torch = _time_pair(ours, theirs, reps)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3)
    flop = 2.0 * M * N * K
    with capsys.disabled():
        print(f"\n[gemm {device} f32 {M}x{N}x{K}] axonn_c {t_ours * 1e3:.2f} ms "
              f"({flop / t_ours / 1e9:.1f} GFLOP/s), torch.matmul {t_torch * 1e3:.2f} ms "
              f"({flop / t_torch / 1e9:.1f} GFLOP/s), ratio {t_ours / t_torch:.3f} "
              f"(threads={torch.get_num_threads()})")
