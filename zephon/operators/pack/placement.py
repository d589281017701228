"""Where pack's pieces go: one placement function over plain int arrays.

``place(strategy, fill, segments, lengths, cap, max_segments)`` decides, for pieces of
``lengths`` placed in order into bins holding ``fill`` tokens and ``segments`` pieces each
(both updated in place), which bin each piece goes to, which bin is emptied first because
the piece fits nowhere, and whether the piece's bin is then full:

* ``first_fit``: the lowest bin with room for the piece;
* ``best_fit``: the bin with the least room that still fits it (Grain's
  ``BestFitPackIterDataset``), the lowest on ties;
* ``concat_then_split``: one bin (Grain's ``ConcatThenSplitIterDataset``): a piece that
  does not fit is cut, its first ``head`` tokens (the bin's room) fill the bin, every
  further ``cap`` tokens fill a bin of their own and the rest starts the next one. Lengths
  may exceed ``cap``.

With media (``pack(media=...)``) each piece also brings ``media[k, f]`` items of media
feature ``f``, and a bin has ``max_media`` slots per feature: a piece fits a bin only where
both its tokens and its items do. ``concat_then_split`` empties its bin first when the
items do not fit its free slots, and a cut piece's items go with its head. A bin whose
slots are all taken is not full: it stays open for pieces without media.

When no bin has room (the fit strategies), the fullest bin by tokens (the lowest on ties)
is emptied and the piece starts it again. A bin is full at ``cap`` tokens, or at
``max_segments`` pieces when that is > 0; a full bin is emptied right away. What a bin
holds and what an emptied bin becomes is up to the caller (:class:`~zephon.operators.pack.pack.Pack`): this module only decides, and says it
in a form the caller can act on without a step per piece: what a bin holds between two
emptyings is an *instance*, numbered ``s * num_bins + b`` for the ``s``-th filling of bin
``b`` in the call (``s = 0``: what the bin held when the call began); each piece's
instance (where its first ``head`` tokens go; a cut piece's other tokens go to the
instances after it, ``cap`` at a time), the instances emptied in order, and each bin's
``s`` at the end.

The C version (``zephon._pack``, ``native/pack_module.c``) and the Python one below are the
same function; ``ZEPHON_PURE_PYTHON=1`` selects Python for the whole process. Placement with
media is Python only (:func:`_place`): a pipeline that decodes images spends its time
there, not here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zephon._native import load

STRATEGIES = ("first_fit", "best_fit", "concat_then_split")
#: The strategy that cuts pieces (one bin, lengths unbounded).
CONCAT_THEN_SPLIT = "concat_then_split"

_NATIVE = load("_pack")


class Placement(NamedTuple):
    """Per piece: the bin it goes to, the bin emptied before it (-1: none), whether its
    bin is full once it is in (then emptied too), its instance and how many of its tokens
    go there (all but for a cut piece); the instances emptied, in order; each bin's filling
    number at the end (0: never emptied in this call)."""

    target: np.ndarray  # int32
    evict: np.ndarray  # int32
    full: np.ndarray  # bool
    instance: np.ndarray  # int64
    head: np.ndarray  # int64
    emitted: np.ndarray  # int64
    opened: np.ndarray  # int64, one per bin


def place(
    strategy: str,
    fill: np.ndarray,
    segments: np.ndarray,
    lengths: np.ndarray,
    cap: int,
    max_segments: int = 0,
    media: np.ndarray | None = None,
    media_fill: np.ndarray | None = None,
    max_media: int = 0,
) -> Placement:
    """Places pieces of ``lengths`` (int64, each in ``[0, cap]`` but for
    ``concat_then_split``) into the bins of ``fill`` and ``segments`` (int64, one per bin,
    updated in place); with ``media`` (int64 ``[pieces, features]``, each in
    ``[0, max_media]``), into the media slots of the bins too (``media_fill``, int64
    ``[bins, features]``, updated in place). See the module docstring."""
    count = len(lengths)
    target = np.empty(count, dtype=np.int32)
    evict = np.empty(count, dtype=np.int32)
    full = np.empty(count, dtype=np.uint8)
    instance = np.empty(count, dtype=np.int64)
    head = np.empty(count, dtype=np.int64)
    code = STRATEGIES.index(strategy)
    cut_rows = int((lengths // cap).sum()) if code == 2 and count else 0
    emitted = np.empty(2 * count + cut_rows, dtype=np.int64)
    opened = np.empty(len(fill), dtype=np.int64)
    if media is not None:  # in Python alone (see the module docstring)
        n = _place(
            code, fill, segments, lengths, cap, max_segments, target, evict, full, instance,
            head, emitted, opened, media, media_fill, max_media,
        )  # fmt: skip
    else:
        run = _NATIVE.place_into if _NATIVE is not None else _place
        n = run(
            code, fill, segments, lengths, cap, max_segments, target, evict, full, instance,
            head, emitted, opened,
        )  # fmt: skip
    return Placement(target, evict, full.view(np.bool_), instance, head, emitted[:n], opened)


def _place(
    code: int,
    fill_out: np.ndarray,
    segments_out: np.ndarray,
    lengths: np.ndarray,
    cap: int,
    max_segments: int,
    target: np.ndarray,
    evict: np.ndarray,
    full_out: np.ndarray,
    instance: np.ndarray,
    head_out: np.ndarray,
    emitted_out: np.ndarray,
    opened_out: np.ndarray,
    media: np.ndarray | None = None,
    media_fill_out: np.ndarray | None = None,
    max_media: int = 0,
) -> int:
    """``zephon._pack.place_into`` in Python (over lists: numpy scalars are slow); with
    ``media`` and ``media_fill_out``, a piece goes only where its items fit too (the same
    choices as without for pieces that bring none)."""
    fill, segments = fill_out.tolist(), segments_out.tolist()
    num_bins = len(fill)
    bins = range(num_bins)
    count = len(lengths)
    where, emptied, full = [0] * count, [-1] * count, [0] * count
    inst, emitted, opened = [0] * count, [], [0] * num_bins
    head = lengths.tolist()
    if media is None or media_fill_out is None:
        items: list[list[int]] = [[]] * count
        slots: list[list[int]] = [[] for _ in bins]
    else:
        items, slots = media.tolist(), media_fill_out.tolist()
    empty = [0] * (len(slots[0]) if slots else 0)
    if code == 2 and num_bins != 1:
        raise ValueError(f"concat then split fills one bin; got {num_bins}")
    for k, n in enumerate(head):
        m = items[k]
        if n < 0 or (code != 2 and n > cap):
            raise ValueError(f"piece {k} has length {n}, outside [0, cap={cap}]")
        some = any(m)
        if some and any(c < 0 or c > max_media for c in m):
            raise ValueError(f"piece {k} has {m} media items, outside [0, {max_media}]")
        if code == 2:  # one bin; a piece that does not fit is cut, its items in its head
            if some and fill[0] and not _fits(slots[0], m, max_media):
                emptied[k] = 0  # its items do not fit the row's free slots: the row goes
                emitted.append(opened[0])
                opened[0] += 1
                fill[0] = segments[0] = 0
                slots[0] = list(empty)
            inst[k] = opened[0]
            room = cap - fill[0]
            if n <= room:
                fill[0] += n
                segments[0] += 1
                if some:
                    slots[0] = _added(slots[0], m)
                full[k] = fill[0] == cap or 0 < max_segments <= segments[0]
            else:
                rest = n - room
                head[k] = room
                emitted.append(opened[0])
                opened[0] += 1
                while rest >= cap:
                    emitted.append(opened[0])
                    opened[0] += 1
                    rest -= cap
                fill[0], segments[0] = rest, int(rest > 0)
                slots[0] = list(empty)
                full[k] = rest == 0 or max_segments == 1
                if rest == 0:
                    continue
            if full[k]:
                emitted.append(opened[0])
                opened[0] += 1
                fill[0] = segments[0] = 0
                slots[0] = list(empty)
            continue
        room = cap - n
        b = -1
        for i in bins:
            if fill[i] > room or (some and not _fits(slots[i], m, max_media)):
                continue
            if code == 0:  # first fit
                b = i
                break
            if b < 0 or fill[i] > fill[b]:  # best fit: the least room that fits
                b = i
        if b < 0:  # nothing fits: the fullest bin goes, lowest index on ties
            b = fill.index(max(fill))
            emptied[k] = b
            emitted.append(opened[b] * num_bins + b)
            opened[b] += 1
            fill[b] = segments[b] = 0
            slots[b] = list(empty)
        where[k] = b
        inst[k] = opened[b] * num_bins + b
        fill[b] += n
        segments[b] += 1
        if some:
            slots[b] = _added(slots[b], m)
        if fill[b] == cap or (max_segments > 0 and segments[b] >= max_segments):
            full[k] = 1
            emitted.append(opened[b] * num_bins + b)
            opened[b] += 1
            fill[b] = segments[b] = 0
            slots[b] = list(empty)
    fill_out[:] = fill
    segments_out[:] = segments
    if media_fill_out is not None and len(empty):
        media_fill_out[:] = slots
    target[:] = where
    evict[:] = emptied
    full_out[:] = full
    instance[:] = inst
    head_out[:] = head
    emitted_out[: len(emitted)] = emitted
    opened_out[:] = opened
    return len(emitted)


def _fits(slots: list[int], items: list[int], max_media: int) -> bool:
    """Whether a bin's taken media ``slots`` (per feature) have room for ``items``."""
    return all(a + c <= max_media for a, c in zip(slots, items, strict=True))


def _added(slots: list[int], items: list[int]) -> list[int]:
    return [a + c for a, c in zip(slots, items, strict=True)]
