"""``shuffle``: a per-lane buffer shuffle, re-seeded at every epoch of the lane.

The generator of an epoch is seeded from (seed, lane, cursor of the epoch's first record):
that record is the same on the original run and on a replay, so the epoch's order is too,
and nothing about the generator has to be checkpointed.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from zephon._args import positive_int
from zephon.operators.base import LaneStateOperator, OpTraits, Output, PipelineContext
from zephon.records import Record
from zephon.work_sources.permutation import mix64


class _Buffer:
    __slots__ = ("items", "rng")

    def __init__(self, rng: np.random.Generator) -> None:
        self.items: list[Record] = []
        self.rng = rng


class Shuffle(LaneStateOperator):
    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    name = "shuffle"

    def __init__(self, buffer_size: int, seed: int | None = None) -> None:
        super().__init__()
        self.buffer_size = positive_int("shuffle(buffer_size=...)", buffer_size)
        self.seed = seed
        self._seed = 0 if seed is None else seed

    def bind(self, ctx: PipelineContext) -> None:
        if self.seed is None:
            self._seed = ctx.seed

    def process(self, record: Record) -> Iterable[Output]:
        buf = self._lanes.get(record.lane)
        if buf is None:
            c = record.cursor
            key = mix64(self._seed, c.lane, c.chunk_id, c.offset, c.child)
            buf = self._lanes[record.lane] = _Buffer(np.random.Generator(np.random.PCG64(key)))
        items = buf.items
        if len(items) < self.buffer_size:
            items.append(record)
            return ()
        j = int(buf.rng.integers(self.buffer_size))
        out = items[j]
        items[j] = record
        return (out,)

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        buf = self._lanes.get(lane_id)
        if buf is None:
            return ()
        order = buf.rng.permutation(len(buf.items))
        out = [buf.items[i] for i in order]
        if reset:
            del self._lanes[lane_id]
        else:
            buf.items = []
        return out

    def pending(self, lane_id: int) -> int:
        buf = self._lanes.get(lane_id)
        return 0 if buf is None else len(buf.items)

    def fingerprint(self) -> str:
        return f"Shuffle(buffer_size={self.buffer_size}, seed={self._seed})"

    def __repr__(self) -> str:
        return f"Shuffle(buffer_size={self.buffer_size}, seed={self.seed})"
