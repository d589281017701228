"""Producer process for test_shm_processes.py (run as a script, not collected).

Usage: python _shm_ring_child.py FD COUNT
Attaches to the ring behind the inherited descriptor FD, sends COUNT verifiable messages
(alternating ``put`` and in-place ``reserve``/``array``/``commit``), closes the ring and
prints the core implementation it ran. ``produce_from_pipe`` does the same in a process a
multiprocess start method made, receiving the descriptor over its pipe.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np

from zephon.shm import IMPLEMENTATION, ShmRing, recv_fds


def expected_arrays(i: int) -> list[np.ndarray]:
    """The arrays of message ``i``: sizes and contents vary with i."""
    return [
        (np.arange(i % 37 * 100, dtype=np.int32) * 7 + i).reshape(-1, 100),
        np.full((i % 5, 3), i * 0.5, dtype=np.float32),
        np.frombuffer(np.random.default_rng(i).bytes(1000 + i * 61), dtype=np.uint8),
        np.array(i, dtype=np.int64),
    ]


def expected_meta(i: int) -> bytes:
    return msgpack.packb({"i": i, "contributors": [[i, j, 0, True] for j in range(i % 4)]})


def produce_from_pipe(conn: Any, count: int) -> None:
    (fd,) = recv_fds(conn)
    produce(fd, count)
    conn.send(IMPLEMENTATION)


def main(fd: int, count: int) -> None:
    produce(fd, count)
    print(IMPLEMENTATION)


def produce(fd: int, count: int) -> None:
    ring = ShmRing.attach(fd)
    try:
        for i in range(count):
            arrays = expected_arrays(i)
            if i % 2:
                ring.put(expected_meta(i), arrays, timeout_s=30)
                continue
            with ring.reserve(timeout_s=30) as slot:
                for a in arrays:
                    slot.array(a.shape, a.dtype)[...] = a
                slot.commit(expected_meta(i))
    finally:
        ring.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
