"""Where pack's pieces go: one placement function over plain int arrays.

``place(strategy, fill, segments, lengths, cap, max_segments)`` decides, for pieces of
``lengths`` placed in order into bins holding ``fill`` tokens and ``segments`` pieces each
(both updated in place), which bin each piece goes to, which bin is emptied first because
the piece fits nowhere, and whether the piece's bin is then full:

* ``first_fit``: the lowest bin with room for the piece;
* ``best_fit``: the bin with the least room that still fits it (Grain's
  ``BestFitPackIterDataset``), the lowest on ties.

When no bin has room, the fullest bin (the lowest on ties) is emptied and the piece starts
it again. A bin is full at ``cap`` tokens, or at ``max_segments`` pieces when that is > 0;
a full bin is emptied right away. What a bin holds and what an emptied bin becomes is up to
the caller (:class:`~zephon.operators.pack.Pack`): this module only decides, and says it
in a form the caller can act on without a step per piece: what a bin holds between two
emptyings is an *instance*, numbered ``s * num_bins + b`` for the ``s``-th filling of bin
``b`` in the call (``s = 0``: what the bin held when the call began); each piece's
instance, the instances emptied in order, and each bin's ``s`` at the end.

The C version (``zephon._pack``, ``native/pack_module.c``) and the Python one below are the
same function; ``ZEPHON_PURE_PYTHON=1`` selects Python for the whole process.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zephon._native import load

STRATEGIES = ("first_fit", "best_fit")

_NATIVE = load("_pack")


class Placement(NamedTuple):
    """Per piece: the bin it goes to, the bin emptied before it (-1: none), whether its
    bin is full once it is in (then emptied too) and its instance; the instances emptied,
    in order; each bin's filling number at the end (0: never emptied in this call)."""

    target: np.ndarray  # int32
    evict: np.ndarray  # int32
    full: np.ndarray  # bool
    instance: np.ndarray  # int64
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
    """Places pieces of ``lengths`` (int64, each in ``[0, cap]``) into the bins of ``fill``
    and ``segments`` (int64, one per bin, updated in place); see the module docstring."""
    count = len(lengths)
    target = np.empty(count, dtype=np.int32)
    evict = np.empty(count, dtype=np.int32)
    full = np.empty(count, dtype=np.uint8)
    instance = np.empty(count, dtype=np.int64)
    emitted = np.empty(2 * count, dtype=np.int64)
    opened = np.empty(len(fill), dtype=np.int64)
    code = STRATEGIES.index(strategy)
    run = _NATIVE.place_into if _NATIVE is not None else _place
    n = run(
        code, fill, segments, lengths, cap, max_segments, target, evict, full, instance,
        emitted, opened,
    )  # fmt: skip
    return Placement(target, evict, full.view(np.bool_), instance, emitted[:n], opened)


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
    emitted_out: np.ndarray,
    opened_out: np.ndarray,
) -> int:
    """``zephon._pack.place_into`` in Python (over lists: numpy scalars are slow)."""
    fill, segments = fill_out.tolist(), segments_out.tolist()
    num_bins = len(fill)
    bins = range(num_bins)
    where, emptied, full = [0] * len(lengths), [-1] * len(lengths), [0] * len(lengths)
    inst, emitted, opened = [0] * len(lengths), [], [0] * num_bins
    for k, n in enumerate(lengths.tolist()):
        if not 0 <= n <= cap:
            raise ValueError(f"piece {k} has length {n}, outside [0, cap={cap}]")
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
    emitted_out[: len(emitted)] = emitted
    opened_out[:] = opened
    return len(emitted)
