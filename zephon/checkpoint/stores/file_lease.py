"""The directory stores' emulated leases (local and fsspec alike): a value framed with its
expiry, and the thread that rewrites it (see :mod:`zephon.checkpoint.stores.directory`).

A leased value is written as ``ZLEASE01``, the expiry (wall clock, a float64) and the value;
``unframe`` reads an expired one as absent. A plain value that starts with the magic is
framed too, with an expiry that never comes, so it reads back unchanged.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
from collections.abc import Callable

from zephon.checkpoint.stores.base import BaseStore

__all__ = ["FileLease", "frame", "unframe"]

log = logging.getLogger("zephon.checkpoint.stores.directory")

_MAGIC = b"ZLEASE01"
_HEADER = struct.Struct("<8sd")  # magic, expiry (unix seconds; inf = never)


class FileLease:
    """A ``keep_alive`` handle: refreshes the key until ``stop()``, which deletes it.

    ``store`` is the directory store (its ``delete``, ``describe`` and ``log_prefix``);
    ``write(key, data)`` writes the framed bytes as they are."""

    def __init__(
        self,
        store: BaseStore,
        write: Callable[[str, bytes], None],
        key: str,
        value: bytes,
        ttl_s: float,
    ) -> None:
        self._store = store
        self._write = write
        self._key = key
        self._value = value
        self._ttl_s = ttl_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._expiry = 0.0
        self._lost = False
        self._refresh()
        self._thread = threading.Thread(target=self._run, name=f"zephon-lease-{key}", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True once the key may have expired under its holder (it was not refreshed in
        time: the process was paused, or the directory unwritable); stays True."""
        if not self._lost and time.time() > self._expiry:
            self._lost = True
        return self._lost

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _refresh(self) -> None:
        expiry = time.time() + self._ttl_s
        self._write(self._key, _HEADER.pack(_MAGIC, expiry) + self._value)
        self._expiry = expiry

    def _run(self) -> None:
        while not self._stopped.wait(self._ttl_s / 3):
            with self._lock:
                if self._stopped.is_set():
                    return
                _ = self.lost  # notice a lapse before refreshing hides it
                try:
                    self._refresh()
                except Exception as e:  # a missed refresh is retried; ttl_s covers two
                    log.warning(
                        "%scould not refresh %r in %s: %s",
                        self._store.log_prefix,
                        self._key,
                        self._store.describe(),
                        e,
                    )

    def stop(self) -> None:
        """Stop refreshing and delete the key; idempotent."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
        self._thread.join()
        self._store.delete(self._key)


def frame(value: bytes) -> bytes:
    """A plain value that happens to look like a lease frame is wrapped in one that never
    expires, so ``get`` unwraps it back to exactly ``value``."""
    value = bytes(value)
    if value[: len(_MAGIC)] == _MAGIC:
        return _HEADER.pack(_MAGIC, math.inf) + value
    return value


def unframe(data: bytes) -> bytes | None:
    """The value in ``data`` as ``frame`` or a lease wrote it; None once a lease's expiry
    has passed (or for a torn frame)."""
    if data[: len(_MAGIC)] != _MAGIC:
        return data
    if len(data) < _HEADER.size:
        return None
    _, expiry = _HEADER.unpack_from(data)
    if time.time() > expiry:
        return None
    return data[_HEADER.size :]
