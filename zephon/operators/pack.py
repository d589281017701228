"""``pack``: first-fit packing of pieces into ``num_bins`` open bins of ``seq_len``.

Emits ``{f, f_segment_ids, f_positions}`` per packed feature (Grain's naming), padded to
``seq_len`` with 0; segment ids start at 1 and 0 marks padding. A bin is emitted when it
becomes full, or when a piece fits nowhere (then the fullest bin goes, lowest index on
ties). The bins' state depends on all history, which is why flush sentinels exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from zephon.operators.base import LaneStateOperator, OpTraits, Output
from zephon.records import Contributor, LazyRecord, Record, Tombstone

if TYPE_CHECKING:
    from zephon.replay import ReplayFilter

#: A piece waiting in a bin: its contributors, its per-component token counts, its arrays
#: (one per packed feature) and its length.
Piece = tuple[list[Contributor], dict[int, int], tuple[np.ndarray, ...], int]


class _Bins:
    __slots__ = ("pieces", "fill")

    def __init__(self, num_bins: int) -> None:
        self.pieces: list[list[Piece]] = [[] for _ in range(num_bins)]
        self.fill = [0] * num_bins


class Pack(LaneStateOperator):
    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    name = "pack"
    #: The replay filter when it comes right after this operator (the chain runner sets it):
    #: after a restore, the bins it would drop become tombstones here, never records.
    screen: ReplayFilter | None = None

    def __init__(
        self, seq_len: int, num_bins: int = 8, features: Sequence[str] = ("tokens",)
    ) -> None:
        super().__init__()
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"pack(seq_len=...) must be a positive int; got {seq_len!r}")
        if not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"pack(num_bins=...) must be a positive int; got {num_bins!r}")
        if isinstance(features, str) or not features:
            raise ValueError(
                f"pack(features=...) must be a non-empty list of names; got {features!r}"
            )
        self.seq_len = seq_len
        self.num_bins = num_bins
        self.features = tuple(features)

    def _length(self, record: Record) -> int:
        data = record.data
        lengths = []
        for f in self.features:
            try:
                lengths.append(len(data[f]))
            except (KeyError, TypeError):
                raise KeyError(
                    f"pack: record has no feature {f!r}; pack(features={list(self.features)}) "
                    "needs every feature in each record (tokenize first?)"
                ) from None
        n = lengths[0]
        if any(m != n for m in lengths):
            raise ValueError(
                f"pack: features {self.features} differ in length {lengths} in one record"
            )
        if n > self.seq_len:
            raise ValueError(
                f"pack: a piece of {n} tokens is longer than seq_len={self.seq_len}; "
                f"put .split(max_len={self.seq_len}) before .pack()"
            )
        return n

    def piece(self, record: Record) -> Piece:
        """What a bin keeps of ``record`` (checked: every feature, one length, that fits)."""
        data = record.data
        if len(self.features) == 1 and type(data) is dict:
            tokens = data.get(self.features[0])
            if type(tokens) is np.ndarray and tokens.ndim == 1 and len(tokens) <= self.seq_len:
                return (record.contributors, record.mix, (tokens,), len(tokens))
        n = self._length(record)
        return (record.contributors, record.mix, tuple(data[f] for f in self.features), n)

    def process(self, record: Record) -> Iterable[Output]:
        return self.place(record.lane, (self.piece(record),))

    def process_batch(self, records: list[Record]) -> list[Output]:
        return self.place_runs([r.lane for r in records], [self.piece(r) for r in records])

    def place_runs(self, lanes: list[int], pieces: list[Piece]) -> list[Output]:
        """:meth:`place` for pieces of several lanes (``lanes[i]`` is piece ``i``'s), one
        call per run of one lane's pieces."""
        out: list[Output] = []
        i, n = 0, len(pieces)
        while i < n:
            lane = lanes[i]
            j = i + 1
            while j < n and lanes[j] == lane:
                j += 1
            out.extend(self.place(lane, pieces[i:j]))
            i = j
        return out

    def bins(self, lane: int) -> _Bins:
        """``lane``'s open bins (made empty on first use)."""
        bins = self._lanes.get(lane)
        if bins is None:
            bins = self._lanes[lane] = _Bins(self.num_bins)
        return bins  # type: ignore[no-any-return]

    def place(self, lane: int, pieces: Iterable[Piece]) -> list[Output]:
        """First-fit placement of ``lane``'s pieces, in order; the bins it emits."""
        bins = self.bins(lane)
        cap, num_bins = self.seq_len, self.num_bins
        fill, held = bins.fill, bins.pieces
        out: list[Output] = []
        for piece in pieces:
            room = cap - piece[3]
            for target in range(num_bins):  # first fit
                if fill[target] <= room:
                    break
            else:
                # Nothing fits: the fullest bin goes (lowest index on ties), its slot reopens.
                target = fill.index(max(fill))
                out.append(self.emit(lane, bins, target))
            held[target].append(piece)
            fill[target] += piece[3]
            if fill[target] == cap:
                out.append(self.emit(lane, bins, target))
        _compact(held)
        return out

    def emit(self, lane: int, bins: _Bins, i: int) -> Output:
        """Empties bin ``i`` of ``lane``: its record, or a tombstone if the screen drops it."""
        pieces = bins.pieces[i]
        bins.pieces[i] = []
        bins.fill[i] = 0
        contributors = [c for p in pieces for c in p[0]]
        screen = self.screen
        if screen is not None and lane in screen.targets:
            # What the replay filter right after would do with the record, without the record.
            screen.drop(lane, contributors[0])
            return Tombstone(lane, contributors)
        mix: dict[int, int] = {}
        for p in pieces:
            for comp, w in p[1].items():
                mix[comp] = mix.get(comp, 0) + w
        # Assembled on first use: a replayed bin that the replay filter drops never is.
        return LazyRecord(lambda: self._assemble(pieces), lane, contributors, mix)

    def _assemble(self, pieces: list[Piece]) -> dict[str, np.ndarray]:
        data = {}
        lengths = np.fromiter((p[3] for p in pieces), dtype=np.int64, count=len(pieces))
        total = int(lengths.sum())
        starts = np.cumsum(lengths) - lengths
        seg = np.zeros(self.seq_len, dtype=np.int32)
        seg[:total] = np.repeat(
            np.cumsum(lengths > 0, dtype=np.int32), lengths
        )  # empty pieces take no id
        pos = np.zeros(self.seq_len, dtype=np.int32)
        pos[:total] = np.arange(total, dtype=np.int32) - np.repeat(starts, lengths).astype(np.int32)
        for j, f in enumerate(self.features):
            parts = [p[2][j] for p in pieces]
            buf = np.zeros(self.seq_len, dtype=np.result_type(*parts))
            if parts:
                np.concatenate(parts, out=buf[:total])
            data[f] = buf
            data[f + "_segment_ids"] = seg if j == 0 else seg.copy()
            data[f + "_positions"] = pos if j == 0 else pos.copy()
        return data

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        bins = self._lanes.get(lane_id)
        if bins is None:
            return ()
        out = [self.emit(lane_id, bins, i) for i in range(self.num_bins) if bins.pieces[i]]
        if reset:
            del self._lanes[lane_id]
        return out

    def pending(self, lane_id: int) -> int:
        bins = self._lanes.get(lane_id)
        return 0 if bins is None else sum(len(p) for p in bins.pieces)

    def __repr__(self) -> str:
        return f"Pack(seq_len={self.seq_len}, num_bins={self.num_bins}, features={list(self.features)})"


def _compact(held: list[list[Piece]]) -> None:
    """Copies out the arrays of pieces left in bins that are small views of a bigger
    buffer (a tokenizer may encode a whole chunk into one buffer): a piece waiting in a bin
    must not keep the rest of that buffer alive. A process owning thousands of lanes holds
    one set of bins per lane."""
    for pieces in held:
        for k, p in enumerate(pieces):
            if len(p) != 4:
                continue  # a bare piece (replay by length) holds no tokens yet
            arrays = p[2]
            if any(a.base is not None and a.base.nbytes > 2 * a.nbytes for a in arrays):
                pieces[k] = (p[0], p[1], tuple(a.copy() for a in arrays), p[3])
