"""TorchStore against a TCPStore server in another process that is SIGSTOPped, resumed and
SIGKILLed. TCPStore's own check/set/delete wait on the socket with no timeout (a stalled
server blocked them for 10 minutes in testing): every call must instead end in an
AggregationError naming the server within the request timeout, and work again after
SIGCONT on a fresh connection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.stopping import stop_process
from zephon.errors import AggregationError

pytestmark = [pytest.mark.stores, pytest.mark.processes]

HERE = Path(__file__).parent
TIMEOUT_S = 0.5


@pytest.fixture
def master():
    pytest.importorskip("torch.distributed")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_store_tcp_master.py")], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()
        proc.stdout.close()


def test_stalled_then_dead_tcpstore_server_gives_bounded_errors(master):
    import torch.distributed as dist

    from zephon.checkpoint.stores.torch_store import TorchStore

    proc, port = master
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    store = TorchStore(client, request_timeout_s=TIMEOUT_S)
    assert store.describe() == f"torch://127.0.0.1:{port}"
    store.put("k", b"v")

    stop_process(proc.pid)  # every thread: a server stopping answered calls (a busy machine)
    try:
        for op in (lambda: store.get("k"), lambda: store.get("absent"), lambda: store.delete("k")):
            t0 = time.monotonic()
            with pytest.raises(AggregationError, match=f"torch://127.0.0.1:{port} did not answer"):
                op()
            assert time.monotonic() - t0 < TIMEOUT_S + 2.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    store.put("k", b"after")
    assert store.get("k") == b"after"

    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    with pytest.raises(AggregationError, match=f"torch://127.0.0.1:{port}"):
        store.get("k")
    assert time.monotonic() - t0 < TIMEOUT_S + 2.0
    store.close()


def test_a_master_port_another_process_holds_is_named_at_once(monkeypatch):
    pytest.importorskip("torch.distributed")
    import socket

    from zephon.checkpoint.stores.torch_store import store_from_env

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        t0 = time.monotonic()
        with pytest.raises(AggregationError) as e:
            store_from_env(30)
    assert time.monotonic() - t0 < 10  # not the 30 s connect timeout
    assert f"another process holds port {port}. Pick a free MASTER_PORT" in str(e.value)
    assert "within" not in str(e.value)


def test_a_key_read_as_empty_while_it_is_deleted_is_absent():
    # TCPStore.get is a wait, then a read: a key deleted in between reads as b"" (a
    # follower once failed a round on that, taking the round key for a foreign value).
    dist = pytest.importorskip("torch.distributed")
    from zephon.checkpoint.stores.torch_store import TorchStore

    class DeletedMidGet(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.data: dict[str, bytes] = {}
            self.empty_once: set[str] = set()

        def set(self, key, value):
            self.data[key] = bytes(value)

        def get(self, key):
            if key in self.empty_once:
                self.empty_once.discard(key)
                return b""
            return self.data[key]

        def check(self, keys):
            return all(k in self.data for k in keys)

        def delete_key(self, key):
            return self.data.pop(key, None) is not None

        def set_timeout(self, timeout):
            pass

    inner = DeletedMidGet()
    store = TorchStore(inner)
    store.put("round", b"r-1")
    assert store.get("round") == b"r-1"
    (key,) = inner.data
    inner.empty_once.add(key)
    assert store.get("round") is None
    assert store.get("round") == b"r-1"  # on the fresh connection it reads again
