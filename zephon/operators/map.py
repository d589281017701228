"""``map``: a user function, one record's data in, new data out."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from zephon._fingerprint import describe_callable
from zephon.operators.base import Operator, OpTraits, Output
from zephon.records import Record


class Map(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "map"

    def __init__(self, fn: Callable[[Any], Any], parallelism: int = 1) -> None:
        if not callable(fn):
            raise TypeError(f"map needs a callable; got {type(fn).__name__} {fn!r}")
        self.fn = fn
        self.parallelism = parallelism

    def process(self, record: Record) -> Iterable[Output]:
        return (record.replace(self.fn(record.data)),)

    def process_batch(self, records: list[Record]) -> list[Output]:
        fn = self.fn
        return [r.replace(fn(r.data)) for r in records]

    def fresh(self) -> Operator:
        return self  # stateless: user functions are shared, never deep-copied

    def fingerprint(self) -> str:
        return f"Map({describe_callable(self.fn)})"

    def fingerprint_parts(self) -> dict[str, str]:
        return {"fn": describe_callable(self.fn)}

    def __repr__(self) -> str:
        return (
            f"Map(fn={getattr(self.fn, '__qualname__', self.fn)!s}, parallelism={self.parallelism})"
        )
