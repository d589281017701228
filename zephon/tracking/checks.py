"""The checks of a lane's checkpoint state, as
:meth:`zephon.tracking.tracker.LaneTracker.load` reads it: its keys, counts, in-flight chunks
and their pointers into the datasets, boundaries, replay cursor and ``ensure_mixture``
holds. Each check raises a CheckpointError that names what is malformed and shows the
value.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.errors import CheckpointError
from zephon.records import SampleCursor
from zephon.tracking.schema import (
    CHUNK_COMPONENTS,
    CHUNK_ID,
    CHUNK_INDICES,
    CHUNK_KEYS,
    CHUNK_LANE,
    CHUNK_SEED,
    HELD,
)


def checked_keys(what: str, state: Any, keys: tuple[str, ...]) -> None:
    """``state`` is a dict holding every one of ``keys``, else a CheckpointError naming
    ``what`` (and the keys missing, or what it is instead)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{what} must be a dict; got {shown(state)}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"{what} has no {missing} (it has {sorted(map(str, state))})")


def shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.80}"


def checked_count(what: str, value: Any, limit: int = 1 << 63) -> int:
    """``value`` if it is an int in ``[0, limit)`` (not a bool), else a CheckpointError
    naming ``what`` and showing the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise CheckpointError(f"{what} must be an int in [0, {limit}); got {shown(value)}")
    return value


def checked_chunk(state: Any) -> tuple[dict[str, Any], int]:
    """An in-flight chunk in its :meth:`WorkChunk.to_state` form, checked: its plain state
    and its number of samples.

    Raises:
        CheckpointError: a key is missing, a value has the wrong type or is out of
            range; the message says which.
    """
    checked_keys("an in-flight chunk", state, CHUNK_KEYS)
    comps, indices = state[CHUNK_COMPONENTS], state[CHUNK_INDICES]
    if not isinstance(comps, bytes) or not isinstance(indices, bytes):
        raise CheckpointError(
            f"chunk components and indices must be bytes; got {type(comps).__name__} and "
            f"{type(indices).__name__}"
        )
    size = len(comps) // 4
    if len(comps) != 4 * size or len(indices) != 8 * size:
        raise CheckpointError(
            f"chunk arrays of {len(comps)} and {len(indices)} bytes are not int32 and int64 "
            "of one length"
        )
    plain: dict[str, Any] = {
        CHUNK_LANE: checked_count("chunk lane", state[CHUNK_LANE]),
        CHUNK_ID: checked_count("chunk_id", state[CHUNK_ID]),
        CHUNK_COMPONENTS: comps,
        CHUNK_INDICES: indices,
        CHUNK_SEED: checked_count("chunk seed", state[CHUNK_SEED], 1 << 64),
    }
    return plain, size


def check_pointers(chunks: Sequence[dict[str, Any]], lengths: Sequence[int]) -> None:
    """Every pointer of the checked in-flight ``chunks`` (as :func:`checked_chunk` returns
    them) names a component and an index inside its dataset (one pass over all of them)."""
    c = np.frombuffer(b"".join(st[CHUNK_COMPONENTS] for st in chunks), dtype="<i4")
    i = np.frombuffer(b"".join(st[CHUNK_INDICES] for st in chunks), dtype="<i8")
    if not c.size:
        return
    if len(lengths) == 1:
        bad = c.any() or int(i.min()) < 0 or int(i.max()) >= lengths[0]
    else:
        bad = int(c.min()) < 0 or int(c.max()) >= len(lengths)
        bad = bad or bool(((i < 0) | (i >= np.asarray(lengths, dtype=np.int64)[c])).any())
    if not bad:
        return
    wrong = (c < 0) | (c >= len(lengths))
    if not wrong.any():
        wrong = (i < 0) | (i >= np.asarray(lengths, dtype=np.int64)[c])
    at = int(np.flatnonzero(wrong)[0])
    sizes = [len(st[CHUNK_COMPONENTS]) // 4 for st in chunks]
    k = 0
    while at >= sizes[k]:  # which chunk holds it
        at -= sizes[k]
        k += 1
    p = sum(sizes[:k]) + at
    raise CheckpointError(
        f"in-flight chunk {chunks[k][CHUNK_ID]} points at component {int(c[p])}, index "
        f"{int(i[p])} (offset {at}), outside the datasets (lengths {list(lengths)})"
    )


def checked_boundaries(
    raw: Any, ids: list[int], next_id: int, flush_every_k_chunks: int
) -> list[int]:
    """Boundaries as :meth:`LaneTracker.state` writes them: ascending multiples of the flush
    cadence, above the lowest in-flight chunk (or equal to ``next_chunk_id`` when none is in
    flight) and at most ``next_chunk_id``."""
    if not isinstance(raw, list):
        raise CheckpointError(f"boundaries must be a list of chunk ids; got {shown(raw)}")
    boundaries = [checked_count("a boundary", b) for b in raw]
    floor = ids[0] if ids else next_id
    ok = (
        all(a < b for a, b in itertools.pairwise(boundaries))
        and all(floor <= b <= next_id and (ids or b == floor) for b in boundaries)
        and (
            not boundaries
            or (flush_every_k_chunks > 0 and all(b % flush_every_k_chunks == 0 for b in boundaries))
        )
    )
    if not ok:
        raise CheckpointError(
            f"boundaries {boundaries} are not ascending multiples of "
            f"flush_every_k_chunks={flush_every_k_chunks} within chunks {floor}..{next_id}"
        )
    return boundaries


def checked_cursor(raw: Any, lane: int, sizes: dict[int, int]) -> SampleCursor | None:
    """The replay cursor of ``lane``, ``None`` or ``[chunk_id, offset, child]`` inside the
    in-flight chunks (``sizes``: samples per chunk id, ascending)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != 3:
        raise CheckpointError(
            f"the replay cursor must be None or [chunk_id, offset, child]; got {shown(raw)}"
        )
    chunk_id, offset, child = (
        checked_count(f"replay cursor {name}", x)
        for name, x in zip(("chunk_id", "offset", "child"), raw, strict=True)
    )
    cursor = SampleCursor(lane, chunk_id, offset, child)
    if chunk_id not in sizes:
        ids = list(sizes)
        raise CheckpointError(
            f"replay cursor {tuple(cursor)} points outside the in-flight chunks "
            f"{ids[:1]}..{ids[-1:]}; the checkpoint is inconsistent"
        )
    if offset >= sizes[chunk_id]:
        raise CheckpointError(
            f"replay cursor {tuple(cursor)} points at offset {offset} of chunk {chunk_id}, "
            f"which has {sizes[chunk_id]} samples; the checkpoint is inconsistent"
        )
    return cursor


def checked_holds(state: dict[str, Any]) -> list[list[Any]]:
    """A lane state's ``held`` entries, ``[[op, until, [weights...]], ...]`` (none when the
    key is absent), checked.

    Raises:
        CheckpointError: not a list of such entries with ascending ``until`` per operator.
    """
    raw = state.get(HELD, [])
    if not isinstance(raw, list):
        raise CheckpointError(f"held must be a list of [op, until, weights]; got {shown(raw)}")
    out: list[list[Any]] = []
    last: dict[int, int] = {}
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list)):
            raise CheckpointError(f"a held entry must be [op, until, weights]; got {shown(entry)}")
        op = checked_count("held operator", entry[0])
        until = checked_count("held until", entry[1])
        weights = entry[2]
        if not all(
            isinstance(w, float | int) and not isinstance(w, bool) and 0 <= w < float("inf")
            for w in weights
        ):
            raise CheckpointError(f"held weights must be finite floats >= 0; got {shown(weights)}")
        if until <= last.get(op, -1):
            raise CheckpointError(f"held entries of operator {op} must ascend; got {shown(raw)}")
        last[op] = until
        out.append([op, until, [float(w) for w in weights]])
    return out
