"""DirectoryStore (local path and fsspec memory://) and open_store."""

from __future__ import annotations

import importlib
import os
import time
import uuid

import fsspec
import pytest

from zephon.checkpoint.aggregate import open_store
from zephon.checkpoint.stores import BaseStore, DirectoryStore, StaleRoundError
from zephon.errors import AggregationError


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        s = DirectoryStore(tmp_path, "ns")
        yield s
        s.close()
    else:
        root = f"memory://zephon-store-{uuid.uuid4().hex}"
        s = DirectoryStore(root, "ns")
        yield s
        s.close()
        fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_is_a_store(store):
    assert isinstance(store, BaseStore)
    assert store.poll_interval_s > 0
    assert store.poll_max_interval_s >= store.poll_interval_s


def test_put_get_delete(store):
    assert store.get("k") is None
    store.put("k", b"one")
    assert store.get("k") == b"one"
    store.put("k", b"two")
    assert store.get("k") == b"two"
    store.put("empty", b"")
    assert store.get("empty") == b""
    store.delete("k")
    assert store.get("k") is None
    store.delete("k")  # absent is fine


@pytest.mark.parametrize("key", ["", ".hidden", "a/b", "../x", "k.commit", "sp ace", "x" * 201])
def test_bad_keys_are_refused(store, key):
    with pytest.raises(ValueError, match="store key must match"):
        store.put(key, b"v")


def test_bad_namespace_is_refused(tmp_path):
    with pytest.raises(ValueError, match="namespace must match"):
        DirectoryStore(tmp_path, "a/b")


def test_local_keys_are_files_in_root_namespace(tmp_path):
    s = DirectoryStore(tmp_path, "job7")
    s.put("process_0-of-2", b"x")
    assert (tmp_path / "job7" / "process_0-of-2").read_bytes() == b"x"
    assert s.describe() == str(tmp_path / "job7")
    s.delete("process_0-of-2")
    assert os.listdir(tmp_path / "job7") == []


def test_file_url_is_a_local_path(tmp_path):
    s = DirectoryStore(f"file://{tmp_path}", "ns")
    s.put("k", b"v")
    assert (tmp_path / "ns" / "k").read_bytes() == b"v"
    assert s.poll_interval_s == 0.001


def test_fsync_option_writes_the_same(tmp_path):
    s = DirectoryStore(tmp_path, "ns", fsync=True)
    s.put("k", b"v")
    assert s.get("k") == b"v"
    assert sorted(os.listdir(tmp_path / "ns")) == ["k"]  # no temp file left


def test_fsspec_value_without_its_commit_marker_reads_as_absent():
    root = f"memory://zephon-marker-{uuid.uuid4().hex}"
    s = DirectoryStore(root, "ns")
    fs = fsspec.filesystem("memory")
    base = root.removeprefix("memory://") + "/ns"
    fs.pipe_file(f"{base}/k", b"data written, marker not yet")
    assert s.get("k") is None
    s.put("k", b"committed")
    assert fs.cat_file(f"{base}/k.commit").startswith(b"9:")
    assert s.get("k") == b"committed"
    # A new data object under the old marker (a write in progress) is not trusted.
    fs.pipe_file(f"{base}/k", b"newer")
    assert s.get("k") is None
    s.delete("k")
    assert fs.find(base) == []
    assert s.describe() == f"memory://{base.lstrip('/')}"
    assert s.poll_interval_s == 0.05 and s.poll_max_interval_s == 5.0


def test_fence_refuses_a_stale_announcement(store):
    """Announce round A, then B: a late publish fenced on A is refused."""
    fence_a = store.announce("generation", b"round-A")
    store.put("merged-A", b"ok", fence=fence_a)  # still current
    fence_b = store.announce("generation", b"round-B")
    with pytest.raises(StaleRoundError, match="'generation'.*announced again") as info:
        store.put("merged-A", b"late", fence=fence_a)
    assert isinstance(info.value, AggregationError)
    assert store.get("merged-A") == b"ok"
    store.put("merged-B", b"fine", fence=fence_b)
    assert store.get("merged-B") == b"fine"
    store.delete("generation")
    with pytest.raises(StaleRoundError):
        store.put("merged-B", b"after close", fence=fence_b)


def test_fence_must_come_from_announce(store):
    with pytest.raises(TypeError, match="fence must come from"):
        store.put("k", b"v", fence=123)


def test_keep_alive_put_and_stop_deletes(store):
    lease = store.keep_alive("leader", b"round-1 pid=1", 5.0)
    assert store.get("leader") == b"round-1 pid=1"
    lease.stop()
    lease.stop()  # idempotent
    assert store.get("leader") is None


def test_keep_alive_refreshes_and_expires_after_the_holder_stops(store):
    lease = store.keep_alive("leader", b"alive", 0.3)
    time.sleep(0.5)  # past the TTL: only the refresher keeps it
    assert store.get("leader") == b"alive"
    assert not lease.lost
    # The holder "dies": the refresher stops without deleting the key.
    lease._stopped.set()
    lease._thread.join()
    assert store.get("leader") == b"alive"
    time.sleep(0.35)
    assert store.get("leader") is None
    assert lease.lost  # had the holder only been paused, it would know


def test_close_stops_leases(store):
    store.keep_alive("a", b"1", 5.0)
    store.keep_alive("b", b"2", 5.0)
    store.close()
    assert store.get("a") is None and store.get("b") is None


def test_value_that_looks_like_a_lease_frame_round_trips(store):
    tricky = b"ZLEASE01" + b"\x00" * 8 + b"payload"
    store.put("k", tricky)
    assert store.get("k") == tricky


# ------------------------------------------------------------------------------ open_store


def test_open_store_directory_and_url(tmp_path):
    s = open_store(str(tmp_path), namespace="run1")
    assert isinstance(s, DirectoryStore) and s.describe() == str(tmp_path / "run1")
    m = open_store(f"memory://zephon-open-{uuid.uuid4().hex}")
    assert isinstance(m, DirectoryStore) and m.describe().startswith("memory://")


@pytest.mark.parametrize(
    "kwargs", [{}, {"aggregate_dir": "/tmp/x", "aggregate_store": "etcd://127.0.0.1:2379"}]
)
def test_open_store_needs_exactly_one(kwargs):
    with pytest.raises(ValueError, match="give exactly one of aggregate_dir"):
        open_store(**kwargs)


@pytest.mark.parametrize("url", ["redis://h:1", "etcd:h:1", "/some/dir"])
def test_open_store_unknown_scheme(url):
    with pytest.raises(ValueError, match="aggregate_store must be 'etcd://"):
        open_store(aggregate_store=url)


def test_open_store_etcd_needs_an_endpoint():
    with pytest.raises(ValueError, match="names no etcd endpoint"):
        open_store(aggregate_store="etcd://")


def test_open_store_passes_endpoints_and_namespace():
    store = open_store(aggregate_store="etcd://10.0.0.1:2379, 10.0.0.2:2379", namespace="job")
    assert store.describe() == "etcd://10.0.0.1:2379,10.0.0.2:2379"
    assert store.namespace == "job/"
    named = open_store(aggregate_store="etcd://10.0.0.1:2379/other", namespace="job")
    assert named.namespace == "other/", "a namespace in the URL wins"


@pytest.mark.parametrize(
    ("url", "module"),
    [("etcd://h:1", "etcd"), ("jax://", "jax_store"), ("torch://", "torch_store")],
)
def test_open_store_missing_backend_is_a_clear_import_error(monkeypatch, url, module):
    real = importlib.import_module

    def fake_import(name, *args):
        if name == f"zephon.checkpoint.stores.{module}":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(ImportError, match=rf"aggregate_store='{url}' needs .*{module}.*install"):
        open_store(aggregate_store=url)


def test_open_store_etcd_with_a_blob_location(tmp_path):
    from zephon.checkpoint.stores.split import SplitStore

    store = open_store(aggregate_store=f"etcd://10.0.0.1:2379/job7?blobs={tmp_path}")
    assert isinstance(store, SplitStore)
    assert store.control.namespace == "job7/"
    assert store.describe() == f"etcd://10.0.0.1:2379 (states in {tmp_path / 'job7'})"
    # A round's state records go to the directory, everything else to etcd.
    assert store._for("j0a1b.p00ff.s.abc-1.3") is store.blobs
    assert store._for("j0a1b.p00ff.c.d.abc-1") is store.control
    assert store._for("j0a1b.p00ff.a.abc-1.3") is store.blobs  # an acknowledgement
    assert store.watch("j0a1b.p00ff.") is None, "no watch over a prefix holding states"
    store.close()
    with pytest.raises(ValueError, match="the only option is blobs="):
        open_store(aggregate_store="etcd://10.0.0.1:2379?blob=/x")
    with pytest.raises(ValueError, match="the only option is blobs="):
        open_store(aggregate_store="etcd://10.0.0.1:2379?blobs=")


def test_create_is_won_once_and_tells_the_losers_the_winner(store):
    assert store.create("d", b"first") is None
    assert store.create("d", b"second") == b"first"
    assert store.get("d") == b"first"
    assert store.create("empty", b"") is None  # (a full disk still takes an empty file)
    assert store.get("empty") == b""
    store.delete("d")
    assert store.create("d", b"again") is None


def test_list_and_delete_prefix(store):
    for k in ("p.s.1", "p.s.2", "p.c.x", "q.s.1"):
        store.put(k, b"v")
    assert store.list_keys("p.s.") == ["p.s.1", "p.s.2"]
    store.delete_prefix("p.s.")
    assert store.list_keys("p.") == ["p.c.x"] and store.get("q.s.1") == b"v"


def test_counters_count_requests_and_bytes(store):
    before = store.counters.snapshot()
    store.put("k", b"12345")
    assert store.get("k") == b"12345"
    after = store.counters.snapshot()
    assert after["requests"] - before["requests"] == 2
    assert after["bytes_written"] - before["bytes_written"] == 5
    assert after["bytes_read"] - before["bytes_read"] >= 5


def test_a_key_with_dots_is_a_file_in_its_groups_subdirectory(tmp_path):
    s = DirectoryStore(tmp_path, "ns")
    s.put("j1.p2.s.r7.12", b"x")
    s.put("j1.p2.s.r7.13", b"y")
    assert (tmp_path / "ns" / "j1.p2.s.r7~" / "12").read_bytes() == b"x"
    assert s.create("j1.p2.c.d.r7", b"commit") is None
    assert (tmp_path / "ns" / "j1.p2.c.d~" / "r7").read_bytes() == b"commit"
    s.put("trailing.", b"z")  # nothing after its last dot: a file of the namespace
    assert (tmp_path / "ns" / "trailing.").read_bytes() == b"z"
    s.delete("j1.p2.s.r7.12")
    assert os.listdir(tmp_path / "ns" / "j1.p2.s.r7~") == ["13"]
    s.delete_prefix("j1.p2.")
    assert sorted(os.listdir(tmp_path / "ns")) == ["trailing."], "empty subdirectories go"


KEYS = [
    "p", "p.", "p.s", "p.s.1", "p.s.12", "p.s.2", "p.s.2.x", "p.s.2.xy", "p.sx.1",
    "p.c.x", "p.c.d.r1", "p-m.r1", "q.s.1", "q", "root", "ps.1",
]  # fmt: skip


def test_listing_finds_exactly_the_keys_under_any_prefix(store):
    for k in KEYS:
        store.put(k, k.encode())
    prefixes = {k[:i] for k in KEYS for i in range(len(k) + 1)} | {"p.s.3", "z", "p.c.d."}
    for prefix in sorted(prefixes):
        assert store.list_keys(prefix) == sorted(k for k in KEYS if k.startswith(prefix)), prefix
    store.delete_prefix("p.s.")
    assert store.list_keys("p.s") == ["p.s", "p.sx.1"]


def test_a_listing_reads_only_the_subdirectories_that_can_match(store):
    for r in range(50):
        for rank in range(4):
            store.put(f"j.p.s.r{r}.{rank}", b"v")
    before = store.counters.snapshot()["requests"]
    assert store.list_keys("j.p.s.r7.") == [f"j.p.s.r7.{rank}" for rank in range(4)]
    assert store.counters.snapshot()["requests"] - before == 2  # the namespace, r7's group


def test_files_of_the_flat_layout_are_not_keys(tmp_path):
    """A namespace an earlier version wrote (every key a file of it) reads as empty."""
    (tmp_path / "ns").mkdir()
    (tmp_path / "ns" / "j1.p2.c.gen").write_bytes(b"old")
    s = DirectoryStore(tmp_path, "ns")
    assert s.list_keys("j1.") == [] and s.get("j1.p2.c.gen") is None


def test_writes_racing_the_removal_of_their_empty_subdirectory(store):
    """One thread keeps emptying a group (its subdirectory goes each time) while others
    put and create in it: no write fails and every value written reads back."""
    import threading

    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        while not stop.is_set():
            store.put("g.churn", b"c")
            store.delete("g.churn")

    def writer(i: int) -> None:
        try:
            for n in range(150):
                key = f"g.w{i}"
                store.put(key, b"%d" % n)
                assert store.get(key) == b"%d" % n
                store.delete(key)
                assert store.create(key, b"c%d" % n) is None
                store.delete(key)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    churner = threading.Thread(target=churn)
    churner.start()
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    churner.join()
    assert errors == []
    assert store.list_keys("g.") == []


def test_make_room_makes_the_subdirectory_a_round_writes_into(tmp_path):
    s = DirectoryStore(tmp_path, "ns")
    s.make_room(["j.p.s.r1.", "j.p.a.r1."])
    assert sorted(os.listdir(tmp_path / "ns")) == ["j.p.a.r1~", "j.p.s.r1~"]
    assert s.list_keys("j.") == []
    before = s.counters.snapshot()["requests"]
    s.put("j.p.s.r1.3", b"state")
    assert s.counters.snapshot()["requests"] - before == 1, "no failed write, no mkdir"
    s.delete_prefix("j.p.s.r1.")
    assert os.listdir(tmp_path / "ns") == ["j.p.a.r1~"]  # (empty: removed with a deletion)
    name = f"zephon-room-{uuid.uuid4().hex}"
    memory = DirectoryStore(f"memory://{name}", "ns")
    memory.make_room(["j.p.s.r1."])  # prefixes of object names: nothing to make
    fs = fsspec.filesystem("memory")
    assert fs.ls(f"/{name}/ns", detail=False) == []
    fs.rm(f"/{name}", recursive=True)
