"""axonn_c.Linear on a CUDA device (cuBLASLt path), one rank: equals nn.Linear in float32,
bfloat16 and float16, forward and backward. Skipped with a reason on machines without a GPU."""
import pytest
import torch

import axonn_c

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA device (torch.cuda.is_available() is False)")


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    axonn_c.finalize()
    yield
    axonn_c.finalize()


@needs_gpu
@pytest.mark.parametrize("backend", ["nccl", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_linear_equals_nn_linear(backend, dtype, bias):
    axonn_c.init(backend=backend)
    torch.manual_seed(0)
    ref = torch.nn.Linear(96, 160, bias=bias).cuda().to(dtype)
    torch.manual_seed(0)
    ours = axonn_c.Linear(96, 160, bias=bias, device="cuda", dtype=dtype)
    x = torch.randn(4, 33, 96, device="cuda", dtype=dtype, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = ours(x), ref(xr)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, yr, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad.reshape(-1), **tol)
    if bias:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **tol)
