"""The small key-value interface that multi-rank checkpoint rounds run over.

One protocol (``zephon.checkpoint.aggregate``) runs over every backend: a shared directory
or fsspec URL, etcd, the JAX coordination service, torch's TCPStore. A store only needs
atomic whole-value puts, gets that return None for absent keys, and deletes; nothing lists
keys (TCPStore cannot), so every key the protocol reads is one it can name.

Two optional powers make rounds safer where a backend has them:

* a *fence*: ``announce`` returns a token, and ``put(..., fence=token)`` succeeds only while
  the announcement it came from is still current, so a stalled old leader cannot publish
  over a newer round (etcd: a transaction on the key's mod revision);
* a *liveness lease*: ``keep_alive(key, ttl_s)`` makes ``key`` vanish ``ttl_s`` after the
  holder stops refreshing it, so followers learn of a dead leader (etcd: a lease).

Backends without them return None from ``announce`` and no-op ``keep_alive``; the protocol
then relies on the failure notice and the round's time budget.

The round never deletes the key it fences on while a fenced write may still follow (it
announces a separate ``generation`` key for that), so "still current" can be checked as
"the key's revision is still the one ``announce`` made" (etcd) or "the key still holds the
announced value" (a directory).

A ``keep_alive`` handle may also expose ``lost`` (optional; absent means False): True
once the key may have expired under its living holder (a paused process, a lease the
server dropped). The round's leader then refuses to publish (its followers may have given
it up for dead) and takes a new lease for the next round.

Polling: waiters sleep ``poll_interval_s`` between reads. A store may also set
``poll_max_interval_s`` (optional; absent means "no backoff"): waiters then back off
exponentially from ``poll_interval_s`` up to it (``poll_delays``); object storage uses 5 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from zephon.errors import AggregationError


class StaleRoundError(AggregationError):
    """A fenced write was refused: the round it belonged to is no longer current."""


@runtime_checkable
class Store(Protocol):
    #: seconds between polls when waiting for a key; backends over object storage back
    #: off exponentially from this, capped at 5 s (see ``poll_delays``).
    poll_interval_s: float

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        """Atomically create or replace ``key``; with ``fence``, raise StaleRoundError
        unless the announcement that returned ``fence`` is still current."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent. Never blocks longer than the backend's request
        timeout; a backend that cannot be reached raises ``AggregationError`` naming it."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; absent is fine."""
        ...

    def announce(self, key: str, value: bytes) -> Any:
        """Put ``key`` and return a fence token for later fenced puts (None: no fencing)."""
        ...

    def keep_alive(self, key: str, value: bytes, ttl_s: float) -> Any:
        """Put ``key`` so that it disappears ``ttl_s`` after the returned handle's
        ``stop()`` or the holder's death; the handle refreshes it in the background.
        Backends without leases put it plainly and return a handle whose stop deletes it."""
        ...

    def describe(self) -> str:
        """Where the store is, for error messages: ``etcd://127.0.0.1:2379``, a path, ..."""
        ...

    def close(self) -> None: ...


def get_many(store: Store, keys: list[str]) -> list[bytes | None]:
    """Several gets at once: one request where the backend offers ``get_many`` (etcd: one
    transaction), else one get per key. Rounds poll many keys per step, and on a busy host
    the number of requests, not their size, is what a round costs."""
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
