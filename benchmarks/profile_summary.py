"""Summarise sampling profiles of bench_host.py --spin loops (py-spy record --native --format
raw, one loop per file, as benchmarks/profile_host.sh writes them): per file, its samples and
the frames that hold the most of them -- inclusive (a frame counted once per stack it is on)
and self (the leaf). Every thread of the process counts: on CUDA the backward runs on
autograd's device thread, while the main thread waits for it (a wait shows as a libc leaf).

    bash benchmarks/profile_host.sh axonn_c_on prof_axonn_c_on.txt 6 --device cuda
    python benchmarks/profile_summary.py prof_*.txt [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import os
import re


def frame_name(frame: str) -> str:
    """'fn (file.py:12)' -> 'fn (file.py)'; native frames keep their library or file."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def summarise(path: str, top: int) -> None:
    total = 0
    incl, leaf = collections.Counter(), collections.Counter()
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit() or not stack:
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        for f in set(frames):
            incl[f] += n
        leaf[frames[-1]] += n
    print(f"\n== {os.path.basename(path)}: {total} samples")
    if not total:
        return
    print("   inclusive (% of the samples)")
    for f, n in incl.most_common(top):
        print(f"   {100 * n / total:6.1f}  {f}")
    print("   self")
    for f, n in leaf.most_common(top // 2):
        print(f"   {100 * n / total:6.1f}  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    for path in args.profiles:
        summarise(path, args.top)


if __name__ == "__main__":
    main()
