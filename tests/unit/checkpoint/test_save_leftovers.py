"""Issue 33 item 5: a save killed midway leaves its temp file; the next save in that
directory removes it once its writer is gone (and never a live writer's, nor another
host's). A save that fails after a committed round says that the round committed."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

import zephon as zp
from zephon.checkpoint.atomic import remove_stale_temps, temp_path

_WRITE_AND_DIE = """
import os, signal, sys
from zephon.checkpoint.atomic import temp_path
tmp = temp_path(sys.argv[1])
with open(tmp, "wb") as f:
    f.write(b"half a checkpoint")
    f.flush()
print(tmp, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_writer_temp(target) -> str:
    """The temp file of a save SIGKILLed before its rename."""
    out = subprocess.run(
        [sys.executable, "-c", _WRITE_AND_DIE, str(target)], capture_output=True, text=True
    )
    assert out.returncode == -9, out.stderr
    tmp = out.stdout.strip()
    assert os.path.exists(tmp)
    return tmp


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    target = tmp_path / "ckpt.zph"
    dead = _killed_writer_temp(target)
    other = _killed_writer_temp(tmp_path / "other.zph")  # any file's, in that directory
    live = temp_path(target)  # this process's own: a save still running
    with open(live, "wb") as f:
        f.write(b"in progress")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = os.path.join(
            tmp_path, f".ckpt.zph.tmp-{sleeper.pid}-" + os.path.basename(live)[-24:]
        )
        with open(theirs, "wb") as f:
            f.write(b"another live writer's")
        foreign = str(tmp_path / f".ckpt.zph.tmp-1-00000000{'ab' * 8}")  # another host's
        with open(foreign, "wb") as f:
            f.write(b"another host's")
        zp.save(target, {"step": 1})
        left = sorted(p.name for p in tmp_path.iterdir())
        assert os.path.basename(dead) not in left and os.path.basename(other) not in left
        assert os.path.basename(live) in left
        assert os.path.basename(theirs) in left
        assert os.path.basename(foreign) in left
        assert zp.load(target) == {"step": 1}
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale_temps(tmp_path) == [theirs]  # its writer is gone now
    assert remove_stale_temps(tmp_path / "missing") == []  # never raises


def test_a_save_that_fails_after_a_committed_round_says_the_round_committed(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    state = {"step": 9, "round": {"round_id": "abc-3", "step": 9, "job_id": "j"}}
    with pytest.raises(OSError) as info:
        zp.save(blocker / "ckpt.zph", state)  # a file where a directory must be
    assert info.value.errno == errno.ENOTDIR
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "checkpoint round abc-3 (step 9) committed on every rank" in notes
    assert "only this save failed" in notes
    with pytest.raises(OSError) as plain:
        zp.save(blocker / "ckpt.zph", {"step": 9})  # no round: nothing to add
    assert not getattr(plain.value, "__notes__", [])
