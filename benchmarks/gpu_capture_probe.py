"""Why does cuBLASLt fail inside a CUDA-graph capture? One probe per way of issuing a GEMM, each in
a fresh process (a failed capture can leave the context unusable), on the GPU machine:

    python benchmarks/gpu_capture_probe.py --out DIR          # all probes; DIR/capture_probe.txt

Every probe warms its GEMM up three times on a side stream, then captures it with
torch.cuda.graph (global capture mode), replays the graph and compares with the eager result.
It reports the capture status of the stream right before the GEMM (cudaStreamIsCapturing: 1
active, 2 invalidated), the error, cudaGetLastError afterwards, and the tail of cuBLASLt's own
log (CUBLASLT_LOG_LEVEL=5) and of CUDA's error log (CUDA_LOG_FILE, CUDA >= 12.9).

The probes:
  torch_mm            torch.mm (fp32), torch's default BLAS
  torch_lt            torch.backends.cuda.preferred_blas_library("cublaslt"); F.linear in bf16
                      with a bias, and torch.mm
  ct_lt_noalgo        cublasLtMatmul called directly (ctypes, the libcublasLt torch loaded):
                      algo NULL (cuBLASLt's own choice), no workspace
  ct_lt_heur_ws       the same with the heuristic's algorithm and a 32 MiB torch workspace (what
                      axonn_c's axc_gemm does)
  axc_gemm            axonn_c._C.gemm (fp32, then bf16 with a bias)
  axc_linear          an axonn_c.Linear forward + backward, overlap off, world of one
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import traceback

PROBES = ("torch_mm", "torch_lt", "ct_lt_noalgo", "ct_lt_heur_ws", "axc_gemm", "axc_linear")


def loaded(name: str) -> str:
    for line in open("/proc/self/maps"):
        p = line.split()[-1]
        if "/" in p and os.path.basename(p).startswith(name):
            return p
    return ""


class Cuda:
    """The CUDA runtime torch loaded, for the capture status and the last error."""

    def __init__(self):
        self.rt = ctypes.CDLL(loaded("libcudart.so"))

    def capturing(self, stream: int) -> int:
        st = ctypes.c_int(-1)
        err = self.rt.cudaStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(st))
        return st.value if err == 0 else -100 - err

    def last_error(self) -> str:
        self.rt.cudaGetErrorString.restype = ctypes.c_char_p
        err = self.rt.cudaGetLastError()
        return f"{err} ({self.rt.cudaGetErrorString(err).decode()})"


class Lt:
    """cublasLtMatmul through ctypes, column-major C[m,n] = A[m,k] B[k,n], fp32."""

    def __init__(self, torch):
        self.torch = torch
        self.lib = ctypes.CDLL(loaded("libcublasLt.so"))
        self.handle = ctypes.c_void_p()
        assert self.lib.cublasLtCreate(ctypes.byref(self.handle)) == 0
        self.desc = ctypes.c_void_p()
        assert self.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), 68, 0) == 0  # 32F, R_32F
        self.lay = ctypes.c_void_p()
        n = 64
        assert self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.lay), 0, ctypes.c_uint64(n),
                                                   ctypes.c_uint64(n), ctypes.c_int64(n)) == 0
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(0.0)
        self.algo = None
        self.ws = None

    def use_heuristic(self, ws_bytes: int):
        self.ws = self.torch.empty(ws_bytes, dtype=self.torch.uint8, device="cuda")
        pref = ctypes.c_void_p()
        assert self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)) == 0
        wsb = ctypes.c_uint64(ws_bytes)
        assert self.lib.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(wsb), 8) == 0
        self.algo = ctypes.create_string_buffer(96 * 4)  # cublasLtMatmulHeuristicResult_t[4]
        count = ctypes.c_int(0)
        r = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.lay, self.lay,
                                                     self.lay, self.lay, pref, 4, self.algo,
                                                     ctypes.byref(count))
        assert r == 0 and count.value > 0, (r, count.value)

    def mm(self, a, b, c, stream: int):
        ws_ptr = ctypes.c_void_p(self.ws.data_ptr() if self.ws is not None else 0)
        ws_n = ctypes.c_size_t(self.ws.numel() if self.ws is not None else 0)
        r = self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha),
                                    ctypes.c_void_p(a.data_ptr()), self.lay,
                                    ctypes.c_void_p(b.data_ptr()), self.lay,
                                    ctypes.byref(self.beta), ctypes.c_void_p(c.data_ptr()),
                                    self.lay, ctypes.c_void_p(c.data_ptr()), self.lay,
                                    self.algo, ws_ptr, ws_n, ctypes.c_void_p(stream))
        if r != 0:
            raise RuntimeError(f"cublasLtMatmul returned cublasStatus {r}")


def run_probe(name: str) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    cuda_holder = {}
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(64, 64, device="cuda")
    torch.mm(a, b)  # loads cuBLAS(Lt)
    torch.cuda.synchronize()
    cu = Cuda()
    print("libcublasLt:", loaded("libcublasLt.so"), "| libcudart:", loaded("libcudart.so"))
    status = {}

    def mark():
        status["capturing_before"] = cu.capturing(torch.cuda.current_stream().cuda_stream)

    if name == "torch_mm":
        def step():
            mark()
            return torch.mm(a, b)
    elif name == "torch_lt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
        w = torch.randn(96, 64, device="cuda")
        bias = torch.randn(96, device="cuda")

        def step():
            mark()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = F.linear(a, w, bias)
            return y.float().sum() + torch.mm(a, b).sum()
    elif name in ("ct_lt_noalgo", "ct_lt_heur_ws"):
        lt = Lt(torch)
        if name == "ct_lt_heur_ws":
            lt.use_heuristic(32 << 20)
        c = torch.empty(64, 64, device="cuda")

        def step():
            mark()
            lt.mm(a, b, c, torch.cuda.current_stream().cuda_stream)
            return c.clone()
    elif name == "axc_gemm":
        from axonn_c import _C

        c = torch.empty(64, 64, device="cuda")
        ab = a.bfloat16()
        bb = b.bfloat16()
        cb = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)

        def step():
            mark()
            s = torch.cuda.current_stream().cuda_stream
            _C.gemm(0, s, "float32", False, False, 64, 64, 64, a.data_ptr(), 64, b.data_ptr(),
                    64, c.data_ptr(), 64, 1.0, 0.0, 0)
            _C.gemm(0, s, "bfloat16", False, False, 64, 64, 64, ab.data_ptr(), 64,
                    bb.data_ptr(), 64, cb.data_ptr(), 64, 1.0, 0.0, bias.data_ptr())
            return c.clone() + cb.float()
    elif name == "axc_linear":
        import axonn_c

        axonn_c.init(overlap=False)
        layer = axonn_c.Linear(64, 64, device="cuda")
        x = torch.randn(8, 64, device="cuda", requires_grad=True)

        def step():
            mark()
            layer.weight.grad = None
            x.grad = None
            y = layer(x)
            y.sum().backward()
            return torch.cat([y.detach().flatten(), layer.weight.grad.flatten(),
                              x.grad.flatten()])
        cuda_holder["layer"] = layer
    else:
        raise SystemExit(f"unknown probe {name}")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = eager.clone()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step()
    except Exception as e:  # noqa: BLE001  (the probe reports whatever it is)
        print("capturing status right before the GEMM:", status.get("capturing_before"))
        print("CAPTURE FAILED:", type(e).__name__, str(e).splitlines()[0][:400])
        cause = e.__cause__ or e.__context__
        if cause is not None:
            print("  cause:", type(cause).__name__, str(cause).splitlines()[0][:400])
        print("cudaGetLastError after:", cu.last_error())
        traceback.print_exc(limit=4)
        return
    print("capturing status right before the GEMM:", status.get("capturing_before"))
    graph.replay()
    torch.cuda.synchronize()
    same = torch.allclose(out, eager, rtol=1e-3, atol=1e-3)
    print("CAPTURE OK; replay", "equals eager" if same else "DIFFERS from eager",
          f"(max abs diff {(out - eager).abs().max().item():.3g})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--probe", default="", help="run one probe in this process")
    ap.add_argument("--timeout", type=int, default=60)
    args = ap.parse_args()
    if args.probe:
        run_probe(args.probe)
        return 0
    os.makedirs(args.out, exist_ok=True)
    report = []
    for name in PROBES:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, CUBLASLT_LOG_LEVEL="5",
                       CUBLASLT_LOG_FILE=os.path.join(tmp, "lt_%i.log"),
                       CUDA_LOG_FILE=os.path.join(tmp, "cuda_err.log"), PYTHONUNBUFFERED="1")
            try:
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", name],
                                   env=env, capture_output=True, text=True, timeout=args.timeout)
                out = p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:
                out = f"TIMED OUT after {args.timeout}s\n{e.stdout or ''}{e.stderr or ''}"
            report.append(f"===== {name}\n{out.strip()}\n")
            for log in sorted(os.listdir(tmp)):
                lines = open(os.path.join(tmp, log), errors="replace").read().splitlines()
                # the API trace around a failure: its error lines, and the last calls
                errs = [ln for ln in lines if "rror" in ln or "fail" in ln.lower()]
                report.append(f"--- {log}: {len(lines)} lines; error lines (first 15):\n" +
                              "\n".join(x[:300] for x in errs[:15]) +
                              "\n--- last 25 lines:\n" +
                              "\n".join(x[:300] for x in lines[-25:]) + "\n")
        print(f"{name}: done")
    text = "\n".join(report)
    with open(os.path.join(args.out, "capture_probe.txt"), "w") as f:
        f.write(text)
    print(text[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
