"""The wire under the etcd store: etcd's v3 JSON gateway, spoken over ``http.client``.

``etcd://`` URLs and their endpoints; one keep-alive HTTP connection per endpoint
(:class:`_Endpoint`); the endpoints tried in order with failover (:class:`_Connection`),
whose errors name every endpoint that failed and why; the base64 the gateway wants for keys
and values, the range end that covers a prefix, and the short error texts the store's
messages quote. ``requests``, under etcd3gw, cost 2.3-2.8 ms of CPU per request where
``http.client`` costs 0.4 ms, which at a thousand ranks is most of a round; no client
library is needed.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from zephon.checkpoint.stores.base import StoreCounters
from zephon.errors import AggregationError

DEFAULT_PORT = 2379


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
