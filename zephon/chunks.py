"""Sample pointers and work chunks: the unit of fetching, in-flight tracking and replay."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

#: An in-flight chunk's state (:meth:`WorkChunk.to_state`): its lane and id,
#: its components and indices as little-endian int32 and int64 bytes, and its seed.
CHUNK_LANE = "lane"
CHUNK_ID = "chunk_id"
CHUNK_COMPONENTS = "components"
CHUNK_INDICES = "indices"
CHUNK_SEED = "seed"
CHUNK_KEYS = (CHUNK_LANE, CHUNK_ID, CHUNK_COMPONENTS, CHUNK_INDICES, CHUNK_SEED)


class SamplePointer(NamedTuple):
    """One raw sample of the mixture: dataset ``component``, row ``index``."""

    component: int
    index: int  # type: ignore[assignment]  # shadows tuple.index, as the spec names it


@dataclass(frozen=True, eq=False, slots=True)
class WorkChunk:
    """A small batch of sample pointers for one lane.

    ``components[i]``/``indices[i]`` is the i-th pointer (offset ``i``). ``component_order``
    is the order in which the mixture interleaved components in this chunk (the same as
    ``components``; kept under the spec's name). ``seed`` is a per-chunk seed derived from
    the work source's seed, the lane and the chunk id, for operators that want randomness
    tied to the data rather than to the process.
    """

    lane: int
    chunk_id: int
    components: np.ndarray  # int32 [n]
    indices: np.ndarray  # int64 [n]
    seed: int

    def __post_init__(self) -> None:
        if self.components.shape != self.indices.shape or self.components.ndim != 1:
            raise ValueError(
                f"WorkChunk components and indices must be 1-D and equally long; got "
                f"{self.components.shape} and {self.indices.shape}"
            )

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    @property
    def pointers(self) -> tuple[SamplePointer, ...]:
        return tuple(
            SamplePointer(int(c), int(i))
            for c, i in zip(self.components, self.indices, strict=True)
        )

    @property
    def component_order(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.components)

    @classmethod
    def from_pointers(
        cls,
        lane: int,
        chunk_id: int,
        pointers: list[SamplePointer] | tuple[SamplePointer, ...],
        seed: int,
    ) -> WorkChunk:
        comps = np.fromiter((p[0] for p in pointers), dtype=np.int32, count=len(pointers))
        idx = np.fromiter((p[1] for p in pointers), dtype=np.int64, count=len(pointers))
        return cls(lane, chunk_id, comps, idx, seed)

    @classmethod
    def of_bytes(
        cls, lane: int, chunk_id: int, components: bytes, indices: bytes, seed: int
    ) -> WorkChunk:
        """A chunk whose arrays are read-only views of ``components`` (little-endian
        int32s) and ``indices`` (int64s), the very bytes :meth:`to_state` then stores: a
        checkpoint of a rank of thousands of lanes reads no chunk's arrays."""
        comps = np.frombuffer(components, dtype="<i4")
        idx = np.frombuffer(indices, dtype="<i8")
        if sys.byteorder != "little":
            comps, idx = comps.astype(np.int32), idx.astype(np.int64)
        return cls(lane, chunk_id, comps, idx, seed)

    def to_state(self) -> dict[str, Any]:
        """Msgpack-able form, stored in full in checkpoints."""
        return {
            CHUNK_LANE: self.lane,
            CHUNK_ID: self.chunk_id,
            CHUNK_COMPONENTS: _as_bytes(self.components, _I4),
            CHUNK_INDICES: _as_bytes(self.indices, _I8),
            CHUNK_SEED: self.seed,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> WorkChunk:
        """The chunk :meth:`to_state` gave; its arrays are read-only views of the state's
        bytes where the machine is little-endian (a restore decodes every in-flight chunk)."""
        return cls.of_bytes(
            int(state[CHUNK_LANE]),
            int(state[CHUNK_ID]),
            state[CHUNK_COMPONENTS],
            state[CHUNK_INDICES],
            int(state[CHUNK_SEED]),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkChunk):
            return NotImplemented
        return (
            self.lane == other.lane
            and self.chunk_id == other.chunk_id
            and self.seed == other.seed
            and np.array_equal(self.components, other.components)
            and np.array_equal(self.indices, other.indices)
        )

    def __repr__(self) -> str:
        return f"WorkChunk(lane={self.lane}, chunk_id={self.chunk_id}, len={len(self)}, seed={self.seed})"


_I4, _I8 = np.dtype("<i4"), np.dtype("<i8")


def _as_bytes(array: np.ndarray, dtype: np.dtype) -> bytes:
    """``array`` as bytes of ``dtype``: the bytes it views where it is a whole bytes object
    of that dtype (:meth:`WorkChunk.of_bytes`), without a copy."""
    base = array.base
    if type(base) is bytes and len(base) == array.nbytes and array.dtype == dtype:
        return base
    return array.astype(dtype, copy=False).tobytes()
