"""A real S3-compatible server on loopback for the object-storage tests and benchmark: the
``moto`` package's server mode, and an HTTP proxy in front of it that adds a delay to
every request or drops the next few connections (transient failures).

    with S3Server() as s3:
        s3.client().create_bucket(Bucket="data")
        proxy = s3.proxy(delay_s=0.02)
        ds = zp.JsonlSource("s3://data/*.jsonl", storage_options=proxy.storage_options)

``S3Server`` runs moto on a thread of this process, with the proxy beside it: the tests'
choice (no process to start; faults injected). For throughput, ``S3ServerProcess`` runs
moto in a process of its own with the delay added by the server itself (before every
answer), so neither the server nor a proxy shares the loader's interpreter, and counts its
requests:

    python -m benchmarks.s3_local --serve PORT [--delay-ms D]
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def storage_options_for(endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs options for a local endpoint with moto's dummy credentials."""
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }


class _Endpoint:
    """What both servers give their users: fsspec options and a boto3 client for
    ``self.endpoint``, with moto's dummy credentials."""

    endpoint: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return storage_options_for(self.endpoint)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )


class S3Server(_Endpoint):
    """moto's S3 server on 127.0.0.1 (a free port), started and stopped by this object.

    Raises:
        RuntimeError: the server did not answer within ``start_timeout_s``.
    """

    def __init__(self, start_timeout_s: float = 20.0) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self._proxies: list[Proxy] = []
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError as e:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(
                        f"the moto S3 server on {self.endpoint} did not start within "
                        f"{start_timeout_s} s ({e})"
                    ) from e
                time.sleep(0.05)

    def proxy(self, delay_s: float = 0.0) -> Proxy:
        proxy = Proxy(self.port, delay_s)
        self._proxies.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        self._proxies = []
        self._server.stop()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up (or a dropped connection) is not news here


class Proxy:
    """Forwards HTTP requests to ``127.0.0.1:target_port``, each after ``delay_s``; the next
    ``fail_next(n)`` requests are answered by closing the connection instead."""

    def __init__(self, target_port: int, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.requests = 0  # forwarded
        self.methods: dict[str, int] = {}
        self.dropped = 0
        self.in_flight = 0  # requests being delayed or forwarded now
        self.max_in_flight = 0  # the most at once since the last reset_counts
        self._fail = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with owner._lock:
                    fail = owner._fail > 0
                    if fail:
                        owner._fail -= 1
                        owner.dropped += 1
                    else:
                        owner.requests += 1
                        owner.methods[self.command] = owner.methods.get(self.command, 0) + 1
                if fail:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with owner._lock:
                    owner.in_flight += 1
                    owner.max_in_flight = max(owner.max_in_flight, owner.in_flight)
                try:
                    self._answer(body)
                finally:
                    with owner._lock:
                        owner.in_flight -= 1

            def _answer(self, body: bytes | None) -> None:
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                conn = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    head = self.command == "HEAD"  # keeps the object's Content-Length
                    for key, value in response.getheaders():
                        if key.lower() in _HOP_HEADERS or (
                            key.lower() == "content-length" and not head
                        ):
                            continue
                        self.send_header(key, value)
                    if not head:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def storage_options(self) -> dict[str, Any]:
        return storage_options_for(self.endpoint)

    def fail_next(self, n: int) -> None:
        with self._lock:
            self._fail = n

    def reset_counts(self) -> None:
        with self._lock:
            self.requests, self.dropped, self.methods = 0, 0, {}
            self.max_in_flight = self.in_flight

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


_COUNT_PATH = "/__zephon/requests"


def _serve(port: int, delay_s: float) -> None:
    """moto's app on 127.0.0.1:``port``, threaded, each request answered after ``delay_s``;
    ``GET /__zephon/requests`` gives the requests served (``?reset=1``: and resets them).
    Exits when the process that started it is gone."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()
    served = [0]

    def delayed(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == _COUNT_PATH:
            with lock:
                body = json.dumps({"requests": served[0]}).encode()
                if "reset=1" in environ.get("QUERY_STRING", ""):
                    served[0] = 0
            start_response("200 OK", [("Content-Length", str(len(body)))])
            return [body]
        with lock:
            served[0] += 1
        if delay_s:
            time.sleep(delay_s)
        return app(environ, start_response)

    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    server = make_server("127.0.0.1", port, delayed, True, request_handler=MotoRequestHandler)
    server.serve_forever()


class S3ServerProcess(_Endpoint):
    """moto's S3 server in a process of its own on 127.0.0.1, every answer ``delay_s``
    late; started and stopped by this object.

    Raises:
        RuntimeError: the server did not answer within ``start_timeout_s``.
    """

    def __init__(self, delay_s: float = 0.0, start_timeout_s: float = 30.0) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, "-m", "benchmarks.s3_local", "--serve", str(self.port)]
        cmd += ["--delay-ms", str(delay_s * 1e3)]
        self._process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                self.requests(reset=True)
                break
            except OSError as e:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(
                        f"the moto S3 server process on {self.endpoint} did not start within "
                        f"{start_timeout_s} s ({e})"
                    ) from e
                time.sleep(0.1)

    def requests(self, reset: bool = False) -> int:
        """The requests served (the count's own excepted) since the last reset."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", _COUNT_PATH + ("?reset=1" if reset else ""))
            return int(json.loads(conn.getresponse().read())["requests"])
        finally:
            conn.close()

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> S3ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="moto's S3 server with a delay, in this process")
    ap.add_argument("--serve", type=int, required=True, metavar="PORT")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    _serve(args.serve, args.delay_ms / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
