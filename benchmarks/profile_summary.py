"""Summarise a sampling profile of bench_host.py --spin (py-spy record --native --format raw):
per loop (axonn_c with overlap off / on, nn.Linear), the samples, and the frames that hold the
most of them -- inclusive (a frame counted once per stack it is on) and self (the leaf).

    py-spy record --native --format raw -o prof.txt -- python benchmarks/bench_host.py --spin 10
    python benchmarks/profile_summary.py prof.txt [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import re

LOOPS = ("spin_axonn_c_overlap_off", "spin_axonn_c_overlap_on", "spin_nn_linear")


def frame_name(frame: str) -> str:
    """'fn (file.py:12)' -> 'fn (file.py)'; native frames keep their library or file."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    total = collections.Counter()
    other = collections.Counter()
    incl = {k: collections.Counter() for k in LOOPS}
    leaf = {k: collections.Counter() for k in LOOPS}
    for line in open(args.profile):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        loop = next((k for k in LOOPS for f in frames if f.startswith(k + " ")), None)
        if loop is None:
            # another thread's (on CUDA the autograd engine's device thread runs the backward;
            # its samples name no loop), or start-up
            other[frames[-1] if frames else "?"] += int(count)
            continue
        n = int(count)
        total[loop] += n
        after = frames[next(i for i, f in enumerate(frames) if f.startswith(loop + " ")) + 1:]
        for f in set(after):
            incl[loop][f] += n
        if after:
            leaf[loop][after[-1]] += n
    n_other = sum(other.values())
    print(f"samples on no loop's stack (other threads, start-up): {n_other}; their top leaves:")
    for f, n in other.most_common(8):
        print(f"   {n:7d}  {f}")
    for loop in LOOPS:
        if not total[loop]:
            continue
        print(f"\n== {loop}: {total[loop]} samples")
        print("   inclusive (% of the loop's samples)")
        for f, n in incl[loop].most_common(args.top):
            print(f"   {100 * n / total[loop]:6.1f}  {f}")
        print("   self")
        for f, n in leaf[loop].most_common(args.top // 2):
            print(f"   {100 * n / total[loop]:6.1f}  {f}")


if __name__ == "__main__":
    main()
