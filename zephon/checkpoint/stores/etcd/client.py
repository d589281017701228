"""What a lease (:mod:`.lease`) and a watch (:mod:`.watch`) use of the etcd store, as a
Protocol: they take the store as an :class:`EtcdClient` and import nothing of ``store.py``,
which imports them."""

from __future__ import annotations

from typing import Any, Protocol

from zephon.checkpoint.stores.base import StoreCounters


class EtcdClient(Protocol):
    """The part of :class:`~zephon.checkpoint.stores.etcd.store.EtcdStore` that its leases
    and watches use: where it talks (its endpoints, timeout and namespace), its counters and
    log prefix, and its calls."""

    endpoints: list[tuple[str, int]]
    namespace: str
    request_timeout_s: float
    counters: StoreCounters
    log_prefix: str

    def describe(self) -> str: ...

    def get(self, key: str) -> bytes | None: ...

    def _key(self, key: str) -> bytes: ...

    def _call(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]: ...

    def _write(
        self,
        key: str,
        value: bytes,
        *,
        fence: Any,
        lease_id: int | None,
        create: bool = False,
        delete: list[str] | None = None,
    ) -> tuple[bool, bytes | None, int]: ...
