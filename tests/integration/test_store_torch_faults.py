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

from zephon.errors import AggregationError

pytestmark = pytest.mark.processes

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

    os.kill(proc.pid, signal.SIGSTOP)
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
