"""The etcd backend of the aggregation store: ``aggregate_store="etcd://host:port[,host:port]"``.

It speaks etcd's v3 JSON gateway (the API ``etcd3gw`` wraps; not the ``etcd3`` package, which
no longer imports with protobuf >= 4) directly with the standard library's ``http.client``:
``requests``, under etcd3gw, cost 2.3-2.8 ms of CPU per request where ``http.client`` costs
0.4 ms, which at a thousand ranks is most of a round. No client library is needed.

* **a timeout on every request** (``request_timeout_s``, applied by ``requests`` to the
  connect and to every read), and a server that does not answer in time — refused, reset,
  or SIGSTOPped with the kernel still accepting connections — raises ``AggregationError``
  naming the endpoint rather than hanging;
* **failover**: endpoints are tried in the order given, starting from the last one that
  answered; the error names every endpoint that failed and why. Worst case for one call is
  ``len(endpoints) * request_timeout_s``. A request that timed out may still have been
  applied by the server (as with any RPC); puts are idempotent and fenced writes stay fenced;
* every key lives under ``namespace`` (default ``"zephon/"``; ``etcd://h:p/myjob`` gives
  ``"myjob/"``), so several jobs can share one cluster;
* **etcd's default limits are never hit**: a transaction holds at most 64 operations
  (``--max-txn-ops`` is 128), a request at most ``part_size_bytes`` of value (1 MiB, under
  ``--max-request-bytes`` of 1.5 MiB), range reads are paginated (``list_keys``) and a
  round's keys are removed with one range delete (``delete_prefix``);
* **watches** (``watch(prefix)``): a daemon thread holds one watch stream over the prefix
  (its own HTTP connection) and keeps a local copy of every key under it, so a waiting rank
  sends no requests until something changes. The stream has a read timeout and reconnects
  (a range read, then a watch from the revision after it) after an error, a timeout or a
  compaction that cancelled it;
* **compaction** (``compact()``): etcd keeps every revision of every key until it is
  compacted, and its database quota (2 GiB by default) counts that history. Rounds write
  their states into etcd, so the leader compacts after each committed round (``physical``
  false: etcd frees the space in the background and reuses it; the database file does not
  shrink without a defragmentation, but it stops growing);
* **fencing**: ``announce`` returns an :class:`EtcdFence` — the announcement key and its
  ``mod_revision`` after the put — and a fenced ``put``/``create`` is one transaction
  ``mod_revision(f.key) == f.mod_revision ? write : nothing``; a failed compare raises
  :class:`StaleRoundError`. A newer announcement *or the deletion* of the announcement key
  makes older fences stale;
* **create**: one transaction ``create_revision(key) == 0 ? put : range(key)``, so of
  several racing writers exactly one wins and the others get its value;
* **leases**: ``keep_alive`` grants a lease of ``ceil(ttl_s)`` seconds, puts the key with
  it and refreshes it every ``ttl_s / 3`` from a daemon thread with its own connection;
  ``stop()`` revokes the lease (the key vanishes at once); a dead holder's key vanishes when
  the lease expires (etcd checks expiry about every 0.5 s). A lease the server reports
  expired is never re-granted (the followers may already have given up on this leader):
  the handle's ``lost`` turns True instead. ``lost`` is also True once ``ttl_s`` has passed
  since the last refresh the server confirmed, so a holder that was paused (SIGSTOP) knows
  at once when it resumes, before its refresher thread has run;
* **large values are split**: a value of more than ``part_size_bytes`` is written as
  numbered parts under ``<key>#zephon-part/<nonce>/<i>`` followed by a small manifest at
  ``<key>`` itself, written last (and fenced or conditional, when asked), so a reader sees
  either the old value or the whole new one. ``get`` reads the parts at the manifest's
  revision (a consistent snapshot even if the key is overwritten meanwhile); overwriting or
  deleting the key removes the old parts. Values are framed with one tag byte (inline or
  manifest), so keys written by other tools are reported as foreign rather than misread.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from zephon.checkpoint.stores.base import KeyHeldError, StaleRoundError, StoreCounters
from zephon.errors import AggregationError

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_NAMESPACE = "zephon/"
DEFAULT_REQUEST_TIMEOUT_S = 5.0
#: etcd's default --max-request-bytes is 1.5 MiB; the JSON gateway base64-encodes values
#: (4/3) but the limit applies to the decoded gRPC request, so 1 MiB parts leave margin.
DEFAULT_PART_SIZE_BYTES = 1 << 20
#: operations per transaction, well under etcd's default --max-txn-ops of 128
MAX_TXN_OPS = 64
#: keys per page of a keys-only range read
LIST_PAGE_KEYS = 1000
#: a watch stream with no traffic for this long is reopened (a stalled server, a lost peer)
WATCH_READ_TIMEOUT_S = 30.0

_TAG_INLINE = b"\x00"
_TAG_MANIFEST = b"\x01"
_PART_MARK = "#zephon-part/"
_PART_READ_RETRIES = 3


@dataclass(frozen=True)
class EtcdFence:
    """Proof of an announcement: valid while ``key``'s mod revision is ``mod_revision``."""

    key: str
    mod_revision: int


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str | None]:
    """``etcd://h1:p1,h2:p2[/namespace]`` -> ([(h1, p1), (h2, p2)], namespace or None)."""
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise ValueError(
            f"an etcd aggregate_store looks like 'etcd://host:port[,host:port][/namespace]'; "
            f"got {url!r}"
        )
    endpoints = [_parse_endpoint(e.strip(), url) for e in parts.netloc.split(",") if e.strip()]
    namespace = parts.path.strip("/") or None
    return endpoints, (namespace + "/" if namespace else None)


def _parse_endpoint(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:2379
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port {port_text!r} in etcd endpoint {text!r} of {url!r}") from None
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad etcd endpoint {text!r} in {url!r}; expected host:port")
    return host, port


def _endpoint_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\x00"
    b[-1] += 1
    return bytes(b)


class _Refused(AggregationError):
    """The server answered and refused (quota, bad request): failing over would not help."""


class _Timeout(Exception):
    pass


class _Endpoint:
    """One keep-alive HTTP connection to one etcd endpoint (``http.client``), reopened after
    an error; ``timeout_s`` applies to the connect and to every read."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body) of ``POST /v3<path>``; raises _Timeout or OSError."""
        for attempt in (0, 1):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(
                    self.host, self.port, timeout=self.timeout_s
                )
            try:
                self._conn.request("POST", "/v3" + path, body, _HEADERS)
                resp = self._conn.getresponse()
                data = resp.read()
                if resp.will_close:
                    self.close()
                return resp.status, data
            except TimeoutError as e:
                self.close()
                raise _Timeout from e
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A kept-alive connection the server had closed: once more on a new one.
                self.close()
                if not reused or attempt:
                    raise
            except (OSError, http.client.HTTPException):
                self.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


_HEADERS = {"Content-Type": "application/json"}


class _Connection:
    """Connections to every endpoint, tried in order with failover; one per thread of use.

    The JSON gateway is spoken with the standard library's ``http.client``: etcd3gw's
    ``requests`` session cost 2.3-2.8 ms of CPU per request on the benchmark machine,
    ``http.client`` 0.4 ms, and at 1,024 ranks that difference is most of a round.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        timeout_s: float,
        counters: StoreCounters | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.endpoints = list(endpoints)
        self.names = [_endpoint_text(h, p) for h, p in endpoints]
        self.clients = [_Endpoint(h, p, timeout_s) for h, p in endpoints]
        self.counters = counters if counters is not None else StoreCounters()
        self._preferred = 0

    def call(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        """POST ``payload`` to ``/v3<path>`` on the first endpoint that answers."""
        body = json.dumps(payload).encode()
        failures: list[str] = []
        n = len(self.clients)
        for step in range(n):
            i = (self._preferred + step) % n
            try:
                status, data = self.clients[i].post(path, body)
            except _Timeout:
                self.counters.add(requests=1)
                failures.append(f"{self.names[i]} (no answer within {self.timeout_s:g} s)")
                continue
            except (OSError, http.client.HTTPException) as e:
                self.counters.add(requests=1)
                failures.append(f"{self.names[i]} ({_short(e)})")
                continue
            self.counters.add(requests=1, read=len(data))
            text = data.decode("utf-8", errors="replace")
            if status == 503:  # no leader yet, or shutting down: try another
                failures.append(f"{self.names[i]} (unavailable: {_short_text(text)})")
                continue
            if status != 200:
                raise _Refused(f"etcd at {self.names[i]} refused {what}: {_short_text(text)}")
            self._preferred = i
            result: dict[str, Any] = json.loads(data)
            return result
        raise AggregationError(
            f"no etcd endpoint answered {what}: {'; '.join(failures)}. Check that etcd is "
            f"running and reachable, or raise request_timeout_s (now {self.timeout_s:g} s)"
        )

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _short(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"[Errno {e.errno}] {e.strerror or e}"
    detail = str(e) or type(e).__name__
    errno = re.search(r"\[Errno -?\d+\] [^\"')]*", detail)
    if errno:  # some errors bury the reason in a long repr
        return errno.group(0)
    return _short_text(detail)


def _short_text(text: str) -> str:
    if text.startswith("{"):
        try:
            text = str(json.loads(text).get("message", text))
        except (ValueError, AttributeError):
            pass
    text = text.strip()
    return text if len(text) <= 300 else text[:300] + "..."


class EtcdStore:
    """A :class:`~zephon.checkpoint.stores.base.Store` over etcd (see the module docstring).

    Args:
        endpoints: ``"host:port"`` strings or ``(host, port)`` pairs, tried in order.
        namespace: prefix of every key this store touches.
        request_timeout_s: the limit on each HTTP request (connect and each read).
        part_size_bytes: values larger than this are split into parts of this size.
        poll_interval_s: how often the round protocol first re-reads a key it waits for
            when it cannot watch it.
        poll_max_interval_s: the longest it backs off to between re-reads.
    """

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
        self.counters = StoreCounters()
        self.log_prefix = ""  # the round sets "[rank=N] " so background warnings name it
        self._conn = _Connection(parsed, self.request_timeout_s, self.counters)
        self._lock = threading.Lock()  # the store may be shared by a rank's threads
        self._handles: list[EtcdLease] = []
        self._watches: list[EtcdWatch] = []
        #: the store revision of the last answer this store got (what compact() uses)
        self.last_revision: int | None = None

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
        whoever did (one transaction; see the module docstring)."""
        for _ in range(3):
            won, existing = self._write(key, bytes(value), fence=fence, lease_id=None, create=True)
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
        return self._read_parts(key, self._manifest(key, raw), revision)

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

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key under ``prefix`` (parts included) in one range delete."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        start = self._key(prefix)
        self._call(
            "/kv/deleterange",
            {"key": _b64(start), "range_end": _b64(_prefix_end(start))},
            f"delete keys under {prefix!r}",
        )

    def _manifest(self, key: str, raw: bytes) -> dict[str, Any]:
        if raw[:1] != _TAG_MANIFEST:
            raise AggregationError(
                f"key {key!r} in {self.describe()} holds a value not written by Zephon "
                f"(first byte {raw[:1]!r}); is another tool using namespace "
                f"{self.namespace!r}?"
            )
        manifest: dict[str, Any] = json.loads(raw[1:])
        return manifest

    def delete(self, key: str) -> None:
        result = self._call(
            "/kv/deleterange", {"key": _b64(self._key(key)), "prev_kv": True}, f"delete {key!r}"
        )
        for kv in result.get("prev_kvs") or []:
            self._delete_parts_of(key, _unb64(kv.get("value")))

    def announce(self, key: str, value: bytes) -> EtcdFence:
        _, _, revision = self._write_full(key, bytes(value), fence=None, lease_id=None)
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
        won, existing, _ = self._write_full(
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
        """Put ``key`` under a lease refreshed in the background (see the module docstring).

        Raises:
            KeyHeldError: ``exclusive`` and the key exists (another holder's lease is live);
                the error carries the holder's value.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0; got {ttl_s}")
        ttl = max(1, math.ceil(ttl_s))
        grant = self._call("/lease/grant", {"TTL": ttl, "ID": 0}, f"lease grant for {key!r}")
        if grant.get("error"):
            raise AggregationError(f"etcd at {self.describe()} refused a lease: {grant['error']}")
        lease_id = int(grant["ID"])
        try:
            won, existing = self._write(
                key, bytes(value), fence=None, lease_id=lease_id, create=exclusive
            )
        except BaseException:
            self._revoke_quietly(lease_id)
            raise
        if not won:
            self._revoke_quietly(lease_id)
            raise KeyHeldError(key, existing or b"", self.describe())
        handle = EtcdLease(self, key, lease_id, ttl_s)
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

    def _write(
        self,
        key: str,
        value: bytes,
        *,
        fence: Any,
        lease_id: int | None,
        create: bool = False,
    ) -> tuple[bool, bytes | None]:
        won, existing, _ = self._write_full(
            key, value, fence=fence, lease_id=lease_id, create=create
        )
        return won, existing

    def _write_full(
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
        new_parts: bytes | None = None
        if len(value) + 1 <= self.part_size_bytes:
            payload = _TAG_INLINE + value
        else:
            nonce = os.urandom(8).hex()
            new_parts = self._part_prefix(key, nonce)
            n = math.ceil(len(value) / self.part_size_bytes)
            for i in range(n):
                chunk = value[i * self.part_size_bytes : (i + 1) * self.part_size_bytes]
                put: dict[str, Any] = {"key": _b64(new_parts + b"%06d" % i), "value": _b64(chunk)}
                if lease_id is not None:
                    put["lease"] = lease_id
                self._call("/kv/put", put, f"put part {i + 1}/{n} of {key!r}")
            manifest = {
                "nonce": nonce,
                "parts": n,
                "size": len(value),
                "blake2b": hashlib.blake2b(value, digest_size=16).hexdigest(),
            }
            payload = _TAG_MANIFEST + json.dumps(manifest).encode()
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
                compare: list[dict[str, Any]] = []
                if fence is not None:
                    compare.append(
                        {
                            "key": _b64(self._key(fence.key)),
                            "target": "MOD",
                            "result": "EQUAL",
                            "mod_revision": str(fence.mod_revision),
                        }
                    )
                if create:
                    compare.append(
                        {"key": k64, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                    )
                failure = [{"request_range": {"key": k64}}]
                if fence is not None:
                    failure.append({"request_range": {"key": _b64(self._key(fence.key))}})
                success: list[dict[str, Any]] = [{"request_put": request}]
                success += [
                    {"request_delete_range": {"key": _b64(self._key(k))}} for k in delete or ()
                ]
                txn = {"compare": compare, "success": success, "failure": failure}
                what = ("create " if create else "fenced put ") + repr(key)
                result = self._call("/kv/txn", txn, what)
                # protobuf's JSON leaves out false booleans: no "succeeded" means it failed
                if not result.get("succeeded", False):
                    responses = result.get("responses") or []
                    if fence is not None:
                        fkvs = responses[1].get("response_range", {}).get("kvs") or []
                        if not fkvs or int(fkvs[0].get("mod_revision", 0)) != fence.mod_revision:
                            raise StaleRoundError(
                                f"fenced write of {key!r} refused: announcement {fence.key!r}"
                                f" is no longer at revision {fence.mod_revision} (a newer round"
                                f" was announced or this one was closed) in {self.describe()}"
                            )
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

    def _read_parts(self, key: str, manifest: dict[str, Any], revision: int) -> bytes | None:
        prefix = self._part_prefix(key, manifest["nonce"])
        chunks = []
        for i in range(int(manifest["parts"])):
            request = {"key": _b64(prefix + b"%06d" % i), "revision": revision}
            try:
                result = self._call("/kv/range", request, f"get part {i} of {key!r}")
            except AggregationError as e:
                if "compacted" in str(e):
                    return None
                raise
            kvs = result.get("kvs") or []
            if not kvs:
                return None
            chunks.append(_unb64(kvs[0].get("value")))
        value = b"".join(chunks)
        digest = hashlib.blake2b(value, digest_size=16).hexdigest()
        if len(value) != manifest["size"] or digest != manifest["blake2b"]:
            raise AggregationError(
                f"the parts of {key!r} in {self.describe()} do not match their manifest "
                f"({len(value)} bytes, expected {manifest['size']}): the value is corrupt"
            )
        return value

    def _delete_parts_of(self, key: str, old_raw: bytes) -> None:
        if old_raw[:1] != _TAG_MANIFEST:
            return
        try:
            nonce = json.loads(old_raw[1:])["nonce"]
        except (ValueError, KeyError):
            return
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

    def _revoke_quietly(self, lease_id: int) -> None:
        try:
            self._call("/lease/revoke", {"ID": lease_id}, "lease revoke")
        except AggregationError as e:
            log.warning("%scould not revoke lease %d: %s", self.log_prefix, lease_id, e)


class EtcdLease:
    """The handle ``EtcdStore.keep_alive`` returns: a daemon thread refreshes the lease
    every ``ttl_s / 3``; ``stop()`` revokes it, so the key disappears at once."""

    def __init__(self, store: EtcdStore, key: str, lease_id: int, ttl_s: float) -> None:
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


class EtcdWatch:
    """A local copy of every key under a prefix, kept current by one etcd watch stream
    (see :class:`~zephon.checkpoint.stores.base.PrefixWatch`).

    The thread does a range read of the prefix, then watches from the revision after it;
    after any error (the stream broke, no traffic for ``WATCH_READ_TIMEOUT_S``, a
    compaction cancelled it) it starts over with a fresh range read, so the copy is never
    missing a change for longer than one reconnect. Values split into parts are fetched
    with a get. Keys are the store's (namespace stripped).
    """

    def __init__(self, store: EtcdStore, prefix: str) -> None:
        self._store = store
        self.prefix = prefix
        self._start = store._key(prefix)
        self._end = _prefix_end(self._start)
        self._cut = len(store.namespace.encode())
        self._values: dict[str, bytes] = {}
        self._changed: dict[str, bytes | None] = {}
        self._cond = threading.Condition()
        self._seq = 0
        self._seen = 0
        self._error: str | None = None
        self.closed = False
        self.synced = threading.Event()
        self._resp: Any = None
        self._conn = _Connection(store.endpoints, store.request_timeout_s, store.counters)
        self._thread = threading.Thread(
            target=self._run, name=f"zephon-etcd-watch-{prefix}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"EtcdWatch({self.prefix!r}, {len(self._values)} keys)"

    # ------------------------------------------------------------------ reading

    def get(self, key: str) -> bytes | None:
        with self._cond:
            return self._values.get(key)

    def items(self) -> dict[str, bytes]:
        with self._cond:
            return dict(self._values)

    def drain(self) -> dict[str, bytes | None]:
        with self._cond:
            out, self._changed = self._changed, {}
            return out

    def wait(self, timeout_s: float) -> bool:
        """Block until a change since the previous ``wait`` returned, at most ``timeout_s``."""
        with self._cond:
            if self._seq == self._seen:
                self._cond.wait(max(0.0, timeout_s))
            changed = self._seq != self._seen
            self._seen = self._seq
            return changed

    @property
    def error(self) -> str | None:
        return self._error

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        http_conn = self._resp
        if http_conn is not None:
            # Closing the connection from here would wait for the reading thread's read to
            # time out; shutting the socket down ends that read at once.
            try:
                if http_conn.sock is not None:
                    http_conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass
        with self._cond:
            self._cond.notify_all()
        self._conn.close()

    # ------------------------------------------------------------------ the stream

    def _set(self, key: str, value: bytes | None) -> None:
        if value is None:
            self._values.pop(key, None)
        else:
            self._values[key] = value
        self._changed[key] = value

    def _decode(self, key: str, raw: bytes) -> bytes | None:
        if raw[:1] == _TAG_INLINE:
            return raw[1:]
        if raw[:1] == _TAG_MANIFEST:
            return self._store.get(key)  # a split value: read its parts
        return None  # not Zephon's: the round reports it when it reads the key itself

    def _resync(self) -> int:
        """Read the whole prefix (paginated); replace the copy; return the revision."""
        fresh: dict[str, bytes] = {}
        start = self._start
        revision = 0
        while True:
            result = self._conn.call(
                "/kv/range",
                {"key": _b64(start), "range_end": _b64(self._end), "limit": 256}
                | ({"revision": revision} if revision else {}),
                f"read keys under {self.prefix!r}",
            )
            revision = revision or int(result["header"]["revision"])
            kvs = result.get("kvs") or []
            for kv in kvs:
                name = _unb64(kv.get("key"))[self._cut :].decode()
                if _PART_MARK in name:
                    continue
                value = self._decode(name, _unb64(kv.get("value")))
                if value is not None:
                    fresh[name] = value
            if not result.get("more") or not kvs:
                break
            start = _unb64(kvs[-1].get("key")) + b"\x00"
        with self._cond:
            for key in set(self._values) - set(fresh):
                self._set(key, None)
            for key, value in fresh.items():
                if self._values.get(key) != value:
                    self._set(key, value)
            self._seq += 1
            self._cond.notify_all()
        return revision

    def _run(self) -> None:
        backoff = 0.05
        try:
            while not self.closed:
                try:
                    revision = self._resync()
                    self.synced.set()
                    self._stream(revision + 1)
                    backoff = 0.05
                except Exception as e:  # noqa: BLE001 - reported through .error, then retried
                    if self.closed:
                        return
                    self._error = f"{type(e).__name__}: {e}"
                    with self._cond:
                        self._seq += 1
                        self._cond.notify_all()
                    time.sleep(backoff)
                    backoff = min(2.0, backoff * 2)
        finally:
            self._conn.close()  # (close() may have run while a request was in flight)

    def _stream(self, start_revision: int) -> None:
        conn = self._conn
        create: dict[str, Any] = {
            "create_request": {
                "key": _b64(self._start),
                "range_end": _b64(self._end),
                "start_revision": start_revision,
            }
        }
        i = conn._preferred  # the endpoint that answered the range read just before
        host, port = conn.endpoints[i]
        http_conn = http.client.HTTPConnection(host, port, timeout=conn.timeout_s)
        self._resp = http_conn
        try:
            http_conn.request("POST", "/v3/watch", json.dumps(create).encode(), _HEADERS)
            resp = http_conn.getresponse()
            conn.counters.add(requests=1)
            if resp.status != 200:
                raise AggregationError(
                    f"watch refused: {_short_text(resp.read().decode(errors='replace'))}"
                )
            if http_conn.sock is not None:  # between events the stream may be idle for long
                http_conn.sock.settimeout(WATCH_READ_TIMEOUT_S)
            while True:
                line = resp.readline()
                if not line:
                    return  # the server ended the stream: start over
                if self.closed:
                    return
                if not line.strip():
                    continue
                conn.counters.add(read=len(line))
                result = json.loads(line).get("result") or {}
                if result.get("canceled") or result.get("compact_revision"):
                    reason = result.get("cancel_reason") or "compacted"
                    raise AggregationError(f"watch cancelled ({reason})")
                events = result.get("events") or []
                if not events:
                    continue
                conn.counters.add(events=len(events))
                with self._cond:
                    for ev in events:
                        kv = ev.get("kv") or {}
                        name = _unb64(kv.get("key"))[self._cut :].decode()
                        if _PART_MARK in name:
                            continue
                        if ev.get("type") == "DELETE":
                            self._set(name, None)
                        else:
                            raw = _unb64(kv.get("value"))
                            if raw[:1] == _TAG_INLINE:
                                self._set(name, raw[1:])
                            else:
                                self._cond.release()
                                try:
                                    value = self._decode(name, raw)
                                finally:
                                    self._cond.acquire()
                                if value is not None:
                                    self._set(name, value)
                    self._error = None
                    self._seq += 1
                    self._cond.notify_all()
        finally:
            self._resp = None
            http_conn.close()
