"""``ShmRing``: a single-producer/single-consumer message ring in shared memory.

One ring per worker process: the worker (producer) writes finished batches —
numpy arrays plus a small msgpack'd metadata blob — straight into a slot, the
parent (consumer) reads them as numpy views of the slot and releases the slot
when done. No pickle anywhere.

The ring protocol lives in a small core with two interchangeable
implementations: the C extension ``zephon._ring`` (futex waits, GIL released)
and ``zephon.shm.pyring`` (pure Python, polling), picked once at import:
``ZEPHON_PURE_PYTHON=1`` or a missing extension selects the pure one.
``IMPLEMENTATION`` says which is active. Both return status codes, which
``_raise_for_status`` below turns into exceptions — the one place that does.

What a slot holds is the message frame (``zephon.shm.frame``); the producer writes it
through a ``SlotWriter`` (``zephon.shm.writer``), the consumer gets a ``Message`` that
holds the slot until it is released (``zephon.shm.message``). A committed length of 0
marks a slot the producer gave up (``abort``); the consumer skips it.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

import msgpack
import numpy as np

from zephon._native import load
from zephon.errors import RingError, ShmError
from zephon.shm import pyring
from zephon.shm.frame import (
    _FRAME,
    _FRAME_MAGIC,
    _FRAME_VERSION,
    _LAYOUT_CACHE_MAX,
    SLOT_ALIGN,
    _decode,
    _Layout,
    _round_up,
    message_nbytes,
)
from zephon.shm.message import Message, _Lease, _pinned_memory
from zephon.shm.segment import Segment, attach_segment, create_segment
from zephon.shm.writer import SlotWriter


def _select_core() -> tuple[ModuleType, str]:
    native = load("_ring")
    return (pyring, "python") if native is None else (native, "native")


_core, IMPLEMENTATION = _select_core()


class RingClosedError(RingError, EOFError):
    """The ring was closed: ``reserve`` fails at once, ``get`` once the ring is drained.

    A RingError (the ring cannot be used any more) and an EOFError (for the
    consumer, the normal end of the stream)."""


_PROBLEMS = {
    pyring.BAD_MAGIC: "the segment does not hold a Zephon ring (bad magic)",
    pyring.BAD_VERSION: f"the ring has another layout version (this build reads version "
    f"{pyring.LAYOUT_VERSION}); producer and consumer must run the same Zephon",
    pyring.BAD_SIZE: "the ring header does not match the segment size or the request "
    "(nslots, slot_bytes or nbytes out of range)",
    pyring.BAD_SLOT: "the slot is not held by this side in the right state "
    "(committed or released twice, or the header was overwritten)",
    pyring.BAD_ALIGN: "the ring memory is not 4096-byte aligned",
    pyring.SYSTEM: "a futex or clock system call failed",
}


def _raise_for_status(
    status: int, action: str, name: str, timeout_s: float | None = None
) -> NoReturn:
    """Maps a non-OK core status to the exception Zephon raises for it."""
    if status == pyring.TIMEOUT:
        if action == "reserve":
            raise TimeoutError(
                f"ring {name!r} is full: no slot was released within {timeout_s} s; "
                f"the consumer is not keeping up or stopped releasing messages"
            )
        raise TimeoutError(
            f"ring {name!r} is empty: no message arrived within {timeout_s} s; "
            f"the producer is slow, stuck or dead"
        )
    if status == pyring.CLOSED:
        if action == "get":
            raise RingClosedError(f"ring {name!r} is closed and drained: no more messages")
        raise RingClosedError(f"ring {name!r} is closed: cannot {action}")
    problem = _PROBLEMS.get(status, f"unknown status {status}")
    raise RingError(f"{action} on ring {name!r} failed: {problem}")


#: ``madvise`` advice (Linux 5.14+) that maps a range's pages into the process in one call,
#: for reading or writing, instead of a page fault for each page on first touch.
_POPULATE_READ, _POPULATE_WRITE = 22, 23
_PAGE = 4096
_can_populate = hasattr(mmap.mmap, "madvise")


def _timeout_ns(timeout_s: float | None) -> int:
    if timeout_s is None:
        return -1
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s must be >= 0 or None (wait forever); got {timeout_s}")
    return int(timeout_s * 1e9)


class ShmRing:
    """A single-producer/single-consumer ring of fixed-size slots in a shared memfd.

    The parent creates it (``ShmRing.create``), passes ``ring.fileno()`` to the worker
    (``zephon.shm.send_fds``), which attaches (``ShmRing.attach(fd)``). The segment has no
    name: it goes when the last process holding it exits, however it exits. Exactly one
    producer and one consumer, each used from one thread at a time (``close`` may come
    from any thread and wakes a blocked call).

    Closing: ``close()`` marks the ring closed for both sides, wakes any blocked call and
    unmaps. After it the producer's ``reserve`` raises RingClosedError at once; the
    consumer's ``get`` keeps returning the messages committed before and raises
    RingClosedError (an EOFError) when the ring is drained. Garbage collection closes the
    ring too, except in a forked copy of the process that made the object.
    """

    def __init__(self, segment: Segment, *, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("use ShmRing.create(nslots, slot_bytes) or ShmRing.attach(fd)")
        self._segment = segment
        self.name = segment.name
        self._pid = os.getpid()
        self._view: memoryview | None = None
        view = memoryview(segment.mmap)
        status, nslots, slot_bytes, slots_offset = _core.attach(view)
        if status != pyring.OK:
            view.release()
            _raise_for_status(status, "attach", segment.name)
        self._view = view
        self.nslots: int = nslots
        self.slot_bytes: int = slot_bytes
        self._slots_offset: int = slots_offset
        # One byte view per slot, made on first use. Never released, only dropped:
        # arrays built on them keep the mapping alive until they go.
        self._slot_views: list[memoryview | None] = [None] * nslots
        self._layouts: dict[bytes, _Layout] = {}
        #: The slots this process has mapped in at once (see _populate), and the bytes of
        #: the last message it committed: how much of a slot the next one likely fills.
        self._mapped = bytearray(nslots)
        self._last_nbytes = 0
        self.implementation = IMPLEMENTATION

    @classmethod
    def create(cls, nslots: int, slot_bytes: int, name: str = "zephon-ring") -> ShmRing:
        """Creates a ring in a new shared-memory segment.

        Args:
            nslots: slots in the ring (messages in flight), >= 1.
            slot_bytes: capacity of one slot; rounded up to a multiple of 4096.
            name: the segment's label, in error messages and ``/proc/<pid>/fd``.

        Raises:
            ShmError: not enough memory for the ring, or it cannot be created.
        """
        if not isinstance(nslots, int) or not 1 <= nslots <= 0xFFFFFFFF:
            raise ValueError(f"nslots must be an int in [1, 2**32); got {nslots!r}")
        if not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ValueError(f"slot_bytes must be an int >= 1; got {slot_bytes!r}")
        slot_bytes = _round_up(slot_bytes, SLOT_ALIGN)
        size = _core.required_size(nslots, slot_bytes)
        segment = create_segment(size, name=name)
        try:
            with memoryview(segment.mmap) as view:
                status = _core.init(view, nslots, slot_bytes)
            if status != pyring.OK:
                _raise_for_status(status, "create", segment.name)
            return cls(segment, _token=_PRIVATE)
        except BaseException:
            segment.close()
            raise

    @classmethod
    def attach(cls, fd: int) -> ShmRing:
        """Attaches to the ring behind ``fd`` (a ring's ``fileno()`` received from the
        process that created it), validating its header. Takes over ``fd``: the ring's
        ``close()`` closes it, and so does a failure here.

        Raises:
            ShmError: ``fd`` cannot be mapped. RingError: it does not hold a valid ring
                (bad magic, another layout version, or a size that does not match).
        """
        segment = attach_segment(fd)
        try:
            return cls(segment, _token=_PRIVATE)
        except BaseException:
            segment.close()
            raise

    def fileno(self) -> int:
        """The segment's fd, to pass to the process that attaches (``zephon.shm.send_fds``)."""
        return self._segment.fileno()

    # -- state ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once either side closed the ring (or this object was closed)."""
        view = self._view
        return view is None or bool(_core.is_closed(view))

    def _live_view(self, action: str) -> memoryview:
        view = self._view
        if view is None:
            raise RingClosedError(f"ring {self.name!r} was closed by this process: cannot {action}")
        return view

    def _slot_view(self, view: memoryview, slot: int) -> memoryview:
        mv = self._slot_views[slot]
        if mv is None:
            start = self._slots_offset + slot * self.slot_bytes
            mv = self._slot_views[slot] = view[start : start + self.slot_bytes]
        return mv

    def _populate(self, slot: int, nbytes: int, advice: int) -> None:
        """Maps the first ``nbytes`` of ``slot`` into this process in one call, the first
        time this process uses the slot: a slot of a new ring is not mapped yet, and a
        batch of megabytes would otherwise take a page fault per page. Nothing where the
        kernel does not know the advice (the pages then come in as they are touched)."""
        global _can_populate
        if nbytes <= 0 or not _can_populate:
            return  # nothing committed yet to size it by: the pages come in as touched
        self._mapped[slot] = 1
        start = self._slots_offset + slot * self.slot_bytes
        length = min(-(-nbytes // _PAGE) * _PAGE, self.slot_bytes)
        try:
            mapping = self._segment.mmap
        except ShmError:
            return  # unmapped under us (closed): the call itself says so
        try:
            mapping.madvise(advice, start, length)
        except (OSError, ValueError):
            _can_populate = False  # an older kernel: not asked again

    def fill(self) -> int:
        """Messages the producer committed that the consumer has not taken yet (0 once
        this object is closed); read without synchronisation, for the metrics."""
        view = self._view
        return 0 if view is None else pyring.fill(view)

    # -- producer ------------------------------------------------------------

    def reserve(self, timeout_s: float | None = None) -> SlotWriter:
        """Waits for a free slot and returns it for writing (``timeout_s=None``: forever).

        Raises:
            TimeoutError: no slot became free in time (the ring is full).
            RingClosedError: the ring is closed.
        """
        view = self._live_view("reserve")
        status, slot = _core.reserve(view, _timeout_ns(timeout_s))
        if status != pyring.OK:
            _raise_for_status(status, "reserve", self.name, timeout_s)
        if not self._mapped[slot]:
            self._populate(slot, self._last_nbytes, _POPULATE_WRITE)
        return SlotWriter(self._commit_slot, self.name, slot, self._slot_view(view, slot))

    def put(
        self,
        meta: bytes | bytearray | memoryview,
        arrays: Sequence[np.ndarray] = (),
        timeout_s: float | None = None,
    ) -> int:
        """Copies ``arrays`` into a slot and publishes them with ``meta``.

        Returns:
            The bytes the message occupies in the slot.

        Raises:
            ValueError: the message is larger than a slot (checked before waiting).
            TimeoutError: the ring stayed full for ``timeout_s``.
            RingClosedError: the ring is closed.
        """
        arrays = [np.asarray(a) for a in arrays]
        meta_nbytes = memoryview(meta).nbytes
        need = message_nbytes(meta_nbytes, arrays)
        if need > self.slot_bytes:
            raise ValueError(
                f"message needs {need} bytes (metadata {meta_nbytes} B, {len(arrays)} arrays "
                f"{sum(a.nbytes for a in arrays)} B, framing) but ring {self.name!r} slots hold "
                f"{self.slot_bytes} bytes; raise slot_bytes to at least {need} when creating "
                f"the ring"
            )
        with self.reserve(timeout_s) as slot:
            for a in arrays:
                np.copyto(slot.array(a.shape, a.dtype), a, casting="no")
            return slot.commit(meta)

    def _commit_slot(self, slot: int, nbytes: int) -> None:
        status = _core.commit(self._live_view("commit"), slot, nbytes)
        if status != pyring.OK:
            _raise_for_status(status, "commit", self.name)
        if nbytes:
            self._last_nbytes = nbytes

    # -- consumer ------------------------------------------------------------

    def get(self, timeout_s: float | None = None, *, zero_copy: bool = True) -> Message:
        """Waits for the next message (``timeout_s=None``: forever).

        Args:
            timeout_s: seconds to wait; None waits forever.
            zero_copy: True returns views into the slot, which stays held until
                ``Message.release()`` (or until the Message and all its views are
                dropped); False copies the arrays out and releases the slot at once.

        Raises:
            TimeoutError: no message in time (the ring is empty).
            RingClosedError: the ring is closed and every message was read.
            RingError: the slot does not hold a valid message (it is released first).
        """
        timeout_ns = _timeout_ns(timeout_s)
        deadline = None if timeout_ns < 0 else time.monotonic() + timeout_ns / 1e9
        while True:
            view = self._live_view("get")
            status, slot, nbytes = _core.acquire(view, timeout_ns)
            if status != pyring.OK:
                _raise_for_status(status, "get", self.name, timeout_s)
            if nbytes == 0:  # aborted by the producer
                self._release_slot(slot)
                if deadline is not None:
                    timeout_ns = max(0, int((deadline - time.monotonic()) * 1e9))
                continue
            if not self._mapped[slot]:
                self._populate(slot, nbytes, _POPULATE_READ)
            if not zero_copy:
                try:
                    return self._copy_out(view, slot, nbytes)
                finally:
                    self._release_slot(slot)
            lease = _Lease(self._release_slot, slot)
            try:
                return self._views(view, lease, nbytes)
            except BaseException:
                lease.release()
                raise

    def _copy_out(self, view: memoryview, slot: int, nbytes: int) -> Message:
        mv = self._slot_view(view, slot)
        meta, layout = self._parse(mv, slot, nbytes)
        arrays = [np.ndarray(dims, dt, buffer=mv, offset=off).copy() for dt, dims, off in layout]
        return Message(meta, arrays, nbytes, _Lease(None, slot))

    def _views(self, view: memoryview, lease: _Lease, nbytes: int) -> Message:
        meta, layout = self._parse(self._slot_view(view, lease.slot), lease.slot, nbytes)
        # The arrays' buffer holds the slot lease: dropping the message and every view
        # of it hands the slot back too.
        memory = _pinned_memory(view, self._slots_offset + lease.slot * self.slot_bytes, nbytes)
        memory.lease = lease
        arrays = [np.ndarray(dims, dt, buffer=memory, offset=off) for dt, dims, off in layout]
        return Message(meta, arrays, nbytes, lease)

    def _parse(
        self, mv: memoryview, slot: int, nbytes: int
    ) -> tuple[bytes, tuple[tuple[np.dtype, tuple[int, ...], int], ...]]:
        try:
            magic, version, _flags, narrays, desc_nbytes, trailer_offset, meta_nbytes = (
                _FRAME.unpack_from(mv, 0)
            )
            if magic != _FRAME_MAGIC or version != _FRAME_VERSION:
                raise ValueError(f"bad frame header {magic!r} version {version}")
            meta_start = trailer_offset + desc_nbytes
            if meta_start + meta_nbytes > nbytes:
                raise ValueError("trailer runs past the message")
            descriptors = mv[trailer_offset:meta_start].tobytes()
            layout = self._layouts.get(descriptors)
            if layout is None:
                layout = _decode(descriptors, narrays)
                if len(self._layouts) >= _LAYOUT_CACHE_MAX:
                    self._layouts.clear()
                self._layouts[descriptors] = layout
            if layout.end > nbytes:
                raise ValueError(f"arrays end at byte {layout.end}, past the message")
            return mv[meta_start : meta_start + meta_nbytes].tobytes(), layout.arrays
        except (ValueError, TypeError, KeyError, struct.error, msgpack.UnpackException) as e:
            raise RingError(
                f"slot {slot} of ring {self.name!r} does not hold a valid message "
                f"({nbytes} bytes): {e}"
            ) from e

    def _release_slot(self, slot: int) -> None:
        view = self._view
        if view is None:
            return  # closed locally: the peer was told, nothing to hand back
        status = _core.release(view, slot)
        if status != pyring.OK:
            _raise_for_status(status, "release", self.name)

    # -- lifecycle -----------------------------------------------------------

    def detach(self) -> None:
        """Unmaps the ring without marking it closed: the peer reads on what is in it (a
        worker leaving a ring for a bigger one). Idempotent; closing after it is a no-op."""
        view, self._view = self._view, None
        if view is None:
            return
        self._slot_views = [None] * self.nslots
        del view
        self._segment.close()

    def close(self) -> None:
        """Marks the ring closed (waking the peer and any blocked call) and unmaps it.

        Idempotent. Views of slots still alive keep the mapping until they are dropped.
        """
        view, self._view = self._view, None
        if view is None:
            return
        self._slot_views = [None] * self.nslots
        try:
            _core.close(view)
        finally:
            # Drop the view rather than release() it: a call blocked in another thread
            # may still be using it, and a released view would fail under it. Our last
            # reference going away lets the segment unmap; if slot views or a blocked
            # call still hold the mapping, it is unmapped when they let go.
            del view
            self._segment.close()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if os.getpid() != self._pid:
                return  # a forked copy must not close the parent's ring (close is shared)
            self.close()
        except Exception:  # noqa: BLE001 - best effort at garbage collection
            pass

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"ShmRing {self.name!r} cannot be pickled; pass ring.fileno() to the other "
            f"process (zephon.shm.send_fds, or subprocess pass_fds) and call "
            f"ShmRing.attach(fd) there"
        )

    def __repr__(self) -> str:
        return (
            f"ShmRing(name={self.name!r}, nslots={self.nslots}, slot_bytes={self.slot_bytes}, "
            f"implementation={self.implementation!r}, "
            f"closed={self._view is None})"
        )


_PRIVATE = object()

__all__ = ["IMPLEMENTATION", "RingClosedError", "ShmRing"]
