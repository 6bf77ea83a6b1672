"""Runs AxoNN's test files (tests/third_party/axonn) with pytest on this rank, as AxoNN's CI
does under torchrun, and prints this rank's outcome counts: `rank R: passed=P failed=F
skipped=S`. Arguments: pytest arguments (the test files, -k, --collect-only ...).
Launched by tests/test_axonn_compat.py."""
import os
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent.parent / "third_party" / "axonn"


class Counts:
    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "collected": 0}

    def pytest_collection_modifyitems(self, items):
        self.counts["collected"] += len(items)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.counts[report.outcome] += 1


def main():
    counts = Counts()
    args = ["-q", "-p", "no:cacheprovider", f"--rootdir={SUITE}", f"--confcutdir={SUITE}",
            "-W", "ignore", *[str(SUITE / a) if a.endswith(".py") else a for a in sys.argv[1:]]]
    rc = pytest.main(args, plugins=[counts])
    c = counts.counts
    print(f"rank {os.environ.get('RANK', '0')}: passed={c['passed']} failed={c['failed']} "
          f"skipped={c['skipped']} collected={c['collected']}", flush=True)
    sys.exit(int(rc))


if __name__ == "__main__":
    main()
