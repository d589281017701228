"""The WorkSource contract: where each lane's work chunks come from.

A WorkSource is one lane's deterministic stream of ``WorkChunk``s. The Pipeline holds one
per lane, obtained from a ``LaneShardable`` description through ``for_lane``; it checkpoints
each with ``state_dict()`` and restores with ``load_state_dict()``, after which the source
must produce exactly the chunks it would have produced next — in O(1), never by replaying
what came before.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from zephon.chunks import WorkChunk

__all__ = ["LaneShardable", "RandomAccessDataset", "WorkSource"]


@runtime_checkable
class RandomAccessDataset(Protocol):
    """What a WorkSource needs from a dataset: a length and integer indexing.

    A dataset may also offer ``content_identity() -> dict``: a small dict of plain values
    that changes when its data does, for the pipeline fingerprint (see
    :mod:`zephon.sources.identity`; without it only its type name and length are checked),
    and ``skipped_records() -> dict[str, int]``: records it left out, by kind, reported by
    ``Pipeline.stats()``.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


@runtime_checkable
class WorkSource(Protocol):
    """One lane's stream of work chunks, checkpointable in O(1)."""

    def next_chunk(self) -> WorkChunk | None:
        """The lane's next chunk (``chunk_id`` 0, 1, 2, …), or None once it is exhausted.

        Once None is returned, every later call returns None too.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """Msgpack-able state (str keys; ints, floats, bools, lists), whose size does not
        grow with how many chunks were produced."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``next_chunk()`` returns what the source that
        saved it would have returned next. Raises ValueError when the state does not belong
        to this source (other lane, lane count or shape, unknown version)."""
        ...


@runtime_checkable
class LaneShardable(Protocol):
    """A work-source description the Pipeline splits into one WorkSource per lane."""

    def for_lane(self, lane: int, num_lanes: int) -> WorkSource:
        """A fresh WorkSource (at the start of the stream) for ``lane`` of ``num_lanes``."""
        ...

    def config(self) -> dict[str, Any]:
        """Msgpack-able description of everything that determines the chunks of every lane
        (but not the lane itself); part of the pipeline fingerprint."""
        ...
