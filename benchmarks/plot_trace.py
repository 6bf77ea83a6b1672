"""Draws an axonn_c timeline trace (Chrome-trace JSON) as a Gantt chart.

    python benchmarks/plot_trace.py TRACE.json OUT.png [--title TEXT] [--width 12]

TRACE.json is what axonn_c.timeline.export writes (one rank) or axonn_c.timeline.merge writes
(several ranks; benchmarks/bench_overlap.py --trace gives a merged one). One lane per rank and
thread: `compute` (the layer's GEMMs), then one `comm:<group>` lane per communication group, then
an `exposed` lane: the communication time of that rank during which it waited for a collective
(without wait spans: during which no compute span ran), what axonn_c.timeline.summary() calls
exposed_comm_s. Bars are coloured by span name.
"""
import argparse
import json
import sys
from collections import defaultdict

COLORS = {"gemm": "#4c72b0", "gemm:dw": "#64b5cd", "all_reduce": "#dd8452", "all_gather": "#55a868",
          "reduce_scatter": "#c44e52", "all_to_all": "#8172b3", "broadcast": "#937860",
          "barrier": "#8c8c8c", "exposed": "#222222"}


def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def subtract(xs, ys):
    """Parts of the (disjoint, sorted) intervals xs not covered by the (disjoint, sorted) ys."""
    out, j = [], 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def load(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = defaultdict(list)  # (rank, tid) -> [(t0_ms, t1_ms, name)]
    for e in events:
        if e.get("ph") != "X":
            continue
        t0 = e["ts"] / 1e3
        spans[(e["pid"], e["tid"])].append((t0, t0 + e.get("dur", 0) / 1e3, e["name"]))
    return spans


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--title", default=None)
    p.add_argument("--width", type=float, default=12.0, help="figure width in inches")
    p.add_argument("--dpi", type=int, default=80)
    a = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = load(a.trace)
    if not spans:
        p.error(f"{a.trace}: no complete ('X') events")
    ranks = sorted({r for r, _ in spans})
    lanes = []  # (label, [(t0, t1, name)])
    for r in ranks:
        tids = sorted((t for rr, t in spans if rr == r),
                      key=lambda t: (not t.startswith("compute"), t))
        comp = union([(s[0], s[1]) for t in tids if t.startswith("compute")
                      for s in spans[(r, t)]])
        comm = union([(s[0], s[1]) for t in tids if t.startswith("comm") for s in spans[(r, t)]])
        wait = union([(s[0], s[1]) for t in tids if t.startswith("wait") for s in spans[(r, t)]])
        for t in tids:
            lanes.append((f"rank {r} {t}", spans[(r, t)]))
        # exposed as timeline.summary() counts it: comm while the rank waited for it and no GEMM
        # ran (without wait spans: comm while no compute span ran)
        hidden = union([tuple(x) for x in subtract(comm, wait)] + [tuple(x) for x in comp]) \
            if wait else comp
        lanes.append((f"rank {r} exposed",
                      [(x, y, "exposed") for x, y in subtract(comm, union(hidden))]))

    fig, ax = plt.subplots(figsize=(a.width, 0.32 * len(lanes) + 1.2))
    used = set()
    for i, (label, ss) in enumerate(lanes):
        y = len(lanes) - 1 - i
        for t0, t1, name in ss:
            color = COLORS.get(name, "#999999")
            used.add(name if name in COLORS else "other")
            ax.broken_barh([(t0, max(t1 - t0, 1e-3))], (y - 0.4, 0.8), facecolors=color,
                           edgecolor="black" if name != "exposed" else color, linewidth=0.3)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([lab for lab, _ in reversed(lanes)], fontsize=8)
    for k in range(1, len(ranks)):  # separators between ranks
        n_before = sum(1 for lab, _ in lanes if int(lab.split()[1]) < ranks[k])
        ax.axhline(len(lanes) - n_before - 0.5, color="grey", linewidth=0.6)
    ax.set_xlabel("time (ms)")
    ax.set_xlim(left=0)
    ax.grid(axis="x", linewidth=0.3)
    ax.set_title(a.title or a.trace, fontsize=10)
    handles = [Patch(facecolor=COLORS.get(n, "#999999"), label=n) for n in COLORS if n in used]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 if len(lanes) > 8
                                                                   else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(a.out, dpi=a.dpi)
    print(f"wrote {a.out} ({len(lanes)} lanes, {sum(len(s) for _, s in lanes)} bars)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
