"""Schedules: weights as a function of each lane's own progress, restored exactly at, before
and after a boundary, into the same or another world size."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon as zp
from zephon.checkpoint.state import merge_states
from zephon.testing import assert_resumes_exactly, assert_resumes_through_breaks, roundtrip, take
from zephon.work_sources.static_mixture import StaticMixtureWorkSource

# ------------------------------------------------------------------ the Schedule itself


def test_step_and_linear_weights_at_positions() -> None:
    step = zp.Schedule([(0, [1, 0]), (10, [1, 1]), (20, [0, 1])])
    vectors = step.vectors_for(["a", "b"])
    assert step.weights_at(vectors, 0).tolist() == [1.0, 0.0]
    assert step.weights_at(vectors, 9).tolist() == [1.0, 0.0]
    assert step.weights_at(vectors, 10).tolist() == [0.5, 0.5]
    assert step.weights_at(vectors, 10**9).tolist() == [0.0, 1.0]
    linear = zp.Schedule([(0, [1, 0]), (10, [0, 1])], interpolate="linear")
    vectors = linear.vectors_for(["a", "b"])
    assert linear.weights_at(vectors, 5).tolist() == [0.5, 0.5]
    assert linear.weights_at(vectors, 2).tolist() == pytest.approx([0.8, 0.2])
    assert linear.weights_at(vectors, 99).tolist() == [0.0, 1.0]
    by_name = zp.Schedule([(0, {"b": 3, "a": 1})], unit="tokens")
    assert by_name.vectors_for(["a", "b"])[0].tolist() == [0.25, 0.75]
    assert by_name.unit == "tokens" and by_name.names == ("b", "a")
    assert msgpack.unpackb(msgpack.packb(by_name.config())) == by_name.config()
    assert "Schedule([(0, {'b': 0.75, 'a': 0.25})], unit='tokens'" in repr(by_name)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (([],), {}, ValueError, r"at least one point"),
        (([(5, [1])],), {}, ValueError, r"first point must be at position 0; got 5"),
        (([(0, [1]), (0, [2])],), {}, ValueError, r"ascend strictly; point 1 is at 0, after 0"),
        (([(0, [1]), (3, [1, 2])],), {}, ValueError, r"point 1 has 2 weights but point 0 has 1"),
        (([(0, {"a": 1}), (3, [1])],), {}, TypeError, r"all be dicts or all be lists"),
        (([(0, {"a": 1}), (3, {"b": 1})],), {}, ValueError, r"point 1 names \['b'\] but point 0"),
        (([(0, [1, -1])],), {}, ValueError, r"point 0: weight 1 must be finite and >= 0; got -1"),
        (
            ([(0, [1, "0.5"])],),
            {},
            ValueError,
            r"point 0: weight 1 must be a number; got the string '0\.5': give the number itself",
        ),
        (([(0, [True, 1])],), {}, ValueError, r"point 0: weight 0 .* got the boolean True"),
        (([(0, [0, 0])],), {}, ValueError, r"point 0: weights must have a positive sum"),
        (([(0.5, [1])],), {}, TypeError, r"position must be an int; got 0.5"),
        (
            ([(0, [1])],),
            {"unit": "steps"},
            ValueError,
            r"unit must be one of \('chunks', 'tokens'\)",
        ),
        (([(0, [1])],), {"interpolate": "cubic"}, ValueError, r"interpolate must be one of"),
        (([(0, "ab")],), {}, TypeError, r"weights must be a list or a dict"),
    ],
)
def test_schedule_validation(args, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        zp.Schedule(*args, **kwargs)


def test_schedule_must_fit_the_datasets() -> None:
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        StaticMixtureWorkSource({"a": [1], "b": [2]}, zp.Schedule([(0, {"a": 1, "c": 1})]))
    with pytest.raises(ValueError, match="Schedule has 3 weights per point for 2 datasets"):
        StaticMixtureWorkSource([[1], [2]], zp.Schedule([(0, [1, 1, 1])]))
    with pytest.raises(ValueError, match=r"dataset 'b' \(component 1\) is empty but has weight"):
        StaticMixtureWorkSource({"a": [1], "b": []}, zp.Schedule([(0, [1, 0]), (4, [1, 1])]))
    with pytest.raises(ValueError, match="weight_unit='tokens' needs the token count"):
        StaticMixtureWorkSource([["text"]], zp.Schedule([(0, [1])], unit="tokens"))


# ----------------------------------------------------------------- in the work source


def test_a_step_boundary_switches_weights_between_chunks() -> None:
    sched = zp.Schedule([(0, [1, 0]), (5, [0, 1]), (9, [1, 1])])
    src = StaticMixtureWorkSource([list(range(50)), list(range(50))], sched, chunk_size=4)
    assert src.weights is None and src.schedule is sched
    comps = [src.next_chunk().components.tolist() for _ in range(12)]
    assert comps[:5] == [[0] * 4] * 5
    assert comps[5:9] == [[1] * 4] * 4
    assert all(sorted(c) == [0, 0, 1, 1] for c in comps[9:])
    assert src.current_weights == (0.5, 0.5)


def test_a_token_schedule_follows_the_lanes_tokens() -> None:
    lengths = [np.full(100, 10), np.full(100, 10)]
    sched = zp.Schedule([(0, [1, 0]), (200, [0, 1])], unit="tokens")
    src = StaticMixtureWorkSource([list(range(100))] * 2, sched, chunk_size=3, lengths=lengths)
    chunks = [src.next_chunk() for _ in range(12)]
    # 30 tokens a chunk: chunks start at 0, 30, ..., 180 (before 200), 210 (after)
    assert [c.components.tolist() for c in chunks[:7]] == [[0, 0, 0]] * 7
    assert [c.components.tolist() for c in chunks[7:]] == [[1, 1, 1]] * 5
    assert src.state_dict()["lane_tokens"] == 360


def test_linear_schedule_moves_the_share_chunk_by_chunk() -> None:
    sched = zp.Schedule([(0, [1, 0]), (40, [0, 1])], interpolate="linear")
    src = StaticMixtureWorkSource([list(range(500))] * 2, sched, chunk_size=50)
    shares = [np.mean(src.next_chunk().components == 1) for _ in range(44)]
    assert shares[0] == 0.0 and shares[-1] == 1.0
    # Each chunk's share is its weight at its start, to within one sample of 50.
    for i, share in enumerate(shares[:40]):
        assert abs(share - i / 40) <= 1 / 50 + 1e-9, (i, share)
    assert src.state_dict()["carry"] != b""  # weights moved: credits carried


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 30), min_size=2, max_size=4),
    points=st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(0, 5), min_size=4, max_size=4)),
        min_size=0,
        max_size=3,
    ),
    unit=st.sampled_from(["chunks", "tokens"]),
    interpolate=st.sampled_from(["step", "linear"]),
    weight_unit=st.sampled_from(["samples", "tokens"]),
    k=st.integers(0, 60),
    lanes=st.integers(1, 4).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
)
def test_state_round_trip_at_any_point_of_a_schedule(
    sizes, points, unit, interpolate, weight_unit, k, lanes
) -> None:
    c = len(sizes)
    scale = 40 if unit == "tokens" else 1
    pos = sorted({p * scale for p, _ in points})
    raw = [(0, [1] * c)] + [
        (p, [1 + w[i % 4] for i in range(c)]) for p, (_, w) in zip(pos, points, strict=False)
    ]
    lengths = [np.arange(1, n + 1) * 3 for n in sizes]

    def make(lane: int, num_lanes: int) -> StaticMixtureWorkSource:
        sched = zp.Schedule(raw, unit=unit, interpolate=interpolate)
        return StaticMixtureWorkSource(
            [list(range(n)) for n in sizes],
            sched,
            chunk_size=3,
            weight_unit=weight_unit,
            lengths=lengths,
            lane=lane,
            num_lanes=num_lanes,
        )

    lane, num_lanes = lanes
    original = make(lane, num_lanes)
    [original.next_chunk() for _ in range(k)]
    state = msgpack.unpackb(msgpack.packb(original.state_dict(), use_bin_type=True), raw=False)
    restored = make(0, 1).for_lane(lane, num_lanes)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert [restored.next_chunk() for _ in range(8)] == [original.next_chunk() for _ in range(8)]


# ----------------------------------------------------------------------- in a pipeline

A_DOCS = ["a" * (5 + i % 17) for i in range(200)]
B_DOCS = ["B" * (20 + i % 31) for i in range(200)]
LANES = 4


def build(rank: int = 0, world_size: int = 1, interpolate: str = "step", unit: str = "chunks"):
    points = [(0, {"a": 1, "b": 0}), (6, {"a": 1, "b": 3})]
    if interpolate == "linear":  # b from 0 at chunk 6 to 3 at chunk 12
        points = [(0, {"a": 1, "b": 0}), (6, {"a": 1, "b": 0}), (12, {"a": 1, "b": 3})]
    if unit == "tokens":
        points = [(0, {"a": 1, "b": 0}), (400, {"a": 1, "b": 3})]
    src = StaticMixtureWorkSource(
        {"a": zp.ArraySource(A_DOCS), "b": zp.ArraySource(B_DOCS)},
        zp.Schedule(points, unit=unit, interpolate=interpolate),
        seed=3,
        chunk_size=4,
        weight_unit="tokens" if unit == "tokens" else "samples",
        lengths={
            "a": zp.ByteTokenizer().count_tokens(A_DOCS),
            "b": zp.ByteTokenizer().count_tokens(B_DOCS),
        },
    )
    return (
        zp.Pipeline(
            src,
            canonical_replicas=LANES,
            flush_every_k_chunks=2,
            prefetch=0,
            rank=rank,
            world_size=world_size,
        )
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(24)
        .pack(24, num_bins=2)
        .shuffle(3)
        .batch(2)
    )


def first_b_step(batches) -> int:
    """The first step whose batch holds a token of component b (a byte 'B')."""
    b = ord("B") + 3
    return next(i for i, batch in enumerate(batches) if np.any(batch["tokens"] == b))


@pytest.mark.parametrize(
    ("interpolate", "unit"), [("step", "chunks"), ("linear", "chunks"), ("step", "tokens")]
)
def test_resume_exactly_before_at_and_after_a_boundary(interpolate, unit) -> None:
    with build(interpolate=interpolate, unit=unit) as p:
        reference = take(p, 70)
    boundary = first_b_step(reference)
    assert 5 < boundary < 60, boundary  # the boundary is inside the compared run
    cuts = sorted({0, boundary - 2, boundary - 1, boundary, boundary + 1, boundary + 3, 69})
    assert_resumes_exactly(
        lambda: build(interpolate=interpolate, unit=unit), cuts=cuts, reference=reference
    )
    assert_resumes_through_breaks(
        lambda: build(interpolate=interpolate, unit=unit),
        [boundary - 1, boundary, boundary + 2],
        limit=70,
    )


def digest(batch) -> str:
    return hashlib.sha256(np.ascontiguousarray(batch["tokens"]).tobytes()).hexdigest()[:12]


def per_lane(pipe, steps: int) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for _ in range(steps):
        batch = next(pipe)
        (lane,) = pipe.last_batch_lanes
        out.setdefault(lane, []).append(digest(batch))
    return out


def run_ranks(world_size: int, steps: int, state=None):
    streams: dict[int, list[str]] = {}
    states = []
    for rank in range(world_size):
        with build(rank=rank, world_size=world_size) as p:
            if state is not None:
                p.restore(state)
            for lane, ds in per_lane(p, steps).items():
                streams.setdefault(lane, []).extend(ds)
            states.append(roundtrip(p.checkpoint()))
    return streams, merge_states(states)


@pytest.mark.parametrize("before_steps", [4, 10, 24])  # lanes before, across, after the switch
@pytest.mark.parametrize("world_size", [1, 4])
def test_elastic_restore_across_a_boundary(before_steps, world_size) -> None:
    with build() as p:
        uninterrupted = per_lane(p, 160)
    before, merged = run_ranks(2, before_steps)
    after, _ = run_ranks(world_size, 80 // world_size, state=merged)
    for lane in range(LANES):
        got = before.get(lane, []) + after.get(lane, [])
        assert got == uninterrupted[lane][: len(got)], f"lane {lane} diverged"
        assert len(after.get(lane, [])) > 0
