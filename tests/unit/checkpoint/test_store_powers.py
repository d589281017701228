"""BaseStore: what a store must have, the defaults of what it may have, and the directory
stores' one layout under two ways of writing (a local path, an fsspec URL)."""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from typing import Any

import fsspec
import pytest

from tests.unit.checkpoint._stores import MemoryStore
from tests.unit.checkpoint.test_aggregate_round import (
    JOB,
    check_results,
    close_all,
    lanes_of,
    make_state,
    merge,
    run_ranks,
)
from zephon.checkpoint.aggregate import Aggregator
from zephon.checkpoint.stores import BaseStore, DirectoryStore, FsspecStore, LocalStore
from zephon.checkpoint.stores.base import PlainHandle
from zephon.checkpoint.stores.split import SplitStore
from zephon.errors import AggregationError

# ------------------------------------------------------------------ only what is required


def memory_aggs(n: int, shared: dict[str, bytes], timeout_s: float = 10.0) -> list[Aggregator]:
    lock = threading.Lock()
    return [
        Aggregator(
            MemoryStore(shared, lock),
            rank=r,
            world_size=n,
            timeout_s=timeout_s,
            expected_lanes=lambda rank, n=n: lanes_of(rank, n),
            merge=merge,
            lease_ttl_s=2.0,
            job_id=JOB,
        )
        for r in range(n)
    ]


@pytest.mark.parametrize("n", [2, 3])
def test_a_store_with_only_the_required_methods_runs_rounds(n):
    """No fence, lease, listing, watch or batched writes: every round commits through the
    defaults, and close() leaves nothing behind (deleting what a listing would have found
    by the names the round knows)."""
    shared: dict[str, bytes] = {}
    aggs = memory_aggs(n, shared)
    for step in (1, 2, 3):
        states = [make_state(r, n, step) for r in range(n)]
        out = run_ranks(aggs, states)
        check_results([res for res, _ in out], states)
    assert aggs[0].last_round is not None and aggs[0].last_round.requests == 0  # not counted
    close_all(aggs)
    assert shared == {}


def test_over_the_defaults_a_round_missing_a_rank_fails_and_the_next_commits():
    shared: dict[str, bytes] = {}
    aggs = memory_aggs(2, shared, timeout_s=0.5)
    (err, _), _ = run_ranks(aggs, [make_state(0, 2, 1), None])  # the follower never comes
    assert isinstance(err, AggregationError)
    assert re.search(r"timed out after 0.5 s waiting for 1 of 2 ranks.*rank 1 \(lanes", str(err))
    states = [make_state(r, 2, 2) for r in range(2)]
    check_results([res for res, _ in run_ranks(aggs, states)], states)
    close_all(aggs)


def test_a_store_must_be_a_base_store():
    class DuckStore:  # every method a round calls, but not a BaseStore
        poll_interval_s = 0.01

        def put(self, key, value, *, fence=None): ...
        def create(self, key, value, *, fence=None): ...
        def get(self, key): ...
        def delete(self, key): ...
        def describe(self):
            return "duck"

    with pytest.raises(TypeError, match=r"Aggregator's store must be a .*BaseStore.*DuckStore"):
        Aggregator(
            DuckStore(),  # type: ignore[arg-type]
            rank=0,
            world_size=1,
            timeout_s=1.0,
            expected_lanes=lambda r: [0],
            merge=merge,
        )
    memory = MemoryStore({}, threading.Lock())
    with pytest.raises(TypeError, match="SplitStore's blob store must be"):
        SplitStore(memory, DuckStore())  # type: ignore[arg-type]


def test_the_required_methods_are_abstract():
    class NoCreate(BaseStore):
        def put(self, key, value, *, fence=None): ...
        def get(self, key): ...
        def delete(self, key): ...
        def describe(self):
            return "x"

    with pytest.raises(TypeError, match="abstract.*create"):
        NoCreate()  # type: ignore[abstract]


def test_the_defaults_of_the_optional_powers(caplog):
    s = MemoryStore({}, threading.Lock())
    assert (s.poll_interval_s, s.poll_max_interval_s, s.log_prefix) == (0.01, None, "")
    assert not s.announce_batches
    assert s.counters.snapshot() == {
        "requests": 0,
        "bytes_read": 0,
        "bytes_written": 0,
        "events": 0,
    }
    assert s.counters is s.counters  # one per store, made on first use

    assert s.announce("gen", b"r1") is None and s.get("gen") == b"r1"  # no fence
    s.put("k", b"v", fence=None)
    handle = s.keep_alive("leader", b"me", 0.1, exclusive=True)
    assert isinstance(handle, PlainHandle) and not handle.lost and s.get("leader") == b"me"
    handle.stop()
    handle.stop()
    assert s.get("leader") is None

    assert s.get_many(["k", "absent"]) == [b"v", None]
    assert s.list_keys("") is None  # cannot list
    assert s.watch("p.") is None  # cannot push
    assert s.make_room(["p.s.r1."]) is None
    assert s.compact() is None

    for k in ("p.s.1", "p.s.2", "q.1"):
        s.put(k, b"x")
    s.delete_prefix("p.s.", ["p.s.1", "p.s.2", "p.s.3"])  # the known keys, absent ones too
    assert s.get_many(["p.s.1", "p.s.2", "q.1"]) == [None, None, b"x"]

    s.put("old", b"commit")
    assert s.announce_with("gen", b"r2", {"round": b"ann"}, delete=["old"]) is None
    assert s.get_many(["gen", "round", "old"]) == [b"r2", b"ann", None]

    # create_and_delete: the deletions come first, whether or not the create wins
    s.put("d", b"first")
    assert s.create_and_delete("d", b"second", delete=["round"]) == b"first"
    assert s.get("round") is None
    assert s.create_and_delete("d2", b"new", delete=["gen"]) is None
    assert s.get_many(["d2", "gen"]) == [b"new", None]
    s.close()


def test_announce_with_keeps_the_announcement_when_a_deletion_fails(caplog):
    class NoDeletes(MemoryStore):
        def delete(self, key):
            raise OSError("read-only")

    s = NoDeletes({}, threading.Lock())
    s.log_prefix = "[rank=0] "
    with caplog.at_level(logging.WARNING, logger="zephon.checkpoint.stores"):
        s.announce_with("gen", b"r1", {"round": b"ann"}, delete=["old"])
    assert s.get_many(["gen", "round"]) == [b"r1", b"ann"]
    assert any(m.startswith("[rank=0] could not delete 'old'") for m in caplog.messages)
    with pytest.raises(OSError, match="read-only"):
        s.delete_prefix("p.", ["p.1", "p.2"])  # each tried, the first error raised


# ----------------------------------------------------------------- the directory stores


def test_directory_store_picks_the_store_for_its_root(tmp_path):
    assert type(DirectoryStore(tmp_path, "ns")) is LocalStore
    assert type(DirectoryStore(f"file://{tmp_path}", "ns", fsync=True)) is LocalStore
    name = f"zephon-pick-{uuid.uuid4().hex}"
    memory = DirectoryStore(f"memory://{name}", "ns")
    assert type(memory) is FsspecStore and memory.describe() == f"memory://{name}/ns"
    fsspec.filesystem("memory").rm(f"/{name}", recursive=True)
    with pytest.raises(ValueError, match="fsync=True applies to local paths only"):
        DirectoryStore(f"memory://{name}", "ns", fsync=True)
    with pytest.raises(ValueError, match="LocalStore takes a path or a file:// URL"):
        LocalStore("memory://x", "ns")
    with pytest.raises(ValueError, match="namespace must match"):
        FsspecStore("memory://x", "a/b")


def test_local_and_fsspec_stores_share_one_layout(tmp_path):
    """Over the same directory (fsspec's file://), what the fsspec store writes the local
    store reads and lists: the same files, the same keys. The commit markers are no keys."""
    local = LocalStore(tmp_path, "ns")
    remote = FsspecStore(f"file://{tmp_path}", "ns")
    keys = ["root", "j1.p2.c.gen", "j1.p2.s.r7.0", "j1.p2.s.r7.1", "trailing."]
    for k in keys:
        remote.put(k, k.encode())
        assert remote._path(k).removeprefix("/") == local._path(k).removeprefix("/"), k
    assert remote.create("j1.p2.c.d.r7", b"commit") is None
    assert local.create("j1.p2.c.d.r7", b"other") == b"commit"
    lease = remote.keep_alive("j1.p2.c.leader", b"alive", 5.0)
    everything = sorted([*keys, "j1.p2.c.d.r7", "j1.p2.c.leader"])
    assert local.list_keys("") == remote.list_keys("") == everything
    assert local.list_keys("j1.p2.s.r7.") == ["j1.p2.s.r7.0", "j1.p2.s.r7.1"]
    assert local.get_many(keys) == [k.encode() for k in keys]
    assert local.get("j1.p2.c.leader") == b"alive"  # the lease's frame, read the same way
    assert os.path.exists(tmp_path / "ns" / "j1.p2.s.r7~" / "0.commit")
    # A local write has no commit marker: over fsspec it is not (yet) a key.
    local.put("j1.p2.a.r7.1", b"ack")
    assert remote.get("j1.p2.a.r7.1") is None
    assert remote.list_keys("j1.p2.a.") == []
    lease.stop()
    remote.delete_prefix("j1.")
    assert local.list_keys("") == ["j1.p2.a.r7.1", "root", "trailing."]


def test_a_round_over_fsspec_file_urls_commits(tmp_path):
    """The fsspec store on a backend with real directories (file://) makes the
    subdirectories that object storage never needs."""
    n = 2
    stores: list[Any] = [FsspecStore(f"file://{tmp_path}", "job") for _ in range(n)]
    for s in stores:
        s.poll_interval_s, s.poll_max_interval_s = 0.002, 0.02
    aggs = [
        Aggregator(
            stores[r],
            rank=r,
            world_size=n,
            timeout_s=10.0,
            expected_lanes=lambda rank: lanes_of(rank, n),
            merge=merge,
            job_id=JOB,
        )
        for r in range(n)
    ]
    states = [make_state(r, n, 1) for r in range(n)]
    check_results([res for res, _ in run_ranks(aggs, states)], states)
    close_all(aggs)
    assert LocalStore(tmp_path, "job").list_keys("") == []
