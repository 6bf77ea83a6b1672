"""AxoNN migration (issue 24 item 6): AxoNN's own tests run unmodified against axonn_c's
compatibility layer (tests/third_party/axonn, launched with torchrun as AxoNN's CI does), and
AxoNN's names on 4 ranks (tests/workers/axonn_compat_worker.py)."""
import re

import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiproc


def _counts(out):
    return sorted(re.findall(r"rank (\d+): passed=(\d+) failed=(\d+) skipped=(\d+) "
                             r"collected=(\d+)", out))


def test_axonn_fc_test_unmodified():
    """AxoNN's test_intra_layer_fc.py on 2 ranks (the world size it is written for): its 108
    cases pass on every rank; the 72 it skips itself (bias backward) stay skipped."""
    out = torchrun(2, "axonn_suite_worker.py", "test_intra_layer_fc.py", timeout=900)
    assert _counts(out) == [("0", "108", "0", "72", "180"), ("1", "108", "0", "72", "180")], out


def test_axonn_embedding_and_conv_tests_import():
    """AxoNN's embedding and convolution test modules import (every name they take from axonn
    exists) and collect all their cases."""
    out = torchrun(1, "axonn_suite_worker.py", "test_intra_layer_emb.py",
                   "test_intra_layer_conv.py", "--collect-only", timeout=300)
    assert _counts(out) == [("0", "0", "0", "0", str(208 + 324))], out


def test_axonn_names_on_four_ranks():
    out = torchrun(4, "axonn_compat_worker.py", timeout=600)
    assert "axonn_compat_worker: ok" in out, out
