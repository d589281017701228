"""The replay filter matches on equality, not on a threshold (the seed page's C2 C1 C3)."""

from __future__ import annotations

import pytest

from zephon.errors import CheckpointError
from zephon.operators.replay import ReplayFilter
from zephon.records import Contributor, FlushSentinel, Record, SampleCursor, Tombstone


def rec(chunk: int, offset: int) -> Record:
    return Record(None, 0, [Contributor(chunk, offset, 0, True)], {0: 1})


def run(f: ReplayFilter, records):
    out = []
    for r in records:
        out.extend(f.process(r))
    return out


def test_equality_not_threshold():
    c1, c2, c3, c4, c0 = rec(0, 1), rec(0, 2), rec(0, 3), rec(0, 4), rec(0, 0)
    f = ReplayFilter("batch_replay_filter", monotone=False)
    f.set_target(0, SampleCursor(0, 0, 3, 0))  # saved target = C3
    out = run(f, [c2, c1, c3, c4, c0])
    assert [type(o) for o in out[:3]] == [Tombstone] * 3
    # C0 sorts below C3 but comes after it: never consumed, so it must pass
    assert out[3:] == [c4, c0]
    assert f.dropped == {0: 3} and not f.active(0)


def test_no_target_passes_everything():
    f = ReplayFilter("x", monotone=False)
    r = [rec(0, i) for i in range(3)]
    assert run(f, r) == r


def test_target_missing_when_its_epoch_closes():
    f = ReplayFilter("x", monotone=False)
    f.set_target(0, SampleCursor(0, 2, 1, 0))
    f.on_sentinel(FlushSentinel(0, 2))  # an earlier epoch closing is fine
    with pytest.raises(
        CheckpointError, match=r"replay target \(0, 2, 1, 0\) of lane 0 never reappeared"
    ):
        f.on_sentinel(FlushSentinel(0, 4))


def test_target_missing_at_lane_end_and_on_monotone_overtake():
    f = ReplayFilter("x", monotone=False)
    f.set_target(0, SampleCursor(0, 2, 1, 0))
    with pytest.raises(CheckpointError, match="the lane ended"):
        f.on_sentinel(FlushSentinel(0, 3, final=True))
    m = ReplayFilter("x", monotone=True)
    m.set_target(0, SampleCursor(0, 2, 1, 0))
    run(m, [rec(2, 0)])
    with pytest.raises(CheckpointError, match="a later record"):
        run(m, [rec(2, 2)])
