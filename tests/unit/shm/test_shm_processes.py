"""A producer in another process: 500 verifiable messages through the ring."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

import zephon.shm
from zephon.shm import RingClosedError, ShmRing

HERE = Path(__file__).resolve().parent
REPO = Path(zephon.shm.__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))
from _shm_ring_child import expected_arrays, expected_meta  # noqa: E402

pytestmark = pytest.mark.processes


def start_producer(name: str, count: int) -> subprocess.Popen:
    env = dict(os.environ)  # keeps ZEPHON_PURE_PYTHON: the child runs the same core
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, str(HERE / "_shm_ring_child.py"), name, str(count)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_producer_in_a_child_process_sends_500_messages() -> None:
    count = 500
    with ShmRing.create(nslots=4, slot_bytes=256 * 1024) as ring:
        child = start_producer(ring.name, count)
        try:
            for i in range(count):
                with ring.get(timeout_s=30, zero_copy=bool(i % 3)) as message:
                    assert msgpack.unpackb(message.meta)["i"] == i
                    assert message.meta == expected_meta(i)
                    want = expected_arrays(i)
                    assert [a.dtype for a in message.arrays] == [a.dtype for a in want]
                    for got, expected in zip(message.arrays, want, strict=True):
                        np.testing.assert_array_equal(got, expected)
            with pytest.raises(RingClosedError):  # the child closed after the last one
                ring.get(timeout_s=30)
            out, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, err
        assert out.strip() == zephon.shm.IMPLEMENTATION
