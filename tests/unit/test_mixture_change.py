"""``restore(state, allow_mixture_change=True)``: the contract of
:mod:`zephon.work_sources.mixture_change`, checked sample by sample.

The datasets hold unique ints (``a``: 0.., ``b``: 1000.., ``c``: 2000.., ``d``: 3000..), so
a delivered batch says exactly which samples reached the training loop."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

import zephon as zp
from zephon.checkpoint.state import merge_states
from zephon.errors import CheckpointError
from zephon.testing import assert_resumes_exactly, roundtrip, take

BASE = {"a": 0, "b": 1000, "c": 2000, "d": 3000}
SIZES = {"a": 60, "b": 45, "c": 50, "d": 30}
LANES = 3


def data(name: str, shift: int = 0) -> zp.ArraySource:
    return zp.ArraySource(np.arange(SIZES[name]) + BASE[name] + shift)


def build(
    weights: dict[str, float],
    *,
    ensure: bool = True,
    num_epochs: int | None = 1,
    rank: int = 0,
    world_size: int = 1,
    shifted: tuple[str, ...] = (),
    seed: int = 7,
    unit: str = "samples",
) -> zp.Pipeline:
    datasets = {n: data(n, 500 if n in shifted else 0) for n in weights}
    kw = {}
    if unit == "tokens":
        kw = {
            "weight_unit": "tokens",
            "lengths": {n: np.full(SIZES[n], 1 + i) for i, n in enumerate(weights)},
        }
    src = zp.StaticMixtureWorkSource(
        datasets, weights, seed=seed, chunk_size=4, num_epochs=num_epochs, **kw
    )
    p = (
        zp.Pipeline(
            src,
            canonical_replicas=LANES,
            flush_every_k_chunks=2,
            prefetch=0,
            rank=rank,
            world_size=world_size,
        )
        .fetch()
        .shuffle(3)
    )
    if ensure:
        p = p.ensure_mixture(buffer_size=4)
    return p.batch(2, drop_last=False)


def samples(batches) -> list[int]:
    return [int(x) for b in batches for x in np.asarray(b).ravel()]


def component_of(v: int) -> str:
    return "abcd"[v // 1000]


def by_component(values) -> dict[str, list[int]]:
    out: dict[str, list[int]] = collections.defaultdict(list)
    for v in values:
        out[component_of(v)].append(v)
    return out


def checkpoint_after(weights, steps, **kw):
    with build(weights, **kw) as p:
        head = take(p, steps)
        return samples(head), roundtrip(p.checkpoint())


def restore_and_drain(weights, state, **kw):
    with build(weights, **kw) as p:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            change = p.restore(state, allow_mixture_change=True)
        after = roundtrip(p.checkpoint())
        tail = take(p)
    return change, samples(tail), after, caught


def inflight_pointers(state) -> list[tuple[int, int, list[int]]]:
    out = []
    for ls in state["lanes"]:
        for ch in ls["inflight"]:
            out.append((ls["lane"], ch["chunk_id"], np.frombuffer(ch["indices"], "<i8").tolist()))
    return out


@pytest.mark.parametrize("steps", [1, 5, 12])
@pytest.mark.parametrize("ensure", [True, False])
def test_reweight_and_add_lose_or_repeat_nothing(steps, ensure) -> None:
    """A finite run (every sample once), cut, restored with other weights and a new
    dataset: every sample of the old datasets is delivered exactly once over both halves,
    and every sample of the new one once after the restore."""
    old = {"a": 2.0, "b": 1.0}
    new = {"a": 1.0, "c": 3.0, "b": 1.0}
    head, state = checkpoint_after(old, steps, ensure=ensure)
    change, tail, after, caught = restore_and_drain(new, state, ensure=ensure)
    assert isinstance(change, zp.MixtureChange)
    assert change.kept == ("a", "b") and change.added == ("c",) and change.reweighted
    assert not change.removed and not change.replaced
    assert str(change) == "mixture change: kept ['a', 'b']; added ['c']; weights changed"
    assert not caught
    got = by_component(head + tail)
    for name in ("a", "b", "c"):
        assert sorted(got[name]) == list(range(BASE[name], BASE[name] + SIZES[name])), name
    # In-flight chunks replay as they were made: the same pointers, lane by lane.
    assert inflight_pointers(after) == inflight_pointers(state)


def test_a_dataset_that_stays_keeps_its_cursor_mid_epoch() -> None:
    """With num_epochs=None the streams never end: a dataset that stays continues its
    lane's sequence exactly where it was (no sample of its epoch repeated or skipped)."""
    old = {"a": 1.0, "b": 1.0}
    with build(old, num_epochs=None, ensure=False) as p:
        take(p, 6)
        state = roundtrip(p.checkpoint())
    new = {"b": 1.0, "a": 4.0, "d": 1.0}  # reordered, reweighted, and a new one
    with build(new, num_epochs=None, ensure=False) as p:
        p.restore(state, allow_mixture_change=True)
        positions = [
            dict(zip(p.source.names, p._engine.trackers[lane].source.positions, strict=True))
            for lane in p.lanes
        ]
    for lane, ls in enumerate(state["lanes"]):
        saved = zp.StaticMixtureWorkSource(
            {n: data(n) for n in old}, old, seed=7, chunk_size=4
        ).for_lane(lane, LANES)
        saved.load_state_dict(ls["source"])
        assert positions[lane] == {"a": saved.positions[0], "b": saved.positions[1], "d": 0}


def test_restoring_the_same_change_twice_gives_the_same_stream() -> None:
    head, state = checkpoint_after({"a": 2.0, "b": 1.0}, 7)
    _, tail1, _, _ = restore_and_drain({"a": 1.0, "b": 1.0, "c": 1.0}, state)
    _, tail2, _, _ = restore_and_drain({"a": 1.0, "b": 1.0, "c": 1.0}, state)
    assert tail1 == tail2


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_exact_resume_across_and_after_a_change(unit) -> None:
    """Checkpoints taken after the change (also while ensure_mixture still holds the old
    weights for the replayed epochs) restore exactly."""
    _, state = checkpoint_after({"a": 2.0, "b": 1.0}, 5, unit=unit)
    new = {"a": 1.0, "b": 1.0, "c": 2.0}

    def build_changed() -> zp.Pipeline:
        p = build(new, unit=unit)
        p.restore(state, allow_mixture_change=True)
        return p

    with build_changed() as p:
        first = roundtrip(p.checkpoint())
    assert any("held" in ls for ls in first["lanes"])  # the hold travels in the checkpoint
    assert_resumes_exactly(
        build_changed, cuts=range(0, 40, 3), restore_build=lambda: build(new, unit=unit)
    )


def test_new_chunks_follow_the_new_weights() -> None:
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 3, num_epochs=None)
    with build({"a": 1.0, "b": 0.0, "c": 3.0}, num_epochs=None) as p:
        p.restore(state, allow_mixture_change=True)
        tail = samples(take(p, 200))
    late = collections.Counter(component_of(v) for v in tail[-300:])
    assert late["b"] == 0
    assert 2.5 < late["c"] / late["a"] < 3.5


def test_a_removed_dataset_with_samples_in_flight_is_refused_then_dropped_later() -> None:
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 4, num_epochs=None)
    assert any(v >= 1000 for v in samples_inflight(state))
    with build({"a": 1.0}, num_epochs=None) as p:
        with pytest.raises(
            CheckpointError,
            match=r"cannot restore into this mixture: 'b' \(not in the new mixture\): \d+ samples in flight in lanes \[",
        ) as e:
            p.restore(state, allow_mixture_change=True)
    assert "keep each with weight 0" in str(e.value) and "zephon inspect" in str(e.value)
    # Kept with weight 0, it is never drawn again; once nothing of it is in flight it goes.
    with build({"a": 1.0, "b": 0.0}, num_epochs=None) as p:
        p.restore(state, allow_mixture_change=True)
        for _ in range(200):
            next(p)
            later = roundtrip(p.checkpoint())
            if not any(v >= 1000 for v in samples_inflight(later)):
                break
        else:
            raise AssertionError("b stayed in flight")
    with build({"a": 1.0}, num_epochs=None) as p:
        change = p.restore(later, allow_mixture_change=True)
        assert change.removed == ("b",) and change.kept == ("a",)
        assert all(v < 1000 for v in samples(take(p, 20)))


def samples_inflight(state) -> list[int]:
    """The values of every in-flight sample (index + base of its component)."""
    out = []
    names = [
        state["fingerprint_parts"][f"component.{c}.name"].strip("'")
        for c in range(int(state["fingerprint_parts"]["components"]))
    ]
    for ls in state["lanes"]:
        for ch in ls["inflight"]:
            comps = np.frombuffer(ch["components"], "<i4")
            idx = np.frombuffer(ch["indices"], "<i8")
            out += [BASE[names[c]] + int(i) for c, i in zip(comps, idx, strict=True)]
    return out


def test_a_dataset_whose_content_changed_is_treated_as_new_and_the_restore_says_so() -> None:
    # c had weight 0 before (nothing of it in flight); now it holds other data.
    head, state = checkpoint_after({"a": 1.0, "c": 0.0}, 4)
    change, tail, _, caught = restore_and_drain({"a": 1.0, "c": 1.0}, state, shifted=("c",))
    assert change.replaced == ("c",) and change.kept == ("a",)
    assert [str(w.message) for w in caught] == [
        "restore: the data of ['c'] is not what the checkpoint was made with (another content "
        "identity or length): they are treated as new datasets and start at their beginning"
    ]
    got = by_component(head + tail)
    assert sorted(got["c"]) == list(range(2500, 2500 + SIZES["c"]))  # all of it, from the start


def test_changed_content_with_samples_in_flight_is_refused() -> None:
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 4, num_epochs=None)
    with build({"a": 1.0, "b": 1.0}, num_epochs=None, shifted=("b",)) as p:
        with pytest.raises(
            CheckpointError, match=r"'b' \(holds other data now\): \d+ samples in flight"
        ):
            p.restore(state, allow_mixture_change=True)


def test_only_the_mixture_may_change() -> None:
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 4)
    with build({"a": 1.0, "b": 2.0}, seed=8) as p:
        with pytest.raises(
            CheckpointError,
            match=r"and not only in the mixture \(allow_mixture_change=True lets the datasets and "
            r"weights change, nothing else\): work source seed: the checkpoint has 7, this "
            r"pipeline has 8",
        ):
            p.restore(state, allow_mixture_change=True)
    with build({"a": 1.0, "b": 2.0}) as p:  # without the flag, a reweight is refused as before
        with pytest.raises(
            CheckpointError, match=r"component 1 \('b'\) weight: the checkpoint has"
        ):
            p.restore(state)


def test_a_changed_mixture_restored_without_the_flag_names_the_flag() -> None:
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 4)
    with build({"a": 1.0, "b": 1.0, "c": 1.0}) as p:  # a component added
        with pytest.raises(
            CheckpointError,
            match=r"the checkpoint has 2 components \('a', 'b'\), this pipeline has 3 \('a', 'b', "
            r"'c'\).*\. Only the mixture differs \(its datasets or weights\): if you changed it "
            r"on purpose, restore with pipe\.restore\(state, allow_mixture_change=True\)",
        ):
            p.restore(state)
    with build({"a": 1.0, "b": 1.0}, seed=8) as p:  # not the mixture: no word of the flag
        with pytest.raises(CheckpointError) as e:
            p.restore(state)
        assert "allow_mixture_change" not in str(e.value)
        assert str(e.value).endswith(
            "Restore into the pipeline (and datasets) that made the checkpoint"
        )


def test_ensure_mixture_needs_the_kept_datasets_in_their_order() -> None:
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 4)
    with build({"b": 1.0, "a": 1.0}) as p:
        with pytest.raises(
            CheckpointError,
            match=r"must keep their relative order \(was \['a', 'b'\], now \['b', 'a'\]\)",
        ):
            p.restore(state, allow_mixture_change=True)
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 4, ensure=False)
    with build({"b": 1.0, "a": 1.0}, ensure=False) as p:  # without it, order is free
        assert p.restore(state, allow_mixture_change=True).kept == ("b", "a")


def test_an_unchanged_mixture_returns_none() -> None:
    _, state = checkpoint_after({"a": 1.0, "b": 1.0}, 4)
    with build({"a": 1.0, "b": 1.0}) as p:
        assert p.restore(state, allow_mixture_change=True) is None


@pytest.mark.parametrize("world_size", [1, 3])
def test_elastic_restore_into_a_changed_mixture(world_size) -> None:
    """Ranks of 1 lane each checkpoint together; the merged state goes into another world
    size and another mixture; every sample is delivered once over the whole run."""
    old = {"a": 2.0, "b": 1.0}
    new = {"a": 1.0, "b": 1.0, "c": 1.0}
    head: list[int] = []
    states = []
    for rank in range(3):
        with build(old, rank=rank, world_size=3) as p:
            head += samples(take(p, 3 + rank))
            states.append(roundtrip(p.checkpoint()))
    merged = merge_states(states)
    tail: list[int] = []
    for rank in range(world_size):
        with build(new, rank=rank, world_size=world_size) as p:
            p.restore(merged, allow_mixture_change=True)
            tail += samples(take(p))
    got = by_component(head + tail)
    for name in ("a", "b", "c"):
        assert sorted(got[name]) == list(range(BASE[name], BASE[name] + SIZES[name])), name
