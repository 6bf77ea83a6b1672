"""The leak checks see only their own jobs' segments: segments that another job on the machine
creates meanwhile do not fail them, a segment their own job leaves behind still does, and the
segment name carries the job's AXONN_C_SHM_TAG (which is what tells them apart; the C test
csrc/tests/test_shm.c checks the same on the C side)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import SESSION_TAG, WORKERS, free_port, torchrun

pytestmark = pytest.mark.multiproc


def remove_made(text):
    for name in re.findall(r"^MADE (\S+)$", text, re.M):
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass


def test_foreign_segments_do_not_fail_the_check():
    out = ""
    try:
        out = torchrun(2, "shm_tag_worker.py", "foreign")
        assert "shm tag worker done" in out
        # the ranks met through a segment named with torchrun()'s tag for this job
        assert re.search(rf"^SEGMENT /axonn_c\.\d+\.\d+\.[0-9a-f]+\.{SESSION_TAG}-\d+$", out, re.M), out
        assert len(re.findall(r"^MADE ", out, re.M)) == 3  # made during the run, still there
    finally:
        remove_made(out)


def test_own_leaked_segment_fails_the_check():
    out = ""
    with pytest.raises(AssertionError, match=r"left behind by torchrun shm_tag_worker\.py"):
        try:
            out = torchrun(2, "shm_tag_worker.py", "leak")
        finally:
            # torchrun() raised before returning the output: remove by the tag's pattern
            for name in os.listdir("/dev/shm"):
                if re.fullmatch(r"axonn_c\.\d+\.993\.1\..+", name):
                    os.unlink(os.path.join("/dev/shm", name))
            remove_made(out)


def test_a_bad_tag_is_refused_by_name():
    env = dict(os.environ, AXONN_C_SHM_TAG="../x", PYTHONWARNINGS="ignore")
    out = torchrun_failure(env)
    assert "AXONN_C_SHM_TAG" in out and "letters, digits" in out, out


def torchrun_failure(env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(WORKERS / "shm_tag_worker.py"), "foreign"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    return proc.stdout + proc.stderr
