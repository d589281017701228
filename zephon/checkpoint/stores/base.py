"""The key-value store that multi-rank checkpoint rounds run over: :class:`BaseStore`.

One protocol (``zephon.checkpoint.rounds``) runs over every backend: a local or shared
directory, an fsspec URL, etcd, the JAX coordination service, torch's TCPStore. Every store
subclasses :class:`BaseStore`, and so must one you write yourself (``Aggregator`` refuses
anything else with a ``TypeError``): the round calls each method the same way on every
backend, and never asks what a store is.

**Required** (abstract): ``put`` (an atomic whole-value write), ``get`` (None for an absent
key), ``delete``, ``describe`` and ``create``: a put that only succeeds when the key is
absent and otherwise returns the value that won. That one primitive is what makes a round's
outcome a single decision every rank agrees on (the leader's commit and a follower's "I
gave up" race for the same key; see ``zephon.checkpoint.rounds``).

**Optional powers** make rounds cheaper or safer where a backend has them. Each has a
default here that is correct on any store, and a backend overrides it where it can do
better:

============================  =================================  ===========================
power                         the default                        overridden by
============================  =================================  ===========================
``announce`` (a fence)        a plain put; no fence              etcd, directory
``keep_alive`` (a lease)      a plain put; ``stop()`` deletes    etcd, directory
``get_many``                  one ``get`` per key                etcd, split
``list_keys``                 None: cannot list                  etcd, directory, split
``delete_prefix``             list (or the keys the caller       etcd, directory, split
                              knows), delete one by one
``watch``                     None: waiters poll                 etcd (split: its control)
``make_room``                 nothing to prepare                 local directory, split
``compact``                   nothing to compact                 etcd, split
``announce_with``             ``announce``, then puts, deletes   etcd, split
``create_and_delete``         deletes, then ``create``           etcd, split
``counters``                  a fresh :class:`StoreCounters`     every store counts
``log_prefix``                ``""``                             (set by the round)
``poll_interval_s``           0.01 s                             every store
``poll_max_interval_s``       None: no backoff                   etcd, directory
``announce_batches``          False                              etcd, split
``close``                     nothing to release                 every store
============================  =================================  ===========================

Without fences and leases (the JAX and torch stores, a store of your own) a round relies on
its decision key, the failure notice and its time budget.

Polling: waiters sleep ``poll_interval_s`` between reads, backing off exponentially up to
``poll_max_interval_s`` where a store sets it (``poll_delays``; object storage uses 5 s).
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from zephon.errors import AggregationError

__all__ = [
    "BaseStore",
    "KeepAlive",
    "KeyHeldError",
    "PlainHandle",
    "PrefixWatch",
    "StaleRoundError",
    "StoreCounters",
    "check_store",
    "poll_delays",
]

log = logging.getLogger(__name__)


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


class KeepAlive(Protocol):
    """What ``keep_alive`` returns: ``stop()`` ends the key (idempotent), and ``lost`` is
    True once the key may have expired under its living holder (a paused process, a lease
    the server dropped): the round's leader then gives the round up instead of
    committing."""

    @property
    def lost(self) -> bool: ...

    def stop(self) -> None: ...


class PrefixWatch(Protocol):
    """What ``store.watch(prefix)`` returns: a local copy of every key under ``prefix``,
    kept current by the server's pushes.

    ``synced`` is set once the first copy is loaded (the round reads the store itself until
    then). ``get`` and ``items`` read the local copy (no request). ``wait`` blocks until
    anything under the prefix changed since the previous ``wait`` returned, or ``timeout_s``
    passed (False). ``drain`` returns the keys that changed since the previous ``drain``
    (value or None for a deletion). ``error`` is the last problem of the stream (it
    reconnects by itself); ``close`` ends it."""

    synced: threading.Event

    def get(self, key: str) -> bytes | None: ...

    def items(self) -> dict[str, bytes]: ...

    def wait(self, timeout_s: float) -> bool: ...

    def drain(self) -> dict[str, bytes | None]: ...

    @property
    def error(self) -> str | None: ...

    def close(self) -> None: ...


class PlainHandle:
    """``keep_alive`` without leases: the key is a plain put, and ``stop()`` deletes it. It
    is never ``lost``: the key cannot expire."""

    def __init__(self, store: BaseStore, key: str) -> None:
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


class BaseStore(abc.ABC):
    """What every store is: five required methods, and optional powers with defaults that
    are correct on any store (see the module docstring for the table).

    Keys are the round's short ASCII names (letters, digits and ``._-``; see
    :mod:`zephon.checkpoint.rounds.keys`); values are bytes, possibly empty (an empty value
    is present, not absent). Every method may raise ``AggregationError`` naming the store
    when it cannot be reached; it never blocks much longer than the backend's request
    timeout.
    """

    #: seconds between polls when waiting for a key (see ``poll_delays``)
    poll_interval_s: float = 0.01
    #: where polling backs off to; None: no backoff, every poll ``poll_interval_s`` apart
    poll_max_interval_s: float | None = None
    #: put before the store's own log lines (background warnings of leases, watches); the
    #: round sets ``"[rank=N] "``
    log_prefix: str = ""
    #: whether ``announce_with`` is one request (etcd: a transaction). Where it is, the
    #: round leaves the deletions that can wait (commits no rank needs any more) to its next
    #: announcement; where each key is a request anyway, it sends them as soon as they may
    #: go.
    announce_batches: bool = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"

    # ------------------------------------------------------------------------- required

    @abc.abstractmethod
    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        """Atomically create or replace ``key`` (a reader sees the old value or the new
        one, never a part).

        Args:
            fence: what ``announce`` returned: the write succeeds only while that
                announcement is still current. A store whose ``announce`` returns None
                receives None here.

        Raises:
            StaleRoundError: the fence's announcement was replaced or removed.
        """

    @abc.abstractmethod
    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        """Write ``key`` only if it is absent: None when this call created it, else the
        value already there (whoever created it first won; of several racing writers
        exactly one wins). With ``fence``, raise StaleRoundError (and write nothing)
        unless that announcement is still current."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or None when absent. Never waits for an absent key."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; absent is fine."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the store is, for error messages: ``etcd://127.0.0.1:2379``, a path, ..."""

    # ------------------------------------------------------------ fences and leases

    def announce(self, key: str, value: bytes) -> Any:
        """Put ``key`` and return a fence for later fenced ``put``/``create`` calls, which
        succeed only while this announcement is current (a stalled old leader then cannot
        commit over a newer round).

        Default: a plain put, returning None (no fence: fenced writes are plain writes).
        etcd fences on the key's revision, in one transaction with the write; the
        directory stores re-read the key before a fenced write (best effort)."""
        self.put(key, value)
        return None

    def keep_alive(
        self, key: str, value: bytes, ttl_s: float, *, exclusive: bool = False
    ) -> KeepAlive:
        """Put ``key`` so that it disappears ``ttl_s`` after the returned handle's
        ``stop()`` or the holder's death, so followers learn of a dead leader. With
        ``exclusive``, raise :class:`KeyHeldError` when the key is already there.

        Default: a plain put, returning a :class:`PlainHandle` whose ``stop()`` deletes the
        key; the key never expires. ``exclusive`` is not honoured there: a dead holder's
        key never expires (torchrun's agent store outlives a restarted rank), so refusing
        to overwrite it would lock a restarted job out. etcd grants a lease (a
        transaction, for ``exclusive``); the directory stores write the value framed with
        an expiry and rewrite it from a thread."""
        self.put(key, value)
        return PlainHandle(self, key)

    # ------------------------------------------------------------------ reads in bulk

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """``[get(k) for k in keys]`` in as few requests as the backend allows.

        Default: one get per key. etcd reads them in transactions of at most 64 reads."""
        return [self.get(k) for k in keys]

    def list_keys(self, prefix: str) -> list[str] | None:
        """The keys that start with ``prefix``, sorted; None when the store cannot list.

        Where a store lists, the leader reads each state once, as it arrives, instead of
        polling the keys still missing. Default: None (TCPStore and the JAX service cannot
        list). etcd does a keys-only range read; the directory stores read the
        subdirectories that can match."""
        return None

    def delete_prefix(self, prefix: str, known: Sequence[str] = ()) -> None:
        """Remove every key that starts with ``prefix``; a store that cannot list removes
        the keys in ``known`` (those the caller may have written there).

        Default: the listed keys (else ``known``) deleted one by one; each is tried, and
        the first error raised after the others. etcd deletes the range in one request;
        the directory stores also remove the emptied subdirectories."""
        listed = self.list_keys(prefix)
        errors: list[Exception] = []
        for key in listed if listed is not None else known:
            try:
                self.delete(key)
            except Exception as e:  # noqa: BLE001 - the others still go; raised below
                errors.append(e)
        if errors:
            raise errors[0]

    def watch(self, prefix: str) -> PrefixWatch | None:
        """A :class:`PrefixWatch` of every key under ``prefix``, kept current by the
        server's pushes, so waiting ranks send no requests; None: the store cannot push,
        and waiters poll. Default: None. etcd watches; the split store offers its control
        store's watch for control prefixes."""
        return None

    # --------------------------------------------------------------- round-sized writes

    def make_room(self, prefixes: list[str]) -> None:
        """Prepare for many ranks writing keys under each of ``prefixes`` (each ending with
        a dot: a round's states, its acknowledgements) at once.

        Default: nothing to prepare. The local directory store makes each prefix's
        subdirectory, so a thousand followers do not each find it missing and race to
        make it."""
        return None

    def compact(self) -> int | None:
        """Drop the history of deleted keys after a committed round; returns the point
        compacted to, where the store has one.

        Default: nothing (None). etcd keeps every revision until compacted, and its
        database quota counts them."""
        return None

    def announce_with(
        self, key: str, value: bytes, also: dict[str, bytes], delete: Sequence[str] = ()
    ) -> Any:
        """``announce(key, value)``, ``put`` of every ``also`` item and ``delete`` of every
        ``delete`` key (keys whose removal could wait: the round's old commits); returns the
        fence. A store with transactions does it all in one request (one revision, one
        event per watcher).

        Default: the announcement, then the puts, then the deletes, one request each; a
        delete that fails leaves its key behind with a warning (the announcement stands).
        etcd: one transaction."""
        fence = self.announce(key, value)
        for k, v in also.items():
            self.put(k, v)
        for k in delete:
            try:
                self.delete(k)
            except Exception as e:  # noqa: BLE001 - a leftover, not the announcement's failure
                log.warning(
                    "%scould not delete %r in %s: %s", self.log_prefix, k, self.describe(), e
                )
        return fence

    def create_and_delete(
        self, key: str, value: bytes, *, fence: Any = None, delete: Sequence[str] = ()
    ) -> bytes | None:
        """``create(key, value, fence=fence)`` that also deletes the ``delete`` keys.

        Default: the deletes first, then the create, so the deleted keys are gone whether
        or not the create wins (pass only keys whose deletion is right either way). etcd:
        one transaction, deleting them only when it creates the key."""
        for k in delete:
            self.delete(k)
        return self.create(key, value, fence=fence)

    # ----------------------------------------------------------------- bookkeeping

    @property
    def counters(self) -> StoreCounters:
        """The requests and bytes this store object sent and received (the round's
        figures, :class:`~zephon.checkpoint.rounds.stats.RoundStats`).

        Default: a :class:`StoreCounters` made on first use, that a store adds to as it
        works (one that never does reports zeros)."""
        counters: StoreCounters = self.__dict__.setdefault("_counters", StoreCounters())
        return counters

    @counters.setter
    def counters(self, value: StoreCounters) -> None:
        self.__dict__["_counters"] = value

    def close(self) -> None:
        """Release what this store object holds (connections, threads, leases still held);
        the keys of others stay. Default: nothing to release."""
        return None


def check_store(store: object, what: str = "store") -> BaseStore:
    """``store``, checked to be a :class:`BaseStore`.

    Raises:
        TypeError: it is not one, naming its type and what to do.
    """
    if not isinstance(store, BaseStore):
        raise TypeError(
            f"{what} must be a zephon.checkpoint.stores.BaseStore (subclass it: put, create,"
            f" get, delete and describe are required, the rest have defaults); got"
            f" {type(store).__module__}.{type(store).__qualname__}"
        )
    return store


def poll_delays(first_s: float, cap_s: float = 5.0, factor: float = 1.6) -> Iterator[float]:
    """Exponential backoff: first_s, first_s*1.6, ... capped at ``cap_s`` (forever)."""
    d = first_s
    while True:
        yield d
        d = min(cap_s, d * factor)
