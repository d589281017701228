"""Exact resume of the full chain across seeds, lane counts, flush cadences and chunk sizes."""

from __future__ import annotations

import itertools

import pytest

import zephon as zp
from tests.integration.corpus import lm_pipeline
from zephon.testing import assert_resumes_exactly, assert_resumes_through_breaks, take


def test_full_chain_resumes_at_every_step():
    ref = assert_resumes_exactly(lambda: lm_pipeline(seed=3))
    assert len(ref) > 20


def test_full_chain_several_breaks_in_one_run():
    assert_resumes_through_breaks(lambda: lm_pipeline(seed=4), breaks=[1, 5, 6, 17, 30])


def test_checkpoint_after_exhaustion_restores_to_an_empty_stream():
    build = lambda: lm_pipeline(seed=5)  # noqa: E731
    with build() as p:
        n = len(take(p))
        state = p.checkpoint()
    with build() as q:
        q.restore(state)
        assert take(q) == []
    assert n > 0


@pytest.mark.parametrize(
    "seed,lanes,k,chunk_size",
    list(itertools.product([0, 1, 2], [1, 3, 8], [1, 2, 5], [1, 7, 64])),
)
def test_sweep(seed, lanes, k, chunk_size):
    build = lambda: lm_pipeline(seed=seed, lanes=lanes, k=k, chunk_size=chunk_size, n_docs=40)  # noqa: E731
    with build() as p:
        ref = take(p)
    n = len(ref)
    assert n > 0
    assert_resumes_exactly(build, cuts=[0, 1, n // 3, n // 2 + 1, n], reference=ref)


@pytest.mark.parametrize("prefetch", [0, 1, 5])
def test_prefetch_depth_changes_nothing(prefetch):
    with lm_pipeline(seed=6) as a, lm_pipeline(seed=6, prefetch=prefetch) as b:
        ra, rb = take(a), take(b)
    from zephon.testing import assert_same_batches

    assert_same_batches(ra, rb)
    assert_resumes_exactly(lambda: lm_pipeline(seed=6, prefetch=prefetch), cuts=[0, 3, 11])


def test_lockstep_resumes_exactly_and_concatenates_lanes_in_order():
    build = lambda: lm_pipeline(seed=7, lanes=4, output="lockstep", num_epochs=None)  # noqa: E731
    ref = assert_resumes_exactly(build, cuts=[0, 1, 4, 9], limit=12)
    assert ref[0]["tokens"].shape == (4 * 3, 64)


def test_infinite_stream_resumes():
    assert_resumes_exactly(lambda: lm_pipeline(seed=8, num_epochs=None), cuts=[0, 13, 40], limit=60)


def test_monotone_pipeline_resumes_with_filter_and_split():
    def build():
        src = zp.StaticMixtureWorkSource(
            [zp.ArraySource(list(range(200)))], seed=1, chunk_size=6, num_epochs=1
        )
        return (
            zp.Pipeline(src, canonical_replicas=3)
            .fetch()
            .filter(lambda x: x % 3 != 0)
            .map(lambda x: {"tokens": zp.ByteTokenizer().encode(str(x) * (x % 7 + 1))})
            .split(max_len=4)
            .map(lambda d: {"tokens": __import__("numpy").resize(d["tokens"], 4)})
            .batch(5)
        )

    assert "eviction=monotone flush_every_k_chunks=0" in build().explain()
    assert_resumes_exactly(build)


def test_first_batch_is_made_on_the_callers_thread_then_the_pump_runs_ahead():
    import threading

    seen: list[str] = []

    def note(data):
        seen.append(threading.current_thread().name)
        return data

    src = zp.StaticMixtureWorkSource([zp.ArraySource(list(range(400)))], seed=0, chunk_size=8)
    with zp.Pipeline(src, canonical_replicas=2, prefetch=2).map(note).batch(4) as p:
        next(p)
        # The first chunk (8 samples, mapped as one layer) went through on this thread.
        assert seen[:8] == [threading.current_thread().name] * 8
        for _ in range(250):  # and the pump runs ahead while the caller is away (5 s at most)
            if "zephon-pump" in seen:
                break
            threading.Event().wait(0.02)
        assert "zephon-pump" in seen
