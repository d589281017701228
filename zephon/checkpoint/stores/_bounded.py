"""What the stores whose client calls have no timeout of their own (the JAX coordination
service client, torch's TCPStore) share: run each call on a worker thread and give up on it
after a deadline."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class BoundedWorker:
    """One daemon thread that owns one connection and runs calls on it, so a call stuck on
    a stalled server can be abandoned (daemon: it never blocks interpreter exit).

    ``connect()`` makes the connection lazily, on the worker thread; each call receives it.
    """

    def __init__(self, name: str, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._conn: Any = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, box, done = item
            try:
                if self._conn is None:
                    self._conn = self._connect()
                box.append((True, fn(self._conn)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()

    def run(self, fn: Callable[[Any], Any], timeout_s: float) -> Any:
        """``fn(connection)`` on the worker; TimeoutError if it takes over ``timeout_s``."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._queue.put((fn, box, done))
        if not done.wait(timeout_s):
            raise TimeoutError
        ok, value = box[0]
        if ok:
            return value
        raise value

    def abandon(self) -> None:
        """Let the thread end after its current call (if that ever returns)."""
        self._queue.put(None)
