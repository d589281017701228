"""The parent's handle on one worker process (see :mod:`zephon.runners.processes`)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from zephon.runners import wire


class WorkerHandle:
    """One worker as the parent sees it: its process, control pipe, lanes and rings (the
    one read now, bigger ones sent to it, ones it moved out of), and what it has said."""

    __slots__ = (
        "id",
        "proc",
        "conn",
        "ring",
        "lanes",
        "lock",
        "configured",
        "booted",
        "ready",
        "next_rings",
        "retired",
    )

    def __init__(self, wid: int, conn: Any, ring: Any, lanes: list[int]) -> None:
        self.id, self.conn, self.ring, self.lanes = wid, conn, ring, lanes
        #: bigger rings sent to the worker, in order; each is read once the worker's
        #: ``moved`` marker ends the one before (it may grow again before we get there)
        self.next_rings: deque[Any] = deque()
        self.retired: list[Any] = []  # rings it moved out of (zero-copy leases may live)
        self.proc: Any = None  # set by the keeper thread once the process started
        self.configured = False  # the keeper has sent the worker its configuration
        self.booted = False  # the worker said it is past its start method's imports
        self.ready = False  # the worker said it runs: it got its configuration and ring
        self.lock = threading.Lock()  # conn sends: the feeder thread, and close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def send(self, msg: dict[str, Any], timeout_s: float = -1) -> bool:
        if not self.lock.acquire(timeout=timeout_s):
            return False
        try:
            self.conn.send_bytes(wire.pack(msg))
            return True
        except (OSError, ValueError):
            return False
        finally:
            self.lock.release()
