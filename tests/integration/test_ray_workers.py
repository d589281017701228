"""Lanes on Ray actors (``workers=zp.RayWorkers(n)``): the batches of ``workers=0``, bit for
bit; checkpoints that restore across executors; lanes that move when an actor dies; errors
that name the actor and the lane; a local Ray that stays on 127.0.0.1.

One local Ray per module (started on loopback, shut down at the end). Under ``CI=true`` a
missing ``ray`` fails these tests (the suite's conftest turns the skip into a failure).
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import zephon as zp
from tests.integration.corpus import lm_pipeline
from zephon.errors import WorkerError
from zephon.testing import assert_resumes_exactly, assert_same_batches, roundtrip, take

pytestmark = pytest.mark.ray

SEED = 21


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the ray extra (pip install zephon[ray])")
    from zephon.runners.ray_options import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(num_cpus=2, object_store_memory=100 << 20)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    with lm_pipeline(seed=SEED) as p:
        return take(p)


def ray_pipeline(n: int = 2, **kw):
    return lm_pipeline(seed=kw.pop("seed", SEED), workers=zp.RayWorkers(n), **kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"num_workers": 0}, r"num_workers=\.\.\.\) must be an int >= 1; got 0"),
        ({"num_workers": 2, "address": ""}, r"address=\.\.\.\) must be None"),
        ({"num_workers": 2, "resources": {"CPU": -1}}, r"resources=\.\.\.\) must map"),
        ({"num_workers": 2, "speculate": "yes"}, r"speculate=\.\.\.\) must be a bool"),
        ({"num_workers": 2, "straggler_factor": 0}, r"straggler_factor=\.\.\.\) must be > 0"),
        ({"num_workers": 2, "straggler_min_s": -1}, r"straggler_min_s=\.\.\.\) must be >= 0"),
    ],
)
def test_ray_workers_arguments_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        zp.RayWorkers(**kw)


def test_ray_workers_is_a_workers_value_without_importing_ray():
    import sys

    had_ray = "ray" in sys.modules
    pipe = lm_pipeline(workers=zp.RayWorkers(3, resources={"CPU": 0.5, "GPU": 0, "disk": 1}))
    assert pipe.workers == 3
    assert zp.RayWorkers(1, resources={"CPU": 0.5, "GPU": 0, "disk": 1}).actor_options() == {
        "num_cpus": 0.5,
        "num_gpus": 0.0,
        "resources": {"disk": 1.0},
    }
    assert "place=ray runner=ray" in pipe.explain()
    assert ("ray" in sys.modules) == had_ray  # nothing runs until the first next()
    pipe.close()


def test_interleave_matches_in_process_and_local_workers(ray_cluster, reference):
    with ray_pipeline(2) as p:
        got = take(p)
        assert p.stats()["ray"]["lane_moves"] == 0
    assert_same_batches(reference, got, "ray vs workers=0")
    with lm_pipeline(seed=SEED, workers=1) as p:
        assert_same_batches(take(p), got, "ray vs local workers")


def test_zero_copy_hands_out_views_of_the_object_store(ray_cluster, reference):
    with lm_pipeline(seed=SEED, workers=zp.RayWorkers(2), zero_copy=True) as p:
        got = take(p)
    assert_same_batches(reference, got, "ray, zero_copy=True")
    # read-only views, valid for as long as they are kept (not only until the next batch)
    assert not any(a.flags.writeable for batch in got for a in batch.values())


def test_lockstep_matches_in_process(ray_cluster):
    with lm_pipeline(seed=22, output="lockstep", num_epochs=None) as p:
        ref = take(p, 10)
    with ray_pipeline(2, seed=22, output="lockstep", num_epochs=None) as p:
        assert_same_batches(ref, take(p, 10))


def test_too_few_resources_is_an_error_in_worker_timeout_s(ray_cluster):
    # no actor fits the cluster's 2 CPUs (fewer actors than asked for start: see
    # test_ray_nodes.py, where the others join once a node is added)
    spec = zp.RayWorkers(2, resources={"CPU": 3})
    pipe = lm_pipeline(seed=SEED, workers=spec, worker_timeout_s=2)
    with (
        pipe,
        pytest.raises(
            WorkerError,
            match=r"(?s)none of 2 Ray actors started within worker_timeout_s=2(\.0)? s: each asks for "
            r"\{'num_cpus': 3\.0\}.*add nodes",
        ),
    ):
        next(iter(pipe))


def test_checkpoint_from_ray_restores_into_workers_0(ray_cluster, reference):
    n = len(reference)
    assert_resumes_exactly(
        lambda: ray_pipeline(2),
        restore_build=lambda: lm_pipeline(seed=SEED),
        cuts=[0, n // 2],
        reference=reference,
    )


def test_checkpoint_from_workers_0_restores_into_ray(ray_cluster, reference):
    assert_resumes_exactly(
        lambda: lm_pipeline(seed=SEED),
        restore_build=lambda: ray_pipeline(2),
        cuts=[7],
        reference=reference,
    )


def _take_while_pending(pipe, cap_s: float = 60.0) -> list:
    """Batches, slowly, until no actor of ``pipe`` is waiting to start (one slow to start
    on a loaded machine, or waiting for the CPU a killed actor of an earlier test held)."""
    got = []
    deadline = time.monotonic() + cap_s
    while pipe.stats()["ray"]["pending_actors"] and time.monotonic() < deadline:
        got += take(pipe, 1)
        time.sleep(0.005)
    assert not pipe.stats()["ray"]["pending_actors"], pipe.stats()["ray"]
    return got


def _kill_actor(ray, pipe, index: int) -> None:
    executor = pipe._engine.executor
    ray.kill(executor.actors[index].handle, no_restart=True)


def _take_until_moved(pipe, cap: int = 2000) -> list:
    """Batches until the pipeline has seen its killed actor's death (its watch notices
    within 20 ms of Ray, or a wait on that actor does), at most ``cap``."""
    got = []
    while pipe.stats()["ray"]["lane_moves"] == 0 and len(got) < cap:
        got += take(pipe, 1)
    assert pipe.stats()["ray"]["lane_moves"] == 1
    return got


def _check_after_death(stats, victim: int, lanes: int = 4) -> None:
    """The killed actor has no lane left, and every lane is on one live actor."""
    actors = {a["id"]: a for a in stats["actors"]}
    assert not actors[victim]["alive"] and not actors[victim]["lanes"], stats
    placed = sorted(lane for a in actors.values() if a["alive"] for lane in a["lanes"])
    assert placed == list(range(lanes)), stats


def _tracking(state):
    """Each lane's lowest in-flight chunk and replay cursor: where eviction stands."""
    return [(lane["inflight"][0]["chunk_id"], lane["cursor"]) for lane in state["lanes"]]


@pytest.mark.parametrize("output", ["interleave", "lockstep"])
def test_killed_actor_gives_its_lanes_to_another(ray_cluster, output):
    kw = {"output": output, "num_epochs": None}
    with ray_pipeline(2, seed=24, **kw) as p:
        got = take(p, 3)
        got += _take_while_pending(p)  # all actors up: the kills name them
        joins = p.stats()["ray"]["joins"]  # 1 if an actor was slow to start (a busy machine)
        _kill_actor(ray_cluster, p, 0)
        got += _take_until_moved(p)
        got += take(p, 5)
        _check_after_death(p.stats()["ray"], 0)
        # its replacement (asked for at once) is placed on the CPU it left, and takes lanes
        deadline = time.monotonic() + 60
        while p.stats()["ray"]["joins"] == joins and time.monotonic() < deadline:
            got += take(p, 1)
            time.sleep(0.005)
        stats = p.stats()["ray"]
        assert stats["replacements"] == 1 and stats["joins"] == joins + 1, stats
        assert [(a["id"], a["alive"]) for a in stats["actors"]] == [
            (0, False),
            (1, True),
            (2, True),
        ]
        _check_after_death(stats, 0)  # (a lane may have gone back: see test_ray_nodes.py)
        state = roundtrip(p.checkpoint())  # taken after the move: restores anywhere
        cut = len(got)
        got += take(p, 10)
    with lm_pipeline(seed=24, **kw) as p:
        ref = take(p, cut)
        # every piece counted once: eviction where workers=0 has it at the same step
        assert _tracking(state) == _tracking(p.checkpoint())
        ref += take(p, 10)
    assert_same_batches(ref, got, "batches across the actor's death")
    with lm_pipeline(seed=24, **kw) as q:
        q.restore(state)
        assert_same_batches(ref[cut:], take(q, 10), "restored after the move")


def test_a_death_is_noticed_before_the_consumer_reaches_the_dead_lanes(ray_cluster, reference):
    """The actor's lanes had made their next batches before it died (the consumer was
    away): the next next() moves them anyway (the actors' watch calls fail with the
    death), whichever lane it is for, so they replay while the consumer takes what was
    made; the batches do not change."""
    with ray_pipeline(2, prefetch=0) as p:  # next() runs the executor on this thread
        got = take(p, 3)
        got += _take_while_pending(p)  # all actors up: the kill names one
        time.sleep(0.5)  # every lane's calls in flight have made their outputs
        _kill_actor(ray_cluster, p, 0)
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and ray_cluster.wait([p._engine.executor.actors[0].watch], timeout=0.1)[0] == []
        ):
            pass  # Ray's notice of the death
        got += take(p, 1)  # without the watch: a batch the dead actor made, no move
        stats = p.stats()["ray"]
        assert stats["lane_moves"] == 1, stats
        _check_after_death(stats, 0)
        got += take(p, len(reference) - len(got))
    assert_same_batches(reference, got, "batches across the actor's death")


@pytest.mark.parametrize(
    "trial,output,when",
    [(0, "interleave", "before"), (1, "interleave", "during"), (2, "lockstep", "during")],
)
def test_actor_killed_at_a_random_moment_around_a_checkpoint(ray_cluster, trial, output, when):
    """Seeded faults: after a random number of batches a random actor is killed right
    before a checkpoint, or from a thread (after a random delay) while checkpoints are
    being taken. The batches across the death are those of workers=0, and the checkpoint
    taken around the kill restores exactly into workers=0."""
    rng = random.Random(1000 + trial)
    kw = {"seed": 40 + trial, "num_epochs": None, "output": output}
    with ray_pipeline(2, **kw) as p:
        got = take(p, rng.randrange(1, 40))
        got += _take_while_pending(p)  # all actors up: the kills name them
        victim = rng.randrange(2)
        if when == "before":
            _kill_actor(ray_cluster, p, victim)
            state = roundtrip(p.checkpoint())
        else:
            killer = threading.Timer(rng.uniform(0, 0.01), _kill_actor, (ray_cluster, p, victim))
            killer.start()
            while True:  # the last checkpoint began before the kill was done, or during it
                done = not killer.is_alive()
                state = roundtrip(p.checkpoint())
                if done:
                    break
            killer.join()
        cut = len(got)
        got += _take_until_moved(p)
        got += take(p, 8)
        stats = p.stats()["ray"]
    _check_after_death(stats, victim)
    with lm_pipeline(**kw) as p:
        ref = take(p, len(got))
    assert_same_batches(ref, got, f"trial {trial}: across the kill")
    with lm_pipeline(**kw) as q:
        q.restore(state)
        assert_same_batches(
            ref[cut : cut + 8], take(q, 8), f"trial {trial}: restored from around the kill"
        )


@pytest.mark.parametrize("victim", ["original", "copy"])
def test_kill_during_forced_speculation_keeps_batches(ray_cluster, victim):
    """Every wait for a lane starts a speculative run of it on another actor; at the third,
    the actor of the lane's original run, or of its copy, is killed as soon as the copy
    is started (mid-race). Batches unchanged, every piece counted once."""
    kw = {"seed": 27, "num_epochs": None}
    spec = zp.RayWorkers(3, resources={"CPU": 0.5})
    with lm_pipeline(workers=spec, **kw) as p:
        got = take(p, 2)
        got += _take_while_pending(p)
        executor = p._engine.executor
        speculate, started = executor._speculate, []

        def speculate_then_kill(lane, st):
            speculate(lane, st)
            if st.copy is None:
                return  # no other live actor to run it
            started.append(lane)
            if len(started) == 3:
                target = st.actor if victim == "original" else st.copy.actor
                ray_cluster.kill(target.handle, no_restart=True)

        executor._speculate = speculate_then_kill
        executor.force_speculation = True
        deadline = time.monotonic() + 60
        while all(a["alive"] for a in p.stats()["ray"]["actors"]) and time.monotonic() < deadline:
            got += take(p, 1)  # until the kill is noticed (the killed actor may have no
            # lane left by then: copies that win take their lanes along)
        got += take(p, 8)
        stats = p.stats()["ray"]
        state = roundtrip(p.checkpoint())
        cut = len(got)
        got += take(p, 4)
    assert stats["speculations"] >= 3 and len(started) >= 3, stats
    assert sum(not a["alive"] for a in stats["actors"]) == 1 and stats["lane_moves"] <= 1, stats
    with lm_pipeline(**kw) as p:
        ref = take(p, cut)
        assert _tracking(state) == _tracking(p.checkpoint())  # every piece counted once
        ref += take(p, 4)
    assert_same_batches(ref, got, f"forced speculation, {victim} killed")


def _monotone(workers=0, chain=True, **kw):
    """fetch -> tokenize -> split -> map (a lambda) -> batch: every operator keeps cursor order (watermark
    eviction, no flush sentinels)."""
    src = zp.StaticMixtureWorkSource(
        datasets={"a": zp.ArraySource([f"doc {i} " * (i % 9 + 1) for i in range(80)])},
        weights={"a": 1.0},
        seed=5,
        chunk_size=5,
        num_epochs=None,
    )
    pipe = zp.Pipeline(src, canonical_replicas=3, workers=workers, **kw)
    if not chain:
        return pipe
    pad = lambda d: {"tokens": np.pad(d["tokens"], (0, 16 - d["tokens"].size))}  # noqa: E731
    return pipe.fetch().tokenize(zp.ByteTokenizer()).split(16).map(pad).batch(4)


def test_monotone_pipeline_moves_and_resumes(ray_cluster):
    with _monotone(zp.RayWorkers(2)) as p:
        got = take(p, 4)
        got += _take_while_pending(p)  # all actors up: the kills name them
        _kill_actor(ray_cluster, p, 1)
        got += _take_until_moved(p)
        state = roundtrip(p.checkpoint())
        cut = len(got)
        got += take(p, 10)
    with _monotone() as p:
        ref = take(p, len(got))
    assert_same_batches(ref, got, "monotone, across the actor's death")
    with _monotone(zp.RayWorkers(1)) as q:
        q.restore(state)
        assert_same_batches(ref[cut:], take(q, 10), "restored into one actor")


def _monotone_then(workers, step, **kw):
    """The monotone pipeline with ``step`` mapped over its padded samples before the
    batch; ``kw`` goes to ``zp.Pipeline``."""
    pad = lambda d: {"tokens": np.pad(d["tokens"], (0, 16 - d["tokens"].size))}  # noqa: E731
    pipe = _monotone(workers, chain=False, **kw)
    return pipe.fetch().tokenize(zp.ByteTokenizer()).split(16).map(pad).map(step).batch(4)


def _straggling(workers, slow_pid: Path, wait_s: float = 0.01, **kw):
    """The monotone pipeline with a map that waits ``wait_s`` a sample in the process
    whose id ``slow_pid`` holds (one actor: a straggler), nowhere else."""

    def slow(d):
        if slow_pid.read_text() == str(os.getpid()):
            time.sleep(wait_s)
        return d

    return _monotone_then(workers, slow, **kw)


def _held(workers, hold: Path, **kw):
    """The monotone pipeline with a map that, in the process whose id ``hold`` holds,
    waits for as long as that file exists."""

    def held_here() -> bool:
        try:
            return hold.read_text() == str(os.getpid())
        except FileNotFoundError:  # let go between a look and the read
            return False

    def wait_while_held(d):
        while held_here():
            time.sleep(0.01)
        return d

    return _monotone_then(workers, wait_while_held, **kw)


def test_a_death_moves_lanes_while_the_consumer_waits_on_another_actor(ray_cluster, tmp_path):
    """Actor 1 is held (its lane makes nothing) and the consumer waits on it; actor 0 is
    killed then, and actor 1 let go only once Ray has reported the death: the wait saw
    actor 0's watch call fail and moved its lanes (they replayed during the wait), so the
    lanes have moved when that next() returns actor 1's batch. Batches unchanged."""
    hold = tmp_path / "hold"
    spec = zp.RayWorkers(2, speculate=False)
    waiting, entered, done = threading.Event(), [0.0], threading.Event()

    def kill_while_the_consumer_waits():
        while not done.is_set():
            if waiting.is_set() and time.monotonic() - entered[0] > 0.3:
                watch = p._engine.executor.actors[0].watch
                _kill_actor(ray_cluster, p, 0)
                ray_cluster.wait([watch], timeout=30)  # Ray's notice of the death
                time.sleep(0.2)
                hold.unlink()
                done.set()
            time.sleep(0.01)

    with _held(spec, hold, prefetch=0) as p:
        got = take(p, 2)
        got += _take_while_pending(p)
        held = p.stats()["ray"]["actors"][1]
        (tmp_path / "hold.new").write_text(str(held["pid"]))
        os.replace(tmp_path / "hold.new", hold)  # whole, never read half written
        killer = threading.Thread(target=kill_while_the_consumer_waits, daemon=True)
        killer.start()
        while not done.is_set() and len(got) < 5000:
            entered[0] = time.monotonic()
            (last,) = p._engine.last_lanes
            if (last + 1) % 3 in held["lanes"]:  # a lane of actor 1's turn (round robin)
                waiting.set()
            got += take(p, 1)
            waiting.clear()
        (lane,) = p._engine.last_lanes
        stats = p.stats()["ray"]
        done.set()
        killer.join()
        assert lane in held["lanes"] and stats["lane_moves"] == 1, (lane, held, stats)
        _check_after_death(stats, 0, lanes=3)
        got += take(p, 30)
    with _held(0, hold) as p:
        ref = take(p, len(got))
    assert_same_batches(ref, got, "a death while the consumer waits on another actor")


def test_straggler_runs_again_on_another_actor_and_batches_do_not_change(ray_cluster, tmp_path):
    slow_pid = tmp_path / "slow_pid"
    slow_pid.write_text("none")
    forced = zp.RayWorkers(2, straggler_factor=1.0, straggler_min_s=0.0)  # speculate at once
    with _straggling(forced, slow_pid) as p:
        got = take(p, 2)
        got += _take_while_pending(p)
        slow_pid.write_text(str(p.stats()["ray"]["actors"][0]["pid"]))
        while p.stats()["ray"]["speculation_wins"] == 0 and len(got) < 1000:
            got += take(p, 1)  # what actor 0 made before it slowed comes first
        got += take(p, 10)
        stats = p.stats()["ray"]
        state = roundtrip(p.checkpoint())
        cut = len(got)
        got += take(p, 5)
    assert stats["speculations"] >= 1 and stats["speculation_wins"] >= 1, stats
    assert stats["lane_moves"] == 0 and all(a["alive"] for a in stats["actors"])
    with _straggling(0, slow_pid) as p:
        ref = take(p, cut)
        assert _tracking(state) == _tracking(p.checkpoint())  # every piece counted once
        ref += take(p, 5)
    assert_same_batches(ref, got, "with a straggling actor, speculated")


def _spread_over(pipe, n: int) -> bool:
    """Whether ``pipe`` has ``n`` live actors, none pending, with 4 lanes spread evenly
    (the pipeline's thread moves them one by one: this looks until it is done)."""
    stats = pipe.stats()["ray"]
    counts = [len(a["lanes"]) for a in stats["actors"] if a["alive"]]
    return not stats["pending_actors"] and counts == [4 // n] * n


def test_resize_workers_moves_lanes_and_keeps_batches(ray_cluster):
    kw = {"seed": 25, "num_epochs": None}
    with ray_pipeline(1, **kw) as p:
        got = take(p, 3)
        p.resize_workers(2)
        got += take(p, 4)
        # an added actor slow to start joins once up, taking lanes then
        while not _spread_over(p, 2) and len(got) < 2000:
            got += take(p, 1)
            time.sleep(0.002)
        stats = p.stats()["ray"]
        assert [(a["alive"], len(a["lanes"])) for a in stats["actors"]] == [(True, 2), (True, 2)]
        p.resize_workers(1)
        got += take(p, 4)
        stats = p.stats()["ray"]
        assert [a["alive"] for a in stats["actors"]] == [True, False]
        assert sorted(stats["actors"][0]["lanes"]) == [0, 1, 2, 3] and stats["resizes"] == 2
        state = roundtrip(p.checkpoint())
        cut = len(got)
        got += take(p, 5)
    with lm_pipeline(**kw) as p:
        ref = take(p, cut)
        assert _tracking(state) == _tracking(p.checkpoint())
        ref += take(p, 5)
    assert_same_batches(ref, got, "across two resizes")
    with ray_pipeline(2, **kw) as p:  # before the first batch: it starts with that many
        p.resize_workers(1)
        assert_same_batches(ref[:3], take(p, 3), "started resized")
        assert len(p.stats()["ray"]["actors"]) == 1
        with pytest.raises(ValueError, match=r"must be an int >= 1; got 0"):
            p.resize_workers(0)
    with lm_pipeline(**kw) as p, pytest.raises(ValueError, match=r"needs workers=zp.RayWorkers"):
        p.resize_workers(2)


def _one_pass_of_short_docs() -> zp.StaticMixtureWorkSource:
    """One epoch of 55 documents of 20 to 398 bytes, in chunks of 4."""
    return zp.StaticMixtureWorkSource(
        datasets={"docs": zp.ArraySource(["x" * n for n in range(20, 400, 7)])},
        weights={"docs": 1.0},
        seed=1,
        chunk_size=4,
        num_epochs=1,
    )


def test_user_error_names_type_actor_and_lane(ray_cluster):
    def explode(d):
        if d["tokens"].size > 150:
            raise KeyError("a long document")
        return d

    src = _one_pass_of_short_docs()
    pipe = zp.Pipeline(src, canonical_replicas=2, workers=zp.RayWorkers(2))
    pipe = pipe.fetch().tokenize(zp.ByteTokenizer()).map(explode).batch(2)
    with pipe, pytest.raises(KeyError) as info:
        take(pipe)
    assert isinstance(info.value, WorkerError)
    assert "a long document" in str(info.value)
    assert "Ray actor" in str(info.value) and "lane " in str(info.value)


def test_a_lane_that_kills_every_actor_is_an_error_naming_it(ray_cluster):
    """A sample whose map kills the process (os._exit) kills every actor its lane moves
    to: after max_lane_restarts moves the next death ends the run with an error naming
    the lane, its deaths and Ray's cause, instead of moving the lane forever."""

    def crash(d):
        if d["tokens"].size == 210:  # the document of 209 bytes (and its end token)
            os._exit(3)
        return {"tokens": np.resize(d["tokens"], 8)}

    src = _one_pass_of_short_docs()
    spec = zp.RayWorkers(2, max_lane_restarts=1)
    pipe = zp.Pipeline(src, canonical_replicas=2, workers=spec)
    pipe = pipe.fetch().tokenize(zp.ByteTokenizer()).map(crash).batch(2)
    ended: list[BaseException] = []

    def run():
        try:
            take(pipe)
        except BaseException as e:  # noqa: BLE001 - checked below
            ended.append(e)

    with pipe:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(300)  # a pipeline that moves the lane forever never ends
        assert not t.is_alive(), f"still running: {pipe.stats()['ray']}"
        moves = pipe.stats()["ray"]["lane_moves"]
    assert len(ended) == 1 and isinstance(ended[0], WorkerError), ended
    msg = str(ended[0])
    assert re.search(r"died running lane [01]: 2 deaths in a row of the actors running it", msg)
    assert "RayWorkers(max_lane_restarts=1)" in msg, msg
    assert "The actor is dead because" in msg and "\n" not in msg, msg
    assert moves == 1  # the first death moved the lane; the second did not


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_max_lane_restarts_is_checked(bad):
    with pytest.raises(ValueError, match=r"max_lane_restarts=\.\.\.\) must be an int >= 0 or None"):
        zp.RayWorkers(2, max_lane_restarts=bad)
    assert zp.RayWorkers(2).max_lane_restarts == 3
    assert zp.RayWorkers(2, max_lane_restarts=None).max_lane_restarts is None


def _missing_on_the_cluster():
    raise ModuleNotFoundError("No module named 'only_on_the_laptop'")


class _OnlyHere:
    """Pickles here; unpickling it (on an actor) fails as a missing package would."""

    def __reduce__(self):
        return _missing_on_the_cluster, ()


def test_actor_that_cannot_start_is_an_error_naming_the_cause(ray_cluster):
    held = _OnlyHere()
    pipe = _monotone(zp.RayWorkers(1), chain=False)
    pipe = pipe.fetch().map(lambda d: d if held else d).batch(2)
    with (
        pipe,
        pytest.raises(WorkerError, match=r"(?s)Ray actor 0 could not start.*only_on_the_laptop"),
    ):
        next(iter(pipe))


def test_unreachable_address_is_an_error_naming_it(ray_cluster):
    t0 = time.monotonic()
    pipe = lm_pipeline(seed=SEED, workers=zp.RayWorkers(1, address="127.0.0.1:1"))
    with pipe, pytest.raises(ConnectionError, match=r"address='127\.0\.0\.1:1'.*cannot be reached"):
        next(iter(pipe))
    assert time.monotonic() - t0 < zp.RayWorkers(1).connect_timeout_s + 5


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_bytes()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _tcp_sockets() -> dict[int, tuple[str, str]]:
    """inode -> (local address, remote address) of every TCP socket (v4 and v6)."""

    def addr(hexaddr: str) -> str:
        ip, port = hexaddr.split(":")
        raw = bytes.fromhex(ip)
        if len(raw) == 4:
            return ".".join(str(b) for b in raw[::-1])
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        v6 = b"".join(words)
        if v6[:12] == b"\0" * 10 + b"\xff\xff":
            return ".".join(str(b) for b in v6[12:])
        return "::1" if v6 == b"\0" * 15 + b"\1" else ("::" if v6 == b"\0" * 16 else v6.hex())

    out = {}
    for name in ("tcp", "tcp6"):
        lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        for line in lines:
            f = line.split()
            out[int(f[9])] = (addr(f[1]), addr(f[2]))
    return out


def _loopback_violations() -> tuple[dict, dict]:
    """The TCP sockets of this process's descendants (the Ray processes it started):
    ``(pid, inode) -> (local, remote)``, all of them and those off loopback."""
    sockets = _tcp_sockets()
    seen = {}
    for pid in _descendants(os.getpid()):
        for inode in _socket_inodes(pid):
            if inode in sockets:
                seen[(pid, inode)] = sockets[inode]
    loopback = {"127.0.0.1", "::1"}
    wild = {"0.0.0.0", "::"}
    bad = {
        k: v
        for k, v in seen.items()
        if v[0] not in loopback or (v[1] not in loopback and v[1] not in wild)
    }
    return seen, bad


def test_every_ray_socket_is_on_loopback(ray_cluster, reference):
    with ray_pipeline(2) as p:  # actors up and talking while we look
        take(p, 3)
        seen, bad = _loopback_violations()
    assert seen, "no Ray process or socket found"
    assert not bad, f"Ray sockets off loopback (pid, inode) -> (local, remote): {bad}"
    names = {_comm(pid) for pid, _ in seen}
    assert {"raylet", "gcs_server", "ray::LaneActor"} <= names, names


@pytest.mark.bench
def test_remote_benchmark_quick(ray_cluster, tmp_path, capsys):
    """``benchmarks.remote --quick`` runs (left out by default: ``pytest -m bench``); no
    timings are asserted (CI machines are noisy; the figures are in docs/guides/ray.md)."""
    import json

    from benchmarks import remote

    assert remote.main(["--quick", "--results", str(tmp_path)]) == 0
    assert "Lanes on Ray actors" in capsys.readouterr().out
    rows = json.loads((tmp_path / "remote.json").read_text())["rows"]
    assert [(r["question"].split(" ")[0], r["candidate"]) for r in rows] == [
        ("overhead", "local workers=2"),
        ("overhead", "ray actors=2"),
        ("overhead", "ray actors=2, zero_copy"),
        ("scaling", "ray actors=2"),
        ("scaling", "ray actors=4"),
        ("stragglers", "no straggler"),
        ("stragglers", "actor 0 slowed 10x, speculate"),
        ("stragglers", "actor 0 slowed 10x, speculate=False"),
        ("recovery", "longest next() across the death"),
        ("recovery", "  restore into workers=0 + next()"),
        ("recovery", "no watch: next() that moves"),
        ("recovery", "  restore into workers=0 + next()"),
    ]
    assert all(r["identical"] == "yes" for r in rows if "identical" in r)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
