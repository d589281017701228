"""Shared pieces for the operator tests: small sources, pipelines, a recording operator.

Test modules here have no package, so helpers are handed out as fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.operators.base import Operator, OpTraits
from zephon.records import Record

# 40 distinct documents of 3 to 28 UTF-8 bytes, some with multi-byte characters.
DOCS: tuple[str, ...] = tuple(
    (f"{i:02d}" + "abcdéfghij€klmnopq"[: (i * 7) % 19] + "xyz"[: i % 4])[: 1 + (i * 13) % 31]
    + f"#{i}"
    for i in range(40)
)


class Recorder(Operator):
    """Passes records through unchanged and keeps each one, for inspecting identities.

    ``fresh`` returns ``self`` so the pipeline's copy records into this very list.
    """

    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[Record] = []

    def process(self, record: Record) -> Iterable[Record]:
        self.seen.append(record)
        return (record,)

    def fresh(self) -> Operator:
        return self


def make_source(
    datasets: Sequence[Any],
    *,
    weights: Sequence[float] | None = None,
    seed: int = 7,
    chunk_size: int = 5,
    num_epochs: int | None = 1,
    shuffle: bool = True,
    source_cls: type[zp.StaticMixtureWorkSource] = zp.StaticMixtureWorkSource,
) -> zp.StaticMixtureWorkSource:
    return source_cls(
        [
            zp.ArraySource(ds) if isinstance(ds, list | tuple | np.ndarray) else ds
            for ds in datasets
        ],
        weights,
        seed=seed,
        shuffle=shuffle,
        chunk_size=chunk_size,
        num_epochs=num_epochs,
    )


def make_pipeline(
    datasets: Sequence[Any],
    *,
    lanes: int = 2,
    k: int | None = None,
    prefetch: int = 3,
    **source_kwargs: Any,
) -> zp.Pipeline:
    return zp.Pipeline(
        make_source(datasets, **source_kwargs),
        canonical_replicas=lanes,
        flush_every_k_chunks=k,
        prefetch=prefetch,
    )


def pointer_map(
    source: zp.StaticMixtureWorkSource, lanes: int
) -> dict[tuple[int, int, int], tuple[int, int]]:
    """(lane, chunk_id, offset) -> (component, dataset index) for every chunk of every lane."""
    out = {}
    for lane in range(lanes):
        ws = source.for_lane(lane, lanes)
        while (chunk := ws.next_chunk()) is not None:
            for off, (c, i) in enumerate(chunk.pointers):
                out[lane, chunk.chunk_id, off] = (c, i)
    return out


def pad_to(n: int) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """A map function: the record's tokens, zero-padded (or cut) to ``n``."""

    def pad(d: dict[str, np.ndarray]) -> np.ndarray:
        out = np.zeros(n, dtype=np.int32)
        t = d["tokens"][:n]
        out[: len(t)] = t
        return out

    return pad


class Helpers:
    DOCS = DOCS
    Recorder = Recorder
    make_source = staticmethod(make_source)
    make_pipeline = staticmethod(make_pipeline)
    pointer_map = staticmethod(pointer_map)
    pad_to = staticmethod(pad_to)


@pytest.fixture
def h() -> type[Helpers]:
    """The helpers above: ``h.DOCS``, ``h.Recorder``, ``h.make_source``, ``h.make_pipeline``,
    ``h.pointer_map``, ``h.pad_to``."""
    return Helpers
