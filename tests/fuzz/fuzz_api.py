"""Randomized malformed calls of axonn_c's public API (issue 28). Run alone (a world of one) or
under torchrun (every rank draws the same calls from the same seed, so the collectives match):

    python tests/fuzz/fuzz_api.py --calls 10000 --seed 1
    python -m torch.distributed.run --nproc_per_node 2 tests/fuzz/fuzz_api.py --calls 10000

Each call must return or raise a named refusal (REFUSALS); anything else (an AttributeError or
IndexError from inside the package, a CommTimeoutError between ranks making the same calls) is a
finding, and a crash or hang ends the process (tests/fuzz/test_fuzz.py tells them apart). Prints
one line "FUZZ rank=<r> calls=<n> ok=<n> refused=<n> findings=<n> by_error=<json>" at the end,
and writes the call in progress to --trace so a crash can be traced to its call."""
import argparse
import faulthandler
import json

import os
import random
import sys
import tempfile
from collections import Counter

import torch

import axonn_c
from axonn_c import plan

# the refusals a malformed call may end in: each names the argument or the problem
REFUSALS = (TypeError, ValueError, OverflowError, RuntimeError, NotImplementedError)
# never a refusal: an internal error escaping, or peers that made the same calls timing out
FINDINGS = (AttributeError, IndexError, KeyError, ZeroDivisionError, AssertionError,
            SystemError, UnboundLocalError, MemoryError, RecursionError,
            axonn_c.CommTimeoutError)
PER_CALL_HANG_S = 60


class FakeTensor:
    """Looks like a tensor to duck typing (issue 28 item 3)."""
    dtype, device, layout, is_nested, shape = torch.float32, torch.device("cpu"), torch.strided, \
        False, (1 << 20,)

    def is_contiguous(self):
        return True

    def numel(self):
        return 1 << 20

    def data_ptr(self):
        return 16

    def dim(self):
        return 1


class LyingTensor(torch.Tensor):
    def data_ptr(self):
        return 16


SCALARS = [0, 1, 2, 3, 4, 8, -1, -2**31, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, True, False,
           0.0, 1.5, 3.7, -0.0, float("nan"), float("inf"), -float("inf"), 1e300, "", "2", "4",
           "world", "nope", None, [], [1, 2], {}, (), object(), b"x", 1j]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
GROUPS = ["world", "col", "row", "depth", "data", "intra", "nope", "", "World", None, 3]
OPS = ["sum", "avg", "max", "min", "prod", "", None, 0]


def tensor(rng, numel=None):
    """A random tensor, well-formed or not: odd dtypes, shapes, strides, layouts, devices."""
    n = numel if numel is not None else rng.choice([0, 1, 2, 3, 4, 7, 8, 16])
    kind = rng.random()
    dt = torch.float32 if rng.random() < 0.6 else rng.choice(DTYPES)
    if kind < 0.55:
        return torch.ones(n, dtype=dt)
    if kind < 0.65:
        return torch.ones(max(n, 1), 2, dtype=dt).t()  # not contiguous
    if kind < 0.7:
        return torch.ones((), dtype=dt)
    if kind < 0.75:
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    if kind < 0.8:
        return torch.ones(n, device="meta")
    if kind < 0.85:
        return torch.ones(4, 4).to_sparse()
    if kind < 0.9:
        return torch.ones(max(n, 1)).as_subclass(LyingTensor)
    if kind < 0.95:
        return torch.ones(n, requires_grad=True)
    return torch.ones(n, 4, dtype=dt)


def junk(rng, tensor_p=0.3):
    r = rng.random()
    if r < tensor_p:
        return tensor(rng)
    if r < tensor_p + 0.05:
        return FakeTensor()
    return rng.choice(SCALARS)


class Fuzzer:
    def __init__(self, rng, tmp, world):
        self.rng, self.tmp, self.world, self.trace = rng, tmp, world, None
        torch.manual_seed(0)
        self.layer = axonn_c.Linear(8, 8)
        self.model = torch.nn.Sequential(axonn_c.Linear(8, 8), torch.nn.ReLU())

    def note(self, *args):
        """Adds the arguments' description to the trace line of the call in progress."""
        if self.trace:
            desc = [f"{type(a).__name__}{tuple(a.shape)}:{a.dtype}:{a.layout}:{a.device}:"
                    f"{a.stride() if a.layout == torch.strided and not a.is_nested else ''}"
                    if isinstance(a, torch.Tensor) else repr(a)[:80] for a in args]
            self.trace.write(" ".join(desc) + "\n")
            self.trace.flush()

    # each target draws its arguments and makes one call
    def coll(self):
        rng = self.rng
        name = rng.choice(["all_reduce", "broadcast", "all_gather", "reduce_scatter",
                           "all_to_all", "barrier"])
        fn = getattr(axonn_c.comm, name)
        kw = {}
        if rng.random() < 0.3:
            kw["group"] = rng.choice(GROUPS)
        if rng.random() < 0.3:
            kw["async_op"] = rng.choice([True, False, 1, "yes", None])
        if name in ("all_reduce", "reduce_scatter") and rng.random() < 0.3:
            kw["op"] = rng.choice(OPS)
        if name == "broadcast" and rng.random() < 0.3:
            kw["src"] = junk(rng, 0)
        if name == "barrier":
            return fn(**kw)
        n = rng.choice([1, 2, 4, 8])
        x = tensor(rng, n) if rng.random() < 0.8 else junk(rng)
        if name in ("all_reduce", "broadcast"):
            return self._wait(fn(x, **kw))
        out_n = {"all_gather": n * self.world, "reduce_scatter": max(n // self.world, 1),
                 "all_to_all": n}[name]
        if rng.random() < 0.2:
            out_n = rng.choice([0, 1, 3, out_n + 1])
        out = tensor(rng, out_n) if rng.random() < 0.85 else junk(rng)
        if rng.random() < 0.05 and isinstance(x, torch.Tensor) and x.dim() == 1:
            out = x  # aliasing
        return self._wait(fn(out, x, **kw))

    @staticmethod
    def _wait(work):
        if isinstance(work, axonn_c.Work):
            work.wait()

    def linear_new(self):
        rng = self.rng
        args = [rng.choice([8, 4, 16]) if rng.random() < 0.3 else junk(rng, 0)
                for _ in range(2)]
        kw = {}
        if rng.random() < 0.3:
            kw[rng.choice(["bias", "transpose", "skip_bias_add", "expert_mode"])] = junk(rng, 0)
        if rng.random() < 0.2:
            kw["dtype"] = rng.choice([torch.float64, torch.int64, "float", None])
        axonn_c.Linear(*args, **kw)

    def linear_call(self):
        rng = self.rng
        x = tensor(rng, 8) if rng.random() < 0.5 else junk(rng)
        if isinstance(x, torch.Tensor) and x.dim() == 1 and x.numel() == 8 and rng.random() < 0.5:
            x = x.reshape(1, 8)
        self.note(x)
        self.layer(x)

    def sequential(self):
        axonn_c.Sequential(torch.nn.Identity(), chunks=junk(self.rng, 0))

    def forward_backward(self):
        rng = self.rng
        rows = rng.choice([1, 2, 4])
        x = torch.ones(rows, 8) if rng.random() < 0.7 else junk(rng)
        y = torch.ones(rows, 8) if rng.random() < 0.8 else junk(rng)
        mb = rng.choice([1, 2, 4, 5]) if rng.random() < 0.4 else junk(rng, 0)
        model = self.model if rng.random() < 0.8 else junk(rng)
        axonn_c.forward_backward(model, (x, y), torch.nn.functional.mse_loss,
                                 micro_batches=mb)

    def sync_gradients(self):
        rng = self.rng
        model = self.model if rng.random() < 0.6 else junk(rng)
        kw = {}
        if rng.random() < 0.5:
            kw["gradient_attr_name"] = rng.choice(["grad", "main_grad", "nope", "", 3, None])
        if rng.random() < 0.3:
            kw["mean"] = junk(rng, 0)
        axonn_c.sync_gradients(model, **kw)

    def clip(self):
        rng = self.rng
        params = self.model.parameters() if rng.random() < 0.5 else junk(rng)
        axonn_c.clip_grad_norm_(params, junk(rng, 0) if rng.random() < 0.6 else 1.0,
                                norm_type=junk(rng, 0) if rng.random() < 0.4 else 2.0)

    def full_state_dict(self):
        axonn_c.full_state_dict(self.model if self.rng.random() < 0.3 else junk(self.rng))

    def timeline(self):
        rng = self.rng
        what = rng.choice(["record", "export", "capacity"])
        if what == "record":
            axonn_c.timeline.record_compute(rng.choice(["x", None, 3]), junk(rng, 0),
                                            junk(rng, 0), junk(rng, 0))
        elif what == "export":
            path = rng.choice(["", "/", "/dev/full", self.tmp + "/", self.tmp,
                               os.path.join(self.tmp, "t{rank}.json"), None, 3])
            axonn_c.timeline.export(path)
        else:
            axonn_c._C.timeline_set_capacity(junk(rng, 0))

    def init_again(self):
        """init while initialised: the same grid is a no-op, anything else is refused."""
        rng = self.rng
        kw = {rng.choice(["timeout", "bucket_size", "G_data", "G_intra_c", "backend",
                          "prefetch", "fwd_chunks", "concurrent_microbatches"]): junk(rng, 0)}
        axonn_c.init(G_intra_c=self.world, **kw)

    def planner(self):
        rng = self.rng
        argv = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128",
                "--global-batch", "8", "--gpus", "4"]
        opt = rng.choice(["--layers", "--hidden", "--heads", "--seq", "--global-batch",
                          "--gpus", "--ffn", "--vocab", "--micro-batch", "--grad-acc",
                          "--fwd-chunks", "--top", "--compress-data", "--json", "--csv"])
        value = rng.choice(["0", "-1", "1", "3", "nan", "x", "99999999999999999999",
                            str(2**63 - 1), "/", "/proc/nope/x.json", ""])
        if opt in ("--json", "--csv") and value not in ("/", "/proc/nope/x.json", ""):
            value = os.path.join(self.tmp, "plan.out")
        try:
            plan.main(argv + [opt, value])
        except SystemExit as e:  # argparse's refusal of a malformed option
            if e.code != 2:
                raise RuntimeError(f"planner exited {e.code}") from None
            raise ValueError("argparse refused the option") from None

    TARGETS = ["coll", "coll", "coll", "linear_new", "linear_call", "sequential",
               "forward_backward", "sync_gradients", "clip", "full_state_dict", "timeline",
               "init_again", "planner"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0, help="init timeout (seconds)")
    p.add_argument("--trace", default=None, help="file the call in progress is written to")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    axonn_c.init(G_intra_c=world, timeout=args.timeout)
    rng = random.Random(args.seed)
    counts, by_error, findings = Counter(), Counter(), []
    trace = open(args.trace + f".rank{rank}", "w") if args.trace else None
    import io
    import contextlib
    with tempfile.TemporaryDirectory() as tmp:
        fz = Fuzzer(rng, tmp, world)
        fz.trace = trace
        for i in range(args.calls):
            target = rng.choice(Fuzzer.TARGETS)
            if trace:
                trace.seek(0)
                trace.truncate()
                trace.write(f"{i} {target}\n")
                trace.flush()
            faulthandler.dump_traceback_later(PER_CALL_HANG_S, exit=True)
            try:
                with contextlib.redirect_stdout(io.StringIO()), \
                        contextlib.redirect_stderr(io.StringIO()):
                    getattr(fz, target)()
                counts["ok"] += 1
            except FINDINGS as e:
                counts["findings"] += 1
                findings.append(f"call {i} {target}: {type(e).__name__}: {e}")
            except REFUSALS as e:
                counts["refused"] += 1
                by_error[f"{target}:{type(e).__name__}"] += 1
                if not str(e):
                    counts["findings"] += 1
                    findings.append(f"call {i} {target}: {type(e).__name__} without a message")
            faulthandler.cancel_dump_traceback_later()
    axonn_c.finalize()
    for f in findings[:20]:
        print("FINDING", f, flush=True)
    print(f"FUZZ rank={rank} calls={args.calls} ok={counts['ok']} refused={counts['refused']} "
          f"findings={counts['findings']} by_error={json.dumps(dict(sorted(by_error.items())))}",
          flush=True)
    return 1 if counts["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
