"""Stores for the round tests: :class:`Wrapped`, the base of the stores that bend one call
of a real store (a write that fails, a read that hides a key), and :class:`MemoryStore`,
a store with only :class:`BaseStore`'s required methods."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from zephon.checkpoint.stores.base import BaseStore, KeepAlive, StoreCounters


class Wrapped(BaseStore):
    """``inner``'s own powers, forwarded; a subclass overrides the calls it bends.

    What ``inner`` takes from :class:`BaseStore` (``get_many``, ``announce_with``,
    ``create_and_delete``, ``watch``, ``compact``: the directory store's) is not forwarded
    but inherited here too, so those defaults go through the subclass's ``get``, ``put``,
    ``create`` and ``delete``."""

    def __init__(self, inner: BaseStore) -> None:
        self._inner = inner

    @property  # type: ignore[override]
    def poll_interval_s(self) -> float:
        return self._inner.poll_interval_s

    @property  # type: ignore[override]
    def poll_max_interval_s(self) -> float | None:
        return self._inner.poll_max_interval_s

    @property  # type: ignore[override]
    def log_prefix(self) -> str:
        return self._inner.log_prefix

    @log_prefix.setter
    def log_prefix(self, value: str) -> None:
        self._inner.log_prefix = value

    @property
    def counters(self) -> StoreCounters:
        return self._inner.counters

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        self._inner.put(key, value, fence=fence)

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        return self._inner.create(key, value, fence=fence)

    def get(self, key: str) -> bytes | None:
        return self._inner.get(key)

    def delete(self, key: str) -> None:
        self._inner.delete(key)

    def describe(self) -> str:
        return self._inner.describe()

    def announce(self, key: str, value: bytes) -> Any:
        return self._inner.announce(key, value)

    def keep_alive(
        self, key: str, value: bytes, ttl_s: float, *, exclusive: bool = False
    ) -> KeepAlive:
        return self._inner.keep_alive(key, value, ttl_s, exclusive=exclusive)

    def list_keys(self, prefix: str) -> list[str] | None:
        return self._inner.list_keys(prefix)

    def delete_prefix(self, prefix: str, known: Sequence[str] = ()) -> None:
        self._inner.delete_prefix(prefix, known)

    def make_room(self, prefixes: list[str]) -> None:
        self._inner.make_room(prefixes)

    def close(self) -> None:
        self._inner.close()


class MemoryStore(BaseStore):
    """Only the required methods, over a dict that every ``MemoryStore`` made with the same
    ``shared`` dict sees (one per simulated rank, like separate hosts): no fence, no lease,
    no listing, no watch; every other power is :class:`BaseStore`'s default."""

    def __init__(self, shared: dict[str, bytes], lock: threading.Lock) -> None:
        self._data = shared
        self._lock = lock

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        with self._lock:
            self._data[key] = bytes(value)

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        with self._lock:
            if key in self._data:
                return self._data[key]
            self._data[key] = bytes(value)
            return None

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def describe(self) -> str:
        return f"memory-dict@{id(self._data):x}"
