"""axonn_c.Linear on a CUDA device (cuBLASLt path), one rank: equals nn.Linear in float32,
bfloat16 and float16, forward and backward. Skipped with a reason on machines without a GPU."""
import pytest
import torch

import axonn_c

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("world_of_one")]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA device (torch.cuda.is_available() is False)")


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


@needs_gpu
@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_cuda_training_steps_with_overlap(backend):
    """init(overlap=True) on one GPU: the CUDA stream path of the scheduler (its gathered-buffer
    allocator, the end-of-backward completion, the buckets) trains like nn.Linear."""
    axonn_c.init(backend=backend, overlap=True)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                              torch.nn.Linear(128, 64)).cuda()
    torch.manual_seed(0)
    ours = torch.nn.Sequential(axonn_c.Linear(64, 128, device="cuda"), torch.nn.Tanh(),
                               axonn_c.Linear(128, 64, transpose=True, device="cuda"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    for step in range(3):
        x = torch.randn(16, 64, device="cuda")
        for m, opt in zip((ours, ref), opts):
            opt.zero_grad()
            m(x).square().mean().backward()
        axonn_c.sync_gradients(ours)
        for m, opt in zip((ours, ref), opts):
            opt.step()
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[0].full_weight(), ref[0].weight, **tol)
    torch.testing.assert_close(ours[2].full_weight(), ref[2].weight, **tol)


def _messages(exc):
    """The message of an exception and of every exception it replaced (__context__)."""
    out = []
    while exc is not None:
        out.append(str(exc))
        exc = exc.__context__
    return out


@needs_gpu
def test_cuda_graph_capture_with_scheduler_is_refused():
    """A forward/backward step with the cross-layer scheduler on cannot be a CUDA graph (its
    prefetch order and buckets are decided at run time): the capture raises a clear error."""
    axonn_c.init(backend="nccl", overlap=True)
    layer = axonn_c.Linear(64, 64, device="cuda")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    layer(x).sum().backward()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError) as info:
        with torch.cuda.graph(graph):
            layer(x).sum().backward()
    msgs = _messages(info.value)
    assert any("cannot be captured in a CUDA graph" in m for m in msgs), msgs


@needs_gpu
def test_cuda_graph_capture_without_scheduler_replays_eager():
    """With overlap off a forward/backward of an axonn_c.Linear is captured into a CUDA graph, and
    each replay gives what eager gives for the data in the captured input buffers (new data
    copied in between replays). Capture used to fail in every GEMM: cuBLASLt's workspace lookup
    called cudaStreamGetId, which invalidates a capture."""
    axonn_c.init(backend="nccl", overlap=False)
    torch.manual_seed(0)
    layer = axonn_c.Linear(64, 48, device="cuda")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)

    def step():
        layer.weight.grad = None
        layer.bias.grad = None
        x.grad = None
        y = layer(x)
        (y * y).sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's CUDA-graph docs ask
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    dw, db, dx = layer.weight.grad, layer.bias.grad, x.grad
    for trial in range(2):
        with torch.no_grad():
            x.copy_(torch.randn(8, 64, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.nn.Linear(64, 48, device="cuda")
        with torch.no_grad():
            ref.weight.copy_(layer.weight.reshape(48, 64))  # (flat, as the depth shards hold it)
            ref.bias.copy_(layer.bias)
        xr = x.detach().clone().requires_grad_(True)
        yr = ref(xr)
        (yr * yr).sum().backward()
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, yr, **tol, msg=f"replay {trial}: output")
        torch.testing.assert_close(dw, ref.weight.grad.reshape(-1), **tol,
                                   msg=f"replay {trial}: weight grad")
        torch.testing.assert_close(db, ref.bias.grad, **tol, msg=f"replay {trial}: bias grad")
        torch.testing.assert_close(dx, xr.grad, **tol, msg=f"replay {trial}: input grad")
