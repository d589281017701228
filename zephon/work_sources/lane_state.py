"""A mixture lane's checkpoint state: its keys and version, the packed per-component arrays,
and reading a saved state back strictly.

A state is ``{"version", "lane", "num_lanes", "next_chunk_id", "lane_tokens",
"schedule_position", "virtual_time", "positions", "tokens", "received", "carry",
"stopped"}``: a few numbers, and per component packed bytes whose size does not grow with the
progress. ``received`` is stored as its difference from the samples or tokens dealt (zero
until the weights first change); ``carry`` is empty until then. :func:`decode_state` reads
the per-component arrays without the datasets, for ``zephon inspect``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import CheckpointError
from zephon.tracking.checks import checked_count
from zephon.work_sources.schedule import Schedule

__all__ = [
    "STATE_KEYS",
    "STATE_VERSION",
    "LaneState",
    "decode_state",
    "pack_carry",
    "pack_counts",
    "pack_ints",
    "read_state",
    "unpack_carry",
    "unpack_components",
    "unpack_ints",
]

STATE_VERSION = 2
STATE_KEYS = (
    "version",
    "lane",
    "num_lanes",
    "next_chunk_id",
    "lane_tokens",
    "schedule_position",
    "virtual_time",
    "positions",
    "tokens",
    "received",
    "carry",
    "stopped",
)


# ----------------------------------------------------------------- packed int arrays
#
# A state's per-component arrays are bytes: one byte giving the width w (0: all zero, else
# 1, 2, 4 or 8), then the values as little-endian signed w-byte ints, byte plane by byte
# plane (every value's low byte, then every second byte, ...), which zstd compresses well
# when the values have similar magnitudes.


#: Up to this many components :func:`pack_ints` works on Python ints: numpy's calls on a
#: tiny array cost more than the work (a rank of thousands of lanes packs three per lane).
_FEW = 8


def pack_ints(values: np.ndarray) -> bytes:
    """Per-component ints as bytes (see above)."""
    if values.size <= _FEW:
        return _pack_int_list(values.tolist())
    if not values.any():
        return b"\x00"
    width = _width(int(values.min()), int(values.max()))
    planes = values.astype(f"<i{width}").view(np.uint8).reshape(-1, width).T
    return bytes([width]) + planes.tobytes()


def pack_counts(
    positions: np.ndarray, tokens: np.ndarray, received: np.ndarray, token_units: bool
) -> tuple[bytes, bytes, bytes]:
    """A lane's ``positions``, ``tokens`` and ``received`` entries: :func:`pack_ints` of
    the positions, of the tokens, and of the samples (or tokens) dealt since the weights
    last changed (the positions or tokens minus ``received``, the count at that change).
    For a few components, one conversion to ints and no numpy call per entry."""
    if positions.size > _FEW:
        base = tokens if token_units else positions
        return pack_ints(positions), pack_ints(tokens), pack_ints(base - received)
    pos, tok, got = positions.tolist(), tokens.tolist(), received.tolist()
    since = [b - r for b, r in zip(tok if token_units else pos, got, strict=True)]
    return _pack_int_list(pos), _pack_int_list(tok), _pack_int_list(since)


def _pack_int_list(ints: list[int]) -> bytes:
    """:func:`pack_ints` of a few ints as a list."""
    if len(ints) == 1:  # one component: its bytes are the one plane
        (v,) = ints
        if not v:
            return b"\x00"
        width = _width(v, v)
        return bytes((width,)) + v.to_bytes(width, "little", signed=True)
    if not any(ints):
        return b"\x00"
    width = _width(min(ints), max(ints))
    raw = [v.to_bytes(width, "little", signed=True) for v in ints]
    return bytes([width, *(r[b] for b in range(width) for r in raw)])


def _width(lo: int, hi: int) -> int:
    """The fewest bytes (1, 2, 4 or 8) of a signed int holding ``lo`` and ``hi``."""
    for width in (1, 2, 4):
        bound = 1 << (8 * width - 1)
        if -bound <= lo and hi < bound:
            return width
    return 8


def unpack_ints(data: Any, count: int, what: str) -> np.ndarray:
    """:func:`pack_ints`'s bytes back to ``count`` int64s.

    Raises:
        CheckpointError: not bytes, an unknown width, or another count of values.
    """
    if not isinstance(data, bytes) or not data:
        raise CheckpointError(
            f"state {what} must be packed bytes; got {type(data).__name__} {data!r:.40}"
        )
    width = data[0]
    if width == 0 and len(data) == 1:
        return np.zeros(count, dtype=np.int64)
    if width not in (1, 2, 4, 8) or len(data) != 1 + width * count:
        raise CheckpointError(
            f"state {what} holds {len(data) - 1} bytes of width {width}; expected "
            f"{count} values (one per component) of width 1, 2, 4 or 8"
        )
    planes = np.frombuffer(data, dtype=np.uint8, offset=1).reshape(width, count)
    return np.ascontiguousarray(planes.T).view(f"<i{width}").reshape(count).astype(np.int64)


def unpack_components(data: Any, count: int, what: str, names: Sequence[str]) -> np.ndarray:
    """:func:`unpack_ints` for a source over ``names``, which a failure names."""
    try:
        return unpack_ints(data, count, what)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (this source has {count}: {list(names)[:8]})") from e


def pack_carry(carry: np.ndarray) -> bytes:
    """The carried credits as float32 bytes; empty while they are all zero."""
    zero = not any(carry.tolist()) if carry.size <= _FEW else not carry.any()
    return b"" if zero else carry.astype("<f4").tobytes()


def unpack_carry(data: Any, count: int) -> np.ndarray:
    """:func:`pack_carry`'s bytes back to ``count`` float64s.

    Raises:
        CheckpointError: neither empty nor ``count`` finite float32s.
    """
    if not isinstance(data, bytes) or len(data) not in (0, 4 * count):
        raise CheckpointError(
            f"state carry must be b'' or {count} float32s; got {type(data).__name__} {data!r:.40}"
        )
    if not data:
        return np.zeros(count, dtype=np.float64)
    carry = np.frombuffer(data, dtype="<f4").astype(np.float64)
    if not np.all(np.isfinite(carry)):
        raise CheckpointError("state carry must be finite float32s")
    carry[carry == 0] = 0.0
    return carry


def decode_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A lane's work-source state as plain per-component lists (``positions``, ``tokens``),
    for ``zephon inspect``: no datasets needed. The count comes from the packed bytes."""
    out: dict[str, Any] = {}
    for key in ("positions", "tokens"):
        data = state.get(key)
        if not isinstance(data, bytes) or not data:
            return {}
        width = data[0]
        count = 0 if width == 0 else (len(data) - 1) // width
        if width == 0:
            out[key] = None  # all zero; the count is not recorded
            continue
        out[key] = unpack_ints(data, count, key).tolist()
    return out


# ------------------------------------------------------------------------ reading back


@dataclass(frozen=True, eq=False)
class LaneState:
    """A saved lane state, checked and unpacked (``received`` absolute again)."""

    next_chunk_id: int
    lane_tokens: int
    schedule_position: int
    virtual_time: float
    stopped: bool
    positions: np.ndarray
    tokens: np.ndarray
    received: np.ndarray
    carry: np.ndarray


def read_state(
    state: Any,
    lane: int,
    num_lanes: int,
    names: Sequence[str],
    schedule: Schedule | None,
    token_units: bool,
) -> LaneState:
    """``state`` checked against lane ``lane`` of ``num_lanes`` of a source over ``names``
    (with ``schedule``; weights counting tokens if ``token_units``), unpacked.

    Raises:
        CheckpointError (a ValueError): unknown version, missing or unknown keys, a
            state for another lane / lane count / number of components, or values
            inconsistent with the source's parameters.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"StaticMixtureWorkSource state must be a dict; got {type(state).__name__}"
        )
    version = state.get("version")
    if version != STATE_VERSION:
        older = (
            "; it was written by an earlier Zephon, which interleaved components by "
            "smooth weighted round robin: resume it with that version"
            if version == 1
            else ""
        )
        raise CheckpointError(
            f"unknown StaticMixtureWorkSource state version {version!r}; this Zephon "
            f"reads version {STATE_VERSION}{older}"
        )
    missing = [k for k in STATE_KEYS if k not in state]
    extra = sorted(str(k) for k in state if k not in STATE_KEYS)
    if missing or extra:
        raise CheckpointError(
            f"StaticMixtureWorkSource state has missing keys {missing} and unknown keys "
            f"{extra}; expected exactly {list(STATE_KEYS)}"
        )
    saved_lane, saved_num_lanes = state["lane"], state["num_lanes"]
    if type(saved_lane) is not int or type(saved_num_lanes) is not int:
        raise CheckpointError(
            f"state lane and num_lanes must be ints; got {saved_lane!r} and {saved_num_lanes!r}"
        )
    if saved_lane != lane or saved_num_lanes != num_lanes:
        raise CheckpointError(
            f"state belongs to lane {saved_lane} of {saved_num_lanes} but this source is lane "
            f"{lane} of {num_lanes}; load it into for_lane({saved_lane}, {saved_num_lanes})"
        )
    k = len(names)
    next_chunk_id = checked_count("state next_chunk_id", state["next_chunk_id"])
    lane_tokens = checked_count("state lane_tokens", state["lane_tokens"])
    position = checked_count("state schedule_position", state["schedule_position"])
    vtime = state["virtual_time"]
    if not isinstance(vtime, float) or not math.isfinite(vtime):
        raise CheckpointError(f"state virtual_time must be a finite float; got {vtime!r:.40}")
    stopped = state["stopped"]
    if not isinstance(stopped, bool):
        raise CheckpointError(f"state stopped must be a bool; got {stopped!r:.40}")
    positions = unpack_components(state["positions"], k, "positions", names)
    tokens = unpack_components(state["tokens"], k, "tokens", names)
    diff = unpack_components(state["received"], k, "received", names)
    carry = unpack_carry(state["carry"], k)
    for name, array in (("positions", positions), ("tokens", tokens)):
        if np.any(array < 0):
            at = int(np.flatnonzero(array < 0)[0])
            raise CheckpointError(
                f"state {name}[{at}] ({names[at]!r}) must be >= 0; got {int(array[at])}"
            )
    if schedule is not None:
        progress = next_chunk_id if schedule.unit == "chunks" else lane_tokens
        if position > progress:
            raise CheckpointError(
                f"state schedule_position {position} is past the lane's progress "
                f"{progress} ({schedule.unit}); the state is inconsistent"
            )
    elif position != 0:
        raise CheckpointError(
            f"state schedule_position must be 0 without a Schedule; got {position}"
        )
    base = tokens if token_units else positions
    received = base - diff
    if np.any(received < 0):
        at = int(np.flatnonzero(received < 0)[0])
        raise CheckpointError(
            f"state received[{at}] ({names[at]!r}) is negative "
            f"({int(received[at])}); the state is inconsistent"
        )
    return LaneState(
        next_chunk_id, lane_tokens, position, vtime, stopped, positions, tokens, received, carry
    )
