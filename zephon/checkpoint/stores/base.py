"""The small key-value interface that multi-rank checkpoint rounds run over.

One protocol (``zephon.checkpoint.rounds``) runs over every backend: a shared directory or
fsspec URL, etcd, the JAX coordination service, torch's TCPStore. A store needs atomic
whole-value puts, gets that return None for absent keys, deletes, and ``create``: a put
that only succeeds when the key is absent and otherwise returns the value that won. That
one primitive is what makes a round's outcome a single decision every rank agrees on (the
leader's commit and a follower's "I gave up" race for the same key; see
``zephon.checkpoint.rounds``).

Optional powers make rounds cheaper or safer where a backend has them (looked up with
``getattr``; absent means "no"):

* a *fence*: ``announce`` returns a token, and ``put``/``create`` with ``fence=token``
  succeed only while the announcement it came from is still current, so a stalled old
  leader cannot commit over a newer round (etcd: a transaction on the key's revision);
* a *liveness lease*: ``keep_alive(key, ttl_s)`` makes ``key`` vanish ``ttl_s`` after the
  holder stops refreshing it, so followers learn of a dead leader (etcd: a lease);
* ``list_keys(prefix)``: the names under a prefix (a range read; TCPStore cannot list), so
  the leader reads each state once, as it arrives, instead of polling W named keys;
* ``delete_prefix(prefix)``: one request removes a round's states or acks;
* ``watch(prefix)``: the store pushes changes (etcd watches), so waiting ranks send no
  requests while they wait (:class:`PrefixWatch`);
* ``make_room(prefixes)``: prepare for many ranks writing under each prefix at once (the
  directory store makes the prefix's subdirectory, so a thousand followers do not each
  find it missing and race to make it);
* ``compact()``: drop the history of deleted keys after a committed round (etcd keeps every
  revision until compacted, and its database quota counts them);
* ``counters``: a :class:`StoreCounters` of requests and bytes, for the per-round figures.

Backends without a fence return None from ``announce``; without leases ``keep_alive`` puts
plainly and returns a handle whose ``stop()`` deletes the key. The round then relies on the
decision key, the failure notice and its time budget.

A ``keep_alive`` handle may also expose ``lost`` (optional; absent means False): True once
the key may have expired under its living holder (a paused process, a lease the server
dropped). The round's leader then gives the round up instead of committing.

Polling: waiters sleep ``poll_interval_s`` between reads. A store may also set
``poll_max_interval_s`` (optional; absent means "no backoff"): waiters then back off
exponentially from ``poll_interval_s`` up to it (``poll_delays``); object storage uses 5 s.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from zephon.errors import AggregationError

__all__ = [
    "KeyHeldError",
    "PrefixWatch",
    "StaleRoundError",
    "Store",
    "StoreCounters",
    "counters_of",
    "get_many",
    "poll_delays",
]


class StaleRoundError(AggregationError):
    """A fenced write was refused: the round it belonged to is no longer current."""


class KeyHeldError(AggregationError):
    """``keep_alive(..., exclusive=True)`` found the key held (by a live holder)."""

    def __init__(self, key: str, value: bytes, where: str) -> None:
        self.key = key
        self.value = value
        self.where = where
        shown = value.decode(errors="replace")[:200]
        super().__init__(f"{key!r} in {where} is held by another holder: {shown!r}")


@runtime_checkable
class Store(Protocol):
    #: seconds between polls when waiting for a key; backends over object storage back
    #: off exponentially from this, capped at 5 s (see ``poll_delays``).
    poll_interval_s: float

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        """Atomically create or replace ``key``; with ``fence``, raise StaleRoundError
        unless the announcement that returned ``fence`` is still current."""
        ...

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        """Write ``key`` only if it is absent: None when this call created it, else the
        value already there (whoever created it first won). With ``fence``, raise
        StaleRoundError (and write nothing) unless that announcement is still current."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent. Never blocks longer than the backend's request
        timeout; a backend that cannot be reached raises ``AggregationError`` naming it."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; absent is fine."""
        ...

    def announce(self, key: str, value: bytes) -> Any:
        """Put ``key`` and return a fence token for later fenced writes (None: no fencing)."""
        ...

    def keep_alive(self, key: str, value: bytes, ttl_s: float, *, exclusive: bool = False) -> Any:
        """Put ``key`` so that it disappears ``ttl_s`` after the returned handle's
        ``stop()`` or the holder's death; the handle refreshes it in the background.
        Backends without leases put it plainly and return a handle whose stop deletes it.
        With ``exclusive``, raise :class:`KeyHeldError` when the key is already there (a
        transaction on etcd; a check, then the put, elsewhere)."""
        ...

    def describe(self) -> str:
        """Where the store is, for error messages: ``etcd://127.0.0.1:2379``, a path, ..."""
        ...

    def close(self) -> None: ...


@dataclass
class StoreCounters:
    """What one store object sent and received: requests (each round trip to the server
    or the file system), and the bytes of values read and written. Watch events pushed by
    the server are counted in ``events`` and their bytes in ``bytes_read``, not as
    requests."""

    requests: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    events: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, requests: int = 0, read: int = 0, written: int = 0, events: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_read += read
            self.bytes_written += written
            self.events += events

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "requests": self.requests,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "events": self.events,
            }


def counters_of(store: Any) -> dict[str, int]:
    """The store's counters (zeros for a store that does not count)."""
    c = getattr(store, "counters", None)
    if isinstance(c, StoreCounters):
        return c.snapshot()
    return {"requests": 0, "bytes_read": 0, "bytes_written": 0, "events": 0}


class PrefixWatch(Protocol):
    """What ``store.watch(prefix)`` returns: a local copy of every key under ``prefix``,
    kept current by the server's pushes.

    ``get`` and ``items`` read the local copy (no request). ``wait`` blocks until anything
    under the prefix changed since the previous ``wait`` returned, or ``timeout_s`` passed
    (False). ``drain`` returns the keys that changed since the previous ``drain`` (value or
    None for a deletion). ``error`` is the last problem of the stream (it reconnects by
    itself); ``close`` ends it."""

    def get(self, key: str) -> bytes | None: ...

    def items(self) -> dict[str, bytes]: ...

    def wait(self, timeout_s: float) -> bool: ...

    def drain(self) -> dict[str, bytes | None]: ...

    @property
    def error(self) -> str | None: ...

    def close(self) -> None: ...


def get_many(store: Store, keys: list[str]) -> list[bytes | None]:
    """Several gets at once: as few requests as the backend allows (etcd: transactions of at
    most 64 reads, under its default ``--max-txn-ops`` of 128), else one get per key."""
    batched = getattr(store, "get_many", None)
    if batched is not None:
        return list(batched(keys))
    return [store.get(k) for k in keys]


def poll_delays(first_s: float, cap_s: float = 5.0, factor: float = 1.6) -> Iterator[float]:
    """Exponential backoff: first_s, first_s*1.6, ... capped at ``cap_s`` (forever)."""
    d = first_s
    while True:
        yield d
        d = min(cap_s, d * factor)
