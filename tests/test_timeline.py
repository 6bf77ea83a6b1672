"""axonn_c.timeline: recording, summary (compute / comm / exposed), Chrome-trace export, merge."""
import json
import os
import subprocess
import sys
import time

import pytest

import axonn_c
from axonn_c import _C, timeline
from conftest import torchrun

N = 1 << 16


@pytest.fixture(autouse=True)
def _clean_timeline():
    timeline.stop()
    timeline.clear()
    yield
    timeline.stop()
    timeline.clear()


def test_start_stop_clear_summary():
    assert not timeline.enabled()
    timeline.record_compute("ignored", 1, 2)  # not recording
    assert timeline.spans() == []
    timeline.start()
    assert timeline.enabled()
    t0 = timeline.now_ns()
    with timeline.compute("block"):
        time.sleep(0.005)
    timeline.record_compute("manual", t0, t0 + 1_000_000, 64)
    timeline.stop()
    timeline.record_compute("after_stop", 1, 2)
    sp = timeline.spans()
    assert [s[1] for s in sp] == ["block", "manual"]
    assert all(s[0] == 0 and s[2] is None for s in sp)
    assert sp[1][5] == 64 and sp[1][4] - sp[1][3] == 1_000_000
    s = timeline.summary()
    assert s["spans"] == 2 and s["dropped"] == 0
    assert s["comm_s"] == 0 and s["exposed_comm_s"] == 0 and s["per_group"] == {}
    # the two spans overlap: the union is the block (>= 5 ms, starts after t0)
    assert 0.005 <= s["compute_s"] < 1.0
    assert s["compute_s"] < sp[0][4] / 1e9 - sp[0][3] / 1e9 + 0.001 + 1e-9
    timeline.clear()
    assert timeline.spans() == [] and timeline.summary()["spans"] == 0
    timeline.start()
    timeline.record_compute("again", 10, 20)
    assert timeline.summary()["spans"] == 1
    with pytest.raises(ValueError):
        timeline.record_compute("bad", 20, 10)


def test_single_rank_collectives_record_nothing():
    axonn_c.init()
    try:
        timeline.start()
        axonn_c.comm.all_reduce(__import__("torch").ones(16))
        timeline.stop()
        assert timeline.spans() == []  # groups of one move nothing
    finally:
        axonn_c.finalize()


def test_spans_survive_init_and_finalize():
    """The timeline is the runtime's, made with the module: recording started before init()
    goes on through init() (the layer's GEMMs land in it) and its spans outlive finalize()."""
    import torch
    timeline.start()
    timeline.record_compute("before_init", 1, 2)
    axonn_c.init()
    try:
        layer = axonn_c.Linear(8, 8)
        layer(torch.ones(2, 8)).sum().backward()
    finally:
        axonn_c.finalize()
    timeline.record_compute("after_finalize", 3, 4)
    names = [s[1] for s in timeline.spans()]
    assert names[0] == "before_init" and names[-1] == "after_finalize", names
    assert "gemm" in names and "gemm:dw" in names, names  # recorded through the communicator
    axonn_c.init()
    axonn_c.finalize()
    assert [s[1] for s in timeline.spans()] == names


def test_export_naming_and_format(tmp_path):
    timeline.start()
    t0 = timeline.now_ns()
    timeline.record_compute("gemm", t0, t0 + 2000)
    timeline.record_compute("gemm", t0 + 5000, t0 + 9000, 10)
    timeline.stop()
    # world of one: the path as given
    out = timeline.export(tmp_path / "t.json")
    assert out == str(tmp_path / "t.json")
    tr = json.load(open(out))
    assert tr["displayTimeUnit"] == "ms"
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    ms = [e for e in tr["traceEvents"] if e["ph"] == "M"]
    assert [(e["ts"], e["dur"]) for e in xs] == [(0.0, 2.0), (5.0, 4.0)]
    assert all(e["pid"] == 0 and e["tid"] == "compute" for e in xs)
    assert xs[1]["args"] == {"bytes": 10}
    assert {"process_name", "thread_name"} <= {e["name"] for e in ms}
    assert any(e["name"] == "process_name" and e["args"]["name"] == "rank 0" for e in ms)
    # "{rank}" is formatted
    assert timeline.export(str(tmp_path / "r{rank}" / "x.json")) == str(tmp_path / "r0" / "x.json")
    # multi-rank naming rule
    assert timeline._rank_path("a/trace.json", 3, 4) == "a/trace.rank3.json"
    assert timeline._rank_path("trace", 1, 2) == "trace.rank1"
    assert timeline._rank_path("t_{rank}.json", 1, 2) == "t_1.json"
    assert timeline._rank_path("trace.json", 0, 1) == "trace.json"
    # an empty timeline still exports valid JSON
    timeline.clear()
    tr = json.load(open(timeline.export(tmp_path / "empty.json")))
    assert [e for e in tr["traceEvents"] if e["ph"] == "X"] == []


def _results(tmp_path):
    """The ranks' results (each worker writes result.<rank>.json beside the trace)."""
    res = [json.loads(p.read_text()) for p in tmp_path.glob("result.*.json")]
    return sorted(res, key=lambda r: r["rank"])


def test_two_ranks_overlap_and_exposed(tmp_path):
    torchrun(2, "timeline_worker.py", str(tmp_path / "trace.json"),
             env={"AXONN_C_SIM_GBPS": "1", "AXONN_C_SIM_US": "200"})
    res = _results(tmp_path)
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        s = r["summary"]
        groups = [c[1] for c in r["comm"]]
        assert sorted(groups) == ["row"] * 3 + ["world"] * 3, groups
        assert all(c[0] == "all_reduce" for c in r["comm"])
        assert set(s["per_group"]) == {"row", "world"}
        # ring all-reduce on 2 ranks sends N floats per call
        assert s["per_group"]["row"]["bytes"] == 3 * N * 4
        assert s["per_group"]["world"]["bytes"] == 3 * N * 4
        assert s["per_group"]["row"]["spans"] == 3
        # the simulated link: >= 200 us + 256 KiB at 1 GB/s per call
        sim = 200e-6 + N * 4 / 1e9
        assert s["per_group"]["world"]["comm_s"] >= 3 * sim * 0.99
        assert s["per_group"]["row"]["comm_s"] >= 3 * sim * 0.99
        assert s["comm_s"] > 0 and s["compute_s"] > 0
        assert 0 <= s["exposed_comm_s"] <= s["comm_s"] + 1e-12
        # the row all-reduces ran inside the matmul loop's span: fully hidden
        assert s["per_group"]["row"]["exposed_s"] == 0
        # the synchronous ones were waited for: exposed from the wait's start (right after the
        # start call; the progress thread may begin a few microseconds earlier) to their end
        w = s["per_group"]["world"]
        # (under load the gap before the wait can be a sizeable part of a 0.5 ms call)
        assert 0.25 * w["comm_s"] <= w["exposed_s"] <= w["comm_s"] + 1e-12
        assert s["exposed_comm_s"] == pytest.approx(w["exposed_s"], rel=1e-6)
        # (a call that ended before its wait began, the thread descheduled under load, has no
        # wait span)
        assert s["wait_spans"] >= 1 and s["wait_s"] >= w["exposed_s"] - 1e-12
        assert s["dropped"] == 0
        assert [c[0] for c in r["compute"]] == ["matmul_loop"]

    files = [r["file"] for r in res]
    assert files == [str(tmp_path / "trace.rank0.json"), str(tmp_path / "trace.rank1.json")]
    for rank, f in enumerate(files):
        tr = json.load(open(f))
        ph = {e["ph"] for e in tr["traceEvents"]}
        assert {"X", "M"} <= ph
        xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
        assert {"compute", "comm:row", "comm:world", "wait:world"} <= {e["tid"] for e in xs}
        assert all(e["pid"] == rank for e in xs)
        assert min(e["ts"] for e in xs) == 0
        assert all(e["dur"] >= 0 and isinstance(e["args"]["bytes"], int) for e in xs)

    merged = timeline.merge(files, tmp_path / "all.json")
    tr = json.load(open(merged))
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert len([e for e in xs if e["cat"] != "wait"]) == 2 * 7  # 6 comm + 1 compute per rank
    assert min(e["ts"] for e in xs) == 0
    names = {(e["pid"], e["args"]["name"]) for e in tr["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}

    # the CLI
    cli_out = tmp_path / "cli.json"
    p = subprocess.run([sys.executable, "-m", "axonn_c.timeline", "merge", *files, "-o",
                        str(cli_out)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr
    assert json.load(open(cli_out))["traceEvents"] == tr["traceEvents"]
    assert "RuntimeWarning" not in p.stderr  # (import axonn_c does not import the module first)
    # files that are not traces: one line naming the file, no traceback
    (tmp_path / "bad.json").write_text("nope")
    (tmp_path / "arr.json").write_text("[]")
    for bad in ("missing.json", "bad.json", "arr.json"):
        p = subprocess.run([sys.executable, "-m", "axonn_c.timeline", "merge",
                            str(tmp_path / bad), "-o", str(tmp_path / "x.json")],
                           capture_output=True, text=True, env=dict(os.environ))
        assert p.returncode == 1 and p.stderr.startswith("error:") and bad in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
