"""filter: predicates see data, dropped records become tombstones, streams still end."""

from __future__ import annotations

import numpy as np
import pytest

import zephon as zp
from zephon.operators.filter import Filter
from zephon.records import Contributor, Record, Tombstone
from zephon.testing import assert_resumes_exactly, take

A = list(range(32))  # component 0 (16 per lane: batches of 2 drop nothing)
B = list(range(1000, 1030))  # component 1


def test_filter_receives_data_and_keeps_matching_records_in_order(h) -> None:
    seen: list[object] = []

    def even(x: int) -> bool:
        seen.append(x)
        return x % 2 == 0

    out = take(h.make_pipeline([A], lanes=1, shuffle=False).fetch().filter(even))
    assert out == [x for x in A if x % 2 == 0]
    assert seen == A
    assert not any(isinstance(x, Record) for x in seen)


def test_filter_receives_a_dict_after_tokenize(h) -> None:
    seen: list[object] = []
    pipe = (
        h.make_pipeline([list(h.DOCS)], lanes=1, shuffle=False).fetch().tokenize(zp.ByteTokenizer())
    )
    out = take(
        pipe.filter(lambda d: seen.append(d) or len(d["tokens"]) > 10).map(
            lambda d: len(d["tokens"])
        )
    )
    lengths = [len(d.encode()) + 1 for d in h.DOCS]
    assert out == [n for n in lengths if n > 10]
    assert all(isinstance(d, dict) and d["tokens"].dtype == np.int32 for d in seen)


def test_filter_with_closure(h) -> None:
    def at_least(k: int):
        return lambda x: x >= k

    out = take(h.make_pipeline([A], lanes=1, shuffle=False).fetch().filter(at_least(25)))
    assert out == [25, 26, 27, 28, 29, 30, 31]


def test_dropped_records_become_tombstones_with_their_contributors() -> None:
    f = Filter(lambda x: x > 0)
    keep = Record(5, 1, [Contributor(3, 0, 0, True)], {0: 1})
    drop = Record(-5, 1, [Contributor(3, 1, 2, False), Contributor(4, 0, 0, True)], {0: 1})
    out = f.process_batch([keep, drop])
    assert out[0] is keep
    assert type(out[1]) is Tombstone and out[1].lane == 1
    assert out[1].contributors == drop.contributors
    assert list(f.process(drop))[0].contributors == drop.contributors


def test_filter_dropping_a_whole_component_terminates_and_resumes(h) -> None:
    def build() -> zp.Pipeline:
        return h.make_pipeline([A, B]).fetch().filter(lambda x: x < 1000).batch(2)

    ref = assert_resumes_exactly(build)
    assert sorted(x for b in ref for x in b.tolist()) == A  # nothing of B
    assert len(ref) == 16


def test_filter_dropping_a_component_before_ensure_mixture_terminates_and_resumes(h) -> None:
    # ensure_mixture waits for a record of every positive-weight component; with one of them
    # filtered away it must still drain (buffer_size, then the flush) and end.
    def build() -> zp.Pipeline:
        return (
            h.make_pipeline([A, B], k=2)
            .fetch()
            .filter(lambda x: x < 1000)
            .ensure_mixture(buffer_size=3)
            .batch(2)
        )

    ref = assert_resumes_exactly(build)
    assert sorted(x for b in ref for x in b.tolist()) == A


def test_filter_dropping_everything_ends_with_no_batches_and_resumes(h) -> None:
    def build() -> zp.Pipeline:
        return h.make_pipeline([A, B]).fetch().filter(lambda x: False).batch(2)

    assert assert_resumes_exactly(build) == []
    with build() as pipe:
        assert take(pipe) == []
        state = pipe.checkpoint()
        # Every tombstoned offset closed, so every chunk was evicted.
        assert all(lane["inflight"] == [] for lane in state["lanes"])
        assert all(lane["done"] for lane in state["lanes"])


def test_filter_validation() -> None:
    with pytest.raises(TypeError, match=r"filter needs a callable predicate; got str 'x > 0'"):
        Filter("x > 0")
