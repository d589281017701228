"""Every validation error of the Pipeline builder, compiler and restore (SPEC §2–§5)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import zephon as zp
from zephon.errors import CheckpointError
from zephon.testing import roundtrip, take

DOCS = [f"document number {i} " * (1 + i % 3) for i in range(40)]


def source(**kwargs) -> zp.StaticMixtureWorkSource:
    kwargs = {"seed": 3, "chunk_size": 5, "num_epochs": 1, **kwargs}
    return zp.StaticMixtureWorkSource([zp.ArraySource(DOCS), zp.ArraySource(DOCS[:20])], **kwargs)


def packed(seq_len: int = 16, **pipe_kwargs) -> zp.Pipeline:
    pipe_kwargs = {"canonical_replicas": 2, "flush_every_k_chunks": 2, **pipe_kwargs}
    return (
        zp.Pipeline(source(), **pipe_kwargs)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(seq_len)
        .pack(seq_len, num_bins=2)
        .batch(2)
    )


def monotone(**pipe_kwargs) -> zp.Pipeline:
    pipe_kwargs = {"canonical_replicas": 2, **pipe_kwargs}
    return (
        zp.Pipeline(source(), **pipe_kwargs)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(8)
        .map(lambda d: np.pad(d["tokens"], (0, 8 - len(d["tokens"]))))
        .batch(2)
    )


# ------------------------------------------------------------------ flush cadence


def test_flush_zero_with_reordering_operators_names_them() -> None:
    pipe = (
        zp.Pipeline(source(), canonical_replicas=2, flush_every_k_chunks=0)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(8)
        .pack(8)
        .shuffle(4)
        .batch(2)
    )
    with pytest.raises(
        ValueError,
        match=r"flush_every_k_chunks must be > 0 for a pipeline with reordering operators "
        r"\(pack, shuffle\); got 0",
    ):
        pipe.explain()
    with pytest.raises(ValueError, match=r"\(pack, shuffle\)"):
        next(pipe)


def test_positive_flush_on_a_monotone_pipeline_warns_and_uses_zero() -> None:
    pipe = monotone(flush_every_k_chunks=3)
    with pytest.warns(
        UserWarning,
        match=r"flush_every_k_chunks=3 ignored: every operator preserves cursor order.*using 0",
    ):
        text = pipe.explain()
    assert text.splitlines()[-1] == "eviction=monotone flush_every_k_chunks=0"
    # Forced to 0, it is the same pipeline as the default one (same fingerprint and output).
    assert pipe.fingerprint() == monotone().fingerprint()
    assert len(take(pipe)) == len(take(monotone()))


def test_default_flush_picks_four_or_zero() -> None:
    assert (
        packed(flush_every_k_chunks=None).explain().splitlines()[-1]
        == "eviction=epoch flush_every_k_chunks=4"
    )
    assert monotone().explain().splitlines()[-1] == "eviction=monotone flush_every_k_chunks=0"


@pytest.mark.parametrize("bad", [-1, 2.5, "4"])
def test_flush_must_be_none_or_non_negative_int(bad) -> None:
    with pytest.raises(
        ValueError, match=rf"flush_every_k_chunks must be None or an int >= 0; got {bad!r}"
    ):
        zp.Pipeline(source(), flush_every_k_chunks=bad)


# ------------------------------------------------------------------ constructor


def test_bad_output_mode() -> None:
    with pytest.raises(
        ValueError, match=r"output must be one of \('interleave', 'lockstep'\); got 'roundrobin'"
    ):
        zp.Pipeline(source(), output="roundrobin")


@pytest.mark.parametrize("bad", [-1, 1.5, "2", "Auto"])
def test_bad_workers(bad) -> None:
    with pytest.raises(
        ValueError,
        match=rf"workers must be an int >= 0, 'auto' or zp.RayWorkers\(...\); got {bad!r}",
    ):
        zp.Pipeline(source(), workers=bad)


def test_auto_workers_follows_the_cpus_and_the_lanes(monkeypatch) -> None:
    from zephon.pipeline import options

    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert zp.Pipeline(source(), canonical_replicas=8, workers="auto").workers == 8
    assert zp.Pipeline(source(), canonical_replicas=4, workers="auto").workers == 4
    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert zp.Pipeline(source(), canonical_replicas=8, workers="auto").workers == 2
    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: {0})
    assert zp.Pipeline(source(), canonical_replicas=8, workers="auto").workers == 0


@pytest.mark.parametrize("bad", [-1, 0.5, "3", True])
def test_bad_prefetch(bad) -> None:
    with pytest.raises(ValueError, match=rf"prefetch must be None or an int >= 0; got {bad!r}"):
        zp.Pipeline(source(), prefetch=bad)


def test_prefetch_defaults_to_a_pump_in_process_and_none_with_workers() -> None:
    assert zp.Pipeline(source()).prefetch == 3
    assert zp.Pipeline(source(), workers=2).prefetch == 0
    assert zp.Pipeline(source(), workers=2, prefetch=5).prefetch == 5


@pytest.mark.parametrize("bad", [0, -3, math.inf, math.nan, "60"])
def test_bad_aggregate_timeout(bad) -> None:
    with pytest.raises(
        ValueError, match=r"aggregate_timeout_s must be a positive number of seconds"
    ):
        zp.Pipeline(source(), aggregate_timeout_s=bad)


def test_aggregate_dir_and_store_are_exclusive() -> None:
    with pytest.raises(ValueError, match=r"give aggregate_dir or aggregate_store, not both"):
        zp.Pipeline(source(), aggregate_dir="/tmp/x", aggregate_store="etcd://h:1")


def test_canonical_replicas_not_divisible_by_dp_size() -> None:
    with pytest.raises(ValueError, match=r"canonical_replicas=3 is not divisible by dp_size=2"):
        zp.Pipeline(source(), canonical_replicas=3, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"canonical_replicas=4 is not divisible by dp_size=3"):
        zp.Pipeline(source(), canonical_replicas=4, rank=0, world_size=6, dp_rank=0, dp_size=3)


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_bad_canonical_replicas(bad) -> None:
    with pytest.raises(
        ValueError, match=rf"canonical_replicas must be a positive int; got {bad!r}"
    ):
        zp.Pipeline(source(), canonical_replicas=bad)


def test_limits_that_would_hang_or_overflow_are_refused_at_construction() -> None:
    from zephon.pipeline.options import MAX_CANONICAL_REPLICAS, MAX_RING_SLOT_BYTES, MAX_RING_SLOTS

    assert (MAX_CANONICAL_REPLICAS, MAX_RING_SLOT_BYTES, MAX_RING_SLOTS) == (2**20, 2**40, 2**16)
    with pytest.raises(
        ValueError,
        match=r"canonical_replicas must be at most 1048576 \(2\*\*20 lanes: .*\); got "
        r"canonical_replicas=10000000: use fewer lanes, a multiple of every data-parallel size",
    ):
        zp.Pipeline(source(), canonical_replicas=10**7)  # once: minutes before the first batch
    with pytest.raises(
        ValueError,
        match=r"ring_slot_bytes must be at most 1099511627776 \(2\*\*40, 1 TiB a slot: the C "
        r"ring's size, slots x slot bytes, must fit in 64 bits\); got "
        r"ring_slot_bytes=4611686018427387904: give the bytes of your largest batch, or leave "
        r"it None",
    ):
        zp.Pipeline(source(), workers=1, ring_slot_bytes=2**62)  # once: a ring of 0 bytes
    with pytest.raises(
        ValueError, match=r"ring_slots must be at most 65536 .*; got ring_slots=8589934592"
    ):
        zp.Pipeline(source(), workers=1, ring_slots=2**33)
    zp.Pipeline(source(), canonical_replicas=2**20, ring_slot_bytes=2**40, ring_slots=2**16)


def test_bad_rank() -> None:
    with pytest.raises(ValueError, match=r"need 0 <= rank < world_size; got rank=2, world_size=2"):
        zp.Pipeline(source(), canonical_replicas=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"need 0 <= dp_rank < dp_size; got dp_rank=1, dp_size=1"):
        zp.Pipeline(source(), canonical_replicas=2, rank=0, world_size=1, dp_rank=1, dp_size=1)


def test_ranks_own_contiguous_lane_blocks() -> None:
    assert zp.Pipeline(source(), canonical_replicas=8, rank=1, world_size=4).lanes == [2, 3]
    assert zp.Pipeline(source(), canonical_replicas=8).lanes == list(range(8))


def test_empty_pipeline() -> None:
    pipe = zp.Pipeline(source())
    with pytest.raises(
        ValueError, match=r"the pipeline has no operators; add at least \.fetch\(\)"
    ):
        pipe.explain()
    with pytest.raises(ValueError, match=r"no operators"):
        next(pipe)


def test_not_a_work_source() -> None:
    with pytest.raises(
        TypeError, match=r"Pipeline needs a work source with for_lane\(lane, num_lanes\).*got list"
    ):
        zp.Pipeline([zp.ArraySource(DOCS)])
    with pytest.raises(TypeError, match=r"got ArraySource"):
        zp.Pipeline(zp.ArraySource(DOCS))


# ------------------------------------------------------------------ work source


def test_static_mixture_validation() -> None:
    a, b = zp.ArraySource(DOCS), zp.ArraySource([])
    with pytest.raises(
        ValueError,
        match=r"weight of dataset '1' \(component 1\) must be finite and >= 0; got -0\.5",
    ):
        zp.StaticMixtureWorkSource([a, a], [1.0, -0.5])
    with pytest.raises(
        ValueError, match=r"weight of dataset '0' \(component 0\) must be finite and >= 0; got nan"
    ):
        zp.StaticMixtureWorkSource([a, a], [float("nan"), 1.0])
    with pytest.raises(
        ValueError,
        match=r"weights keys must equal datasets keys; missing weights for \['b'\], weights for unknown datasets \['c'\]",
    ):
        zp.StaticMixtureWorkSource({"a": a, "b": a}, {"a": 1.0, "c": 1.0})
    with pytest.raises(ValueError, match=r"got 3 weights for 2 datasets"):
        zp.StaticMixtureWorkSource([a, a], [1, 1, 1])
    with pytest.raises(
        ValueError, match=r"dataset 'empty' \(component 1\) is empty but has weight 1"
    ):
        zp.StaticMixtureWorkSource({"full": a, "empty": b}, {"full": 1, "empty": 1})
    zp.StaticMixtureWorkSource(
        {"full": a, "empty": b}, {"full": 1, "empty": 0}
    )  # zero weight: fine
    with pytest.raises(
        ValueError, match=r"lane must satisfy 0 <= lane < num_lanes; got lane=4, num_lanes=4"
    ):
        source().for_lane(4, 4)


# ------------------------------------------------------------------ explain


def test_explain_matches_the_seed_page_format() -> None:
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(DOCS), zp.ArraySource(DOCS)], seed=1, chunk_size=16
    )
    pipe = (
        zp.Pipeline(src, canonical_replicas=2)
        .fetch(parallelism=4)
        .tokenize(zp.ByteTokenizer(), parallelism=4)
        .ensure_mixture()
        .batch(8)
    )
    assert pipe.explain().splitlines() == [
        "Stage[0] place=local runner=threads cap=4 mode=microbatches",
        "  fetch@p4 -[in_q=16]-> tokenize@p4",
        "  --[stage_out=16]-->",
        "Stage[1] place=local runner=inline cap=1 mode=stream_items",
        "  ensure_mixture@p1 -> batch_replay_filter@p1 -> batch@p1",
        "  ==[final_prefetch=3]==> pipeline_end",
        "eviction=epoch flush_every_k_chunks=4",
    ]


def test_explain_inline_stage_and_prefetch() -> None:
    src = zp.StaticMixtureWorkSource([zp.ArraySource(DOCS)], chunk_size=8)
    text = zp.Pipeline(src, prefetch=5).fetch().map(len).batch(2).explain()
    assert text.splitlines() == [
        "Stage[0] place=local runner=inline cap=1 mode=microbatches",
        "  fetch@p1 -[in_q=8]-> map@p1",
        "  --[stage_out=8]-->",
        "Stage[1] place=local runner=inline cap=1 mode=stream_items",
        "  batch_replay_filter@p1 -> batch@p1",
        "  ==[final_prefetch=5]==> pipeline_end",
        "eviction=monotone flush_every_k_chunks=0",
    ]


def test_replay_filter_is_named_after_the_last_operator_without_batch() -> None:
    src = source()
    text = zp.Pipeline(src).fetch().map(len).explain()
    assert "  map_replay_filter@p1" in text.splitlines()  # a stateful stage of its own
    text = zp.Pipeline(src).fetch().tokenize(zp.ByteTokenizer()).split(4).pack(4).explain()
    assert "  tokenize+split+pack@p1 -> pack_replay_filter@p1" in text.splitlines()
    assert "batch_replay_filter" not in text


# ------------------------------------------------------------------ restore


def _checkpoint_after(build, steps: int) -> dict:
    with build() as pipe:
        take(pipe, steps)
        return roundtrip(pipe.checkpoint())


def test_restore_with_a_different_operator_parameter_is_a_fingerprint_mismatch() -> None:
    state = _checkpoint_after(packed, 5)
    with pytest.raises(
        CheckpointError, match=r"checkpoint fingerprint .* does not match this pipeline's"
    ):
        packed(seq_len=17).restore(state)
    with pytest.raises(CheckpointError, match=r"fingerprint"):
        packed(flush_every_k_chunks=3).restore(state)
    packed().restore(state)  # the same definition restores


def test_restore_after_iteration_began() -> None:
    state = _checkpoint_after(packed, 2)
    with packed() as pipe:
        next(pipe)
        with pytest.raises(
            CheckpointError, match=r"restore\(\) after iteration began; build a fresh pipeline"
        ):
            pipe.restore(state)


def test_restore_unknown_version_and_format() -> None:
    state = _checkpoint_after(packed, 2)
    bad = {**state, "version": 99}
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint format version 99 is not supported by this Zephon \(supports 1\)",
    ):
        packed().restore(bad)
    with pytest.raises(
        CheckpointError, match=r"not a Zephon pipeline checkpoint \(format='other'\)"
    ):
        packed().restore({**state, "format": "other"})
    with pytest.raises(CheckpointError, match=r"checkpoint state must be a dict; got list"):
        packed().restore([state])


def test_restore_with_other_canonical_replicas() -> None:
    state = _checkpoint_after(packed, 2)
    with pytest.raises(
        CheckpointError, match=r"checkpoint has canonical_replicas=2 but this pipeline has 4"
    ):
        packed(canonical_replicas=4).restore(state)


def test_restore_missing_lanes_and_malformed_states() -> None:
    state = _checkpoint_after(packed, 2)
    with pytest.raises(
        CheckpointError, match=r"checkpoint has no state for lanes \[1\] that this rank owns"
    ):
        packed().restore({**state, "lanes": state["lanes"][:1]})
    with pytest.raises(CheckpointError, match=r"malformed checkpoint"):
        packed().restore({k: v for k, v in state.items() if k != "round_robin"})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"indices": b"\0" * 12}, r"chunk arrays of \d+ and 12 bytes are not int32 and int64"),
        ({"components": [0, 0]}, r"components and indices must be bytes; got list and bytes"),
        ({"seed": "x"}, r"chunk seed must be an int in \[0, 18446744073709551616\); got str 'x'"),
        ({"lane": 1}, r"in-flight chunks must be this lane's"),
    ],
    ids=["lengths", "not bytes", "seed", "lane"],
)
def test_restore_checks_every_in_flight_chunk_before_it_returns(change: dict, why: str) -> None:
    # Restored chunks are decoded only when they are replayed; what is wrong with them is
    # still an error of restore() itself, naming the lane.
    state = roundtrip(_checkpoint_after(packed, 3))
    chunks = state["lanes"][0]["inflight"]
    assert chunks
    chunks[-1] = {**chunks[-1], **change}
    with pytest.raises(CheckpointError, match=rf"lane 0: .*{why}"):
        packed().restore(state)


def test_restore_with_a_cursor_outside_the_inflight_chunks() -> None:
    state = _checkpoint_after(packed, 4)
    lane = state["lanes"][0]
    lane["cursor"] = [10_000, 0, 0]
    with pytest.raises(
        CheckpointError,
        match=r"lane 0: replay cursor \(0, 10000, 0, 0\) points outside the in-flight chunks",
    ):
        packed().restore(state)


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (packed, r"its epoch closed at chunk \d+|the lane ended"),
        (monotone, r"a later record \(0, \d+, \d+, \d+\) arrived first"),
    ],
    ids=["epoch", "monotone"],
)
def test_replay_target_that_never_reappears(build, why: str) -> None:
    state = _checkpoint_after(build, 6)
    tampered = copy.deepcopy(state)
    lane = next(ls for ls in tampered["lanes"] if ls["cursor"] is not None and ls["lane"] == 0)
    chunk_id, offset, _ = lane["cursor"]
    lane["cursor"] = [chunk_id, offset, 77]  # an in-flight chunk, but no such child
    with build() as pipe:
        pipe.restore(tampered)  # the cursor's chunk is in flight: restore itself accepts it
        with pytest.raises(
            CheckpointError,
            match=rf"replay target \(0, {chunk_id}, {offset}, 77\) of lane 0 never reappeared \(({why})\)",
        ):
            take(pipe)
    with build() as pipe:  # the untouched state resumes
        pipe.restore(state)
        assert len(take(pipe)) > 0


def test_restore_unknown_lane_state_version_of_the_work_source() -> None:
    state = _checkpoint_after(packed, 2)
    state["lanes"][0]["source"]["version"] = 5
    with pytest.raises(CheckpointError, match=r"unknown StaticMixtureWorkSource state version 5"):
        packed().restore(state)
