"""Custom operators: the flush contract is enforced, and a well-behaved one resumes exactly."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

import zephon as zp
from zephon.operators.base import LaneStateOperator, Operator, OpTraits
from zephon.records import Record
from zephon.testing import assert_resumes_exactly, take


class ReverseWindows(LaneStateOperator):
    """Emits each lane's records in reversed windows of ``size``; flush empties the window."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    name = "reverse_windows"

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def process(self, record: Record) -> Iterable[Record]:
        buf = self._lanes.setdefault(record.lane, [])
        buf.append(record)
        if len(buf) < self.size:
            return ()
        del self._lanes[record.lane]
        return buf[::-1]

    def flush(self, reset: bool, lane_id: int) -> Iterable[Record]:
        return self._lanes.pop(lane_id, [])[::-1]

    def pending(self, lane_id: int) -> int:
        return len(self._lanes.get(lane_id, ()))

    def __repr__(self) -> str:
        return f"ReverseWindows(size={self.size})"


class LeakyHold(ReverseWindows):
    """Forgets to emit or reset what it holds on flush."""

    name = "leaky_hold"

    def flush(self, reset: bool, lane_id: int) -> Iterable[Record]:
        return ()


def test_reverse_windows_reorders(h) -> None:
    pipe = h.make_pipeline([list(range(12))], lanes=1, shuffle=False, k=100, chunk_size=12)
    assert take(pipe.fetch().apply(ReverseWindows(5))) == [4, 3, 2, 1, 0, 9, 8, 7, 6, 5, 11, 10]


def test_flush_leaving_pending_data_is_a_contract_violation(h) -> None:
    pipe = h.make_pipeline([list(range(20))], lanes=1, k=1).fetch().apply(LeakyHold(3))
    with pytest.raises(
        zp.ContractViolation,
        match=r"operator 'leaky_hold' \(LeakyHold\) still holds 2 pending item\(s\) for lane 0 after "
        r"flush\(reset=True\)",
    ):
        take(pipe)


def test_contract_violation_is_a_runtime_error(h) -> None:
    pipe = h.make_pipeline([list(range(20))], lanes=1, k=1).fetch().apply(LeakyHold(3))
    with pytest.raises(RuntimeError):
        take(pipe)


def test_a_reordering_custom_operator_forces_epoch_eviction(h) -> None:
    pipe = h.make_pipeline([list(range(8))]).fetch().apply(ReverseWindows(3))
    text = pipe.explain()
    assert "eviction=epoch flush_every_k_chunks=4" in text
    assert "reverse_windows@p1 -> reverse_windows_replay_filter@p1" in text


def test_apply_takes_only_operators(h) -> None:
    with pytest.raises(TypeError, match=r"apply\(\) takes a zp.Operator; got function"):
        h.make_pipeline([[1]]).apply(lambda r: r)


def test_well_behaved_custom_operator_resumes_exactly(h) -> None:
    def build() -> zp.Pipeline:
        return (
            h.make_pipeline([list(h.DOCS), [d[::-1] for d in h.DOCS[:20]]], k=3)
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .map(h.pad_to(10))
            .apply(ReverseWindows(4))
            .batch(2)
        )

    ref = assert_resumes_exactly(build)
    assert len(ref) == 30
    assert all(b.shape == (2, 10) and b.dtype == np.int32 for b in ref)


def test_stateless_custom_operator_with_default_fresh(h) -> None:
    class AddOne(Operator):
        name = "add_one"

        def process(self, record: Record) -> Iterable[Record]:
            return (record.replace(record.data + 1),)

    def build() -> zp.Pipeline:
        return h.make_pipeline([list(range(30))]).fetch().apply(AddOne()).batch(3)

    ref = assert_resumes_exactly(build)
    assert sorted(x for b in ref for x in b.tolist()) == list(range(1, 31))
