"""The etcd backend of the aggregation store: ``aggregate_store="etcd://host:port[,host:port]"``.

It speaks etcd's v3 JSON gateway through ``etcd3gw`` (the ``etcd`` extra), not the ``etcd3``
package, which no longer imports with protobuf >= 4. Only plain unary requests are used:

* **no watch streams** — a watch can hang on a stalled server; the round protocol polls
  with ``poll_interval_s`` under its own deadline instead;
* **a timeout on every request** (``request_timeout_s``, applied by ``requests`` to the
  connect and to every read), and a server that does not answer in time — refused, reset,
  or SIGSTOPped with the kernel still accepting connections — raises ``AggregationError``
  naming the endpoint rather than hanging;
* **failover**: endpoints are tried in the order given, starting from the last one that
  answered; the error names every endpoint that failed and why. Worst case for one call is
  ``len(endpoints) * request_timeout_s``. A request that timed out may still have been
  applied by the server (as with any RPC); puts are idempotent and fenced puts stay fenced;
* every key lives under ``namespace`` (default ``"zephon/"``; ``etcd://h:p/myjob`` gives
  ``"myjob/"``), so several jobs can share one cluster;
* **fencing**: ``announce`` returns an :class:`EtcdFence` — the announcement key and its
  ``mod_revision`` after the put — and ``put(key, value, fence=f)`` is one transaction
  ``mod_revision(f.key) == f.mod_revision ? put : nothing``; a failed compare raises
  :class:`StaleRoundError`. A newer announcement *or the deletion* of the announcement key
  makes older fences stale, so a round that is closed by deleting its announcement must do
  its fenced writes before that delete;
* **leases**: ``keep_alive`` grants a lease of ``ceil(ttl_s)`` seconds, puts the key with
  it and refreshes it every ``ttl_s / 3`` from a daemon thread with its own HTTP session;
  ``stop()`` revokes the lease (the key vanishes at once); a dead holder's key vanishes when
  the lease expires (etcd checks expiry about every 0.5 s). A lease the server reports
  expired is never re-granted (the followers may already have given up on this leader):
  the handle's ``lost`` turns True instead;
* **large values are split**: etcd refuses requests over ``--max-request-bytes`` (1.5 MiB by
  default). A value of more than ``part_size_bytes`` (1 MiB: leaves room for the gateway's
  base64 and the request envelope) is written as numbered parts under
  ``<key>#zephon-part/<nonce>/<i>`` followed by a small manifest at ``<key>`` itself, written
  last (and fenced, when a fence is given), so a reader sees either the old value or the
  whole new one. ``get`` reads the parts at the manifest's revision (a consistent
  snapshot even if the key is overwritten meanwhile); overwriting or deleting the key
  removes the old parts. Values are framed with one tag byte (inline or manifest), so keys
  written by other tools are reported as foreign rather than misread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from zephon.checkpoint.stores.base import StaleRoundError
from zephon.errors import AggregationError

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_NAMESPACE = "zephon/"
DEFAULT_REQUEST_TIMEOUT_S = 5.0
#: etcd's default --max-request-bytes is 1.5 MiB; the JSON gateway base64-encodes values
#: (4/3) but the limit applies to the decoded gRPC request, so 1 MiB parts leave margin.
DEFAULT_PART_SIZE_BYTES = 1 << 20

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


class _Connection:
    """Clients for every endpoint, tried in order with failover; one per thread of use
    (``requests.Session`` is not meant to be shared between threads)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout_s: float) -> None:
        try:
            import etcd3gw
            from etcd3gw import exceptions as etcd_exceptions
        except ImportError as e:
            raise ImportError(
                "aggregate_store='etcd://...' needs the etcd3gw client: pip install 'zephon[etcd]'"
            ) from e
        self._exceptions = etcd_exceptions
        self.timeout_s = timeout_s
        self.names = [_endpoint_text(h, p) for h, p in endpoints]
        self.clients = [
            etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout_s) for h, p in endpoints
        ]
        self._preferred = 0

    def call(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        """POST ``payload`` to ``/v3/<path>`` on the first endpoint that answers."""
        exc = self._exceptions
        failures: list[str] = []
        n = len(self.clients)
        for step in range(n):
            i = (self._preferred + step) % n
            client = self.clients[i]
            try:
                result = client.post(client.get_url(path), json=payload)
            except exc.ConnectionTimeoutError:
                failures.append(f"{self.names[i]} (no answer within {self.timeout_s:g} s)")
                continue
            except exc.ConnectionFailedError as e:
                failures.append(f"{self.names[i]} ({_short(e)})")
                continue
            except exc.Etcd3Exception as e:
                # the server answered and refused: failing over would not help
                raise AggregationError(
                    f"etcd at {self.names[i]} refused {what}: {_short(e)}"
                ) from e
            self._preferred = i
            return result
        raise AggregationError(
            f"no etcd endpoint answered {what}: {'; '.join(failures)}. Check that etcd is "
            f"running and reachable, or raise request_timeout_s (now {self.timeout_s:g} s)"
        )

    def close(self) -> None:
        for c in self.clients:
            c.session.close()


def _short(e: Exception) -> str:
    detail = getattr(e, "detail_text", None) or str(e) or type(e).__name__
    errno = re.search(r"\[Errno -?\d+\] [^\"')]*", str(detail))
    if errno:  # requests' connection errors bury the reason in a long repr
        return errno.group(0)
    if isinstance(detail, str) and detail.startswith("{"):
        try:
            detail = json.loads(detail).get("message", detail)
        except ValueError:
            pass
    text = str(detail)
    return text if len(text) <= 300 else text[:300] + "..."


class EtcdStore:
    """A :class:`~zephon.checkpoint.stores.base.Store` over etcd (see the module docstring).

    Args:
        endpoints: ``"host:port"`` strings or ``(host, port)`` pairs, tried in order.
        namespace: prefix of every key this store touches.
        request_timeout_s: the limit on each HTTP request (connect and each read).
        part_size_bytes: values larger than this are split into parts of this size.
        poll_interval_s: how often the round protocol first re-reads a key it waits for.
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
        self._conn = _Connection(parsed, self.request_timeout_s)
        self._lock = threading.Lock()  # the store may be shared by a rank's threads
        self._handles: list[EtcdLease] = []

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
            return self._conn.call(path, payload, what)

    # ------------------------------------------------------------------ Store protocol

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        self._write(key, bytes(value), fence=fence, lease_id=None)

    def get(self, key: str) -> bytes | None:
        for _ in range(_PART_READ_RETRIES):
            result = self._call("/kv/range", {"key": _b64(self._key(key))}, f"get {key!r}")
            kvs = result.get("kvs") or []
            if not kvs:
                return None
            raw = _unb64(kvs[0].get("value"))
            if raw[:1] == _TAG_INLINE:
                return raw[1:]
            value = self._read_parts(
                key, self._manifest(key, raw), int(result["header"]["revision"])
            )
            if value is not None:
                return value
            # the parts were compacted away under us: the key was overwritten; read again
        raise AggregationError(
            f"could not read the parts of {key!r} from {self.describe()} after "
            f"{_PART_READ_RETRIES} tries: it is being overwritten faster than it can be read"
        )

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Several keys in one request (a transaction of range reads, one revision)."""
        if not keys:
            return []
        txn = {
            "compare": [],
            "success": [{"request_range": {"key": _b64(self._key(k))}} for k in keys],
            "failure": [],
        }
        result = self._call("/kv/txn", txn, f"get {len(keys)} keys")
        out: list[bytes | None] = []
        for key, resp in zip(keys, result.get("responses") or [], strict=True):
            kvs = resp.get("response_range", {}).get("kvs") or []
            if not kvs:
                out.append(None)
                continue
            raw = _unb64(kvs[0].get("value"))
            # split values are rare (over 1 MiB): read those on their own
            out.append(raw[1:] if raw[:1] == _TAG_INLINE else self.get(key))
        return out

    def _manifest(self, key: str, raw: bytes) -> dict[str, Any]:
        if raw[:1] != _TAG_MANIFEST:
            raise AggregationError(
                f"key {key!r} in {self.describe()} holds a value not written by Zephon "
                f"(first byte {raw[:1]!r}); is another tool using namespace "
                f"{self.namespace!r}?"
            )
        return json.loads(raw[1:])

    def delete(self, key: str) -> None:
        result = self._call(
            "/kv/deleterange", {"key": _b64(self._key(key)), "prev_kv": True}, f"delete {key!r}"
        )
        for kv in result.get("prev_kvs") or []:
            self._delete_parts_of(key, _unb64(kv.get("value")))

    def announce(self, key: str, value: bytes) -> EtcdFence:
        revision = self._write(key, bytes(value), fence=None, lease_id=None)
        return EtcdFence(key, revision)

    def keep_alive(self, key: str, value: bytes, ttl_s: float) -> EtcdLease:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0; got {ttl_s}")
        ttl = max(1, math.ceil(ttl_s))
        grant = self._call("/lease/grant", {"TTL": ttl, "ID": 0}, f"lease grant for {key!r}")
        if grant.get("error"):
            raise AggregationError(f"etcd at {self.describe()} refused a lease: {grant['error']}")
        lease_id = int(grant["ID"])
        self._write(key, bytes(value), fence=None, lease_id=lease_id)
        handle = EtcdLease(self, key, lease_id, ttl_s)
        # remembered so close() can revoke what the caller forgot; stopped ones are dropped
        self._handles = [h for h in self._handles if not h.stopped] + [handle]
        return handle

    def close(self) -> None:
        for handle in self._handles:
            handle.stop()
        self._handles.clear()
        self._conn.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _write(self, key: str, value: bytes, *, fence: Any, lease_id: int | None) -> int:
        """Write ``key`` (split when large, manifest last); returns the key's mod revision."""
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

        request: dict[str, Any] = {
            "key": _b64(self._key(key)),
            "value": _b64(payload),
            "prev_kv": True,
        }
        if lease_id is not None:
            request["lease"] = lease_id
        try:
            if fence is None:
                result = self._call("/kv/put", request, f"put {key!r}")
                revision = int(result["header"]["revision"])
                prev = result.get("prev_kv")
            else:
                txn = {
                    "compare": [
                        {
                            "key": _b64(self._key(fence.key)),
                            "target": "MOD",
                            "result": "EQUAL",
                            "mod_revision": str(fence.mod_revision),
                        }
                    ],
                    "success": [{"request_put": request}],
                    "failure": [],
                }
                result = self._call("/kv/txn", txn, f"fenced put {key!r}")
                # protobuf's JSON leaves out false booleans: no "succeeded" means it failed
                if not result.get("succeeded", False):
                    raise StaleRoundError(
                        f"fenced put of {key!r} refused: announcement {fence.key!r} is no "
                        f"longer at revision {fence.mod_revision} (a newer round was announced "
                        f"or this one was closed) in {self.describe()}"
                    )
                revision = int(result["header"]["revision"])
                response = result["responses"][0].get("response_put", {})
                prev = response.get("prev_kv")
        except BaseException:
            if new_parts is not None:
                self._delete_prefix_quietly(new_parts)
            raise
        if prev:
            self._delete_parts_of(key, _unb64(prev.get("value")))
        return revision

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
            log.warning("could not delete parts under %r: %s", prefix, e)


class EtcdLease:
    """The handle ``EtcdStore.keep_alive`` returns: a daemon thread refreshes the lease
    every ``ttl_s / 3``; ``stop()`` revokes it, so the key disappears at once."""

    def __init__(self, store: EtcdStore, key: str, lease_id: int, ttl_s: float) -> None:
        self.key = key
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.lost = False  # the server let the lease expire (this holder was too slow)
        self._store = store
        self._stop = threading.Event()
        self.stopped = False
        self._conn = _Connection(store.endpoints, min(store.request_timeout_s, ttl_s / 3))
        self._thread = threading.Thread(
            target=self._run, name=f"zephon-etcd-lease-{key}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"EtcdLease(key={self.key!r}, lease_id={self.lease_id}, ttl_s={self.ttl_s})"

    def _run(self) -> None:
        interval = self.ttl_s / 3
        last_ok = time.monotonic()
        while not self._stop.wait(interval):
            try:
                result = self._conn.call(
                    "/lease/keepalive", {"ID": self.lease_id}, f"lease keep-alive for {self.key!r}"
                )
            except AggregationError as e:
                if time.monotonic() - last_ok > self.ttl_s:
                    self.lost = True
                    log.warning("lease for %r lost: %s", self.key, e)
                    return
                continue
            ttl = int((result.get("result") or {}).get("TTL", -1))
            if ttl <= 0:  # expired on the server; never resurrect it
                self.lost = True
                log.warning("lease for %r expired on the server", self.key)
                return
            last_ok = time.monotonic()

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
                "could not revoke the lease for %r (it expires in %s s): %s",
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
