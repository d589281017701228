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

When no bin has room (the fit strategies), the fullest bin (the lowest on ties) is emptied
and the piece starts it again. A bin is full at ``cap`` tokens, or at ``max_segments``
pieces when that is > 0; a full bin is emptied right away. What a bin holds and what an emptied bin becomes is up to
the caller (:class:`~zephon.operators.pack.pack.Pack`): this module only decides, and says it
in a form the caller can act on without a step per piece: what a bin holds between two
emptyings is an *instance*, numbered ``s * num_bins + b`` for the ``s``-th filling of bin
``b`` in the call (``s = 0``: what the bin held when the call began); each piece's
instance (where its first ``head`` tokens go; a cut piece's other tokens go to the
instances after it, ``cap`` at a time), the instances emptied in order, and each bin's
``s`` at the end.

The C version (``zephon._pack``, ``native/pack_module.c``) and the Python one below are the
same function; ``ZEPHON_PURE_PYTHON=1`` selects Python for the whole process.
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
) -> Placement:
    """Places pieces of ``lengths`` (int64, each in ``[0, cap]`` but for
    ``concat_then_split``) into the bins of ``fill`` and ``segments`` (int64, one per bin,
    updated in place); see the module docstring."""
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
    run = _NATIVE.place_into if _NATIVE is not None else _place
    n = run(
        code, fill, segments, lengths, cap, max_segments, target, evict, full, instance, head,
        emitted, opened,
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
) -> int:
    """``zephon._pack.place_into`` in Python (over lists: numpy scalars are slow)."""
    fill, segments = fill_out.tolist(), segments_out.tolist()
    num_bins = len(fill)
    bins = range(num_bins)
    where, emptied, full = [0] * len(lengths), [-1] * len(lengths), [0] * len(lengths)
    inst, emitted, opened = [0] * len(lengths), [], [0] * num_bins
    head = lengths.tolist()
    if code == 2 and num_bins != 1:
        raise ValueError(f"concat then split fills one bin; got {num_bins}")
    for k, n in enumerate(head):
        if n < 0 or (code != 2 and n > cap):
            raise ValueError(f"piece {k} has length {n}, outside [0, cap={cap}]")
        if code == 2:  # one bin; a piece that does not fit is cut
            inst[k] = opened[0]
            room = cap - fill[0]
            if n <= room:
                fill[0] += n
                segments[0] += 1
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
                full[k] = rest == 0 or max_segments == 1
                if rest == 0:
                    continue
            if full[k]:
                emitted.append(opened[0])
                opened[0] += 1
                fill[0] = segments[0] = 0
            continue
        room = cap - n
        b = -1
        if code == 0:  # first fit
            for i in bins:
                if fill[i] <= room:
                    b = i
                    break
        else:  # best fit: the least room that fits, lowest on ties
            for i in bins:
                if fill[i] <= room and (b < 0 or fill[i] > fill[b]):
                    b = i
        if b < 0:  # nothing fits: the fullest bin goes, lowest index on ties
            b = fill.index(max(fill))
            emptied[k] = b
            emitted.append(opened[b] * num_bins + b)
            opened[b] += 1
            fill[b] = segments[b] = 0
        where[k] = b
        inst[k] = opened[b] * num_bins + b
        fill[b] += n
        segments[b] += 1
        if fill[b] == cap or (max_segments > 0 and segments[b] >= max_segments):
            full[k] = 1
            emitted.append(opened[b] * num_bins + b)
            opened[b] += 1
            fill[b] = segments[b] = 0
    fill_out[:] = fill
    segments_out[:] = segments
    target[:] = where
    evict[:] = emptied
    full_out[:] = full
    instance[:] = inst
    head_out[:] = head
    emitted_out[: len(emitted)] = emitted
    opened_out[:] = opened
    return len(emitted)
