"""The collector pause around a checkpoint's state build (zephon.pipeline.collector)."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest

import zephon as zp
from zephon.pipeline import pipeline
from zephon.pipeline.collector import collector_paused


def test_the_pause_nests_and_restores_the_collector_as_it_found_it() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # disabled before: left disabled
    finally:
        gc.enable()


def test_an_exception_inside_the_pause_still_enables_the_collector() -> None:
    try:
        with collector_paused():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.isenabled()


def test_overlapping_pauses_from_two_threads_enable_it_once_both_end() -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with collector_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    with collector_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause is still open
    release.set()
    t.join(10)
    assert gc.isenabled()


def _collections_in_a_checkpoint_of_64_lanes() -> int:
    src = zp.StaticMixtureWorkSource([list(range(200))], seed=0, chunk_size=4)
    ran: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            ran.append(info["generation"])

    with zp.Pipeline(src, canonical_replicas=64, prefetch=0).batch(2) as pipe:
        for _ in range(64):
            next(pipe)
        gc.set_threshold(1)  # any allocation would collect
        gc.callbacks.append(count)
        try:
            state = pipe.checkpoint()
        finally:
            gc.callbacks.remove(count)
            gc.set_threshold(700, 10, 10)
    assert len(state["lanes"]) == 64
    assert gc.isenabled()
    return len(ran)


def test_a_checkpoint_builds_its_lanes_states_without_a_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a threshold of 1 every allocation of a tracked object collects: the few left
    # are the calls around the state's build (the plan, the engine), not its 64 lanes.
    paused = _collections_in_a_checkpoint_of_64_lanes()
    monkeypatch.setattr(
        pipeline, "collector_paused", lambda promote=False: contextlib.nullcontext()
    )
    unpaused = _collections_in_a_checkpoint_of_64_lanes()
    assert paused <= 8 and unpaused >= 64 + paused, (paused, unpaused)


def _pause(promote: bool) -> tuple[list[int], bool, bool]:
    """The collections a pause (and one allocation after it) runs, and whether an object
    alive before it and one it made are in the oldest generation afterwards."""
    ran: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            ran.append(info["generation"])

    gc.collect()
    before = [[k] for k in range(5000)]  # young, tracked, alive across the pause
    gc.callbacks.append(count)
    try:
        with collector_paused(promote=promote):
            made = [{"k": [k]} for k in range(5000)]
        after = [[0]]  # the allocation that would run the collection the block owes
    finally:
        gc.callbacks.remove(count)
    oldest = gc.get_objects(2)
    assert gc.isenabled() and len(made) == len(before) == 5000 and after
    return ran, any(x is before[7] for x in oldest), any(x is made[7] for x in oldest)


def test_promoting_moves_the_young_generation_and_the_block_s_objects_to_the_oldest() -> None:
    assert _pause(promote=True) == ([], True, True)  # no collection, both promoted
    assert gc.get_freeze_count() == 0  # nothing is left frozen
    ran, old_before, old_made = _pause(promote=False)
    assert ran and not old_before and not old_made  # a young collection, nothing that old


def test_promoting_leaves_objects_the_program_froze_frozen() -> None:
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with collector_paused(promote=True):
            [{"k": [k]} for k in range(100)]
        # Not thawed (that would leave 0) and nothing added. (Daemon threads that earlier
        # tests left, a lease's refresher say, may free a few frozen objects meanwhile.)
        assert frozen - 1000 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_a_checkpoint_of_many_lanes_promotes_and_of_few_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[bool] = []
    real = pipeline.collector_paused

    def spy(promote: bool = False):  # type: ignore[no-untyped-def]
        asked.append(promote)
        return real(promote)

    monkeypatch.setattr(pipeline, "collector_paused", spy)
    monkeypatch.setattr(pipeline, "PROMOTE_LANES", 16)
    for lanes in (8, 16):
        src = zp.StaticMixtureWorkSource([list(range(200))], seed=0, chunk_size=4)
        with zp.Pipeline(src, canonical_replicas=lanes, prefetch=0).batch(2) as pipe:
            next(pipe)
            assert len(pipe.checkpoint()["lanes"]) == lanes
    assert asked == [False, True]
