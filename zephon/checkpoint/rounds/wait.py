"""How a round waits: one time budget, backoff, and reads that the store pushes where it
can (etcd watches) and that are polled where it cannot (a directory, TCPStore, JAX).

Polling is sized by the world size, so that however many ranks wait, together they read
the store about as often: a follower backs off to the larger of the store's
``poll_max_interval_s`` and ``world_size * FOLLOWER_POLL_PER_RANK_S`` (all followers
together then poll about ``1 / FOLLOWER_POLL_PER_RANK_S`` = 2,500 times a second), starting
from an eighth of that; at 8 ranks that is the store's own cap (5 ms for a local directory),
at 1,024 ranks 0.41 s, which is also about how late a follower sees the commit. The leader,
one rank, polls at the store's pace up to ``world_size * LEADER_POLL_PER_RANK_S`` (20 ms at
1,024 ranks: it lists the states directory, which grows with the world).
"""

from __future__ import annotations

import random
import time
from typing import Any, TypeGuard

from zephon.checkpoint.stores.base import BaseStore, PrefixWatch, poll_delays

__all__ = [
    "FOLLOWER_POLL_PER_RANK_S",
    "LEADER_POLL_PER_RANK_S",
    "ControlView",
    "Deadline",
    "Poller",
    "PrefixFeed",
    "await_written",
]

FOLLOWER_POLL_PER_RANK_S = 400e-6
LEADER_POLL_PER_RANK_S = 20e-6
#: a rank that waits on a watch still wakes this often (to check its budget and its
#: leader's grace period); those wakes send no request
WATCH_WAKE_S = 0.25
#: how long a new watch may take to load its first copy before reads go to the store
WATCH_SYNC_S = 2.0


class Deadline:
    """One time budget for the whole round."""

    def __init__(self, timeout_s: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + timeout_s

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def elapsed_ms(self) -> float:
        return self.elapsed_s() * 1e3


class Poller:
    """Sleeps between polls, backing off as far as the store allows, never past the deadline.

    ``per_rank_s`` times ``world_size`` raises the store's cap (see the module docstring);
    the first interval is the store's, or an eighth of a raised cap.
    """

    def __init__(
        self, store: BaseStore, deadline: Deadline, world_size: int = 1, per_rank_s: float = 0.0
    ) -> None:
        first = float(store.poll_interval_s)
        store_cap = max(first, store.poll_max_interval_s or 0.0)
        cap = max(first, store_cap, world_size * per_rank_s)
        if cap > store_cap:
            first = max(first, cap / 8)
        self.cap_s = cap
        self._delays = poll_delays(first, cap)
        self._deadline = deadline
        self._jitter = random.Random()

    def sleep(self) -> bool:
        """Sleep one poll interval (give or take a fifth, so that ranks which started
        together do not all wake together); False (without sleeping) once the budget is
        spent."""
        remaining = self._deadline.remaining()
        if remaining <= 0:
            return False
        time.sleep(min(next(self._delays) * (0.8 + 0.4 * self._jitter.random()), remaining))
        return True


def open_watch(store: BaseStore, prefix: str) -> PrefixWatch | None:
    """``store.watch(prefix)``, given up to ``WATCH_SYNC_S`` to load its first copy; None
    where the store cannot push."""
    w = store.watch(prefix)
    if w is not None:
        w.synced.wait(WATCH_SYNC_S)
    return w


def _healthy(watch: PrefixWatch | None) -> TypeGuard[PrefixWatch]:
    return watch is not None and watch.error is None and watch.synced.is_set()


class ControlView:
    """A follower's (or the leader's) reads of a few control keys while it waits: from the
    watch's local copy while the watch is healthy (no request), else from the store."""

    def __init__(
        self,
        store: BaseStore,
        watch: PrefixWatch | None,
        deadline: Deadline,
        world_size: int,
        per_rank_s: float = FOLLOWER_POLL_PER_RANK_S,
    ) -> None:
        self.store = store
        self.watch = watch
        self.deadline = deadline
        self._poller = Poller(store, deadline, world_size, per_rank_s)

    @property
    def interval_s(self) -> float:
        """The longest this view waits between two looks at the store."""
        return WATCH_WAKE_S if _healthy(self.watch) else self._poller.cap_s

    @property
    def pushed(self) -> bool:
        """Whether reads come from the store's pushes right now."""
        return _healthy(self.watch)

    def get(self, key: str) -> bytes | None:
        if _healthy(self.watch):
            value: bytes | None = self.watch.get(key)
            return value
        return self.store.get(key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if _healthy(self.watch):
            return [self.watch.get(k) for k in keys]
        return self.store.get_many(keys)

    def changes(self) -> dict[str, bytes | None] | None:
        """The keys the watch changed since the previous call (see ``PrefixWatch.drain``),
        while reads come from it; else None."""
        return self.watch.drain() if _healthy(self.watch) else None

    def sleep(self) -> bool:
        """Wait for a change (watch) or one poll interval; False once the budget is spent."""
        remaining = self.deadline.remaining()
        if remaining <= 0:
            return False
        if _healthy(self.watch):
            self.watch.wait(min(WATCH_WAKE_S, remaining))
            return True
        return self._poller.sleep()


class PrefixFeed:
    """The values under a prefix that the leader has not seen yet, each read once: pushed
    by a watch, or found by listing the prefix (one request) and reading only new keys, or
    (stores that cannot list) by reading the keys still missing. Without ``values`` only
    the names count: a listed key is not read (its value reads as ``b""``). Keys in
    ``known`` (this rank's own) are never read."""

    def __init__(
        self,
        store: BaseStore,
        watch: PrefixWatch | None,
        prefix: str,
        expected: list[str],
        values: bool = True,
        known: tuple[str, ...] = (),
    ) -> None:
        self.store = store
        self.watch = watch
        self.prefix = prefix
        self.values = values
        self._missing = set(expected)
        self._seen: set[str] = set(known)
        self._pushed = False
        self._backlog: dict[str, bytes] = {}
        if _healthy(watch):  # what arrived before this feed existed is in the copy already
            self._pushed = True
            self._backlog = {
                k: v
                for k, v in watch.items().items()
                if k.startswith(prefix) and k not in self._seen
            }

    def poll(self, changes: dict[str, bytes | None] | None = None) -> dict[str, bytes]:
        """New key -> value since the last poll. With a watch, ``changes`` are the watch's
        drained changes (the caller drains once and hands them to every feed)."""
        fresh: dict[str, bytes] = {}
        if self._backlog:
            fresh.update(self._backlog)
            self._backlog = {}
        if self._pushed and _healthy(self.watch):
            for k, v in (changes or {}).items():
                if v is not None and k.startswith(self.prefix) and k not in self._seen:
                    fresh[k] = v
        else:
            if self._pushed:  # the watch broke: from now on read the store
                self._pushed = False
            listed = self.store.list_keys(self.prefix)
            if listed is not None:
                names = [k for k in listed if k not in self._seen]
                if not self.values:
                    fresh.update(dict.fromkeys(names, b""))
                    names = []
            else:
                names = sorted(self._missing - self._seen)
            if names:
                for k, v in zip(names, self.store.get_many(names), strict=True):
                    if v is not None:
                        fresh[k] = v
        for k in fresh:
            self._seen.add(k)
        return fresh

    def forget(self, key: str) -> None:
        """Read ``key`` again when it next appears (its value did not count)."""
        self._seen.discard(key)


def await_written(view: ControlView, prefix: str, pending: dict[str, Any]) -> list[Any]:
    """Wait, within ``view``'s budget, until the keys of ``pending`` (each under
    ``prefix``, mapped to what it stands for) are written: seen in the watch's pushes, or
    in a listing of ``prefix`` (one request; a listed key is written, none is read), or
    (stores that cannot list) by reading the keys still missing. Returns what the keys
    still missing stand for, sorted."""
    feed = PrefixFeed(view.store, view.watch, prefix, list(pending), values=False)
    remaining = dict(pending)
    while remaining:
        changes = view.changes()
        for key in feed.poll(changes):
            remaining.pop(key, None)
        if not remaining or not view.sleep():
            break
    return sorted(remaining.values())
