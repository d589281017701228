"""``map``: a user function, one record's data in, new data out."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from zephon._fingerprint import describe_callable
from zephon.operators.base import Operator, OpTraits, Output, PipelineContext, record_text
from zephon.records import Record


class Map(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "map"

    def __init__(self, fn: Callable[[Any], Any], parallelism: int = 1) -> None:
        if not callable(fn):
            raise TypeError(f"map needs a callable; got {type(fn).__name__} {fn!r}")
        self.fn = fn
        self.parallelism = parallelism
        #: The components' names, for the error that names a record's sample (see bind).
        self.names: tuple[str, ...] = ()

    def bind(self, ctx: PipelineContext) -> None:
        self.names = tuple(ctx.names)

    def process(self, record: Record) -> Iterable[Output]:
        return self.process_batch([record])

    def process_batch(self, records: list[Record]) -> list[Output]:
        fn = self.fn
        out: list[Output] = []
        for r in records:
            data = fn(r.data)
            if data is None:
                raise returned_none("map", fn, r, self.names)
            out.append(r.replace(data))
        return out

    def fresh(self) -> Operator:
        # Stateless: user functions are shared, never deep-copied; a shallow copy so that
        # bind() gives each pipeline its own component names.
        return copy.copy(self)

    def fingerprint(self) -> str:
        return f"Map({describe_callable(self.fn)})"

    def fingerprint_parts(self) -> dict[str, str]:
        return {"fn": describe_callable(self.fn)}

    def __repr__(self) -> str:
        return (
            f"Map(fn={getattr(self.fn, '__qualname__', self.fn)!s}, parallelism={self.parallelism})"
        )


def returned_none(op: str, fn: Any, record: Record, names: Sequence[str] = ()) -> TypeError:
    """The error for a ``map`` (or ``random_map``) function that returned None for
    ``record``: nothing after it could use it (``batch`` would stack None into an object
    array), and the usual cause is a missing ``return``."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return TypeError(
        f"{op}: {name} returned None for {record_text(record, names)}; a {op} function must "
        f"return the record's new data (a missing `return`? e.g. `return data`). To drop "
        "records, use .filter(pred) instead"
    )
