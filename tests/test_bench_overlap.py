"""Smoke test of benchmarks/bench_overlap.py: it runs end to end (three torchrun launches of two
ranks at tiny sizes) and writes the documented JSON keys with positive times. No timing
assertions: timings are the benchmark's business (docs/ARCHITECTURE.md#tests-and-benchmarks)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

KEYS = ("ranks", "G_data", "G_intra_r", "G_intra_c", "G_intra_d", "t_overlap_s",
        "t_no_overlap_s", "t_compute_s", "t_comm_s", "exposed_comm_s")


@pytest.mark.multiproc
def test_bench_overlap_quick(tmp_path):
    out, trace = tmp_path / "overlap.json", tmp_path / "trace.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("AXONN_C_BENCH_SKIP", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_overlap.py"),
                           "--quick", "--ranks", "2", "--json", str(out), "--trace", str(trace),
                           "--ablate-defer", "--gelu", "--micro-batches", "2",
                           "--compute-overlap"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    row = rows[0]
    assert set(KEYS) <= set(row)
    assert row["ranks"] == 2
    assert row["G_data"] * row["G_intra_r"] * row["G_intra_c"] * row["G_intra_d"] == 2
    for k in ("t_overlap_s", "t_no_overlap_s", "t_compute_s", "t_comm_s",
              "t_overlap_nodefer_s", "t_pipelined_s", "t_microbatched_s",
              "t_compute_overlap_s"):
        assert row[k] > 0, (k, row)
    assert row["exposed_comm_s"] >= 0 and row["exposed_nodefer_s"] >= 0
    assert row["exposed_pipelined_s"] >= 0 and row["pipeline_chunks"] == 2 and row["gelu"]
    assert row["exposed_microbatched_s"] >= 0 and row["micro_batches"] == 2
    # the phase bound: each phase at least its longer side, within the steps it comes from
    assert 0 < row["t_compute_fwd_s"] < row["t_compute_s"]
    assert 0 < row["t_comm_fwd_s"] < row["t_comm_s"]
    assert max(row["t_compute_s"], row["t_comm_s"]) <= row["phase_bound_s"] \
        <= row["t_compute_s"] + row["t_comm_s"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert "target" in proc.stdout
