"""The lane scheduler and lane outputs that both executors share (zephon/runners/lanes.py)."""

from __future__ import annotations

import numpy as np
import pytest

import zephon as zp
import zephon.runners.lanes as lanes_mod
from zephon.runners.chain import LaneOutput
from zephon.runners.lanes import schedule
from zephon.testing import take


def _outputs(lengths: dict[int, int]):
    """next_output over lanes that have ``lengths[lane]`` batches, then their end."""
    given = dict.fromkeys(lengths, 0)
    calls: list[int] = []

    def next_output(lane: int) -> LaneOutput:
        calls.append(lane)
        given[lane] += 1
        end = given[lane] > lengths[lane]
        assert given[lane] <= lengths[lane] + 1, f"lane {lane} pulled after its end"
        return LaneOutput(lane, None if end else object(), [], end=end)  # type: ignore[arg-type]

    return next_output, calls


def test_interleave_goes_round_robin_and_takes_each_end_in_its_turn() -> None:
    next_output, calls = _outputs({0: 2, 1: 0, 2: 1})
    got = [(o.lane, o.end) for o in schedule([0, 1, 2], "interleave", next_output, start_lane=0)]
    assert got == [
        (0, False), (1, True), (2, False),
        (0, False), (2, True),
        (0, True),
    ]  # fmt: skip
    assert calls == [0, 1, 2, 0, 2, 0]


def test_interleave_starts_at_the_start_lane_and_skips_done_lanes() -> None:
    next_output, _ = _outputs({0: 1, 1: 1, 2: 1, 3: 1})
    it = schedule([0, 1, 2, 3], "interleave", next_output, start_lane=2, done=[3])
    assert [o.lane for o in it] == [2, 0, 1, 2, 0, 1]


def test_lockstep_yields_the_step_that_ends_the_stream_and_stops() -> None:
    next_output, calls = _outputs({0: 2, 1: 1})
    steps = [
        [(o.lane, o.end) for o in step]
        for step in schedule([0, 1], "lockstep", next_output, start_lane=0)
    ]  # type: ignore[union-attr]
    assert steps == [[(0, False), (1, False)], [(0, False), (1, True)]]
    assert calls == [0, 1, 0, 1]


def test_lockstep_with_a_lane_already_done_yields_nothing() -> None:
    next_output, calls = _outputs({0: 2, 1: 2})
    assert list(schedule([0, 1], "lockstep", next_output, start_lane=0, done=[1])) == []
    assert calls == []


def _many_lanes(lanes: int) -> zp.Pipeline:
    docs = [" ".join(["word"] * (i % 37 + 1)) for i in range(3000)]
    src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=1, chunk_size=16)
    return (
        zp.Pipeline(src, canonical_replicas=lanes, flush_every_k_chunks=2, prefetch=0)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(max_len=32)
        .pack(seq_len=32, num_bins=3)
        .shuffle(buffer_size=3)
        .batch(2)
    )


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_a_process_of_many_lanes_makes_each_output_lazily_with_the_same_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lanes = lanes_mod.LAZY_LANES + 6
    with _many_lanes(lanes) as pipe:
        lazy = take(pipe, 3 * lanes)
        assert pipe._engine.executor.outputs.lazy  # type: ignore[union-attr]
        state = pipe.checkpoint()
        lazy_tail = take(pipe, 40)
    monkeypatch.setattr(lanes_mod, "LAZY_LANES", 10 * lanes)
    with _many_lanes(lanes) as pipe:
        eager = take(pipe, 3 * lanes)
        assert not pipe._engine.executor.outputs.lazy  # type: ignore[union-attr]
        eager_tail = take(pipe, 40)
    assert _same(lazy, eager) and _same(lazy_tail, eager_tail)
    with _many_lanes(lanes) as pipe:  # and a restore into the eager runner
        pipe.restore(state)
        assert _same(take(pipe, 40), lazy_tail)
