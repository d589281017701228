"""Watches of the etcd store: a local copy of every key under a prefix, kept current.

``EtcdStore.watch(prefix)`` starts an :class:`EtcdWatch`: a daemon thread holds one watch
stream over the prefix (its own HTTP connection) and keeps a local copy of every key under
it, so a waiting rank sends no requests until something changes. The stream has a read
timeout and reconnects (a range read, then a watch from the revision after it) after an
error, a timeout or a compaction that cancelled it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any

from zephon.checkpoint.stores.etcd.client import EtcdClient
from zephon.checkpoint.stores.etcd.gateway import (
    _HEADERS,
    _b64,
    _Connection,
    _prefix_end,
    _short_text,
    _unb64,
)
from zephon.checkpoint.stores.etcd.parts import _PART_MARK, _TAG_INLINE, _TAG_MANIFEST
from zephon.errors import AggregationError

#: a watch stream with no traffic for this long is reopened (a stalled server, a lost peer)
WATCH_READ_TIMEOUT_S = 30.0


class EtcdWatch:
    """A local copy of every key under a prefix, kept current by one etcd watch stream
    (see :class:`~zephon.checkpoint.stores.base.PrefixWatch`).

    The thread does a range read of the prefix, then watches from the revision after it;
    after any error (the stream broke, no traffic for ``WATCH_READ_TIMEOUT_S``, a
    compaction cancelled it) it starts over with a fresh range read, so the copy is never
    missing a change for longer than one reconnect. Values split into parts are fetched
    with a get. Keys are the store's (namespace stripped).
    """

    def __init__(self, store: EtcdClient, prefix: str) -> None:
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
