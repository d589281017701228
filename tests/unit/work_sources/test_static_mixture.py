"""StaticMixtureWorkSource: order, lanes, mixture shares, exhaustion, state, validation."""

from __future__ import annotations

import collections
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.chunks import WorkChunk
from zephon.errors import CheckpointError
from zephon.sources.identity import dataset_identity
from zephon.work_sources import (
    LaneShardable,
    StaticMixtureWorkSource,
    WorkSource,
    mix64,
    permute,
)
from zephon.work_sources.interleave import component_key
from zephon.work_sources.lane_state import pack_counts, pack_ints, unpack_ints


def make(lengths, weights=None, **kwargs) -> StaticMixtureWorkSource:
    return StaticMixtureWorkSource([list(range(n)) for n in lengths], weights, **kwargs)


def take(ws: StaticMixtureWorkSource, k: int) -> list[WorkChunk | None]:
    return [ws.next_chunk() for _ in range(k)]


def drain(ws: StaticMixtureWorkSource, limit: int = 100_000) -> list[WorkChunk]:
    out = []
    for _ in range(limit):
        chunk = ws.next_chunk()
        if chunk is None:
            return out
        out.append(chunk)
    raise AssertionError(f"lane {ws.lane} not exhausted after {limit} chunks")


def pointers(chunks: list[WorkChunk]) -> list[tuple[int, int]]:
    return [p for chunk in chunks for p in chunk.pointers]


# ---------------------------------------------------------------------------- golden


def test_golden_first_chunks() -> None:
    ws = make([10, 7], [0.7, 0.3], seed=0, chunk_size=4, lane=1, num_lanes=2)
    chunks = take(ws, 3)
    assert [c.chunk_id for c in chunks] == [0, 1, 2]
    assert [c.components.tolist() for c in chunks] == [[0, 1, 0, 0], [1, 0, 0, 1], [0, 0, 0, 1]]
    assert [c.indices.tolist() for c in chunks] == [[7, 1, 6, 4], [0, 8, 5, 5], [0, 2, 6, 0]]
    assert all(c.components.dtype == np.int32 and c.indices.dtype == np.int64 for c in chunks)
    assert all(c.lane == 1 for c in chunks)
    assert [c.seed for c in chunks] == [mix64(0, 1, i) for i in range(3)]


# ------------------------------------------------------------------- API, properties


def test_protocols_properties_config_repr() -> None:
    a, b = list(range(5)), np.arange(3)
    ws = StaticMixtureWorkSource({"a": a, "b": b}, {"b": 1, "a": 3}, seed=9, chunk_size=8)
    assert isinstance(ws, WorkSource) and isinstance(ws, LaneShardable)
    assert ws.names == ("a", "b")
    assert ws.datasets[0] is a and ws.datasets[1] is b
    assert ws.weights == (0.75, 0.25)
    assert math.isclose(sum(ws.weights), 1.0)
    assert ws.lengths == (5, 3)
    assert (ws.seed, ws.chunk_size, ws.lane, ws.num_lanes, ws.num_components) == (9, 8, 0, 1, 2)
    assert ws.shuffle is True and ws.num_epochs is None
    config = ws.config()
    assert config == {
        "class": "StaticMixtureWorkSource",
        "names": ["a", "b"],
        "lengths": [5, 3],
        "weights": [0.75, 0.25],
        "seed": 9,
        "shuffle": True,
        "chunk_size": 8,
        "num_epochs": None,
        "identities": [dataset_identity(a), dataset_identity(b)],
    }
    assert [i["kind"] for i in config["identities"]] == ["items", "array"]
    assert msgpack.unpackb(msgpack.packb(config)) == config
    assert ws.for_lane(2, 3).config() == config  # the lane is not part of the config
    assert repr(ws) == (
        "StaticMixtureWorkSource(names=('a', 'b'), lengths=(5, 3), weights=(0.75, 0.25), "
        "seed=9, shuffle=True, chunk_size=8, num_epochs=None, lane=0, num_lanes=1)"
    )
    assert make([4]).names == ("0",)
    assert make([4, 4]).weights == (0.5, 0.5)


def test_for_lane_shares_datasets_and_starts_fresh() -> None:
    base = make([10, 7], [0.7, 0.3], seed=0, chunk_size=4)
    take(base, 5)
    lane1 = base.for_lane(1, 2)
    assert (lane1.lane, lane1.num_lanes) == (1, 2)
    assert all(x is y for x, y in zip(lane1.datasets, base.datasets, strict=True))
    expected = make([10, 7], [0.7, 0.3], seed=0, chunk_size=4, lane=1, num_lanes=2)
    assert take(lane1, 4) == take(expected, 4)
    # base's own progress is untouched by the copy and vice versa.
    assert base.state_dict()["next_chunk_id"] == 5
    with pytest.raises(ValueError, match="got lane=2, num_lanes=2"):
        base.for_lane(2, 2)


def test_unshuffled_order_is_round_robin_over_the_dataset() -> None:
    ws = make([7], shuffle=False, chunk_size=5, lane=2, num_lanes=3)
    # Global positions 2, 5, 8, 11, 14, 17, ... modulo 7.
    assert pointers(take(ws, 2)) == [(0, g % 7) for g in range(2, 30, 3)]


def test_chunk_ids_and_seeds() -> None:
    ws = make([3, 4], seed=5, chunk_size=2, num_lanes=2, lane=1)
    chunks = take(ws, 6)
    assert [c.chunk_id for c in chunks] == list(range(6))
    assert [c.seed for c in chunks] == [mix64(5, 1, i) for i in range(6)]
    assert len({c.seed for c in chunks}) == 6


def test_dict_weights_follow_names_not_order() -> None:
    ws1 = StaticMixtureWorkSource({"x": [1] * 4, "y": [2] * 4}, {"y": 0.2, "x": 0.8})
    ws2 = StaticMixtureWorkSource({"x": [1] * 4, "y": [2] * 4}, [0.8, 0.2])
    assert ws1.weights == ws2.weights == (0.8, 0.2)
    assert take(ws1, 3) == take(ws2, 3)


# ---------------------------------------------------------------------------- lanes


@pytest.mark.parametrize("num_lanes", [1, 3, 8])
@pytest.mark.parametrize("n", [10, 7, 5])
def test_lanes_disjoint_and_cover_every_dataset_epoch(num_lanes: int, n: int) -> None:
    epochs = 3
    base = make([n], seed=1, chunk_size=4, num_epochs=epochs)
    by_global = {}
    for lane in range(num_lanes):
        samples = pointers(drain(base.for_lane(lane, num_lanes)))
        assert samples, f"lane {lane} got no samples"
        for p, (_, index) in enumerate(samples):
            by_global[lane + p * num_lanes] = index
    # The lanes together take each global position exactly once ...
    assert sorted(by_global) == list(range(epochs * n))
    # ... and each dataset epoch is a permutation of the dataset, a different one per epoch.
    orders = [[by_global[e * n + i] for i in range(n)] for e in range(epochs)]
    for order in orders:
        assert sorted(order) == list(range(n))
    assert len({tuple(o) for o in orders}) > 1
    # The permutation's key comes from the dataset's name ("0" here), not its place.
    assert orders[0] == permute(np.arange(n), n, mix64(1, component_key("0"), 0)).tolist()


def test_every_lane_gets_samples_when_dataset_smaller_than_lane_count() -> None:
    base = make([3], chunk_size=2)
    for lane in range(8):
        chunk = base.for_lane(lane, 8).next_chunk()
        assert chunk is not None and len(chunk) == 2


# ------------------------------------------------------------------------- mixture


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5).filter(
        lambda ws: sum(ws) > 1e-3 and all(w == 0 or w > 1e-6 for w in ws)
    ),
    chunk_size=st.integers(1, 70),
)
def test_every_window_of_100_tracks_the_weights(weights: list[float], chunk_size: int) -> None:
    ws = make([13] * len(weights), weights, chunk_size=chunk_size)
    comps = np.concatenate([c.components for c in take(ws, 1 + 1000 // chunk_size)])
    assert comps.size >= 1000
    onehot = np.eye(len(weights))[comps]
    prefix = np.vstack([np.zeros(len(weights)), np.cumsum(onehot, axis=0)])
    windows = prefix[100:] - prefix[:-100]
    deviation = np.abs(windows / 100 - np.array(ws.weights))
    assert deviation.max() <= 2 / 100


def test_zero_weight_component_never_drawn() -> None:
    ws = StaticMixtureWorkSource([list(range(5)), [], list(range(4))], [1, 0, 2], chunk_size=7)
    comps = np.concatenate([c.components for c in take(ws, 100)])
    assert 1 not in comps
    assert set(comps.tolist()) == {0, 2}
    assert ws.weights[1] == 0.0


@pytest.mark.parametrize("num_epochs", [1, 2])
@pytest.mark.parametrize("num_lanes", [1, 3])
def test_exhaustion_sees_every_sample_num_epochs_times(num_epochs: int, num_lanes: int) -> None:
    lengths = [10, 7, 1, 4]
    base = make(lengths, [0.6, 0.3, 0.1, 0.0], chunk_size=4, num_epochs=num_epochs)
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    for lane in range(num_lanes):
        ws = base.for_lane(lane, num_lanes)
        chunks = drain(ws)
        assert [c.chunk_id for c in chunks] == list(range(len(chunks)))
        assert all(len(c) == 4 for c in chunks[:-1])
        counts.update(pointers(chunks))
        assert [ws.next_chunk() for _ in range(3)] == [None] * 3
        state = ws.state_dict()
        limits = [-(-(num_epochs * n - lane) // num_lanes) for n in lengths]
        assert list(ws.positions) == [*limits[:3], 0]  # zero weight: never drawn
        fresh = base.for_lane(lane, num_lanes)
        fresh.load_state_dict(state)
        assert fresh.next_chunk() is None
    expected = {(c, i): num_epochs for c, n in enumerate(lengths[:3]) for i in range(n)}
    assert dict(counts) == expected


def test_lane_with_nothing_left_is_exhausted_from_the_start() -> None:
    base = make([2], chunk_size=4, num_epochs=1)
    assert len(base.for_lane(1, 3).next_chunk()) == 1
    assert base.for_lane(2, 3).next_chunk() is None


# --------------------------------------------------------------------------- state


def roundtrip(state: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(state, use_bin_type=True), raw=False)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    raw_weights=st.lists(st.integers(0, 9), min_size=4, max_size=4),
    seed=st.integers(0, 2**64 - 1),
    shuffle=st.booleans(),
    chunk_size=st.integers(1, 9),
    num_epochs=st.none() | st.integers(1, 3),
    lanes=st.integers(1, 5).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
    k=st.integers(0, 60),
)
def test_state_round_trip_at_any_point(
    lengths, raw_weights, seed, shuffle, chunk_size, num_epochs, lanes, k
) -> None:
    weights = raw_weights[: len(lengths)]
    if sum(weights) == 0:
        weights[0] = 1
    lane, num_lanes = lanes
    kwargs = dict(seed=seed, shuffle=shuffle, chunk_size=chunk_size, num_epochs=num_epochs)
    original = make(lengths, weights, lane=lane, num_lanes=num_lanes, **kwargs)
    take(original, k)
    state = roundtrip(original.state_dict())
    restored = make(lengths, weights, **kwargs).for_lane(lane, num_lanes)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert take(restored, 5) == take(original, 5)


def test_state_size_does_not_grow() -> None:
    ws = make([1000, 77, 5], [0.5, 0.3, 0.2], chunk_size=4, lane=2, num_lanes=3)
    take(ws, 10)
    early = ws.state_dict()
    take(ws, 10_000 - 10)
    late = ws.state_dict()
    assert late["next_chunk_id"] == 10_000
    assert early.keys() == late.keys()
    # Per component one packed int of at most 8 bytes, whatever the progress.
    for key in ("positions", "tokens", "received"):
        assert len(early[key]) <= 1 + 8 * 3 and len(late[key]) <= 1 + 8 * 3
    assert late["carry"] == early["carry"] == b""  # static weights: nothing carried
    assert abs(len(msgpack.packb(late)) - len(msgpack.packb(early))) <= 12


def equal_mix_state(k: int, lane: int, num_lanes: int) -> dict:
    """State after k chunks of 4 of a 50/50 mixture, by hand: the tags tie after every two
    picks (ties go to component 0), so each component has been drawn 2k times, and
    ``received`` (stored as its difference from the positions) is 0."""
    return {
        "version": 2,
        "lane": lane,
        "num_lanes": num_lanes,
        "next_chunk_id": k,
        "lane_tokens": 0,
        "schedule_position": 0,
        "virtual_time": float(4 * k),  # one per sample: the weights sum to exactly 1
        "positions": pack_ints(np.array([2 * k, 2 * k])),
        "tokens": b"\x00",
        "received": b"\x00",
        "carry": b"",
        "stopped": False,
    }


def test_hand_built_state_matches_iterating() -> None:
    ws = make([11, 6], chunk_size=4, seed=3, lane=2, num_lanes=3)
    take(ws, 1000)
    assert ws.state_dict() == equal_mix_state(1000, 2, 3)
    restored = make([11, 6], chunk_size=4, seed=3, lane=2, num_lanes=3)
    restored.load_state_dict(equal_mix_state(1000, 2, 3))
    assert take(restored, 5) == take(ws, 5)


def test_load_far_position_without_iterating() -> None:
    # Chunk 10**6 (8 * 10**6 samples in): loading must not replay anything, or this test
    # would take minutes.
    k = 10**6
    lengths, lane, num_lanes, seed = (11, 6), 2, 3, 3
    ws = make(lengths, chunk_size=4, seed=seed, lane=lane, num_lanes=num_lanes)
    ws.load_state_dict(equal_mix_state(k, lane, num_lanes))
    chunk = ws.next_chunk()
    assert chunk.chunk_id == k and chunk.seed == mix64(seed, lane, k)
    assert chunk.components.tolist() == [0, 1, 0, 1]
    expected = []
    for p in (2 * k, 2 * k, 2 * k + 1, 2 * k + 1):
        c = len(expected) % 2
        g = lane + p * num_lanes
        n = lengths[c]
        key = component_key(str(c))
        expected.append(int(permute(np.array([g % n]), n, mix64(seed, key, g // n))[0]))
    assert chunk.indices.tolist() == expected


@pytest.mark.parametrize("components", [1, 2, 8, 9, 40])  # ints, then numpy past 8
@pytest.mark.parametrize("token_units", [False, True])
def test_a_lanes_packed_counts_are_pack_ints_of_each(components: int, token_units: bool) -> None:
    rng = np.random.default_rng(components)
    positions = rng.integers(0, 2**20, components)
    tokens = positions * rng.integers(1, 3000, components)
    received = rng.integers(0, 2**20, components) * (2**12 if token_units else 1)
    base = tokens if token_units else positions
    assert pack_counts(positions, tokens, received, token_units) == (
        pack_ints(positions),
        pack_ints(tokens),
        pack_ints(base - received),  # negative where received is above the base
    )


@pytest.mark.parametrize(
    "values", [[0], [0, 0, 0], [1, -1, 127, -128], [300, -2], [2**40, 5], [-(2**63), 2**63 - 1]]
)
def test_packed_ints_round_trip_with_the_smallest_width(values: list[int]) -> None:
    data = pack_ints(np.array(values, dtype=np.int64))
    assert unpack_ints(data, len(values), "x").tolist() == values
    width = data[0]
    assert width == 0 or len(data) == 1 + width * len(values)
    lo, hi = min(values), max(values)
    assert width == (
        0
        if not any(values)
        else next(w for w in (1, 2, 4, 8) if -(2 ** (8 * w - 1)) <= lo and hi < 2 ** (8 * w - 1))
    )


def test_state_of_a_thousand_components_compresses_small() -> None:
    """Byte planes of similar ints compress well: a 1,000-component lane state deep into a
    run stays a few KB once zstd has it (the checkpoint file format)."""
    from zephon.checkpoint import dumps

    ws = make([500] * 1000, chunk_size=64, lane=3, num_lanes=8)
    take(ws, 2000)  # 128,000 samples: 128 of each component
    state = ws.state_dict()
    assert sorted(set(ws.positions)) in ([128], [127, 128], [128, 129])
    assert len(dumps({"s": state})) < 1500


# ----------------------------------------------------------------------- validation


class NoGetItem:
    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (([[1], [2]], [1.0]), {}, ValueError, "got 1 weights for 2 datasets"),
        (
            ({"a": [1], "b": [2]}, {"a": 1, "c": 2}),
            {},
            ValueError,
            r"missing weights for \['b'\], weights for unknown datasets \['c'\]",
        ),
        (([[1], [2]], {"0": 1, "1": 1}), {}, ValueError, "weights is a dict .* but datasets is"),
        (
            ({"a": [1], "b": [2]}, {"a": 1, "b": math.nan}),
            {},
            ValueError,
            r"weight of dataset 'b' \(component 1\) must be finite and >= 0; got nan",
        ),
        (
            ([[1], [2]], [1, math.inf]),
            {},
            ValueError,
            r"dataset '1' \(component 1\) must be finite and >= 0; got inf",
        ),
        (
            ([[1], [2]], [-0.5, 1]),
            {},
            ValueError,
            r"dataset '0' \(component 0\) must be finite and >= 0; got -0.5",
        ),
        (([[1], [2]], [0, 0.0]), {}, ValueError, r"positive sum; got \[0.0, 0.0\]"),
        (
            ({"a": [1], "empty": []}, None),
            {},
            ValueError,
            r"dataset 'empty' \(component 1\) is empty but has weight 1.0",
        ),
        (([[1]],), {"chunk_size": 0}, ValueError, "chunk_size must be >= 1; got chunk_size=0"),
        (([[1]],), {"num_epochs": 0}, ValueError, "num_epochs must be >= 1.*got num_epochs=0"),
        (
            ([[1]],),
            {"lane": 3, "num_lanes": 3},
            ValueError,
            r"0 <= lane < num_lanes; got lane=3, num_lanes=3 \(use a lane in 0..2\)",
        ),
        (([[1]],), {"lane": -1}, ValueError, "got lane=-1, num_lanes=1"),
        (([[1]],), {"num_lanes": 0}, ValueError, "num_lanes must be >= 1; got num_lanes=0"),
        (([],), {}, ValueError, "datasets is empty"),
        (
            ([[1], NoGetItem()],),
            {},
            TypeError,
            r"dataset '1' \(component 1\) of type NoGetItem is not random-access",
        ),
        (
            ({"gen": (i for i in range(3))},),
            {},
            TypeError,
            r"dataset 'gen' \(component 0\) of type generator",
        ),
        ((iter([[1]]),), {}, TypeError, "datasets must be a list/tuple .* got list_iterator"),
        (({1: [1]},), {}, TypeError, "dataset names .* must be str; got int 1"),
        (([[1]], "1"), {}, TypeError, "weights must be a list/tuple.*got str"),
        (([[1]], [None]), {}, TypeError, r"weight of dataset '0' \(component 0\) must be a number"),
        (
            ([[1]], ["x"]),
            {},
            ValueError,
            r"weight of dataset '0' \(component 0\) must be a number; got the string 'x'",
        ),
        (
            ({"a": [1], "b": [2]}, ["0.5", "0.5"]),
            {},
            ValueError,
            r"weight of dataset 'a' \(component 0\) must be a number; got the string '0\.5': give "
            r"the number itself \(e\.g\. 0\.5, not '0\.5'\)",
        ),
        (
            ({"a": [1], "b": [2]}, [1.0, False]),
            {},
            ValueError,
            r"weight of dataset 'b' \(component 1\) must be a number; got the boolean False: give "
            r"1\.0 or 0\.0",
        ),
        (
            ({"a": [1], "b": [2]}, {"a": np.bool_(True), "b": 1.0}),
            {},
            ValueError,
            r"weight of dataset 'a' \(component 0\) must be a number; got the boolean True",
        ),
        (
            ([[1]],),
            {"chunk_size": 2**63},
            ValueError,
            r"chunk_size must be at most 65536 \(2\*\*16 pointers: every in-flight chunk is stored "
            r"in full in each checkpoint and replayed whole on restore\); got "
            r"chunk_size=9223372036854775808: leave it at 64",
        ),
        (([[1]],), {"chunk_size": 2.5}, TypeError, "chunk_size must be an int; got float 2.5"),
        (([[1]],), {"seed": 2**64}, ValueError, "seed must fit in 64 bits"),
    ],
)
def test_validation(args, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        StaticMixtureWorkSource(*args, **kwargs)


def test_the_chunk_size_limit_itself_is_fine() -> None:
    from zephon.work_sources.static_mixture import MAX_CHUNK_SIZE

    assert MAX_CHUNK_SIZE == 2**16
    assert len(make([5], chunk_size=MAX_CHUNK_SIZE, num_epochs=1).next_chunk()) == 5


def test_an_empty_file_is_named_by_its_path(tmp_path) -> None:
    import zephon as zp

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "tokens.bin").write_bytes(b"")
    full = zp.ArraySource(["a"])
    with pytest.raises(
        ValueError,
        match=rf"dataset '1' \(component 1, a JsonlSource of {empty}\) is empty but has weight "
        r"1\.0; check the path \(an empty file has no samples\), give it weight 0 or remove it",
    ):
        StaticMixtureWorkSource([full, zp.JsonlSource(empty)])
    with pytest.raises(
        ValueError,
        match=r"dataset 'toks' \(component 0, a TokenFileSource of .*tokens\.bin\) is empty",
    ):
        StaticMixtureWorkSource({"toks": zp.TokenFileSource(tmp_path / "tokens.bin", eos_id=0)})
    shards = []
    for i in range(6):
        shards.append(tmp_path / f"web-{i}.jsonl")
        shards[-1].write_text("")
    with pytest.raises(ValueError) as e:
        StaticMixtureWorkSource({"web": zp.JsonlSource(shards)})
    assert f"a JsonlSource of {shards[0]}, {shards[1]}, {shards[2]}, … and 3 more)" in str(e.value)


def test_a_component_of_no_tokens_is_refused_where_the_mixture_counts_tokens() -> None:
    import zephon as zp

    none = zp.ArraySource([np.zeros(0, np.int32)] * 5)
    some = zp.ArraySource([np.ones(3, np.int32)] * 5)
    message = (
        r"dataset 'none' \(component 0\) has no tokens: every one of its 5 samples is 0 tokens "
        r"long, and the mixture shares out tokens \(weight 1\.0\); its samples cannot make up "
        r"any share: check its lengths .*, or give it weight 0"
    )
    with pytest.raises(ValueError, match=message):
        StaticMixtureWorkSource({"none": none, "some": some}, weight_unit="tokens")
    with pytest.raises(ValueError, match=r"dataset 'none' \(component 0\) has no tokens"):
        StaticMixtureWorkSource(
            {"none": [0] * 5, "some": [1] * 5},
            weight_unit="tokens",
            lengths={"none": np.zeros(5, np.uint32), "some": np.ones(5, np.uint32)},
        )
    # Weight 0, or samples counted (not shared out) by tokens: nothing to refuse.
    StaticMixtureWorkSource({"none": none, "some": some}, [0.0, 1.0], weight_unit="tokens")
    StaticMixtureWorkSource({"none": none, "some": some}, lengths={"none": np.zeros(5, int)})


def test_zero_weight_empty_dataset_is_fine() -> None:
    ws = StaticMixtureWorkSource({"a": [1, 2], "unused": []}, {"a": 1, "unused": 0})
    assert ws.lengths == (2, 0)
    assert set(ws.next_chunk().components.tolist()) == {0}


def good_state() -> dict:
    ws = make([5, 5], chunk_size=2, lane=1, num_lanes=2)
    take(ws, 3)
    return ws.state_dict()


def test_good_state_is_what_the_errors_below_change() -> None:
    assert good_state()["positions"] == pack_ints(np.array([3, 3]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"version": 3},
            "unknown StaticMixtureWorkSource state version 3; this Zephon reads version 2$",
        ),
        (
            {"version": 1},
            "reads version 2; it was written by an earlier Zephon, which interleaved components "
            "by smooth weighted round robin: resume it with that version",
        ),
        ({"lane": 0}, r"lane 0 of 2 but this source is lane 1 of 2; load it into for_lane\(0, 2\)"),
        ({"num_lanes": 3}, "lane 1 of 3 but this source is lane 1 of 2"),
        (
            {"positions": pack_ints(np.array([1, 2, 3]))},
            r"state positions holds 3 bytes of width 1; expected 2 values .* \(this source has 2: "
            r"\['0', '1'\]",
        ),
        ({"positions": [3, 3]}, "state positions must be packed bytes; got list"),
        ({"received": b"\x03\x00"}, "state received holds 1 bytes of width 3"),
        ({"extra": 1}, r"unknown keys \['extra'\]"),
        (
            {"positions": pack_ints(np.array([-1, 0]))},
            r"state positions\[0\] \('0'\) must be >= 0; got -1",
        ),
        (
            {"next_chunk_id": 1.5},
            r"state next_chunk_id must be an int in \[0, \d+\); got float 1.5",
        ),
        ({"carry": b"\x00\x00\xc0\x7f" * 2}, "state carry must be finite float32s"),
        ({"virtual_time": 3}, "state virtual_time must be a finite float; got 3"),
        ({"virtual_time": math.inf}, "state virtual_time must be a finite float; got inf"),
        ({"carry": b"\x00" * 4}, r"state carry must be b'' or 2 float32s"),
        (
            {"received": pack_ints(np.array([4, 0]))},
            r"state received\[0\] \('0'\) is negative \(-1\)",
        ),
        ({"schedule_position": 2}, "schedule_position must be 0 without a Schedule; got 2"),
        ({"stopped": 0}, "state stopped must be a bool; got 0"),
    ],
)
def test_load_state_dict_errors(change: dict, message: str) -> None:
    state = {**good_state(), **change}
    ws = make([5, 5], chunk_size=2, lane=1, num_lanes=2)
    with pytest.raises(CheckpointError, match=message):
        ws.load_state_dict(state)
    assert issubclass(CheckpointError, ValueError)


def test_load_state_dict_missing_key() -> None:
    state = good_state()
    del state["carry"]
    with pytest.raises(ValueError, match=r"missing keys \['carry'\]"):
        make([5, 5], chunk_size=2, lane=1, num_lanes=2).load_state_dict(state)


# ------------------------------------------------- per-component epochs, end policy


def test_num_epochs_per_component() -> None:
    base = make([6, 4, 5], [1, 1, 1], chunk_size=3, num_epochs={"0": 2, "2": 1})
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    for lane in range(2):
        ws = base.for_lane(lane, 2)
        chunks = take(ws, 60)
        counts.update(pointers([c for c in chunks if c is not None]))
        assert chunks[-1] is not None  # component 1 repeats forever: never exhausted
    assert {counts[(0, i)] for i in range(6)} == {2}
    assert {counts[(2, i)] for i in range(5)} == {1}
    assert min(counts[(1, i)] for i in range(4)) > 5
    assert base.num_epochs == {"0": 2, "2": 1}
    assert base.config()["num_epochs"] == {"0": 2, "2": 1}
    with pytest.raises(ValueError, match=r"num_epochs names unknown datasets \['9'\]"):
        make([3], num_epochs={"9": 1})
    with pytest.raises(
        ValueError, match=r"num_epochs\['0'\] must be >= 1.*got num_epochs\['0'\]=0"
    ):
        make([3], num_epochs={"0": 0})


def test_on_exhausted_stop_ends_the_lane_at_the_first_component_to_run_out() -> None:
    renorm = make([4, 40], [1, 1], chunk_size=5, num_epochs=1)
    stop = make([4, 40], [1, 1], chunk_size=5, num_epochs=1, on_exhausted="stop")
    kept = pointers(drain(renorm))
    cut = pointers(drain(stop))
    assert len(kept) == 44
    # The stream stops right after component 0's last sample: the same prefix, no more.
    last0 = max(i for i, (c, _) in enumerate(kept) if c == 0)
    assert cut == kept[: last0 + 1]
    assert stop.state_dict()["stopped"] is True
    assert stop.config()["on_exhausted"] == "stop" and "on_exhausted" not in renorm.config()
    restored = make([4, 40], [1, 1], chunk_size=5, num_epochs=1, on_exhausted="stop")
    restored.load_state_dict(stop.state_dict())
    assert restored.next_chunk() is None
    with pytest.raises(ValueError, match=r"on_exhausted must be one of \('renormalize', 'stop'\)"):
        make([4], on_exhausted="halt")


def test_on_exhausted_stop_for_a_lane_that_gets_nothing_of_a_component() -> None:
    # 2 samples over 3 lanes, one epoch: lane 2 gets none of component 0, so it stops at once.
    base = make([2, 50], [1, 1], chunk_size=4, num_epochs={"0": 1}, on_exhausted="stop")
    assert base.for_lane(2, 3).next_chunk() is None
    assert base.for_lane(0, 3).next_chunk() is not None


def test_defaults_keep_the_config_and_token_options_show_in_it() -> None:
    plain = make([5, 5], [1, 1])
    assert set(plain.config()) == {
        "class",
        "names",
        "lengths",
        "weights",
        "seed",
        "shuffle",
        "chunk_size",
        "num_epochs",
        "identities",
    }
    tok = StaticMixtureWorkSource([list(range(5))], weight_unit="tokens", lengths=[np.arange(1, 6)])
    config = tok.config()
    assert config["weight_unit"] == "tokens"
    assert config["token_lengths"][0].startswith("lengths:")
    assert tok.weight_unit == "tokens" and tok.on_exhausted == "renormalize"
    assert "weight_unit='tokens'" in repr(tok)
    with pytest.raises(ValueError, match=r"weight_unit must be one of \('samples', 'tokens'\)"):
        make([5], weight_unit="bytes")


def test_token_weights_share_tokens_not_documents() -> None:
    """Short and long documents at 50/50 by tokens: about 10 short ones per long one."""
    short, long = np.full(200, 10), np.full(200, 100)
    ws = StaticMixtureWorkSource(
        {"short": list(range(200)), "long": list(range(200))},
        {"short": 1, "long": 1},
        weight_unit="tokens",
        lengths={"short": short, "long": long},
        chunk_size=110,
    )
    comps = ws.next_chunk().components
    assert np.count_nonzero(comps == 0) == 100 and np.count_nonzero(comps == 1) == 10
    assert ws.tokens_dealt == (1000, 1000)
    assert ws.state_dict()["lane_tokens"] == 2000


@pytest.mark.native
@pytest.mark.parametrize("components", [1, 2, 8, 9, 40])
@pytest.mark.parametrize("token_units", [False, True])
def test_a_lanes_counts_packed_in_c_are_the_python_ones(components: int, token_units: bool) -> None:
    from zephon.work_sources import interleave as il
    from zephon.work_sources.lane_state import pack_carry

    native = getattr(il._NATIVE, "mixture_counts", None)
    assert native is not None, "zephon._permute is not built (native tests need it)"
    rng = np.random.default_rng(components * 7 + token_units)
    for scale in (0, 1, 2**7, 2**15, 2**31, 2**62):
        i64 = np.zeros((il.I64_ROWS, components), np.int64)
        f64 = np.zeros((il.F64_ROWS, components), np.float64)
        i64[il.POS] = rng.integers(0, scale + 1, components)
        i64[il.TOK] = rng.integers(-scale, scale + 1, components)
        i64[il.RECV] = rng.integers(0, scale + 1, components)
        if scale:
            f64[il.CARRY] = rng.normal(0, 3, components) * rng.integers(0, 2, components)
        f64[il.CARRY, 0] = -0.0 if scale == 1 else f64[il.CARRY, 0]  # a negative zero is 0
        want = (
            *pack_counts(i64[il.POS], i64[il.TOK], i64[il.RECV], token_units),
            pack_carry(f64[il.CARRY]),
        )
        assert native(f64, i64, token_units) == want
    with pytest.raises(ValueError, match="interleave's f64 and i64"):
        native(np.zeros((4, 2)), np.zeros((7, 3), np.int64), False)
