"""The etcd store: :class:`EtcdStore`, the :class:`~zephon.checkpoint.stores.base.BaseStore`
over etcd's JSON gateway.

Reads (``get``, ``get_many`` in transactions, paginated ``list_keys``), writes (``put``, the
one-transaction ``create``, ``announce`` and the fenced writes after it, range deletes),
compaction and status; leases and watches it hands to :mod:`~.lease` and :mod:`~.watch`. The
behaviour is described in :mod:`zephon.checkpoint.stores.etcd`; the requests go through
:mod:`~.gateway`, large values through :mod:`~.parts`, fenced and conditional writes are
built in :mod:`~.fence`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from zephon.checkpoint.stores.base import BaseStore, StoreCounters
from zephon.checkpoint.stores.etcd.fence import EtcdFence, conditional_txn, raise_if_stale
from zephon.checkpoint.stores.etcd.gateway import (
    _b64,
    _Connection,
    _endpoint_text,
    _parse_endpoint,
    _prefix_end,
    _Refused,
    _unb64,
    parse_etcd_url,
)
from zephon.checkpoint.stores.etcd.lease import EtcdLease
from zephon.checkpoint.stores.etcd.parts import (
    _PART_MARK,
    _PART_READ_RETRIES,
    _TAG_INLINE,
    DEFAULT_PART_SIZE_BYTES,
    manifest_of,
    nonce_of,
    read_parts,
    write_parts,
)
from zephon.checkpoint.stores.etcd.watch import EtcdWatch
from zephon.errors import AggregationError

log = logging.getLogger(__name__)

#: A value this large in etcd gets a warning (once per process): see :meth:`EtcdStore._write`.
LARGE_VALUE_WARN_BYTES = 256 << 10
_warned_large = False

DEFAULT_NAMESPACE = "zephon/"
DEFAULT_REQUEST_TIMEOUT_S = 5.0
#: operations per transaction, well under etcd's default --max-txn-ops of 128
MAX_TXN_OPS = 64
#: keys per page of a keys-only range read
LIST_PAGE_KEYS = 1000


class EtcdStore(BaseStore):
    """A :class:`~zephon.checkpoint.stores.base.BaseStore` over etcd (see
    :mod:`zephon.checkpoint.stores.etcd`).

    Args:
        endpoints: ``"host:port"`` strings or ``(host, port)`` pairs, tried in order.
        namespace: prefix of every key this store touches.
        request_timeout_s: the limit on each HTTP request (connect and each read).
        part_size_bytes: values larger than this are split into parts of this size.
        poll_interval_s: how often the round protocol first re-reads a key it waits for
            when it cannot watch it.
        poll_max_interval_s: the longest it backs off to between re-reads.
    """

    announce_batches = True  # announce_with is one transaction

    def __init__(
        self,
        endpoints: Sequence[str | tuple[str, int]],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        poll_interval_s: float = 0.002,
        poll_max_interval_s: float = 0.02,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        parsed = [
            e if isinstance(e, tuple) else _parse_endpoint(e, "etcd://" + e) for e in endpoints
        ]
        if not parsed:
            raise ValueError("EtcdStore needs at least one endpoint; got none")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0; got {request_timeout_s}")
        if part_size_bytes < 1024:
            raise ValueError(f"part_size_bytes must be >= 1024; got {part_size_bytes}")
        self.endpoints: list[tuple[str, int]] = parsed
        # "job7" and "job7/" are the same namespace (open_store passes the former)
        self.namespace = namespace if not namespace or namespace.endswith("/") else namespace + "/"
        self.request_timeout_s = float(request_timeout_s)
        self.part_size_bytes = int(part_size_bytes)
        # Start polling fast (a round's steps follow each other within milliseconds) and back
        # off, so that waiting ranks do not flood the server while a slow rank catches up.
        self.poll_interval_s = float(poll_interval_s)
        self.poll_max_interval_s = float(poll_max_interval_s)
        self._conn = _Connection(parsed, self.request_timeout_s)
        self._lock = threading.Lock()  # the store may be shared by a rank's threads
        self._handles: list[EtcdLease] = []
        self._watches: list[EtcdWatch] = []
        #: the store revision of the last answer this store got (what compact() uses)
        self.last_revision: int | None = None

    @property
    def counters(self) -> StoreCounters:
        """What this store sent and received (its connection's count: see
        :class:`~zephon.checkpoint.stores.base.BaseStore`); set, its requests count there."""
        return self._conn.counters

    @counters.setter
    def counters(self, value: StoreCounters) -> None:
        self._conn.counters = value

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> EtcdStore:
        """``EtcdStore.from_url("etcd://127.0.0.1:2379,10.0.0.2:2379/myjob")``."""
        endpoints, namespace = parse_etcd_url(url)
        if namespace is not None:
            kwargs.setdefault("namespace", namespace)
        return cls(endpoints, **kwargs)

    def __repr__(self) -> str:
        return (
            f"EtcdStore({self.describe()!r}, namespace={self.namespace!r}, "
            f"request_timeout_s={self.request_timeout_s:g})"
        )

    def describe(self) -> str:
        return "etcd://" + ",".join(_endpoint_text(h, p) for h, p in self.endpoints)

    # ------------------------------------------------------------------ key layout

    def _key(self, key: str) -> bytes:
        return (self.namespace + key).encode()

    def _part_prefix(self, key: str, nonce: str) -> bytes:
        return self._key(f"{key}{_PART_MARK}{nonce}/")

    def _call(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        with self._lock:
            result = self._conn.call(path, payload, what)
        header = result.get("header")
        if isinstance(header, dict) and "revision" in header:
            self.last_revision = int(header["revision"])
        return result

    # ------------------------------------------------------------------ Store protocol

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        self._write(key, bytes(value), fence=fence, lease_id=None)

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        """Write ``key`` only if absent: None when this call created it, else the value of
        whoever did (one transaction; see :mod:`zephon.checkpoint.stores.etcd`)."""
        for _ in range(3):
            won, existing, _revision = self._write(
                key, bytes(value), fence=fence, lease_id=None, create=True
            )
            if won:
                return None
            if existing is not None:
                return existing
        raise AggregationError(
            f"could not create {key!r} in {self.describe()}: it was created and removed three"
            " times while this rank tried; is another job using this namespace?"
        )

    def get(self, key: str) -> bytes | None:
        for _ in range(_PART_READ_RETRIES):
            result = self._call("/kv/range", {"key": _b64(self._key(key))}, f"get {key!r}")
            kvs = result.get("kvs") or []
            if not kvs:
                return None
            value = self._value_of(key, kvs[0], int(result["header"]["revision"]))
            if value is not None:
                return value
            # the parts were compacted away under us: the key was overwritten; read again
        raise AggregationError(
            f"could not read the parts of {key!r} from {self.describe()} after "
            f"{_PART_READ_RETRIES} tries: it is being overwritten faster than it can be read"
        )

    def _value_of(self, key: str, kv: dict[str, Any], revision: int) -> bytes | None:
        raw = _unb64(kv.get("value"))
        if raw[:1] == _TAG_INLINE:
            return raw[1:]
        manifest = manifest_of(key, raw, self.describe(), self.namespace)
        prefix = self._part_prefix(key, manifest["nonce"])
        return read_parts(self._call, key, prefix, manifest, revision, self.describe())

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Several keys in as few requests as etcd allows: transactions of at most
        ``MAX_TXN_OPS`` range reads (each transaction is one revision)."""
        out: list[bytes | None] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[start : start + MAX_TXN_OPS]
            txn = {
                "compare": [],
                "success": [{"request_range": {"key": _b64(self._key(k))}} for k in batch],
                "failure": [],
            }
            result = self._call("/kv/txn", txn, f"get {len(batch)} keys")
            for key, resp in zip(batch, result.get("responses") or [], strict=True):
                kvs = resp.get("response_range", {}).get("kvs") or []
                if not kvs:
                    out.append(None)
                    continue
                raw = _unb64(kvs[0].get("value"))
                # split values are rare (over 1 MiB): read those on their own
                out.append(raw[1:] if raw[:1] == _TAG_INLINE else self.get(key))
        return out

    def list_keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` (parts of split values left out), sorted; a keys-only
        range read, ``LIST_PAGE_KEYS`` keys per request."""
        start = self._key(prefix)
        end = _prefix_end(start)
        cut = len(self.namespace.encode())
        keys: list[str] = []
        while True:
            result = self._call(
                "/kv/range",
                {
                    "key": _b64(start),
                    "range_end": _b64(end),
                    "keys_only": True,
                    "limit": LIST_PAGE_KEYS,
                },
                f"list keys under {prefix!r}",
            )
            kvs = result.get("kvs") or []
            for kv in kvs:
                name = _unb64(kv.get("key"))[cut:].decode()
                if _PART_MARK not in name:
                    keys.append(name)
            if not result.get("more") or not kvs:
                return keys
            start = _unb64(kvs[-1].get("key")) + b"\x00"

    def delete_prefix(self, prefix: str, known: Sequence[str] = ()) -> None:
        """Remove every key under ``prefix`` (parts included) in one range delete
        (``known`` is not needed: the range covers them)."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        start = self._key(prefix)
        self._call(
            "/kv/deleterange",
            {"key": _b64(start), "range_end": _b64(_prefix_end(start))},
            f"delete keys under {prefix!r}",
        )

    def delete(self, key: str) -> None:
        result = self._call(
            "/kv/deleterange", {"key": _b64(self._key(key)), "prev_kv": True}, f"delete {key!r}"
        )
        for kv in result.get("prev_kvs") or []:
            self._delete_parts_of(key, _unb64(kv.get("value")))

    def announce(self, key: str, value: bytes) -> EtcdFence:
        _, _, revision = self._write(key, bytes(value), fence=None, lease_id=None)
        return EtcdFence(key, revision)

    def announce_with(
        self, key: str, value: bytes, also: dict[str, bytes], delete: Sequence[str] = ()
    ) -> EtcdFence:
        """``announce(key, value)``, ``put`` of every ``also`` item and ``delete`` of every
        ``delete`` key in one transaction (one request, one revision); small values only
        (no parts), at most ``MAX_TXN_OPS`` operations."""
        values = {key: bytes(value), **{k: bytes(v) for k, v in also.items()}}
        if (
            any(len(v) + 1 > self.part_size_bytes for v in values.values())
            or len(values) + len(delete) > MAX_TXN_OPS
        ):
            fence = self.announce(key, value)
            for k, v in also.items():
                self.put(k, v)
            for k in delete:
                self.delete(k)
            return fence
        ops: list[dict[str, Any]] = [
            {"request_put": {"key": _b64(self._key(k)), "value": _b64(_TAG_INLINE + v)}}
            for k, v in values.items()
        ]
        ops += [{"request_delete_range": {"key": _b64(self._key(k))}} for k in delete]
        txn = {"compare": [], "success": ops, "failure": []}
        self.counters.add(written=sum(len(v) for v in values.values()))
        result = self._call("/kv/txn", txn, f"announce {key!r}")
        return EtcdFence(key, int(result["header"]["revision"]))

    def create_and_delete(
        self, key: str, value: bytes, *, fence: Any = None, delete: Sequence[str] = ()
    ) -> bytes | None:
        """``create(key, value, fence=fence)`` that also deletes ``delete`` when (and only
        when) it creates the key: one transaction."""
        won, existing, _ = self._write(
            key, bytes(value), fence=fence, lease_id=None, create=True, delete=list(delete)
        )
        if won:
            return None
        if existing is not None:
            return existing
        return self.create(key, value, fence=fence)  # (it was deleted meanwhile: once more)

    def keep_alive(
        self, key: str, value: bytes, ttl_s: float, *, exclusive: bool = False
    ) -> EtcdLease:
        """Put ``key`` under a lease refreshed in the background (see :mod:`~.lease`).

        Raises:
            KeyHeldError: ``exclusive`` and the key exists (another holder's lease is live);
                the error carries the holder's value.
        """
        handle = EtcdLease.grant(self, key, value, ttl_s, exclusive=exclusive)
        # remembered so close() can revoke what the caller forgot; stopped ones are dropped
        self._handles = [h for h in self._handles if not h.stopped] + [handle]
        return handle

    def watch(self, prefix: str) -> EtcdWatch:
        """A :class:`EtcdWatch` of every key under ``prefix``, started now (one range read,
        then a watch stream from the revision after it)."""
        w = EtcdWatch(self, prefix)
        self._watches = [x for x in self._watches if not x.closed] + [w]
        return w

    def compact(self, revision: int | None = None) -> int:
        """Compact etcd's history up to ``revision`` (default: the revision of this store's
        last answer, else the current one, read first); returns it. A revision already
        compacted (by another job, or etcd's auto-compaction) is fine."""
        if revision is None:
            revision = self.last_revision
        if revision is None:
            result = self._call(
                "/kv/range", {"key": _b64(self._key("")), "count_only": True}, "read the revision"
            )
            revision = int(result["header"]["revision"])
        try:
            self._call("/kv/compaction", {"revision": revision}, f"compact to {revision}")
        except _Refused as e:
            if "compacted" not in str(e):
                raise
        return revision

    def status(self) -> dict[str, int]:
        """``{"db_size_bytes", "db_size_in_use_bytes", "revision"}`` of the endpoint."""
        st = self._call("/maintenance/status", {}, "status")
        return {
            "db_size_bytes": int(st.get("dbSize", 0)),
            "db_size_in_use_bytes": int(st.get("dbSizeInUse", 0)),
            "revision": int(st["header"]["revision"]),
        }

    def close(self) -> None:
        for w in self._watches:
            w.close()
        self._watches.clear()
        for handle in self._handles:
            handle.stop()
        self._handles.clear()
        self._conn.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _warn_large(self, key: str, nbytes: int) -> None:
        """Once per process: compaction keeps etcd's database flat, but etcd also keeps
        every write in its raft log, in memory and in its WAL, until its next snapshot
        (``--snapshot-count``, every 100,000 entries by default), so states of megabytes a
        round grow etcd's memory by about that much a round for thousands of rounds
        (``benchmarks.etcd_soak``)."""
        global _warned_large
        _warned_large = True
        log.warning(
            "%s%s: writing %.1f MB (%r) into etcd, which keeps every write in memory and in "
            "its WAL until its next snapshot (--snapshot-count, 100,000 entries by default): "
            "at megabytes a round its memory grows by gigabytes. Put the states in a blob "
            "location and etcd carries only the manifests: aggregate_store='etcd://...?blobs="
            "/shared/dir' (a directory or an fsspec URL every rank reaches)",
            self.log_prefix,
            self.describe(),
            nbytes / 1e6,
            key,
        )

    def _write(
        self,
        key: str,
        value: bytes,
        *,
        fence: Any,
        lease_id: int | None,
        create: bool = False,
        delete: list[str] | None = None,
    ) -> tuple[bool, bytes | None, int]:
        """Write ``key`` (split when large, manifest last), fenced and/or only if absent,
        deleting ``delete`` in the same transaction.

        Returns (written, the existing value when ``create`` lost, the key's mod revision).
        """
        if fence is not None and not isinstance(fence, EtcdFence):
            raise TypeError(
                f"an EtcdStore fence is the EtcdFence that announce() returned; "
                f"got {type(fence).__name__}"
            )
        if len(value) > LARGE_VALUE_WARN_BYTES and not _warned_large:
            self._warn_large(key, len(value))
        new_parts: bytes | None = None
        if len(value) + 1 <= self.part_size_bytes:
            payload = _TAG_INLINE + value
        else:
            nonce = os.urandom(8).hex()
            new_parts = self._part_prefix(key, nonce)
            payload = write_parts(
                self._call, key, new_parts, nonce, value, self.part_size_bytes, lease_id
            )
        self.counters.add(written=len(value))

        k64 = _b64(self._key(key))
        request: dict[str, Any] = {"key": k64, "value": _b64(payload), "prev_kv": True}
        if lease_id is not None:
            request["lease"] = lease_id
        try:
            if fence is None and not create and not delete:
                result = self._call("/kv/put", request, f"put {key!r}")
                revision = int(result["header"]["revision"])
                prev = result.get("prev_kv")
            else:
                fence_key = self._key(fence.key) if fence is not None else b""
                delete_keys = [self._key(k) for k in delete or ()]
                txn = conditional_txn(
                    request,
                    fence=fence,
                    fence_key=fence_key,
                    create=create,
                    delete_keys=delete_keys,
                )
                what = ("create " if create else "fenced put ") + repr(key)
                result = self._call("/kv/txn", txn, what)
                # protobuf's JSON leaves out false booleans: no "succeeded" means it failed
                if not result.get("succeeded", False):
                    responses = result.get("responses") or []
                    if fence is not None:
                        raise_if_stale(responses, fence, key, self.describe())
                    kvs = responses[0].get("response_range", {}).get("kvs") or []
                    if new_parts is not None:
                        self._delete_prefix_quietly(new_parts)
                    if not kvs:
                        return False, None, 0
                    rev = int(result["header"]["revision"])
                    return False, self._value_of(key, kvs[0], rev), 0
                revision = int(result["header"]["revision"])
                response = result["responses"][0].get("response_put", {})
                prev = response.get("prev_kv")
        except BaseException:
            if new_parts is not None:
                self._delete_prefix_quietly(new_parts)
            raise
        if prev:
            self._delete_parts_of(key, _unb64(prev.get("value")))
        return True, None, revision

    def _delete_parts_of(self, key: str, old_raw: bytes) -> None:
        nonce = nonce_of(old_raw)
        if nonce is not None:
            self._delete_prefix_quietly(self._part_prefix(key, nonce))

    def _delete_prefix_quietly(self, prefix: bytes) -> None:
        # cleanup of parts is best effort: leftovers only cost space, never correctness
        try:
            self._call(
                "/kv/deleterange",
                {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))},
                "delete old value parts",
            )
        except AggregationError as e:
            log.warning("%scould not delete parts under %r: %s", self.log_prefix, prefix, e)
