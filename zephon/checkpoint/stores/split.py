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
from collections.abc import Sequence
from typing import Any

from zephon.checkpoint.stores.base import BaseStore, KeepAlive, PrefixWatch, check_store

__all__ = ["SplitStore"]

_STATE = re.compile(r"j[0-9a-f]+\.p[0-9a-f]+\.[sa]\.")  # the ranks' state records, the acks
_CONTROL = re.compile(r"j[0-9a-f]+\.p[0-9a-f]+\.c\.")  # their control prefix


class SplitStore(BaseStore):
    """State records in ``blobs``, every other key in ``control`` (see the module
    docstring). Fences, leases, watches and compaction are ``control``'s; a watch is only
    offered for prefixes that hold no state records. A call whose keys all live in one of
    the two goes to that store whole (etcd's one-transaction ``announce_with``); one that
    spans both takes :class:`BaseStore`'s way, a request per key, each to its own store."""

    def __init__(self, control: BaseStore, blobs: BaseStore) -> None:
        self.control = check_store(control, "SplitStore's control store")
        self.blobs = check_store(blobs, "SplitStore's blob store")
        self.poll_interval_s = float(blobs.poll_interval_s)
        self.poll_max_interval_s = blobs.poll_max_interval_s
        self.announce_batches = control.announce_batches  # (its keys are control's)
        for s in (control, blobs):
            s.counters = self.counters

    def __repr__(self) -> str:
        return f"SplitStore({self.describe()!r})"

    @property  # type: ignore[override]
    def log_prefix(self) -> str:
        return self.control.log_prefix

    @log_prefix.setter
    def log_prefix(self, value: str) -> None:
        self.control.log_prefix = value
        self.blobs.log_prefix = value

    def _for(self, key: str) -> BaseStore:
        return self.blobs if _STATE.match(key) else self.control

    def _one_store(self, keys: Sequence[str]) -> BaseStore | None:
        """The store that holds every one of ``keys``, or None when they span both."""
        stores = {id(self._for(k)): self._for(k) for k in keys}
        return next(iter(stores.values())) if len(stores) == 1 else None

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
                out.update(zip(mine, store.get_many(mine), strict=True))
        return [out[k] for k in keys]

    def delete(self, key: str) -> None:
        self._for(key).delete(key)

    def list_keys(self, prefix: str) -> list[str] | None:
        return self._for(prefix).list_keys(prefix)

    def delete_prefix(self, prefix: str, known: Sequence[str] = ()) -> None:
        for store in {id(s): s for s in (self._for(prefix), self.control)}.values():
            store.delete_prefix(prefix, [k for k in known if self._for(k) is store])

    def announce(self, key: str, value: bytes) -> Any:
        return self.control.announce(key, value)

    def announce_with(
        self, key: str, value: bytes, also: dict[str, bytes], delete: Sequence[str] = ()
    ) -> Any:
        if self._one_store([key, *also, *delete]) is self.control:
            return self.control.announce_with(key, value, also, delete)
        return super().announce_with(key, value, also, delete)

    def create_and_delete(
        self, key: str, value: bytes, *, fence: Any = None, delete: Sequence[str] = ()
    ) -> bytes | None:
        if self._one_store([key, *delete]) is self.control:
            return self.control.create_and_delete(key, value, fence=fence, delete=delete)
        return super().create_and_delete(key, value, fence=fence, delete=delete)

    def keep_alive(
        self, key: str, value: bytes, ttl_s: float, *, exclusive: bool = False
    ) -> KeepAlive:
        return self.control.keep_alive(key, value, ttl_s, exclusive=exclusive)

    def watch(self, prefix: str) -> PrefixWatch | None:
        """The control store's watch of a control prefix; None for any prefix that may
        hold state records (those are polled in the blob location)."""
        return self.control.watch(prefix) if _CONTROL.match(prefix) else None

    def make_room(self, prefixes: list[str]) -> None:
        for store in (self.control, self.blobs):
            mine = [p for p in prefixes if self._for(p) is store]
            if mine:
                store.make_room(mine)

    def compact(self) -> int | None:
        self.blobs.compact()
        return self.control.compact()

    def describe(self) -> str:
        return f"{self.control.describe()} (states in {self.blobs.describe()})"

    def close(self) -> None:
        try:
            self.control.close()
        finally:
            self.blobs.close()
