"""The message frame: how a message's arrays and metadata are laid out in a ring slot.

The ring core (``zephon.shm.ring``) moves committed bytes it does not look into; this
module is the format of those bytes, shared by the producer's ``SlotWriter`` (``zephon.shm.writer``), which
writes it, and the consumer's ``ShmRing.get``, which reads it: where each array goes
(``plan_layout``), the checks on dtypes and shapes, the array descriptors packed and
parsed (each cached per layout: batches repeat theirs), and the bytes a message needs
(``message_nbytes``).

Slot framing (all offsets from the slot's first byte, little-endian)::

    0   frame header  <4sHHIIQQ: b"ZMSG", version, flags, narrays,
                      descriptors_nbytes, trailer_offset, meta_nbytes
    64+ arrays        64-byte aligned; arrays of PHASED_ARRAY_MIN_BYTES or more
                      start at an offset = PAYLOAD_PHASE (2048) mod 4096, so
                      copying them out dodges 4 KiB aliasing (native/ring.h)
    trailer           msgpack([[dtype.str, shape, offset], ...]) then the meta
                      bytes; in the gap before the first array when it fits,
                      else after the last array
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from zephon.shm import pyring

SLOT_ALIGN = pyring.SLOT_ALIGN
PAYLOAD_PHASE = pyring.PAYLOAD_PHASE
ARRAY_ALIGN = 64
PHASED_ARRAY_MIN_BYTES = 16 * 1024  # below this a copy is too short to care about aliasing
_FRAME = struct.Struct("<4sHHIIQQ")
_FRAME_MAGIC = b"ZMSG"
_FRAME_VERSION = 1
FRAME_NBYTES = _FRAME.size
_FIRST_ARRAY_OFFSET = ARRAY_ALIGN  # the frame header rounded up to the array alignment


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def _place(cursor: int, nbytes: int) -> int:
    offset = _round_up(cursor, ARRAY_ALIGN)
    if nbytes >= PHASED_ARRAY_MIN_BYTES:
        offset += (PAYLOAD_PHASE - offset) % SLOT_ALIGN
    return offset


def plan_layout(array_nbytes: Sequence[int]) -> tuple[int, ...]:
    """Slot offsets for arrays of these sizes, in order, as ``SlotWriter.array`` places them.

    Every offset is 64-byte aligned; arrays of ``PHASED_ARRAY_MIN_BYTES`` or more start
    at ``PAYLOAD_PHASE`` modulo 4096. The metadata does not move the arrays: it goes
    in the gap in front of the first array when it fits, after the last one otherwise.
    """
    offsets = []
    cursor = _FIRST_ARRAY_OFFSET
    for nbytes in array_nbytes:
        if nbytes < 0:
            raise ValueError(f"array sizes must be >= 0 bytes; got {nbytes}")
        offset = _place(cursor, nbytes)
        offsets.append(offset)
        cursor = offset + nbytes
    return tuple(offsets)


_CHECKED_DTYPES: dict[Any, np.dtype] = {}


def _checked_dtype(dtype: Any) -> np.dtype:
    try:
        return _CHECKED_DTYPES[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype-like
        pass
    dt = np.dtype(dtype)
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(
            f"ring messages carry plain numeric/bool/bytes arrays; dtype {dt!r} holds "
            f"objects or fields (convert it, or put such data in the msgpack metadata)"
        )
    if len(_CHECKED_DTYPES) < 256:
        try:
            _CHECKED_DTYPES[dtype] = dt
        except TypeError:
            pass
    return dt


def _checked_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if type(shape) is tuple and all(type(d) is int and d >= 0 for d in shape):
        return shape  # the common case, already a tuple of non-negative ints
    dims = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    out = tuple(int(d) for d in dims)
    if any(d < 0 for d in out):
        raise ValueError(f"array shape must have dimensions >= 0; got {out}")
    return out


class _Trailer(NamedTuple):
    descriptors: bytes
    offset: int
    end: int  # bytes the message occupies in the slot


class _Encoded(NamedTuple):
    """A message's array descriptors, packed once per layout (batches repeat theirs)."""

    descriptors: bytes
    first: int | None  # offset of the first array
    arrays_end: int


_ArraySpec = tuple[np.dtype, tuple[int, ...], int, int]  # dtype, shape, offset, nbytes
_ENCODED: dict[tuple[_ArraySpec, ...], _Encoded] = {}
_LAYOUT_CACHE_MAX = 64  # distinct layouts kept per process / per ring


def _encode(arrays: tuple[_ArraySpec, ...]) -> _Encoded:
    enc = _ENCODED.get(arrays)
    if enc is None:
        enc = _Encoded(
            msgpack.packb([[d.str, list(s), o] for d, s, o, _ in arrays], use_bin_type=True),
            min((o for _, _, o, _ in arrays), default=None),
            max((o + n for _, _, o, n in arrays), default=FRAME_NBYTES),
        )
        if len(_ENCODED) >= _LAYOUT_CACHE_MAX:
            _ENCODED.clear()
        _ENCODED[arrays] = enc
    return enc


def _plan_trailer(arrays: Sequence[_ArraySpec], meta_nbytes: int) -> _Trailer:
    descriptors, first, arrays_end = _encode(tuple(arrays))
    trailer_nbytes = len(descriptors) + meta_nbytes
    if first is None or FRAME_NBYTES + trailer_nbytes <= first:
        offset = FRAME_NBYTES
    else:
        offset = _round_up(arrays_end, 8)
    return _Trailer(descriptors, offset, max(arrays_end, offset + trailer_nbytes))


class _Layout(NamedTuple):
    """Parsed and checked descriptors: (dtype, shape, offset) per array, and their end."""

    arrays: tuple[tuple[np.dtype, tuple[int, ...], int], ...]
    end: int


def _decode(descriptors: bytes, narrays: int) -> _Layout:
    items = msgpack.unpackb(descriptors, use_list=True)
    if not isinstance(items, list) or len(items) != narrays:
        raise ValueError(f"expected {narrays} array descriptors")
    arrays = []
    end = FRAME_NBYTES
    for dtype_str, shape, offset in items:
        dt = _checked_dtype(dtype_str)
        dims = _checked_shape(shape)
        if not isinstance(offset, int) or offset < FRAME_NBYTES:
            raise ValueError(f"array {dtype_str}{dims} has a bad offset {offset!r}")
        arrays.append((dt, dims, offset))
        end = max(end, offset + math.prod(dims) * dt.itemsize)
    return _Layout(tuple(arrays), end)


def message_nbytes(meta_nbytes: int, arrays: Sequence[np.ndarray]) -> int:
    """Bytes a message of ``meta_nbytes`` of metadata and these arrays takes in a slot.

    Useful to size ``slot_bytes``: ``ShmRing.create(nslots, message_nbytes(...))``.
    """
    specs = [(_checked_dtype(a.dtype), tuple(a.shape), 0, a.nbytes) for a in arrays]
    offsets = plan_layout([n for *_, n in specs])
    placed = [(d, s, o, n) for (d, s, _, n), o in zip(specs, offsets, strict=True)]
    return _plan_trailer(placed, meta_nbytes).end


__all__ = [
    "FRAME_NBYTES",
    "PAYLOAD_PHASE",
    "PHASED_ARRAY_MIN_BYTES",
    "message_nbytes",
    "plan_layout",
]
