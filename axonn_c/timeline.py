"""Timeline of compute and communication spans, per rank and group, and its summary.

    axonn_c.timeline.start()            # clears and starts recording
    ... training steps ...
    axonn_c.timeline.stop()
    axonn_c.timeline.summary()          # {"compute_s", "comm_s", "exposed_comm_s", "per_group", ...}
    axonn_c.timeline.export("trace.json")   # Chrome-trace / Perfetto JSON, one file per rank

The spans are recorded in C (csrc/sched/timeline.c): every collective executed by the shm backend
(from the moment its group's progress thread starts it to its completion), the layer's GEMMs, and every
wait of the computing thread on a collective that had not finished. "Exposed" communication is
the communication time during which a computing thread was waiting for it and no GEMM ran (when
no waits are recorded, e.g. spans added by hand: the communication time no compute span covers).

`python -m axonn_c.timeline merge rank0.json rank1.json -o trace.json` combines per-rank files.
"""
import argparse
import contextlib
import json
import os
import sys
from types import MappingProxyType
from typing import Iterable, List, Optional

from . import _C, validate
from .state import grid

__all__ = ["start", "stop", "clear", "enabled", "summary", "spans", "export", "merge", "compute",
           "now_ns", "record_compute"]

COMPUTE, COMM, WAIT = 0, 1, 2
_CATS = MappingProxyType({COMPUTE: "compute", COMM: "comm", WAIT: "wait"})


def start() -> None:
    """Forgets earlier spans and starts recording."""
    _C.timeline_clear()
    _C.timeline_enable(True)


def stop() -> None:
    """Stops recording; the spans stay until clear() or the next start()."""
    _C.timeline_enable(False)


def clear() -> None:
    _C.timeline_clear()


def enabled() -> bool:
    return _C.timeline_enabled()


def now_ns() -> int:
    """The timeline's clock (CLOCK_MONOTONIC, ns): use it for record_compute()."""
    return _C.timeline_now()


def record_compute(name: str, t0_ns: int, t1_ns: int, nbytes: int = 0) -> None:
    """Records a compute span [t0_ns, t1_ns) measured with now_ns() (no-op when not recording)."""
    if not isinstance(name, str):
        raise TypeError(f"record_compute: name must be a str, got {type(name).__name__}")
    _C.timeline_record_compute(name, validate.check_int("record_compute: t0_ns", t0_ns, 0),
                               validate.check_int("record_compute: t1_ns", t1_ns, 0),
                               validate.check_int("record_compute: nbytes", nbytes, 0, 2**63 - 1))


@contextlib.contextmanager
def compute(name: str):
    """`with timeline.compute("loss"): ...` records the block as a compute span. For CUDA work the
    span covers the launches, not the kernels, unless the block synchronises."""
    if not _C.timeline_enabled():
        yield
        return
    t0 = _C.timeline_now()
    try:
        yield
    finally:
        _C.timeline_record_compute(name, t0, _C.timeline_now(), 0)


def spans() -> List[tuple]:
    """[(kind, name, group or None, t_begin_ns, t_end_ns, bytes, channel)]; kind 0 compute,
    1 comm, 2 wait; channel: the comm channel of the recording thread (0 unless concurrent
    micro-batches run: micro-batch i is channel i + 1)."""
    return _C.timeline_spans()


def summary() -> dict:
    """compute_s: union of compute spans; comm_s: union of communication spans; exposed_comm_s:
    the part of comm_s not covered by any compute span; per_group: {group: {comm_s, exposed_s,
    bytes, spans}}; spans; dropped (spans lost because the buffer was full)."""
    return _C.timeline_summary()


def _rank_world():
    try:
        if _C.is_initialized():
            g = grid()
            return g.rank, g.G_data * g.G_intra_r * g.G_intra_c * g.G_intra_d
    except Exception:  # noqa: BLE001 - before init the rank is 0
        pass
    return 0, 1


def _rank_path(path: str, rank: int, world: int) -> str:
    path = os.fspath(path)
    # a path naming no file ('', a directory, a device) would become './.rank0', '/.rank0' or
    # '/dev/full.rank0' at several ranks: refuse it
    if not isinstance(path, str) or not path or path.endswith(os.sep) or os.path.isdir(path) \
            or (os.path.exists(path) and not os.path.isfile(path)):
        raise ValueError(f"timeline.export: path must name a file to write, got {path!r}")
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def _tid(kind: int, group: Optional[str], channel: int = 0) -> str:
    """The trace row: compute, wait:<group> or comm:<group>, suffixed @ch<c> off channel 0
    (concurrent micro-batch i runs on channel i + 1, see axonn_c/concurrent.py)."""
    if kind == COMPUTE:
        row = "compute"
    else:
        row = f"{'wait' if kind == WAIT else 'comm'}:{group or 'none'}"
    return row if not channel else f"{row}@ch{channel}"


def _trace(span_list, rank: int) -> dict:
    base = min((s[3] for s in span_list), default=0)
    events = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
               "args": {"name": f"rank {rank}"}},
              {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
               "args": {"sort_index": rank}}]
    tids = sorted({_tid(k, g, c) for k, _, g, _, _, _, c in span_list},
                  key=lambda t: (not t.startswith("compute"), t))
    for i, tid in enumerate(tids):
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                       "args": {"name": tid}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                       "args": {"sort_index": i}})
    for kind, name, group, t0, t1, nbytes, channel in span_list:
        events.append({"ph": "X", "name": name, "cat": _CATS.get(kind, "comm"),
                       "pid": rank, "tid": _tid(kind, group, channel), "ts": (t0 - base) / 1e3,
                       "dur": max(t1 - t0, 0) / 1e3, "args": {"bytes": nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"rank": rank, "t0_ns": base, "clock": "CLOCK_MONOTONIC"}}


def export(path: str) -> str:
    """Writes this rank's spans as Chrome-trace JSON (open in https://ui.perfetto.dev or
    chrome://tracing). `path` may contain "{rank}"; otherwise multi-rank jobs get ".rank<r>"
    before the extension. Returns the path written."""
    rank, world = _rank_world()
    out = _rank_path(path, rank, world)
    trace = _trace(spans(), rank)
    trace["otherData"]["summary"] = summary()
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(out, "w") as f:
        json.dump(trace, f)
    return out


def _read_trace(path: str) -> dict:
    """One trace file as export() writes it (Chrome's object form), or a ValueError naming the
    file and what it holds instead."""
    try:
        with open(path) as f:
            t = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON trace file ({e})") from None
    if not isinstance(t, dict) or not isinstance(t.get("traceEvents", []), list) or not all(
            isinstance(e, dict) for e in t.get("traceEvents", [])):
        raise ValueError(f"{path}: expected a trace object {{\"traceEvents\": [event objects], "
                         f"...}} as axonn_c.timeline.export writes, got {type(t).__name__}")
    other = t.get("otherData", {})
    if not isinstance(other, dict):
        raise ValueError(f"{path}: \"otherData\" must be an object, got {type(other).__name__}")
    return t


def merge(paths: Iterable[str], out: str) -> str:
    """Combines per-rank trace files into one. Each file's times are relative to its own first
    span; they are re-based on the earliest one (ranks on one node share the monotonic clock)."""
    traces = []
    for p in paths:
        traces.append(_read_trace(p))
    if not traces:
        raise ValueError("merge: no input files")
    bases = [t.get("otherData", {}).get("t0_ns") for t in traces]
    known = [b for b in bases if b is not None]
    base = min(known) if known else 0
    events, ranks = [], []
    for t, b in zip(traces, bases):
        shift = (b - base) / 1e3 if b is not None else 0.0
        for e in t.get("traceEvents", []):
            if e.get("ph") == "X" and shift:
                e = dict(e, ts=e["ts"] + shift)
            events.append(e)
        ranks.append(t.get("otherData", {}).get("rank"))
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "otherData": {"ranks": ranks, "t0_ns": base, "clock": "CLOCK_MONOTONIC"}}
    d = os.path.dirname(os.fspath(out))
    if d:
        os.makedirs(d, exist_ok=True)
    with open(out, "w") as f:
        json.dump(merged, f)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m axonn_c.timeline",
                                 description="Timeline trace files of axonn_c.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="combine per-rank trace files into one")
    m.add_argument("inputs", nargs="+")
    m.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "merge":
        try:
            merge(args.inputs, args.output)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {args.output} ({len(args.inputs)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
