"""``filter``: keep records whose data satisfies a predicate; dropped ones become tombstones."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from zephon._fingerprint import describe_callable
from zephon.operators.base import Operator, OpTraits, Output
from zephon.records import Record, Tombstone


class Filter(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "filter"

    def __init__(self, pred: Callable[[Any], bool], parallelism: int = 1) -> None:
        if not callable(pred):
            raise TypeError(
                f"filter needs a callable predicate; got {type(pred).__name__} {pred!r}"
            )
        self.pred = pred
        self.parallelism = parallelism

    def process(self, record: Record) -> Iterable[Output]:
        if self.pred(record.data):
            return (record,)
        return (Tombstone(record.lane, record.contributors),)

    def process_batch(self, records: list[Record]) -> list[Output]:
        pred = self.pred
        return [r if pred(r.data) else Tombstone(r.lane, r.contributors) for r in records]

    def fresh(self) -> Operator:
        return self

    def fingerprint(self) -> str:
        return f"Filter({describe_callable(self.pred)})"

    def fingerprint_parts(self) -> dict[str, str]:
        return {"pred": describe_callable(self.pred)}

    def __repr__(self) -> str:
        return f"Filter(pred={getattr(self.pred, '__qualname__', self.pred)!s})"
