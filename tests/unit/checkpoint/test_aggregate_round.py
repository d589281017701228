"""The multi-rank checkpoint round, with N ranks simulated as threads over one store.

Every rank gets its own store object on the same location (a tmp directory, or an fsspec
``memory://`` root, which threads of one process share), as separate hosts would. The
leader returns the merged state; a follower its share (the merged header, its own lanes).
Job identity, agreement and store failures have their own file:
test_aggregate_identity_and_faults.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import pytest

from tests.unit.checkpoint._stores import Wrapped
from zephon.checkpoint.aggregate import SHARE_KEY, Aggregator
from zephon.checkpoint.rounds.context import read_decision
from zephon.checkpoint.rounds.keys import STATE, Announcement, Keys, encode
from zephon.checkpoint.state import ROUND
from zephon.checkpoint.stores import DirectoryStore, StaleRoundError
from zephon.errors import AggregationError

LANES_PER_GROUP = 2
JOB = "test-job"
KEYS = Keys(JOB, "")


def lanes_of(rank: int, world_size: int, dp_size: int | None = None) -> list[int]:
    dp_size = dp_size or world_size
    dp_rank = rank * dp_size // world_size
    return list(range(dp_rank * LANES_PER_GROUP, (dp_rank + 1) * LANES_PER_GROUP))


def make_state(rank: int, world_size: int, step: int, dp_size: int | None = None) -> dict:
    dp_size = dp_size or world_size
    return {
        "topology": {
            "rank": rank,
            "world_size": world_size,
            "dp_rank": rank * dp_size // world_size,
            "dp_size": dp_size,
            "canonical_replicas": dp_size * LANES_PER_GROUP,
        },
        "lanes": [
            {
                "lane": lane,
                "cursor": [step, lane],
                "inflight": [{"chunk": step + i} for i in range(3)],
            }
            for lane in lanes_of(rank, world_size, dp_size)
        ],
        "step": step,
    }


def merge(states: list[dict]) -> dict:
    lanes: dict[int, dict] = {}
    for st in states:
        for lane in st["lanes"]:
            lanes.setdefault(lane["lane"], lane)
    return {
        "step": states[0]["step"],
        "lanes": [lanes[k] for k in sorted(lanes)],
        "ranks": len(states),
    }


def without_round(result: dict) -> dict:
    """A leader's result without what it says of its round (its id differs every run)."""
    assert isinstance(result, dict), result
    assert isinstance(result[ROUND]["round_id"], str), result[ROUND]
    return {k: v for k, v in result.items() if k != ROUND}


def share_of(merged: dict, rank: int, world_size: int, dp_size: int | None = None) -> dict:
    """What a follower returns, without its "share" entry: the merged header, its lanes."""
    mine = set(lanes_of(rank, world_size, dp_size))
    return {**merged, "lanes": [x for x in merged["lanes"] if x["lane"] in mine]}


def check_results(results: list[Any], states: list[dict], dp_size: int | None = None) -> None:
    n = len(states)
    merged = merge(states)
    for res in results:
        if isinstance(res, dict):
            got = res.pop(ROUND)
            assert got["step"] == states[0]["step"] and got["round_id"], got
    assert results[0] == merged
    for r in range(1, n):
        res = results[r]
        assert not isinstance(res, BaseException), res
        share = res.pop(SHARE_KEY)
        assert share["rank"] == r and share["world_size"] == n
        assert share["lanes_total"] == len(merged["lanes"])
        assert res == share_of(merged, r, n, dp_size)


class Roots:
    """Fresh store locations of one kind; memory roots are removed afterwards."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.made: list[str] = []

    def new(self) -> str:
        if self.kind == "local":
            path = self.tmp_path / f"agg-{len(self.made)}"
            self.made.append(str(path))
            return str(path)
        root = f"memory://zephon-round-{uuid.uuid4().hex}"
        self.made.append(root)
        return root

    def store(self, root: str) -> DirectoryStore:
        s = DirectoryStore(root, "job")
        if self.kind == "memory":
            s.poll_interval_s, s.poll_max_interval_s = 0.002, 0.02  # keep the tests quick
        return s

    def files(self, root: str) -> list[str]:
        """Every file the store holds, named as its key (``g~/f`` is key ``g.f``), temp
        files and stray commit markers too."""
        if self.kind == "local":
            base = os.path.join(root, "job")
            paths = [
                os.path.relpath(os.path.join(d, f), base)
                for d, _, files in os.walk(base)
                for f in files
            ]
        else:
            fs = fsspec.filesystem("memory")
            base = root.removeprefix("memory://") + "/job"
            paths = [p.lstrip("/").removeprefix(base.lstrip("/") + "/") for p in fs.find(base)]
        names = {p.replace("~/", ".") for p in paths}
        if self.kind == "local":
            return sorted(names)
        # A key is its data object plus its commit marker; list keys (and stray markers).
        return sorted(x for x in names if not (x.endswith(".commit") and x[:-7] in names))

    def empty_dirs(self, root: str) -> list[str]:
        """The store's subdirectories that hold nothing (local roots; an object store has
        no empty prefixes)."""
        if self.kind != "local":
            return []
        base = os.path.join(root, "job")
        return sorted(d for d, subs, files in os.walk(base) if d != base and not subs + files)

    def cleanup(self) -> None:
        if self.kind == "memory":
            fs = fsspec.filesystem("memory")
            for root in self.made:
                path = root.removeprefix("memory://")
                if fs.exists(path):
                    fs.rm(path, recursive=True)


@pytest.fixture(params=["local", "memory"])
def roots(request, tmp_path):
    r = Roots(request.param, tmp_path)
    yield r
    r.cleanup()


@pytest.fixture
def local(tmp_path):
    r = Roots("local", tmp_path)
    yield r


def make_aggs(
    roots: Roots,
    root: str,
    n: int,
    *,
    timeout_s: float | list[float] = 10.0,
    merge_fn: Callable[[list[dict]], dict] = merge,
    dp_size: int | None = None,
    lease_ttl_s: float = 10.0,
    store_wrap: Callable[[int, Any], Any] | None = None,
    job_id: str = JOB,
    fingerprint: str = "",
) -> list[Aggregator]:
    timeouts = timeout_s if isinstance(timeout_s, list) else [timeout_s] * n
    aggs = []
    for r in range(n):
        store = roots.store(root)
        if store_wrap is not None:
            store = store_wrap(r, store)
        aggs.append(
            Aggregator(
                store,
                rank=r,
                world_size=n,
                timeout_s=timeouts[r],
                expected_lanes=lambda rank, n=n: lanes_of(rank, n, dp_size),
                merge=merge_fn,
                lease_ttl_s=lease_ttl_s,
                job_id=job_id,
                fingerprint=fingerprint,
            )
        )
    return aggs


def run_ranks(
    aggs: list[Aggregator],
    states: list[dict | None],
    *,
    delays_s: dict[int, float] | None = None,
) -> list[tuple[Any, float]]:
    """Each rank whose state is not None calls round() in its own thread (after its delay);
    returns (merged or the exception, seconds inside round()) per rank (None: did not run)."""
    out: list[Any] = [None] * len(aggs)

    def one(r: int) -> None:
        time.sleep((delays_s or {}).get(r, 0.0))
        t = time.monotonic()
        try:
            res: Any = aggs[r].round(states[r])
        except BaseException as e:
            res = e
        out[r] = (res, time.monotonic() - t)

    threads = [
        threading.Thread(target=one, args=(r,)) for r in range(len(aggs)) if states[r] is not None
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank hung"
    return out


def decisions(files: list[str]) -> list[str]:
    return [f for f in files if f.startswith(KEYS.decisions)]


def assert_only_the_failure_is_left(files: list[str]) -> None:
    """A failed last round leaves its notice (and announcement, if still open) after
    close(), for followers that have not looked yet."""
    notices = decisions(files)
    assert len(notices) == 1, files
    assert set(files) - set(notices) <= {KEYS.round}, files


def close_all(aggs: list[Aggregator]) -> None:
    for a in aggs:
        a.close()


# ----------------------------------------------------------------------------- happy path


@pytest.mark.parametrize("n", [2, 4, 8])
def test_leader_returns_the_merged_state_and_followers_their_share(roots, n):
    root = roots.new()
    aggs = make_aggs(roots, root, n)
    for step in (10, 20, 30):
        states = [make_state(r, n, step) for r in range(n)]
        out = run_ranks(aggs, states)
        check_results([res for res, _ in out], states)
        assert [lane["lane"] for lane in out[0][0]["lanes"]] == list(range(n * LANES_PER_GROUP))
    close_all(aggs)
    assert roots.files(root) == []


def test_a_follower_reads_the_manifest_not_the_other_ranks_lanes(local):
    """Linear fan-out: what a follower reads in a round does not grow with the other
    ranks' lanes (here each rank holds ~40 KB of lane state; a follower reads under 4 KB)."""
    root = local.new()
    n = 6
    aggs = make_aggs(local, root, n)
    states = [make_state(r, n, 1) for r in range(n)]
    for st in states:
        for lane in st["lanes"]:
            lane["inflight"] = [{"chunk": i, "pointers": os.urandom(20_000)} for i in range(1)]
    out = run_ranks(aggs, states)
    assert all(not isinstance(res, BaseException) for res, _ in out), out
    leader = aggs[0].last_round
    assert leader is not None and leader.ok and leader.bytes_read > (n - 1) * 40_000
    for a in aggs[1:]:
        stats = a.last_round
        assert stats is not None and stats.ok and stats.role == "follower"
        assert stats.bytes_read < 4_000, stats
        assert stats.requests > 0
    close_all(aggs)


def eventually(condition: Callable[[], bool], within_s: float = 5.0) -> bool:
    """Whether ``condition()`` holds within ``within_s`` (what the leader deletes after a
    round returns, on a thread, goes soon after)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_previous_merged_is_kept_until_the_next_round_is_acknowledged(roots):
    root = roots.new()
    n = 3
    seen_during_merge: list[list[str]] = []

    def spying_merge(states):
        seen_during_merge.append(roots.files(root))
        return merge(states)

    aggs = make_aggs(roots, root, n, merge_fn=spying_merge)
    run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    first = decisions(roots.files(root))
    assert len(first) == 1
    rid1 = first[0].removeprefix(KEYS.decisions)
    # Between rounds only the "round closed" marker (the commit), every rank's state record
    # (for the followers' shares; the acknowledgements go on a thread after the round), the
    # fence key and the leader's liveness key (held until close()) stay.
    states1 = [KEYS.state(rid1, r) for r in range(n)]
    places = [KEYS.member(r) for r in range(1, n)]  # the followers', held until close()
    expected = sorted([*first, *states1, KEYS.gen, KEYS.leader, *places])
    assert eventually(lambda: sorted(roots.files(root)) == expected), roots.files(root)

    run_ranks(aggs, [make_state(r, n, 2) for r in range(n)])
    # While round 2 was merging, round 1's commit was still there...
    assert first[0] in seen_during_merge[1]
    # ...and once round 2 was acknowledged by everyone, it was gone.
    second = decisions(roots.files(root))
    assert len(second) == 1 and second != first
    assert not set(states1) & set(roots.files(root))
    rid2 = second[0].removeprefix(KEYS.decisions)
    assert eventually(lambda: not [k for k in roots.files(root) if k.startswith(KEYS.acks(rid2))])
    close_all(aggs)
    assert roots.files(root) == []
    assert roots.empty_dirs(root) == []


def test_a_followers_share_saves_and_restores_as_the_merged_state(local, tmp_path):
    """A follower's result is its share (own lanes); ``zp.save`` of it writes the whole
    merged state, read from what the leader left in the store, until the next round is
    acknowledged; after that (or the leader's close()) saving it says why it cannot."""
    import zephon as zp
    from zephon.checkpoint.share import Share
    from zephon.errors import CheckpointError

    root = local.new()
    n = 4
    aggs = make_aggs(local, root, n)
    states = [make_state(r, n, 1) for r in range(n)]
    out = [res for res, _ in run_ranks(aggs, states)]
    merged = out[0]
    share = out[2]
    assert isinstance(share, Share) and not isinstance(merged, Share)
    assert [ls["lane"] for ls in share["lanes"]] == lanes_of(2, n)
    round_bytes = aggs[2].last_round.bytes_read
    assert share.merged() == merged
    assert zp.save(tmp_path / "r2.zph", share) > 0
    assert zp.load(tmp_path / "r2.zph") == merged
    # A plain copy is the share alone: saved as it is.
    zp.save(tmp_path / "plain.zph", dict(share))
    assert zp.load(tmp_path / "plain.zph") == dict(share)
    # The round itself read no other rank's lanes; only saving the share did.
    assert round_bytes < 2_000, round_bytes
    run_ranks(aggs, [make_state(r, n, 2) for r in range(n)])
    with pytest.raises(CheckpointError, match=r"\[rank=2\] the merged state of round .* no longer"):
        zp.save(tmp_path / "late.zph", share)
    assert not (tmp_path / "late.zph").exists()
    close_all(aggs)


class _DropAcks(Wrapped):
    """A store whose acks vanish (a follower acknowledges by writing ``a.<round>.<rank>``):
    the rank read the result, then died before acking."""

    def put(self, key, value, **kw):
        if ".a." not in key:
            self._inner.put(key, value, **kw)


def test_unacknowledged_result_stays_until_a_later_round_is_acknowledged(local, caplog):
    root = local.new()
    n = 3
    flaky = make_aggs(
        local,
        root,
        n,
        timeout_s=[0.4, 5.0, 5.0],
        store_wrap=lambda r, s: _DropAcks(s) if r == 2 else s,
    )
    with caplog.at_level(logging.WARNING, logger="zephon.checkpoint.aggregate"):
        out = run_ranks(flaky, [make_state(r, n, 1) for r in range(n)])
    assert all(isinstance(res, dict) for res, _ in out)  # the leader still returns it
    assert any("[rank=0]" in m and "ranks [2] did not acknowledge" in m for m in caplog.messages)
    first = set(decisions(local.files(root)))
    assert len(first) == 1

    flaky[2].close()
    flaky[2] = make_aggs(local, root, n)[2]  # rank 2 is healthy again
    run_ranks(flaky, [make_state(r, n, 2) for r in range(n)])
    merged_files = set(decisions(local.files(root)))
    assert len(merged_files) == 1 and not merged_files & first
    close_all(flaky)
    assert local.files(root) == []


def test_dp_groups_model_parallel_peers_report_the_same_lanes(local):
    root = local.new()
    n, dp = 4, 2
    aggs = make_aggs(local, root, n, dp_size=dp)
    states = [make_state(r, n, 5, dp_size=dp) for r in range(n)]
    out = run_ranks(aggs, states)
    check_results([res for res, _ in out], states, dp_size=dp)
    assert [lane["lane"] for lane in out[0][0]["lanes"]] == [0, 1, 2, 3]
    close_all(aggs)


def test_late_leader_within_the_budget_is_fine(local):
    root = local.new()
    n = 4
    aggs = make_aggs(local, root, n, timeout_s=3.0)
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)], delays_s={0: 0.8})
    assert all(isinstance(res, dict) for res, _ in out)
    close_all(aggs)
    assert local.files(root) == []  # the followers' probes (after 0.5 s) are gone too


def test_a_merge_that_changes_lane_states_is_refused(local):
    root = local.new()

    def rewriting_merge(states):
        m = merge(states)
        m["lanes"] = [{**x, "cursor": [0, 0]} for x in m["lanes"]]
        return m

    aggs = make_aggs(local, root, 2, merge_fn=rewriting_merge)
    out = run_ranks(aggs, [make_state(r, 2, 1) for r in range(2)])
    assert isinstance(out[0][0], AggregationError)
    assert "changed the state of lane 0" in str(out[0][0])
    assert isinstance(out[1][0], AggregationError) and "changed the state" in str(out[1][0])
    close_all(aggs)


# ----------------------------------------------------------------------------- faults


def test_missing_rank_is_named_with_its_lanes_and_followers_fail_fast(roots):
    root = roots.new()
    n = 4
    # The leader's budget is short, the followers' long: they must fail on the notice.
    aggs = make_aggs(roots, root, n, timeout_s=[0.5, 20.0, 20.0, 20.0])
    states = [make_state(r, n, 1) for r in range(n)]
    states[3] = None  # rank 3 never calls checkpoint()
    out = run_ranks(aggs, states)
    err, elapsed = out[0]
    assert isinstance(err, AggregationError)
    msg = str(err)
    assert msg.startswith("[rank=0] checkpoint round ")
    assert "timed out after 0.5 s waiting for 1 of 4 ranks" in msg
    assert "rank 3 (lanes [6, 7])" in msg
    assert "call checkpoint() at the same step" in msg
    assert 0.5 <= elapsed < 1.5
    for r in (1, 2):
        ferr, felapsed = out[r]
        assert isinstance(ferr, AggregationError)
        assert f"[rank={r}] the leader (rank 0) failed checkpoint round" in str(ferr)
        assert "rank 3 (lanes [6, 7])" in str(ferr)
        assert felapsed < 2.0  # the notice, not their own 20 s budget
    close_all(aggs)
    assert_only_the_failure_is_left(roots.files(root))
    assert roots.empty_dirs(root) == [], "the subdirectories made for the round go with it"


def test_a_dp_peer_cannot_stand_in_for_a_missing_rank(local):
    root = local.new()
    n, dp = 4, 2
    aggs = make_aggs(local, root, n, dp_size=dp, timeout_s=[0.4, 10.0, 10.0, 10.0])
    states: list[dict | None] = [make_state(r, n, 1, dp_size=dp) for r in range(n)]
    states[1] = None  # rank 0 already reports lanes 0 and 1; rank 1 must still report them
    out = run_ranks(aggs, states)
    err, _ = out[0]
    assert isinstance(err, AggregationError)
    assert "1 of 4 ranks" in str(err) and "rank 1 (lanes [0, 1])" in str(err)
    close_all(aggs)


@pytest.mark.parametrize(
    ("corrupt", "expected"),
    [
        (lambda st: st["lanes"].pop(), "it reports lanes [4], the leader expects [4, 5]"),
        (
            lambda st: st["lanes"].__setitem__(1, {"lane": 9}),
            "it reports lanes [4, 9], the leader expects [4, 5]",
        ),
        (
            lambda st: st["topology"].__setitem__("canonical_replicas", 16),
            "canonical_replicas=16 (the leader has 8)",
        ),
        (lambda st: st["topology"].__setitem__("dp_size", 2), "dp_size=2 (the leader has 4)"),
        (lambda st: st["topology"].__setitem__("rank", 3), "rank=3 (the leader has 2)"),
        (lambda st: st.pop("topology"), "it has no 'topology' dict"),
        (lambda st: st.__setitem__("lanes", [4, 5]), "not a list of {'lane': int"),
    ],
)
def test_lane_mapping_mismatch_raises_at_once(local, corrupt, expected):
    root = local.new()
    n = 4
    aggs = make_aggs(local, root, n, timeout_s=20.0)
    states = [make_state(r, n, 1) for r in range(n)]
    corrupt(states[2])
    out = run_ranks(aggs, states)
    err, elapsed = out[0]
    assert isinstance(err, AggregationError)
    assert "rank 2's state in round" in str(err)
    assert "disagrees with the leader's lane mapping" in str(err)
    assert expected in str(err)
    assert elapsed < 2.0  # at once, not at the 20 s deadline
    for r in (1, 2, 3):
        ferr, felapsed = out[r]
        assert isinstance(ferr, AggregationError) and "failed checkpoint round" in str(ferr)
        assert expected in str(ferr)
        assert felapsed < 2.0
    close_all(aggs)
    assert_only_the_failure_is_left(local.files(root))


def test_follower_arriving_after_the_failure_still_fails_fast_and_a_later_run_is_unaffected(
    local,
):
    """The leader fails round 1 at once (a mapping mismatch) before rank 2 even starts:
    rank 2 still joins that round, sees the live leader's notice and fails at once. After
    the job ends, its notice and announcement are left; the next run ignores them."""
    root = local.new()
    n = 3
    aggs = make_aggs(local, root, n, timeout_s=10.0)
    states = [make_state(r, n, 1) for r in range(n)]
    states[1]["lanes"].pop()
    out = run_ranks(aggs, states, delays_s={2: 0.5})
    assert isinstance(out[0][0], AggregationError) and out[0][1] < 0.5
    err, elapsed = out[2]
    assert isinstance(err, AggregationError)
    assert "the leader (rank 0) failed checkpoint round" in str(err)
    assert "it reports lanes [2], the leader expects [2, 3]" in str(err)
    assert elapsed < 0.5
    close_all(aggs)
    assert_only_the_failure_is_left(local.files(root))

    again = make_aggs(local, root, n, timeout_s=10.0)  # the job again, followers first
    states = [make_state(r, n, 2) for r in range(n)]
    out = run_ranks(again, states, delays_s={0: 0.5})
    check_results([res for res, _ in out], states)
    close_all(again)
    assert local.files(root) == []


def test_follower_arriving_after_the_failed_leader_closed_waits_out_its_budget(local):
    """Documented limit: with the leader gone, a failed round's notice looks like a dead
    run's leftover, so a follower that first looks then waits for its deadline (and
    reports the notice it found)."""
    root = local.new()
    n = 3
    aggs = make_aggs(local, root, n, timeout_s=[10.0, 10.0, 0.5])
    states = [make_state(r, n, 1) for r in range(n)]
    states[1]["lanes"].pop()
    out = run_ranks(aggs, states[:2] + [None])
    assert isinstance(out[0][0], AggregationError)
    aggs[0].close()
    err, elapsed = run_ranks(aggs, [None, None, states[2]])[2]
    assert isinstance(err, AggregationError)
    assert "timed out after 0.5 s waiting for the merged result" in str(err)
    assert "found: the leader (rank 0) failed checkpoint round" in str(err)
    assert "it reports lanes [2], the leader expects [2, 3]" in str(err)
    assert elapsed >= 0.5


def test_merge_failure_is_published_so_followers_fail_fast(roots):
    root = roots.new()
    n = 4

    def bad_merge(states):
        raise ValueError("lane 3 is inconsistent")

    aggs = make_aggs(roots, root, n, timeout_s=20.0, merge_fn=bad_merge)
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    err, _ = out[0]
    assert isinstance(err, AggregationError)
    assert "merging the states of round" in str(err)
    assert "ValueError: lane 3 is inconsistent" in str(err)
    assert isinstance(err.__cause__, ValueError)
    for r in range(1, n):
        ferr, felapsed = out[r]
        assert isinstance(ferr, AggregationError)
        assert "the leader (rank 0) failed checkpoint round" in str(ferr)
        assert "lane 3 is inconsistent" in str(ferr)
        assert felapsed < 2.0
    close_all(aggs)
    assert_only_the_failure_is_left(roots.files(root))


def test_follower_with_an_unserialisable_state_fails_the_round_at_once(local):
    root = local.new()
    n = 3
    aggs = make_aggs(local, root, n, timeout_s=20.0)
    states = [make_state(r, n, 1) for r in range(n)]
    states[1]["extra"] = (1, 2)  # a tuple: msgpack would turn it into a list
    out = run_ranks(aggs, states)
    err1, _ = out[1]
    assert isinstance(err1, AggregationError) and "cannot serialise" in str(err1)
    err0, elapsed = out[0]
    assert isinstance(err0, AggregationError)
    assert "rank 1 could not take part in round" in str(err0) and "tuple" in str(err0)
    assert elapsed < 2.0
    err2, elapsed2 = out[2]
    assert isinstance(err2, AggregationError) and "rank 1 ended checkpoint round" in str(err2)
    assert elapsed2 < 2.0
    close_all(aggs)


def test_stale_leader_publish_is_rejected(roots):
    """A newer round is announced while this leader merges: its fenced commit is refused."""
    root = roots.new()
    n = 3
    usurper = roots.store(root)

    def merge_while_a_newer_leader_announces(states):
        usurper.announce(KEYS.gen, b"newer-session-1")
        return merge(states)

    aggs = make_aggs(roots, root, n, timeout_s=20.0, merge_fn=merge_while_a_newer_leader_announces)
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    err, _ = out[0]
    assert isinstance(err, AggregationError)
    assert "cannot publish its merged result" in str(err) and "this leader is stale" in str(err)
    assert isinstance(err.__cause__, StaleRoundError)
    for r in (1, 2):
        ferr, felapsed = out[r]
        assert isinstance(ferr, AggregationError) and "this leader is stale" in str(ferr)
        assert felapsed < 2.0
    (decision,) = decisions(roots.files(root))  # the abort, no commit
    assert read_decision(usurper.get(decision)).kind == "abort"
    close_all(aggs)


def test_leader_whose_liveness_lapsed_does_not_publish(local):
    """Followers may have declared a paused leader dead: it must fail the round too."""
    root = local.new()
    n = 2
    aggs: list[Aggregator] = []

    def merge_after_a_pause(states):
        if states[0]["step"] == 1:
            aggs[0]._side.lease._lost = True  # what the lease reports after a pause over its TTL
        return merge(states)

    aggs.extend(make_aggs(local, root, n, timeout_s=10.0, merge_fn=merge_after_a_pause))
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    assert isinstance(out[0][0], AggregationError)
    assert "liveness key 'leader'" in str(out[0][0]) and "lapsed" in str(out[0][0])
    assert isinstance(out[1][0], AggregationError) and "lapsed" in str(out[1][0])
    # The next round takes a new lease and works.
    out = run_ranks(aggs, [make_state(r, n, 2) for r in range(n)])
    assert all(isinstance(res, dict) for res, _ in out)
    close_all(aggs)
    assert local.files(root) == []


def _record(rid: str, rank: int, n: int, state: dict) -> bytes:
    return encode(
        STATE, round_id=rid, job_id=JOB, fingerprint="", rank=rank, world_size=n, state=state
    )


def test_stale_files_from_a_dead_run_are_ignored(roots):
    """A dead run of this job left an announcement, states (with lanes that would not
    match), a commit and its leader key. The followers start first and adopt the
    stale announcement; the new leader's announcement moves them over; nothing stale
    counts."""
    root = roots.new()
    n = 4
    junk = roots.store(root)
    dead = Announcement("deadbeef0000-7", "deadbeef0000", 7, n, JOB, "", step=7)
    junk.put(KEYS.round, dead.encode())
    junk.put(KEYS.gen, dead.round_id.encode())
    # Its leader's liveness key: expired, as a dead run's lease is.
    lease = junk.keep_alive(KEYS.leader, f"{dead.session} rank=0 pid=1".encode(), 0.05)
    lease._stopped.set()
    lease._thread.join()
    time.sleep(0.06)
    for r in range(1, n):
        wrong = make_state(r, n, 0)
        wrong["lanes"] = [{"lane": 99}]  # would be a mapping mismatch if it were counted
        junk.put(KEYS.state(dead.round_id, r), _record(dead.round_id, r, n, wrong))
    junk.put(KEYS.state(dead.round_id, 2), b"not a checkpoint at all")
    junk.put(KEYS.decision(dead.round_id), b"junk")
    junk.put(KEYS.decision("deadbeef0000-6"), b"junk")

    aggs = make_aggs(roots, root, n, timeout_s=10.0)
    states = [make_state(r, n, 3) for r in range(n)]
    out = run_ranks(aggs, states, delays_s={0: 0.3})
    check_results([res for res, _ in out], states)
    close_all(aggs)
    # Keys the dead run left under names this run never uses stay; the rest was replaced.
    assert set(roots.files(root)) == {KEYS.decision("deadbeef0000-6")}


def test_stale_announcement_alone_does_not_make_followers_fail(local):
    """Its leader key is long gone (expired): the followers wait for the real leader,
    even one that comes later than a lease TTL."""
    root = local.new()
    n = 3
    junk = local.store(root)
    dead = Announcement("feedface0000-2", "feedface0000", 2, n, JOB, "", step=2)
    junk.put(KEYS.round, dead.encode())
    aggs = make_aggs(local, root, n, timeout_s=5.0, lease_ttl_s=0.2)
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)], delays_s={0: 0.6})
    assert all(isinstance(res, dict) for res, _ in out), out
    close_all(aggs)


def test_follower_fails_when_its_leader_vanishes(roots):
    """The leader announced, then died without a notice (SIGKILL): its liveness key expires
    and followers fail about a lease TTL later, naming the leader."""
    root = roots.new()
    n = 3
    ttl = 0.4
    leader_store = roots.store(root)
    ann = Announcement("cafe00000000-1", "cafe00000000", 1, n, JOB, "", step=1)
    lease = leader_store.keep_alive(KEYS.leader, f"{ann.session} rank=0 pid=1".encode(), ttl)
    leader_store.announce(KEYS.gen, ann.round_id.encode())
    leader_store.put(KEYS.round, ann.encode())
    aggs = make_aggs(roots, root, n, timeout_s=20.0, lease_ttl_s=ttl)

    def die():
        time.sleep(0.3)
        lease._stopped.set()  # the refresher dies with the process; the key is not deleted
        lease._thread.join()

    killer = threading.Thread(target=die)
    killer.start()
    states: list[dict | None] = [None] + [make_state(r, n, 1) for r in range(1, n)]
    out = run_ranks(aggs, states)
    killer.join()
    for r in (1, 2):
        err, elapsed = out[r]
        assert isinstance(err, AggregationError)
        # Its own finding, or the first follower's that gave up (its notice ends the round).
        assert str(err).startswith(f"[rank={r}] ")
        assert f"the leader (rank 0) of round {ann.round_id} is gone" in str(err)
        assert "did rank 0 die?" in str(err)
        assert elapsed < 0.3 + 3 * ttl
    # The followers decided the round as failed: a leader that was only paused cannot
    # commit it now.
    assert leader_store.create(KEYS.decision(ann.round_id), b"late commit") is not None
    for a in aggs[1:]:
        a.close()


def test_one_budget_for_the_whole_round_and_the_ranks_agree(local):
    """The leader is late and then slow to merge: the follower's budget counts from its own
    call, so it gives up at timeout_s, not timeout_s after the announcement; and because it
    decided the round as failed, the leader cannot commit it afterwards: both fail."""
    root = local.new()
    n = 2

    def slow_merge(states):
        time.sleep(1.0)
        return merge(states)

    aggs = make_aggs(local, root, n, timeout_s=[3.0, 1.0], merge_fn=slow_merge)
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)], delays_s={0: 0.5})
    err, elapsed = out[1]
    assert isinstance(err, AggregationError)
    assert "[rank=1] checkpoint round" in str(err)
    assert "timed out after 1 s waiting for the merged result from the leader (rank 0)" in str(err)
    assert local.store(root).describe() in str(err)
    assert 1.0 <= elapsed < 1.4
    lead = out[0][0]
    assert isinstance(lead, AggregationError), "the leader must not succeed where rank 1 failed"
    assert "ended before this leader could commit it" in str(lead)
    assert "rank 1" in str(lead) and "timed out after 1 s" in str(lead)
    close_all(aggs)


def test_follower_without_a_leader_says_what_it_waited_for(local):
    root = local.new()
    aggs = make_aggs(local, root, 2, timeout_s=0.3)
    out = run_ranks(aggs, [None, make_state(1, 2, 1)])
    err, elapsed = out[1]
    assert isinstance(err, AggregationError)
    assert "waiting for the leader (rank 0) to announce a round in" in str(err)
    assert "Has rank 0 called checkpoint() at this step?" in str(err)
    assert 0.3 <= elapsed < 1.0
    assert local.files(root) == [KEYS.member(1)]  # its place, held until close()
    close_all(aggs)
    assert local.files(root) == []  # the follower left nothing behind


def test_leader_abandoning_a_round_fails_its_followers(local):
    """A follower still waiting on round k when its own leader announces round k+1."""
    root = local.new()
    n = 2
    s = local.store(root)
    ann1 = Announcement("abcabc000000-1", "abcabc000000", 1, n, JOB, "", step=1)
    s.put(KEYS.round, ann1.encode())
    follower = make_aggs(local, root, n, timeout_s=5.0)[1]

    def move_on():
        time.sleep(0.2)
        s.put(
            KEYS.round,
            Announcement("abcabc000000-2", "abcabc000000", 2, n, JOB, "", step=1).encode(),
        )

    t = threading.Thread(target=move_on)
    t.start()
    with pytest.raises(AggregationError, match="abandoned round abcabc000000-1"):
        follower.round(make_state(1, n, 1))
    t.join()


# ----------------------------------------------------------------------------- API


def test_constructor_validation(local):
    s = local.store(local.new())
    kw: dict[str, Any] = dict(timeout_s=1.0, expected_lanes=lambda r: [r], merge=merge)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        Aggregator(s, rank=0, world_size=0, **kw)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        Aggregator(s, rank=2, world_size=2, **kw)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Aggregator(s, rank=0, world_size=2, **{**kw, "timeout_s": 0})
    with pytest.raises(ValueError, match="lease_ttl_s must be > 0"):
        Aggregator(s, rank=0, world_size=2, lease_ttl_s=-1, **kw)
    with pytest.raises(ValueError, match="job_id= must be a non-empty str"):
        Aggregator(s, rank=0, world_size=2, job_id="", **kw)


def test_single_rank_round_and_close_is_idempotent(local):
    root = local.new()
    (a,) = make_aggs(local, root, 1)
    st = make_state(0, 1, 4)
    assert without_round(a.round(st)) == merge([st])
    assert without_round(a.round(st)) == merge([st])
    a.close()
    a.close()
    assert local.files(root) == []
    assert os.listdir(os.path.join(root, "job")) == [], "no subdirectory made for no follower"
    with pytest.raises(AggregationError, match=r"\[rank=0\] round\(\) after close\(\)"):
        a.round(st)


def test_leader_logs_are_prefixed_with_the_rank(local, caplog):
    root = local.new()
    aggs = make_aggs(local, root, 2, timeout_s=0.2)
    with caplog.at_level(logging.DEBUG, logger="zephon"):
        run_ranks(aggs, [make_state(0, 2, 1), None])
    assert caplog.messages and all(m.startswith("[rank=0] ") for m in caplog.messages)
    close_all(aggs)


class _LateAnnouncement(Wrapped):
    """A leader's store whose next write of the announcement fails on the client side but
    is applied later (what etcd does with requests queued while it was stalled): the
    write is kept in ``late`` for the test to apply."""

    def __init__(self, store: DirectoryStore) -> None:
        super().__init__(store)
        self.fail, self.late = False, []

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        if self.fail and key == KEYS.round:
            self.fail = False
            self.late.append((key, value))
            raise TimeoutError("no answer within 0.5 s (the write is applied later)")
        self._inner.put(key, value, fence=fence)


def test_a_follower_that_joins_a_round_its_leader_never_announced_takes_the_next(local):
    """The leader saw its announcement of round 2 fail and gave the round up; the store
    applies it later, and a follower's next checkpoint() joins that void round before the
    leader's round 3 comes. Round 3's announcement names round 2 void, and the follower
    moves to it instead of failing (both ranks return the merged state)."""
    root = local.new()
    n = 2
    wrapped: dict[int, _LateAnnouncement] = {}

    def wrap(rank: int, store: Any) -> Any:
        if rank == 0:
            wrapped[0] = _LateAnnouncement(store)
            return wrapped[0]
        return store

    aggs = make_aggs(local, root, n, timeout_s=5.0, store_wrap=wrap)
    states = [make_state(r, n, 1) for r in range(n)]
    check_results([res for res, _ in run_ranks(aggs, states)], states)
    wrapped[0].fail = True
    (err, _), _ = run_ranks(aggs, [make_state(0, n, 2), None])
    assert isinstance(err, AggregationError), err
    ((key, value),) = wrapped[0].late
    assert Announcement.decode(value).void == ()
    local.store(root).put(key, value)  # the late write
    states = [make_state(r, n, 3) for r in range(n)]
    out = run_ranks(aggs, states, delays_s={0: 0.2})  # the follower joins the void round
    check_results([res for res, _ in out], states)
    assert aggs[1]._side.last_round[1] == 3  # type: ignore[union-attr]
    close_all(aggs)


class _CountReads(Wrapped):
    """A store that counts the keys it was asked to read."""

    def __init__(self, inner: Any, reads: list[str]) -> None:
        super().__init__(inner)
        self._reads = reads

    def get(self, key):
        self._reads.append(key)
        return self._inner.get(key)

    def get_many(self, keys):
        self._reads.extend(keys)
        return [self._inner.get(k) for k in keys]


def test_the_leader_reads_each_state_once_and_no_acknowledgement(roots):
    """A listed acknowledgement is enough: the leader lists the round's acks, it reads
    none of them (a thousand reads a round over a directory)."""
    root = roots.new()
    n = 4
    reads: list[str] = []
    aggs = make_aggs(roots, root, n, store_wrap=lambda r, s: _CountReads(s, reads) if r == 0 else s)
    for step in (1, 2):
        reads.clear()
        run_ranks(aggs, [make_state(r, n, step) for r in range(n)])
        rid = decisions(roots.files(root))[0].removeprefix(KEYS.decisions)
        assert not [k for k in reads if k.startswith(KEYS.acks(rid))], reads
        states = [k for k in reads if k.startswith(KEYS.states(rid))]
        assert sorted(states) == sorted(KEYS.state(rid, r) for r in range(1, n)), reads
    close_all(aggs)
