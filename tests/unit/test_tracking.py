"""The seed page's eviction examples, on LaneTracker directly."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest

from zephon import records
from zephon.chunks import WorkChunk
from zephon.records import Contributor, FlushSentinel, SampleCursor
from zephon.tracking import tracker as tracking
from zephon.tracking.schema import HELD
from zephon.tracking.tracker import EPOCH, MONOTONE, ChunkTrack, LaneTracker


class ListSource:
    """Hands out chunks of 4 offsets for one lane, forever."""

    def __init__(self, lane: int = 0, size: int = 4) -> None:
        self.lane, self.size, self.next_id = lane, size, 0

    def next_chunk(self) -> WorkChunk:
        c = WorkChunk(
            self.lane,
            self.next_id,
            np.zeros(self.size, np.int32),
            np.arange(self.size, dtype=np.int64),
            0,
        )
        self.next_id += 1
        return c

    def state_dict(self) -> dict:
        return {"next": self.next_id}

    def load_state_dict(self, state: dict) -> None:
        self.next_id = state["next"]


def tracker(mode: str = EPOCH, k: int = 2, lane: int = 0) -> LaneTracker:
    return LaneTracker(lane, ListSource(lane), mode, k)


def pull_chunks(t: LaneTracker, n: int) -> list:
    items = []
    for _ in range(n):
        items.extend(t.pull())
    return items


def close_chunk(t: LaneTracker, chunk_id: int, offsets=range(4)) -> None:
    t.deliver([Contributor(chunk_id, o, 0, True) for o in offsets], None)


@pytest.fixture(params=[pytest.param("C", marks=pytest.mark.native), "Python"])
def add_run_in(request, monkeypatch):
    """ChunkTrack.add_run in C (``zephon._pack.close_run``) or in pure Python."""
    if request.param == "C":
        if tracking._NATIVE is None:
            pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
    else:
        monkeypatch.setattr(tracking, "_NATIVE", None)
    return request.param


def test_bitmap_and_popcount_close_offsets_by_children_in_any_order(add_run_in):
    track = ChunkTrack(WorkChunk(0, 5, np.zeros(4, np.int32), np.arange(4, dtype=np.int64), 0))
    assert track.add_run([Contributor(5, 2, 1, True)], 0) == 1  # last child first: total 2
    assert track.closed == 0
    assert track.add_run([Contributor(5, 2, 0, False), Contributor(6, 0, 0, True)], 0) == 1
    assert track.bitmap == 0b0100 and track.closed == 1  # stopped at chunk 6's piece
    pieces = [Contributor(4, 0, 0, True), *(Contributor(5, o, 0, True) for o in (0, 1, 3))]
    assert track.add_run(pieces, 1) == 4
    assert track.complete and track.bitmap == 0b1111


def test_chunks_5_6_7_incomplete_chunk_blocks_its_epoch():
    # The seed page: chunk 5 has 3 of 4 closed, 6 all closed, 7 none -> nothing evicted.
    t = tracker(k=4)
    pull_chunks(t, 8)  # chunks 0..7, boundaries at 4 and 8
    for c in range(4):
        close_chunk(t, c)
    assert list(t.inflight) == [4, 5, 6, 7]  # epoch 0 evicted (closed by boundary 4)
    close_chunk(t, 5, [0, 1, 3])
    close_chunk(t, 6)
    close_chunk(t, 4)
    assert list(t.inflight) == [4, 5, 6, 7]
    assert t.inflight[5].closed == 3 and t.inflight[6].complete


def test_epochs_evict_atomically_and_bottom_up():
    t = tracker(k=2)
    items = pull_chunks(t, 6)  # epochs [0,1] [2,3] [4,5]
    assert [getattr(i, "boundary", None) for i in items if isinstance(i, FlushSentinel)] == [
        2,
        4,
        6,
    ]
    close_chunk(t, 0)
    assert 0 in t.inflight, "chunk 0 alone must not evict: its epoch shares accumulator history"
    close_chunk(t, 2)
    close_chunk(t, 3)  # epoch 1 complete but epoch 0 is not: bottom-up stops at epoch 0
    assert list(t.inflight) == [0, 1, 2, 3, 4, 5]
    close_chunk(t, 1)  # now epochs 0 and 1 both go
    assert list(t.inflight) == [4, 5]
    assert t.evicted == 4


def test_only_the_lanes_own_boundary_authorises_eviction():
    t = tracker(k=4)
    pull_chunks(t, 2)  # chunks 0,1 ; no boundary of its own yet
    close_chunk(t, 0)
    close_chunk(t, 1)
    assert list(t.inflight) == [0, 1], "open epoch is retained even when every offset is closed"
    other = tracker(k=4, lane=1)
    pull_chunks(other, 4)  # lane 1 records boundary 4; says nothing about lane 0
    assert other.boundaries == [4] and t.boundaries == []
    t.evict()
    assert list(t.inflight) == [0, 1]
    pull_chunks(t, 2)  # chunk 3 closes the epoch: boundary 4 of lane 0
    close_chunk(t, 2)
    close_chunk(t, 3)
    assert list(t.inflight) == []


def test_cursor_pinning_keeps_the_cursors_epoch_until_a_later_delivery():
    t = tracker(k=2)
    pull_chunks(t, 4)
    close_chunk(t, 0)
    t.deliver([Contributor(1, o, 0, True) for o in range(4)], SampleCursor(0, 1, 3, 0))
    assert list(t.inflight) == [0, 1, 2, 3], "epoch 0 is complete but the cursor points into it"
    t.deliver([Contributor(2, 0, 0, True)], SampleCursor(0, 2, 0, 0))
    assert list(t.inflight) == [2, 3]


def test_monotone_watermark_evicts_everything_below_the_cursor_chunk():
    t = tracker(mode=MONOTONE, k=0)
    pull_chunks(t, 5)
    assert t.boundaries == []
    t.deliver([Contributor(3, 1, 0, True)], SampleCursor(0, 3, 1, 0))
    assert list(t.inflight) == [3, 4]
    # a fully tombstoned chunk above the cursor's chunk waits for the bottom to move
    close_chunk(t, 4)
    assert list(t.inflight) == [3, 4]


def test_state_keeps_trailing_boundary_and_restores_replay_with_sentinels():
    t = tracker(k=2)
    pull_chunks(t, 4)
    close_chunk(t, 0)
    close_chunk(t, 1)
    t.deliver([Contributor(2, 0, 0, True)], SampleCursor(0, 2, 0, 0))
    state = t.state()
    assert [c["chunk_id"] for c in state["inflight"]] == [2, 3]
    assert state["boundaries"] == [4], "the trailing boundary after chunk 3 is kept"
    fresh = tracker(k=2)
    assert fresh.load(state) == 2
    feed = [fresh.pull(), fresh.pull()]
    assert [type(x).__name__ for x in feed[0]] == ["WorkChunk"]
    assert [type(x).__name__ for x in feed[1]] == ["WorkChunk", "FlushSentinel"]
    assert feed[1][1].boundary == 4
    nxt = fresh.pull()  # phase 2: the source continues at chunk 4
    assert nxt[0].chunk_id == 4


def test_unknown_chunk_in_delivery_is_reported():
    t = tracker()
    pull_chunks(t, 1)
    with pytest.raises(RuntimeError, match="chunk 9, which is not in flight"):
        t.deliver([Contributor(9, 0, 0, True)], None)


@pytest.mark.native
def test_add_run_counts_many_pieces_in_c_and_python_alike(monkeypatch):
    chunk = WorkChunk(0, 3, np.zeros(64, np.int32), np.arange(64, dtype=np.int64), 0)
    rng = np.random.default_rng(0)
    pieces = [Contributor(3, int(o), c, c == 2) for o in rng.permutation(64) for c in (2, 0, 1)]
    pieces = [pieces[i] for i in rng.permutation(len(pieces))] + [Contributor(4, 0, 0, True)]
    pieces = [list(p) if k % 3 else p for k, p in enumerate(pieces)]  # rows, as from workers
    seen = []
    for native in (tracking._NATIVE, None):
        if native is None and tracking._NATIVE is None:
            pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
        monkeypatch.setattr(tracking, "_NATIVE", native)
        track = ChunkTrack(chunk)
        assert track.add_run(pieces[:100], 0) == 100
        assert track.add_run(pieces, 100) == len(pieces) - 1  # stops at chunk 4
        seen.append((track.bitmap, track.closed, track.delivered, track.total))
    assert seen[0] == seen[1] and seen[0][0] == 2**64 - 1 and seen[0][1] == 64


def test_documents_count_by_component_with_their_last_piece(add_run_in):
    """A document counts once, when its last piece arrives (in any order), for the
    component of its offset; tombstones close offsets without counting."""
    chunk = WorkChunk(0, 5, np.array([0, 2, 2, 1], np.int32), np.arange(4, dtype=np.int64), 0)
    t = LaneTracker(0, ListSource(), EPOCH, 0)
    t.inflight[5] = ChunkTrack(chunk)
    docs: dict[int, int] = {}
    t.deliver([Contributor(5, 1, 1, True), Contributor(5, 0, 0, True)], None, docs)
    assert docs == {2: 1, 0: 1}
    t.deliver([Contributor(5, 1, 0, False)], None, docs)  # closes offset 1: already counted
    assert docs == {2: 1, 0: 1}
    tombstones = [Contributor(5, 3, 0, True)]
    t.deliver([Contributor(5, 2, 0, True)], None, docs, tombstones)
    assert docs == {2: 2, 0: 1} and t.inflight[5].closed == 4


@pytest.mark.native
def test_documents_count_alike_in_c_and_python(monkeypatch):
    # components below 64 are counted in C's local array, the others in the dict at once
    comps = np.random.default_rng(1).integers(0, 100, 64).astype(np.int32)
    chunk = WorkChunk(0, 3, comps, np.arange(64, dtype=np.int64), 0)
    pieces = [Contributor(3, o, c, c == 1) for o in range(64) for c in (0, 1)]
    assert tracking._NATIVE is not None, "zephon._track is not built (native tests need it)"
    seen = []
    for native in (tracking._NATIVE, None):
        monkeypatch.setattr(tracking, "_NATIVE", native)
        docs: dict[int, int] = {}
        ChunkTrack(chunk).add_run(pieces, 0, docs)
        seen.append(docs)
    want = {int(c): int((comps == c).sum()) for c in np.unique(comps)}
    assert seen[0] == seen[1] == want and max(want) >= 64 > min(want)


@pytest.mark.native
def test_a_lanes_delivery_counts_alike_in_c_and_python(monkeypatch):
    """LaneTracker.deliver closes runs of several chunks (sizes below and above 64, the C
    path and the Python one) to the same bitmaps, closed counts and document counts."""
    rng = np.random.default_rng(7)
    sizes = {3: 64, 4: 5, 5: 70, 6: 64}  # 70 offsets: the Python path, in C mode too
    pieces = [
        Contributor(c, o, k, k == 1)
        for c, n in sizes.items()
        for o in rng.permutation(n).tolist()
        for k in (0, 1)
    ]
    assert tracking._NATIVE is not None, "zephon._track is not built (native tests need it)"
    seen = []
    for native in (tracking._NATIVE, None):
        monkeypatch.setattr(tracking, "_NATIVE", native)
        t = LaneTracker(0, ListSource(), EPOCH, 0)
        for c, n in sizes.items():
            comps = np.random.default_rng(c).integers(0, 100, n).astype(np.int32)
            t.inflight[c] = ChunkTrack(WorkChunk(0, c, comps, np.arange(n, dtype=np.int64), 0))
        docs: dict[int, int] = {}
        t.deliver(pieces[:101], None, docs)  # a delivery that ends inside chunk 3's run
        t.deliver(pieces[101:], None, docs)
        seen.append((docs, {c: (k.bitmap, k.closed) for c, k in t.inflight.items()}))
    assert seen[0] == seen[1]
    assert sum(seen[0][0].values()) == sum(sizes.values())
    assert all(closed == sizes[c] for c, (_, closed) in seen[0][1].items())


@pytest.mark.native
def test_close_run_in_c_refuses_what_its_python_twin_would_not_take():
    native = tracking._NATIVE
    assert native is not None, "zephon._track is not built (native tests need it)"
    ok = ([0] * 4, [0] * 4, 0, 5, [Contributor(5, 0, 0, True)], 0)
    assert native.close_run(*ok) == (1, 1, 1)
    with pytest.raises(TypeError, match="from 6 to 8 arguments"):
        native.close_run(*ok[:5])
    with pytest.raises(TypeError, match="must be lists"):
        native.close_run((0,) * 4, *ok[1:])
    with pytest.raises(TypeError, match="bitmap must be int"):
        native.close_run(ok[0], ok[1], 1.5, *ok[3:])


@pytest.mark.native
def test_whole_samples_in_c_are_pythons_and_untracked_by_the_collector(monkeypatch):
    assert records._NATIVE is not None, "zephon._track is not built (native tests need it)"
    made = records.whole_samples(5, 3, 67)
    # Nothing for the cyclic collector to scan: ints in tuples.
    assert not any(gc.is_tracked(one) or gc.is_tracked(one[0]) for one in made)
    monkeypatch.setattr(records, "_NATIVE", None)
    assert made == records.whole_samples(5, 3, 67)
    assert [type(c) for (c,) in made] == [Contributor] * 64
    assert made[-1][0].offset == 66 and made[0][0].is_last_child is True
    assert records.whole_samples(5, 4, 4) == []
    track = ChunkTrack(WorkChunk(0, 5, np.zeros(70, np.int32), np.arange(70, dtype=np.int64), 0))
    assert track.add_run([c for (c,) in made], 0) == 64  # what the tracker counts


def _fresh_states(pipe) -> list:
    """Every lane's state rebuilt from scratch (what the cache must equal)."""
    engine = pipe._engine
    out = []
    for lane in engine.lanes:
        tracker = engine.trackers[lane]
        cached = (tracker._state, tracker._base)
        tracker._state, tracker._base = None, None
        fresh = copy.deepcopy(tracker.state())
        out.append(fresh)
        tracker._state, tracker._base = cached
        if cached[0] is not None:  # the same entries in the same order (msgpack keeps it)
            assert list(cached[0]) == list(fresh)
    return out


@pytest.mark.parametrize("flush", [2, 0])  # epochs, or the watermark
@pytest.mark.parametrize("lanes", [3, 70])  # 70: lazy lane outputs too
def test_a_lane_state_is_rebuilt_exactly_when_the_lane_moves(lanes: int, flush: int) -> None:
    import zephon as zp

    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(2000))], seed=0, chunk_size=8)
    pipe = zp.Pipeline(src, canonical_replicas=lanes, flush_every_k_chunks=flush, prefetch=2)
    pipe = pipe.fetch()
    pipe = (pipe.shuffle(buffer_size=5) if flush else pipe).batch(3)  # no flush: in order
    kept = []
    with pipe:
        for step in range(max(4 * lanes, 60)):  # evictions in every lane
            next(pipe)
            if step % 7 == 0:
                with pipe._engine.lock:  # the pump pulls meanwhile: compare at one moment
                    state = pipe.checkpoint()
                    assert state["lanes"] == _fresh_states(pipe)
                kept.append((state, copy.deepcopy(state)))
        # What an earlier checkpoint returned never changes as the lanes move on.
        assert all(state == copy_then for state, copy_then in kept)


def test_setting_a_lanes_holds_shows_in_its_next_state() -> None:
    import zephon as zp

    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(200))], seed=0, chunk_size=8)
    with zp.Pipeline(src, canonical_replicas=1).fetch().batch(3) as pipe:
        next(pipe)
        tracker = pipe._engine.trackers[0]
        with pipe._engine.lock:
            before = tracker.state()
            assert HELD not in before
            lo = next(iter(tracker.inflight))
            tracker.held = [[0, lo + 1, [1.0]]]
            assert tracker.state()[HELD] == [[0, lo + 1, [1.0]]]
            tracker.held = []
            assert tracker.state() == before and HELD not in tracker.state()


@pytest.mark.parametrize("components", [1, 2])
def test_a_stored_pointer_outside_the_datasets_names_its_chunk_and_offset(components) -> None:
    import zephon as zp
    from zephon.errors import CheckpointError

    datasets = [zp.ArraySource(np.arange(50 + 10 * c)) for c in range(components)]
    src = zp.StaticMixtureWorkSource(datasets, seed=0, chunk_size=4)
    with (
        zp.Pipeline(src, canonical_replicas=1, flush_every_k_chunks=3)
        .fetch()
        .shuffle(buffer_size=64)
        .batch(2) as pipe
    ):
        for _ in range(5):
            next(pipe)
        state = copy.deepcopy(pipe.checkpoint())
    (lane,) = state["lanes"]
    assert len(lane["inflight"]) >= 2
    second = lane["inflight"][1]
    indices = np.frombuffer(second["indices"], dtype="<i8").copy()
    indices[2] = 10_000
    second["indices"] = indices.tobytes()
    again = zp.Pipeline(
        zp.StaticMixtureWorkSource(datasets, seed=0, chunk_size=4),
        canonical_replicas=1,
        flush_every_k_chunks=3,
    )
    again = again.fetch().shuffle(buffer_size=64).batch(2)
    with pytest.raises(CheckpointError) as info:
        again.restore(state)
    chunk = second["chunk_id"]
    assert f"in-flight chunk {chunk} points at component" in str(info.value)
    assert "index 10000 (offset 2), outside the datasets" in str(info.value)


def test_a_chunk_dealt_by_a_mixture_checkpoints_the_bytes_its_arrays_view() -> None:
    import zephon as zp

    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(list(range(50))), zp.ArraySource(list(range(7)))], seed=1, chunk_size=6
    ).for_lane(0, 2)
    chunk = src.next_chunk()
    state = chunk.to_state()
    # No copy at the checkpoint: the state holds the bytes the arrays are views of.
    assert state["components"] is chunk.components.base
    assert state["indices"] is chunk.indices.base
    assert not chunk.components.flags.writeable
    again = WorkChunk.from_state(state)
    assert again == chunk and again.to_state() == state
    # A chunk of arrays of its own (a work source of yours) is copied out as before.
    own = WorkChunk(0, 0, np.array([1, 0], np.int64), np.array([3, 4], np.int32), 9)
    assert own.to_state()["components"] == np.array([1, 0], "<i4").tobytes()
    assert own.to_state()["indices"] == np.array([3, 4], "<i8").tobytes()
    assert WorkChunk.from_state(own.to_state()) == own
