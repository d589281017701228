"""The producer's side of a slot: ``SlotWriter``, which lays a message out in place.

``ShmRing.reserve`` returns a SlotWriter for a free slot. Arrays are allocated in the
slot where ``plan_layout`` puts them (or at an offset the caller planned) and filled in
place; ``commit`` writes the frame (``zephon.shm.frame``) and publishes the slot. A
writer left without a commit gives its slot up, so a failed batch never stalls the ring.
The writer knows nothing of the ring but the function that publishes a slot and the
ring's name (for its messages).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon.errors import RingError
from zephon.shm.frame import (
    _FIRST_ARRAY_OFFSET,
    _FRAME,
    _FRAME_MAGIC,
    _FRAME_VERSION,
    ARRAY_ALIGN,
    _ArraySpec,
    _checked_dtype,
    _checked_shape,
    _place,
    _plan_trailer,
)


class SlotWriter:
    """A reserved slot: allocate arrays in it, fill them in place, then ``commit(meta)``.

    Example::

        with ring.reserve(timeout_s=5) as slot:
            tokens = slot.array((batch, seq_len), np.int32)
            np.stack(rows, out=tokens)
            slot.commit(msgpack.packb(meta))

    Leaving the ``with`` block without committing aborts the slot (the consumer
    skips it); leaving it normally without committing also raises RingError.

    ``commit_slot(index, nbytes)`` publishes the slot (the ring's; ``nbytes`` 0 gives it
    up); ``ring_name`` names the ring in error messages.
    """

    __slots__ = (
        "_commit_slot",
        "_ring_name",
        "index",
        "capacity",
        "_memory",
        "_arrays",
        "_cursor",
        "_done",
    )

    def __init__(
        self, commit_slot: Callable[[int, int], None], ring_name: str, index: int, memory: Any
    ) -> None:
        self._commit_slot = commit_slot
        self._ring_name = ring_name
        self.index = index
        self.capacity = len(memory)
        self._memory = memory
        self._arrays: list[_ArraySpec] = []
        self._cursor = _FIRST_ARRAY_OFFSET
        self._done = False

    @property
    def done(self) -> bool:
        """Whether the slot was committed or aborted."""
        return self._done

    @property
    def buffer(self) -> memoryview:
        """The whole slot as a writable byte memoryview (the first FRAME_NBYTES bytes
        and the trailer are overwritten by ``commit``)."""
        self._check_open()
        return self._memory[:]

    def array(
        self, shape: int | Sequence[int], dtype: Any, *, offset: int | None = None
    ) -> np.ndarray:
        """Allocates an array in the slot and returns a writable view to fill in place.

        Args:
            shape: the array shape.
            dtype: a plain numpy dtype (no objects, no fields).
            offset: slot offset (a multiple of 64, e.g. from ``plan_layout``); by default
                the next free offset, placed as ``plan_layout`` does.

        Raises:
            ValueError: the array does not fit in the slot, or overlaps another one.
        """
        self._check_open()
        dt = _checked_dtype(dtype)
        dims = _checked_shape(shape)
        nbytes = math.prod(dims) * dt.itemsize
        if offset is None:
            offset = _place(self._cursor, nbytes)
        else:
            offset = int(offset)
            if offset < _FIRST_ARRAY_OFFSET or offset % ARRAY_ALIGN:
                raise ValueError(
                    f"array offset must be a multiple of {ARRAY_ALIGN} and >= "
                    f"{_FIRST_ARRAY_OFFSET} (the frame header comes first); got {offset}"
                )
            for d, s, o, n in self._arrays:
                if offset < o + n and o < offset + nbytes:
                    raise ValueError(
                        f"array of {nbytes} bytes at slot offset {offset} overlaps the "
                        f"{d}{list(s)} array at [{o}, {o + n})"
                    )
        end = offset + nbytes
        if end > self.capacity:
            raise ValueError(
                f"array {dt.str}{list(dims)} of {nbytes} bytes at slot offset {offset} needs "
                f"{end} bytes but ring {self._ring_name!r} slots hold {self.capacity} bytes; "
                f"raise slot_bytes when creating the ring"
            )
        self._arrays.append((dt, dims, offset, nbytes))
        self._cursor = max(self._cursor, end)
        return np.ndarray(dims, dt, buffer=self._memory, offset=offset)

    def commit(self, meta: bytes | bytearray | memoryview = b"") -> int:
        """Writes the framing and the metadata and publishes the slot.

        Returns:
            The bytes the message occupies in the slot.

        Raises:
            ValueError: the metadata does not fit (the slot stays reserved: ``abort()``).
        """
        self._check_open()
        meta_view = meta if type(meta) is bytes else memoryview(meta).cast("B")
        meta_nbytes = len(meta_view)
        trailer = _plan_trailer(self._arrays, meta_nbytes)
        if trailer.end > self.capacity:
            arrays_nbytes = sum(n for *_, n in self._arrays)
            raise ValueError(
                f"message needs {trailer.end} bytes (metadata {meta_nbytes} B, "
                f"{len(self._arrays)} arrays {arrays_nbytes} B, framing) but ring "
                f"{self._ring_name!r} slots hold {self.capacity} bytes; raise slot_bytes "
                f"to at least {trailer.end} when creating the ring"
            )
        slot = self._memory
        start = trailer.offset
        mid = start + len(trailer.descriptors)
        slot[start:mid] = trailer.descriptors
        slot[mid : mid + meta_nbytes] = meta_view
        _FRAME.pack_into(
            slot,
            0,
            _FRAME_MAGIC,
            _FRAME_VERSION,
            0,
            len(self._arrays),
            len(trailer.descriptors),
            trailer.offset,
            meta_nbytes,
        )
        self._commit_slot(self.index, trailer.end)
        self._done = True
        return trailer.end

    def abort(self) -> None:
        """Gives the slot up: it is published empty and the consumer skips it."""
        if self._done:
            return
        self._done = True
        self._commit_slot(self.index, 0)

    def __del__(self) -> None:
        # A slot dropped without commit would stall the ring for good: give it up.
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - best effort at garbage collection
            pass

    def _check_open(self) -> None:
        if self._done:
            raise RingError(f"slot {self.index} was already committed or aborted")

    def __enter__(self) -> SlotWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._done:
            return
        self.abort()
        if exc_type is None:
            raise RingError(
                f"slot {self.index} of ring {self._ring_name!r} was reserved but never "
                f"committed; call slot.commit(meta) inside the with block (it was aborted)"
            )

    def __repr__(self) -> str:
        return (
            f"SlotWriter(index={self.index}, capacity={self.capacity}, arrays={len(self._arrays)})"
        )


__all__ = ["SlotWriter"]
