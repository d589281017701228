"""A store that keeps a round's coordination keys in one backend and its bulk, the ranks'
state records, in another: ``aggregate_store="etcd://host:2379?blobs=/shared/dir"``.

etcd is made for small coordination keys: every write goes through its raft log (and,
through the JSON gateway, costs it about 2.6 ms of CPU), and every revision stays in its
database until compacted. Rounds over etcd alone write each rank's state there and compact
after every committed round; at a thousand ranks those writes are most of the round. With a
blob location (a shared directory or an fsspec URL such as ``s3://bucket/zephon``), the
state records (``<job>.<pipeline>.s.<round>.<rank>``, see
:mod:`zephon.checkpoint.rounds.keys`; kept for the followers' shares until the next round
is acknowledged) and the followers' acknowledgements go there, and etcd carries only the
announcement, the liveness lease, the fence and the commit manifest, which followers still
receive by watch. The commit manifest names the
states by round id and rank, and lists their digests.
"""

from __future__ import annotations

import re
from typing import Any

from zephon.checkpoint.stores.base import Store, StoreCounters, get_many

__all__ = ["SplitStore"]

_STATE = re.compile(r"j[0-9a-f]+\.p[0-9a-f]+\.[sa]\.")  # the ranks' state records, the acks
_CONTROL = re.compile(r"j[0-9a-f]+\.p[0-9a-f]+\.c\.")  # their control prefix


class SplitStore:
    """State records in ``blobs``, every other key in ``control`` (see the module
    docstring). Fences, leases, watches and compaction are ``control``'s; a watch is only
    offered for prefixes that hold no state records."""

    def __init__(self, control: Store, blobs: Store) -> None:
        self.control = control
        self.blobs = blobs
        self.poll_interval_s = float(blobs.poll_interval_s)
        self.poll_max_interval_s = float(
            getattr(blobs, "poll_max_interval_s", blobs.poll_interval_s)
        )
        self.counters = StoreCounters()
        for s in (control, blobs):
            if isinstance(getattr(s, "counters", None), StoreCounters):
                s.counters = self.counters  # type: ignore[attr-defined]
        if callable(getattr(control, "announce_with", None)):
            self.announce_with = control.announce_with  # type: ignore[attr-defined]
        if callable(getattr(control, "create_and_delete", None)):
            self.create_and_delete = control.create_and_delete  # type: ignore[attr-defined]
        if callable(getattr(control, "compact", None)):
            self.compact = control.compact  # type: ignore[attr-defined]
        if callable(getattr(blobs, "make_room", None)):
            self.make_room = blobs.make_room  # type: ignore[attr-defined]  # states, acks

    def __repr__(self) -> str:
        return f"SplitStore({self.describe()!r})"

    @property
    def log_prefix(self) -> str:
        return str(getattr(self.control, "log_prefix", ""))

    @log_prefix.setter
    def log_prefix(self, value: str) -> None:
        for s in (self.control, self.blobs):
            if hasattr(s, "log_prefix"):
                s.log_prefix = value  # type: ignore[attr-defined]

    def _for(self, key: str) -> Store:
        return self.blobs if _STATE.match(key) else self.control

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        self._for(key).put(key, value, fence=None if _STATE.match(key) else fence)

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        return self._for(key).create(key, value, fence=None if _STATE.match(key) else fence)

    def get(self, key: str) -> bytes | None:
        return self._for(key).get(key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        out: dict[str, bytes | None] = {}
        for store in (self.control, self.blobs):
            mine = [k for k in keys if self._for(k) is store]
            if mine:
                out.update(zip(mine, get_many(store, mine), strict=True))
        return [out[k] for k in keys]

    def delete(self, key: str) -> None:
        self._for(key).delete(key)

    def list_keys(self, prefix: str) -> list[str]:
        store = self._for(prefix)
        listing = getattr(store, "list_keys", None)
        if not callable(listing):
            raise NotImplementedError(f"{store.describe()} cannot list keys")
        keys: list[str] = listing(prefix)
        return keys

    def delete_prefix(self, prefix: str) -> None:
        for store in {
            id(self._for(prefix)): self._for(prefix),
            id(self.control): self.control,
        }.values():
            delete_prefix = getattr(store, "delete_prefix", None)
            if callable(delete_prefix):
                delete_prefix(prefix)

    def announce(self, key: str, value: bytes) -> Any:
        return self.control.announce(key, value)

    def keep_alive(self, key: str, value: bytes, ttl_s: float, *, exclusive: bool = False) -> Any:
        return self.control.keep_alive(key, value, ttl_s, exclusive=exclusive)

    def watch(self, prefix: str) -> Any:
        """The control store's watch of a control prefix; None for any prefix that may
        hold state records (those are polled in the blob location)."""
        watch = getattr(self.control, "watch", None)
        if callable(watch) and _CONTROL.match(prefix):
            return watch(prefix)
        return None

    def describe(self) -> str:
        return f"{self.control.describe()} (states in {self.blobs.describe()})"

    def close(self) -> None:
        try:
            self.control.close()
        finally:
            self.blobs.close()
