"""Pack's bins: what a lane's open bins hold, and the bookkeeping around placement.

:func:`~zephon.operators.pack.placement.place` decides from the bins' token and piece counts
alone where each piece goes (an *instance* of a bin: see that module); :func:`bin_rows`
then moves the pieces: each emptied instance's pieces (what the bin held before the call,
then this call's, in order) become a row, and each bin ends with its last instance's.
``zephon._pack.bin_rows`` (``native/pack_module.c``) is the same function in C.
:func:`_compact` copies out what a waiting piece would otherwise keep alive.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from zephon._native import load
from zephon.operators.pack.assembly import Piece

_NATIVE = load("_pack")  # bin_rows in C


class Bins:
    """One lane's open bins: their token and piece counts and, with media, their taken
    media slots per media feature (what placement reads), and the pieces each holds; with
    ``order="arrival"`` also the arrival number of each bin's first piece (-1: empty), the
    pieces that have arrived since the last flush, and the emptied rows waiting for an older
    open bin (a heap by their first pieces' arrival numbers, which no two rows share)."""

    __slots__ = (
        "fill",
        "segments",
        "media",
        "pieces",
        "first",
        "arrived",
        "waiting",
        "waiting_pieces",
    )

    def __init__(self, num_bins: int, media_features: int = 0) -> None:
        self.fill = np.zeros(num_bins, dtype=np.int64)
        self.segments = np.zeros(num_bins, dtype=np.int64)
        self.media = np.zeros((num_bins, media_features), dtype=np.int64)
        self.pieces: list[list[Piece]] = [[] for _ in range(num_bins)]
        self.first = [-1] * num_bins
        self.arrived = 0
        self.waiting: list[tuple[int, list[Piece]]] = []
        self.waiting_pieces = 0


def _bin_rows(
    pieces: list[Piece],
    instance: np.ndarray,
    emitted: np.ndarray,
    opened: np.ndarray,
    held: list[list[Piece]],
) -> tuple[list[list[Piece]], list[list[Piece]]]:
    """``pieces[k]`` went to ``instance[k]``; ``held[b]`` is what bin ``b`` held when the
    call began (its instance ``b``). Returns the pieces of each instance of ``emitted``
    (what it held before, then this call's, in order) and the bins' lists that this call's
    pieces went into (for :func:`compact`); ``held`` ends with each bin's pieces.
    ``zephon._pack.bin_rows`` is the same in C; :data:`bin_rows` is whichever runs."""
    return rows_of(grouped(pieces, instance), emitted, opened, held)


#: :func:`_bin_rows`, in C where it is built.
bin_rows: Callable[..., tuple[list[list[Piece]], list[list[Piece]]]] = (
    _NATIVE.bin_rows if _NATIVE is not None else _bin_rows
)


def grouped(pieces: list[Piece], instance: np.ndarray) -> dict[int, list[Piece]]:
    """Instance -> its pieces, in order."""
    placed: dict[int, list[Piece]] = {}
    for p, key in zip(pieces, instance.tolist(), strict=True):
        got = placed.get(key)
        if got is None:
            placed[key] = [p]
        else:
            got.append(p)
    return placed


def rows_of(
    placed: dict[int, list[Piece]],
    emitted: np.ndarray,
    opened: np.ndarray,
    held: list[list[Piece]],
) -> tuple[list[list[Piece]], list[list[Piece]]]:
    """:func:`bin_rows` once the pieces are grouped by instance (``placed``)."""
    num_bins = len(held)
    rows = []
    for key in emitted.tolist():
        old = held[key] if key < num_bins else []
        new = placed.get(key)
        rows.append(old + new if new else old)
    stay = []
    for b, filling in enumerate(opened.tolist()):
        kept = held[b] if filling == 0 else []
        new = placed.get(filling * num_bins + b)
        if new:
            kept = kept + new
            stay.append(kept)
        held[b] = kept
    return rows, stay


def compact(held: list[list[Piece]]) -> None:
    """Copies out the arrays of pieces left in bins that are small views of a bigger
    buffer (a tokenizer may encode a whole chunk into one buffer): a piece waiting in a bin
    must not keep the rest of that buffer alive. A process owning thousands of lanes holds
    one set of bins per lane. Lazy arrays (not made yet) hold no buffer."""
    ndarray = np.ndarray
    for pieces in held:
        for k, p in enumerate(pieces):
            arrays = p.arrays
            if type(arrays) is not tuple:
                continue
            for a in arrays:  # (a loop, not any(): this runs for every piece that waits)
                if type(a) is ndarray and a.base is not None and a.base.nbytes > 2 * a.nbytes:
                    pieces[k] = p._replace(
                        arrays=tuple(a.copy() if type(a) is ndarray else a for a in arrays)
                    )
                    break
