"""Helpers shared by stores whose client calls have no timeout of their own (the JAX
coordination service client, torch's TCPStore): run each call on a worker thread and give
up on it after a deadline; and ``keep_alive`` for stores without leases."""

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


class PlainHandle:
    """``keep_alive`` without leases: the key is a plain put, and ``stop()`` deletes it."""

    def __init__(self, store: Any, key: str) -> None:
        self.key = key
        self.lost = False
        self._store = store
        self._stopped = False

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._store.delete(self.key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"


def plain_keep_alive(store: Any, key: str, value: bytes) -> PlainHandle:
    """``keep_alive`` for a store without leases: a plain put. ``exclusive`` is not
    honoured there: a dead holder's key never expires (torchrun's agent store outlives a
    restarted rank), so refusing to overwrite it would lock a restarted job out; these
    stores belong to one job anyway (its coordinator), so no other job shares them."""
    store.put(key, value)
    return PlainHandle(store, key)
