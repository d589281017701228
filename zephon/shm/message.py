"""The consumer's side of a slot: a received ``Message`` and the lease on its slot.

``ShmRing.get`` hands out a ``Message`` whose arrays (with ``zero_copy=True``) are views
of the slot. The slot goes back to the producer on ``Message.release()``, or once the
Message and every view of it are garbage collected: the views' buffer
(``_pinned_memory``) carries the slot's lease, so a dropped Message whose arrays live on
keeps its slot until they go. The lease knows nothing of the ring: it holds the ring's
function that hands a slot back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np


def _pinned_memory(view: memoryview, offset: int, nbytes: int) -> Any:
    """A buffer over part of the mapping that numpy arrays can keep alive.

    ``np.ndarray(buffer=...)`` keeps a reference to its buffer object but not the
    export; a ctypes array made with ``from_buffer`` holds the export, so the mmap
    cannot be unmapped under a live view (``mmap.close`` raises BufferError and
    the mapping goes when the last view does). It also takes attributes, which
    the consumer uses to hang the slot lease on every view of a message."""
    return (ctypes.c_uint8 * nbytes).from_buffer(view, offset)


class _Lease:
    """Holds a consumer slot; hands it back on ``release()`` or when garbage collected
    (that is, when the Message and every array view of it are gone).

    ``release_slot`` is what hands the slot back (the ring's, called once with ``slot``);
    None for a slot already handed back (a message copied out)."""

    __slots__ = ("_release_slot", "slot")

    def __init__(self, release_slot: Callable[[int], None] | None, slot: int) -> None:
        self._release_slot = release_slot
        self.slot = slot

    @property
    def held(self) -> bool:
        return self._release_slot is not None

    def release(self) -> None:
        release_slot, self._release_slot = self._release_slot, None
        if release_slot is not None:
            release_slot(self.slot)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - best effort at garbage collection
            pass


class Message:
    """A message received from the ring.

    Attributes:
        meta: the metadata bytes (a copy: safe to keep).
        arrays: numpy arrays; with ``zero_copy=True`` views into the slot, valid until
            ``release()`` (dropping the Message and every view also releases it).
        nbytes: bytes the message occupied in its slot.
    """

    __slots__ = ("meta", "arrays", "nbytes", "_lease")

    def __init__(self, meta: bytes, arrays: list[np.ndarray], nbytes: int, lease: _Lease) -> None:
        self.meta = meta
        self.arrays = arrays
        self.nbytes = nbytes
        self._lease = lease

    @property
    def released(self) -> bool:
        return not self._lease.held

    def release(self) -> None:
        """Hands the slot back to the producer; zero-copy arrays must not be used after."""
        self._lease.release()

    def __enter__(self) -> Message:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        arrays = ", ".join(f"{a.dtype}{list(a.shape)}" for a in self.arrays)
        return (
            f"Message(meta={len(self.meta)} B, arrays=[{arrays}], nbytes={self.nbytes}, "
            f"released={self.released})"
        )


__all__ = ["Message"]
