"""A producer in another process: verifiable messages through the ring, whose descriptor
reaches the child inherited (subprocess) or over a pipe (every multiprocess start method)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgpack
import multiprocess
import numpy as np
import pytest

import zephon.shm
from tests.unit.shm._shm_ring_child import expected_arrays, expected_meta, produce_from_pipe
from zephon.shm import RingClosedError, ShmRing, send_fds

HERE = Path(__file__).resolve().parent
REPO = Path(zephon.shm.__file__).resolve().parents[2]

pytestmark = pytest.mark.processes


def start_producer(fd: int, count: int) -> subprocess.Popen:
    env = dict(os.environ)  # keeps ZEPHON_PURE_PYTHON: the child runs the same core
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, str(HERE / "_shm_ring_child.py"), str(fd), str(count)],
        env=env,
        pass_fds=[fd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def receive_all(ring: ShmRing, count: int) -> None:
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


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_producer_started_by_each_start_method_gets_the_ring_over_its_pipe(method) -> None:
    ctx = multiprocess.get_context(method)
    count = 60
    with ShmRing.create(nslots=4, slot_bytes=256 * 1024) as ring:
        parent_end, child_end = ctx.Pipe(duplex=True)
        child = ctx.Process(target=produce_from_pipe, args=(child_end, count))
        child.start()
        child_end.close()
        try:
            send_fds(parent_end, [ring.fileno()])
            receive_all(ring, count)
            assert parent_end.recv() == zephon.shm.IMPLEMENTATION
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
                child.join()
            parent_end.close()
        assert child.exitcode == 0


def test_producer_in_a_child_process_sends_500_messages() -> None:
    count = 500
    with ShmRing.create(nslots=4, slot_bytes=256 * 1024) as ring:
        child = start_producer(ring.fileno(), count)
        try:
            receive_all(ring, count)
            out, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, err
        assert out.strip() == zephon.shm.IMPLEMENTATION
