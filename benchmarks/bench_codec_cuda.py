"""Bandwidth of the CUDA codec kernels (csrc/compress/codec_kernels.cu) at the default block, as a
fraction of the device's copy bandwidth measured in the same run (torch copy_ of the same fp32
buffer: bytes read + written).

    python benchmarks/bench_codec_cuda.py --json codec_cuda.json

For each codec: encode (fp32 -> bytes), encode with error feedback (reads and writes the fp32
residual too), decode and decode-accumulate; GB/s counts every byte the kernel reads and writes.
The bytes equal the CPU reference's (tests/test_gpu.py::test_codec_kernels_bytes_equal_cpu).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from axonn_c import _C

CODECS = ("bf16", "fp8", "int8", "int4")


def timed(fn, iters: int) -> float:
    """Seconds per call, CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elems", type=int, default=64 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    n = args.elems
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x), args.iters)
    copy_gbps = 2 * 4 * n / copy_s / 1e9
    rows = []
    for codec in CODECS:
        block = _C.codec_default_block(codec)
        nbytes = _C.codec_encoded_bytes(codec, n, block)
        enc = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        res = torch.zeros(n, device="cuda")
        out = torch.empty(n, device="cuda")
        cases = {
            "encode": (lambda: _C.codec_encode(codec, block, x, enc, None, stream), 4 * n + nbytes),
            "encode_ef": (lambda: _C.codec_encode(codec, block, x, enc, res, stream),
                          12 * n + nbytes),
            "decode": (lambda: _C.codec_decode(codec, block, enc, out, False, stream),
                       nbytes + 4 * n),
            "decode_acc": (lambda: _C.codec_decode(codec, block, enc, out, True, stream),
                           nbytes + 8 * n),
        }
        for what, (fn, moved) in cases.items():
            s = timed(fn, args.iters)
            gbps = moved / s / 1e9
            rows.append({"codec": codec, "block": block, "op": what, "us": round(s * 1e6, 1),
                         "GBps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3)})
    meta = {"device": torch.cuda.get_device_name(0), "elems": n, "copy_GBps": round(copy_gbps, 1),
            "torch": torch.__version__}
    print(json.dumps(meta))
    print(f"{'codec':<6} {'block':>6} {'op':<11} {'us':>9} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        print(f"{r['codec']:<6} {r['block']:>6} {r['op']:<11} {r['us']:>9} {r['GBps']:>8} "
              f"{r['of_copy']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
