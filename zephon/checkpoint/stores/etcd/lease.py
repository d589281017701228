"""Leases of the etcd store: a key that lives while its holder keeps refreshing it.

``EtcdStore.keep_alive`` grants a lease of ``ceil(ttl_s)`` seconds and puts the key with it;
the :class:`EtcdLease` it returns refreshes the lease every ``ttl_s / 3`` from a daemon
thread with its own connection, and ``stop()`` revokes it (the key vanishes at once). A
lease the server reports expired is never re-granted: the handle's ``lost`` turns True
instead, as it does once ``ttl_s`` has passed since the last refresh the server confirmed
(a holder that was paused knows as soon as it resumes).
"""

from __future__ import annotations

import logging
import math
import threading
import time

from zephon.checkpoint.stores.base import KeyHeldError
from zephon.checkpoint.stores.etcd.client import EtcdClient
from zephon.checkpoint.stores.etcd.gateway import _Connection
from zephon.errors import AggregationError

log = logging.getLogger(__name__)


class EtcdLease:
    """The handle ``EtcdStore.keep_alive`` returns: a daemon thread refreshes the lease
    every ``ttl_s / 3``; ``stop()`` revokes it, so the key disappears at once."""

    def __init__(self, store: EtcdClient, key: str, lease_id: int, ttl_s: float) -> None:
        self.key = key
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self._lost = False  # the server let the lease expire (this holder was too slow)
        self._last_ok = time.monotonic()
        self._store = store
        self._stop = threading.Event()
        self.stopped = False
        self._conn = _Connection(
            store.endpoints, min(store.request_timeout_s, ttl_s / 3), store.counters
        )
        self._thread = threading.Thread(
            target=self._run, name=f"zephon-etcd-lease-{key}", daemon=True
        )
        self._thread.start()

    @classmethod
    def grant(
        cls, store: EtcdClient, key: str, value: bytes, ttl_s: float, *, exclusive: bool
    ) -> EtcdLease:
        """Grant a lease of ``ceil(ttl_s)`` seconds, put ``key`` with it (only if absent,
        when ``exclusive``) and start refreshing it; the lease is revoked if the put fails.

        Raises:
            KeyHeldError: ``exclusive`` and the key exists; the error carries its value.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0; got {ttl_s}")
        ttl = max(1, math.ceil(ttl_s))
        grant = store._call("/lease/grant", {"TTL": ttl, "ID": 0}, f"lease grant for {key!r}")
        if grant.get("error"):
            raise AggregationError(f"etcd at {store.describe()} refused a lease: {grant['error']}")
        lease_id = int(grant["ID"])
        try:
            won, existing, _ = store._write(
                key, bytes(value), fence=None, lease_id=lease_id, create=exclusive
            )
        except BaseException:
            _revoke_quietly(store, lease_id)
            raise
        if not won:
            _revoke_quietly(store, lease_id)
            raise KeyHeldError(key, existing or b"", store.describe())
        return cls(store, key, lease_id, ttl_s)

    def __repr__(self) -> str:
        return f"EtcdLease(key={self.key!r}, lease_id={self.lease_id}, ttl_s={self.ttl_s})"

    @property
    def lost(self) -> bool:
        """True once the lease may have expired on the server: it said so, or no refresh
        was confirmed for ``ttl_s`` (a paused holder knows as soon as it runs again)."""
        if not self._lost and time.monotonic() - self._last_ok > self.ttl_s:
            self._lost = True
        return self._lost

    @lost.setter
    def lost(self, value: bool) -> None:
        self._lost = bool(value)

    def _run(self) -> None:
        interval = self.ttl_s / 3
        prefix = self._store.log_prefix
        while not self._stop.wait(interval):
            sent = time.monotonic()
            try:
                result = self._conn.call(
                    "/lease/keepalive", {"ID": self.lease_id}, f"lease keep-alive for {self.key!r}"
                )
            except AggregationError as e:
                if self.lost:
                    log.warning("%slease for %r lost: %s", prefix, self.key, e)
                    return
                continue
            ttl = int((result.get("result") or {}).get("TTL", -1))
            if ttl <= 0:  # expired on the server; never resurrect it
                self._lost = True
                log.warning("%slease for %r expired on the server", prefix, self.key)
                return
            if self.lost:  # confirmed too late: the key may have been gone meanwhile
                log.warning("%slease for %r lapsed while this process was paused", prefix, self.key)
                return
            self._last_ok = sent

    def stop(self) -> None:
        """Stop refreshing and revoke the lease (its key vanishes now); idempotent."""
        if self.stopped:
            return
        self.stopped = True
        self._stop.set()
        self._thread.join(timeout=self._conn.timeout_s * len(self._conn.clients) + 1)
        try:
            self._conn.call("/lease/revoke", {"ID": self.lease_id}, f"lease revoke {self.key!r}")
        except AggregationError as e:
            # the key still vanishes when the lease runs out
            log.warning(
                "%scould not revoke the lease for %r (it expires in %s s): %s",
                self._store.log_prefix,
                self.key,
                self.ttl_s,
                e,
            )
        finally:
            self._conn.close()

    def __enter__(self) -> EtcdLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _revoke_quietly(store: EtcdClient, lease_id: int) -> None:
    try:
        store._call("/lease/revoke", {"ID": lease_id}, "lease revoke")
    except AggregationError as e:
        log.warning("%scould not revoke lease %d: %s", store.log_prefix, lease_id, e)
