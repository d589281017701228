"""The ring core in pure Python: the same functions, header layout, statuses and
semantics as the native core (``zephon._ring``, see ``native/ring.h``).

Selected when ``ZEPHON_PURE_PYTHON=1`` or when the extension is not built. Both
cores work on the same memory, so a pure-Python producer can feed a native
consumer and the other way round (the tests do).

Why this is correct without atomics: the ring is single-producer/single-consumer,
every shared word has exactly one writer (``closed`` and the futex sequence
words aside, where a lost increment is harmless: see ``close``), and on x86-64
(TSO) an aligned 8-byte load or store is atomic, stores are not reordered with
stores and loads not with loads. ``struct`` with the native ``@`` format copies
fixed-size fields with ``memcpy``, which compiles to one aligned load/store, so
writing a slot's length and state before ``head`` (and reading ``head`` before
them) is the same publication protocol the C code gets from release/acquire.

Waits poll with a sleep that backs off from 20 us to 1 ms instead of a futex.
A native peer may be asleep on a futex word, so whenever its waiter count is
non-zero this core issues ``FUTEX_WAKE`` through ``ctypes`` (when available).
"""

from __future__ import annotations

import ctypes
import platform
import struct
import sys
import threading
import time
from typing import Any

if sys.byteorder != "little":  # pragma: no cover - the layout is little-endian
    raise ImportError("zephon.shm.pyring needs a little-endian host")

# Statuses, as in ring.h.
OK = 0
TIMEOUT = 1
CLOSED = 2
BAD_MAGIC = 3
BAD_VERSION = 4
BAD_SIZE = 5
BAD_SLOT = 6
BAD_ALIGN = 7
SYSTEM = 8

MAGIC = int.from_bytes(b"ZEPHRING", "little")
LAYOUT_VERSION = 1
SLOT_ALIGN = 4096
PAYLOAD_PHASE = 2048
HEADER_FIXED_BYTES = 640
SLOT_META_BYTES = 16

# Byte offsets of the header fields (ring.h, checked there by _Static_assert).
_MAGIC = 0
_VERSION = 8
_NSLOTS = 12
_SLOT_BYTES = 16
_SLOTS_OFFSET = 24
_TOTAL_BYTES = 32
_CLOSED = 40
_HEAD = 128
_RESERVED = 136
_TAIL = 256
_ACQUIRED = 264
_DATA_SEQ = 384
_DATA_WAITERS = 388
_SPACE_SEQ = 512
_SPACE_WAITERS = 516
_SLOT_NBYTES = 0  # within a slot-table entry
_SLOT_STATE = 8

_SLOT_FREE = 0
_SLOT_RESERVED = 1
_SLOT_COMMITTED = 2
_SLOT_ACQUIRED = 3
_SLOT_RELEASED = 4

_U64 = struct.Struct("@Q")  # native: one memcpy, i.e. one aligned 8-byte access
_U32 = struct.Struct("@I")
_CONFIG = struct.Struct("<QIIQQQ")  # magic .. total_bytes

_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3

_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


def _load_syscall() -> Any:
    if _SYS_FUTEX is None:  # pragma: no cover - neither x86-64 nor aarch64
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):  # pragma: no cover - no libc syscall()
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()


def _ld64(buf: Any, off: int) -> int:
    return _U64.unpack_from(buf, off)[0]


def _st64(buf: Any, off: int, value: int) -> None:
    _U64.pack_into(buf, off, value)


def _ld32(buf: Any, off: int) -> int:
    return _U32.unpack_from(buf, off)[0]


def _st32(buf: Any, off: int, value: int) -> None:
    _U32.pack_into(buf, off, value & 0xFFFFFFFF)


def _address(buf: Any) -> int:
    word = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(word)
    finally:
        del word


def _futex_wake(buf: Any, off: int) -> None:
    """Wakes native waiters sleeping on the futex word at ``off``."""
    if _syscall is None or _SYS_FUTEX is None:
        return
    word = ctypes.c_uint32.from_buffer(buf, off)
    try:
        _syscall(
            ctypes.c_long(_SYS_FUTEX),
            ctypes.c_void_p(ctypes.addressof(word)),
            ctypes.c_long(_FUTEX_WAKE),
            ctypes.c_long(0x7FFFFFFF),
            None,
            None,
            ctypes.c_long(0),
        )
    finally:
        del word


_fence_lock = threading.Lock()


def _full_fence() -> None:
    """A store-load barrier: taking an uncontended lock is a locked instruction."""
    _fence_lock.acquire()
    _fence_lock.release()


def _signal(buf: Any, seq_off: int, waiters_off: int) -> None:
    # A native sleeper registers in ``waiters`` and then reads ``seq``; the fence
    # stops x86 from reading ``waiters`` before the new ``seq`` is visible.
    _st32(buf, seq_off, _ld32(buf, seq_off) + 1)
    _full_fence()
    if _ld32(buf, waiters_off) != 0:
        _futex_wake(buf, seq_off)


def _slots_offset_for(nslots: int) -> int:
    raw = HEADER_FIXED_BYTES + nslots * SLOT_META_BYTES
    return (raw + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def _slot_entry(slot: int) -> int:
    return HEADER_FIXED_BYTES + slot * SLOT_META_BYTES


def required_size(nslots: int, slot_bytes: int) -> int:
    """Bytes a ring of this geometry needs; 0 when the geometry is invalid."""
    if not 0 < nslots <= 0xFFFFFFFF or slot_bytes <= 0 or slot_bytes % SLOT_ALIGN:
        return 0
    total = _slots_offset_for(nslots) + nslots * slot_bytes
    return total if total < 1 << 64 else 0


def _validate(buf: Any) -> tuple[int, int, int, int]:
    """(status, nslots, slot_bytes, slots_offset) of the ring in ``buf``."""
    size = memoryview(buf).nbytes
    if size < HEADER_FIXED_BYTES:
        return BAD_SIZE, 0, 0, 0
    magic, version, nslots, slot_bytes, slots_offset, total = _CONFIG.unpack_from(buf, 0)
    if magic != MAGIC:
        return BAD_MAGIC, 0, 0, 0
    if version != LAYOUT_VERSION:
        return BAD_VERSION, 0, 0, 0
    need = required_size(nslots, slot_bytes)
    if need == 0 or slots_offset != _slots_offset_for(nslots) or total != need or need > size:
        return BAD_SIZE, 0, 0, 0
    return OK, nslots, slot_bytes, slots_offset


def init(buf: Any, nslots: int, slot_bytes: int) -> int:
    """Formats a ring over ``buf``."""
    if _address(buf) % SLOT_ALIGN:
        return BAD_ALIGN
    total = required_size(nslots, slot_bytes)
    if total == 0 or total > memoryview(buf).nbytes:
        return BAD_SIZE
    offset = _slots_offset_for(nslots)
    with memoryview(buf) as view, view.cast("B") as raw:
        raw[:offset] = bytes(offset)
    _CONFIG.pack_into(buf, 0, 0, LAYOUT_VERSION, nslots, slot_bytes, offset, total)
    _st64(buf, _MAGIC, MAGIC)  # last: a valid magic means a complete header
    return OK


def attach(buf: Any) -> tuple[int, int, int, int]:
    """Validates the ring header: (status, nslots, slot_bytes, slots_offset)."""
    if _address(buf) % SLOT_ALIGN:
        return BAD_ALIGN, 0, 0, 0
    return _validate(buf)


def _space_ready(buf: Any, nslots: int) -> int | None:
    if _ld32(buf, _CLOSED):
        return CLOSED
    return OK if _ld64(buf, _RESERVED) - _ld64(buf, _TAIL) < nslots else None


def _data_ready(buf: Any, nslots: int) -> int | None:
    if _ld64(buf, _ACQUIRED) < _ld64(buf, _HEAD):
        return OK
    return CLOSED if _ld32(buf, _CLOSED) else None


def fill(buf: Any) -> int:
    """Messages committed and not yet taken: a racy read, for the metrics only."""
    return max(0, _ld64(buf, _HEAD) - _ld64(buf, _ACQUIRED))


def _wait(buf: Any, ready: Any, nslots: int, timeout_ns: int) -> int:
    status = ready(buf, nslots)
    if status is not None:
        return status
    if timeout_ns == 0:
        return TIMEOUT
    deadline = None if timeout_ns < 0 else time.monotonic() + timeout_ns / 1e9
    pause = _SLEEP_MIN_S
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return TIMEOUT
            pause = min(pause, left)
        time.sleep(pause)
        pause = min(pause * 2, _SLEEP_MAX_S)
        status = ready(buf, nslots)
        if status is not None:
            return status


def reserve(buf: Any, timeout_ns: int) -> tuple[int, int]:
    """Producer: waits for a free slot (``timeout_ns < 0``: forever)."""
    status, nslots, _, _ = _validate(buf)
    if status != OK:
        return status, 0
    status = _wait(buf, _space_ready, nslots, timeout_ns)
    if status != OK:
        return status, 0
    reserved = _ld64(buf, _RESERVED)
    slot = reserved % nslots
    entry = _slot_entry(slot)
    _st32(buf, entry + _SLOT_STATE, _SLOT_RESERVED)
    _st64(buf, entry + _SLOT_NBYTES, 0)
    _st64(buf, _RESERVED, reserved + 1)
    return OK, slot


def commit(buf: Any, slot: int, nbytes: int) -> int:
    """Producer: publishes a reserved slot holding ``nbytes``."""
    status, nslots, slot_bytes, _ = _validate(buf)
    if status != OK:
        return status
    if not 0 <= slot < nslots or _ld32(buf, _slot_entry(slot) + _SLOT_STATE) != _SLOT_RESERVED:
        return BAD_SLOT
    if not 0 <= nbytes <= slot_bytes:
        return BAD_SIZE
    entry = _slot_entry(slot)
    _st64(buf, entry + _SLOT_NBYTES, nbytes)
    _st32(buf, entry + _SLOT_STATE, _SLOT_COMMITTED)
    head = start = _ld64(buf, _HEAD)
    reserved = _ld64(buf, _RESERVED)
    while (
        head < reserved and _ld32(buf, _slot_entry(head % nslots) + _SLOT_STATE) == _SLOT_COMMITTED
    ):
        head += 1
    if head != start:
        _st64(buf, _HEAD, head)
        _signal(buf, _DATA_SEQ, _DATA_WAITERS)
    return OK


def acquire(buf: Any, timeout_ns: int) -> tuple[int, int, int]:
    """Consumer: waits for the next message: (status, slot, nbytes)."""
    status, nslots, _, _ = _validate(buf)
    if status != OK:
        return status, 0, 0
    status = _wait(buf, _data_ready, nslots, timeout_ns)
    if status != OK:
        return status, 0, 0
    acquired = _ld64(buf, _ACQUIRED)
    slot = acquired % nslots
    entry = _slot_entry(slot)
    if _ld32(buf, entry + _SLOT_STATE) != _SLOT_COMMITTED:
        return BAD_SLOT, 0, 0
    _st32(buf, entry + _SLOT_STATE, _SLOT_ACQUIRED)
    _st64(buf, _ACQUIRED, acquired + 1)
    return OK, slot, _ld64(buf, entry + _SLOT_NBYTES)


def release(buf: Any, slot: int) -> int:
    """Consumer: hands an acquired slot back to the producer."""
    status, nslots, _, _ = _validate(buf)
    if status != OK:
        return status
    if not 0 <= slot < nslots or _ld32(buf, _slot_entry(slot) + _SLOT_STATE) != _SLOT_ACQUIRED:
        return BAD_SLOT
    _st32(buf, _slot_entry(slot) + _SLOT_STATE, _SLOT_RELEASED)
    tail = start = _ld64(buf, _TAIL)
    acquired = _ld64(buf, _ACQUIRED)
    while tail < acquired:
        entry = _slot_entry(tail % nslots)
        if _ld32(buf, entry + _SLOT_STATE) != _SLOT_RELEASED:
            break
        _st32(buf, entry + _SLOT_STATE, _SLOT_FREE)
        tail += 1
    if tail != start:
        _st64(buf, _TAIL, tail)
        _signal(buf, _SPACE_SEQ, _SPACE_WAITERS)
    return OK


def close(buf: Any) -> int:
    """Marks the ring closed and wakes both sides. Idempotent.

    The sequence words may also be bumped by the peer at the same moment; a lost
    increment is harmless because both writers move the word away from the value
    a sleeper compared against."""
    status = _validate(buf)[0]
    if status != OK:
        return status
    _st32(buf, _CLOSED, 1)
    for seq_off in (_DATA_SEQ, _SPACE_SEQ):
        _st32(buf, seq_off, _ld32(buf, seq_off) + 1)
        _futex_wake(buf, seq_off)
    return OK


def is_closed(buf: Any) -> bool:
    """Whether either side closed the ring (True for an invalid header)."""
    if _validate(buf)[0] != OK:
        return True
    return bool(_ld32(buf, _CLOSED))
