"""``pack``: pieces into ``num_bins`` open bins of ``seq_len``, placed first fit.

Emits ``{f, f_segment_ids, f_positions}`` per packed feature (Grain's naming), padded to
``seq_len`` with 0; segment ids start at 1 and 0 marks padding. Where a piece goes is
decided by :func:`~zephon.operators.placement.place` over the bins' token counts alone: a
bin is emitted when it becomes full, or when a piece fits nowhere (then the fullest bin
goes, lowest index on ties). The bins' state depends on all history, which is why flush
sentinels exist.

A packed record is assembled when its data is first read: one that the replay filter drops
after a restore never is, and a piece whose arrays are lazy (see
:class:`~zephon.stages.split_pack.SplitPack`) makes its tokens only then.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon.operators.base import LaneStateOperator, OpTraits, Output
from zephon.operators.placement import place
from zephon.records import Contributor, LazyRecord, Record


class Piece(NamedTuple):
    """A piece waiting in a bin: its contributors, its per-component token counts, its
    arrays (one per packed feature, indexable; possibly made only when read) and its
    length."""

    contributors: list[Contributor]
    mix: dict[int, int]
    arrays: Sequence[np.ndarray] | Any
    length: int


class Bins:
    """One lane's open bins: their token and piece counts (what placement reads) and the
    pieces each holds."""

    __slots__ = ("fill", "segments", "pieces")

    def __init__(self, num_bins: int) -> None:
        self.fill = np.zeros(num_bins, dtype=np.int64)
        self.segments = np.zeros(num_bins, dtype=np.int64)
        self.pieces: list[list[Piece]] = [[] for _ in range(num_bins)]


class Pack(LaneStateOperator):
    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    name = "pack"

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
        self.strategy = "first_fit"

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
        self.check_length(n)
        return n

    def check_length(self, n: int) -> None:
        """Raises the error for a piece that cannot fit any bin."""
        if n > self.seq_len:
            raise ValueError(
                f"pack: a piece of {n} tokens is longer than seq_len={self.seq_len}; "
                f"put .split(max_len={self.seq_len}) before .pack()"
            )

    def piece(self, record: Record) -> Piece:
        """What a bin keeps of ``record`` (checked: every feature, one length, that fits)."""
        data = record.data
        if len(self.features) == 1 and type(data) is dict:
            tokens = data.get(self.features[0])
            if type(tokens) is np.ndarray and tokens.ndim == 1 and len(tokens) <= self.seq_len:
                return Piece(record.contributors, record.mix, (tokens,), len(tokens))
        n = self._length(record)
        return Piece(record.contributors, record.mix, tuple(data[f] for f in self.features), n)

    def process(self, record: Record) -> Iterable[Output]:
        return self.place(record.lane, [self.piece(record)])

    def process_batch(self, records: list[Record]) -> list[Output]:
        out: list[Output] = []
        i, n = 0, len(records)
        while i < n:  # one placement per run of one lane's records
            lane = records[i].lane
            j = i + 1
            while j < n and records[j].lane == lane:
                j += 1
            out.extend(self.place(lane, [self.piece(r) for r in records[i:j]]))
            i = j
        return out

    def bins(self, lane: int) -> Bins:
        """``lane``'s open bins (made empty on first use)."""
        bins = self._lanes.get(lane)
        if bins is None:
            bins = self._lanes[lane] = Bins(self.num_bins)
        return bins  # type: ignore[no-any-return]

    def place(self, lane: int, pieces: list[Piece]) -> list[Output]:
        """Places ``lane``'s pieces, in order; the records of the bins it emits."""
        if not pieces:
            return []
        bins = self.bins(lane)
        lengths = np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))
        decided = place(self.strategy, bins.fill, bins.segments, lengths, self.seq_len)
        held, num_bins = bins.pieces, self.num_bins
        placed: dict[int, list[int]] = {}  # instance -> the pieces this call put in it
        for i, key in enumerate(decided.instance.tolist()):
            got = placed.get(key)
            if got is None:
                placed[key] = [i]
            else:
                got.append(i)
        # A bin's first instance (key < num_bins) holds what the bin held when we began.
        out: list[Output] = [
            self._record(lane, held[key] if key < num_bins else [], placed.get(key), pieces)
            for key in decided.emitted.tolist()
        ]
        for b, filling in enumerate(decided.opened.tolist()):
            kept = held[b] if filling == 0 else []
            new = placed.get(filling * num_bins + b)
            if new:
                kept = kept + [pieces[i] for i in new]
            held[b] = kept
        _compact(held)
        return out

    def _record(
        self, lane: int, old: list[Piece], new: list[int] | None, pieces: list[Piece]
    ) -> Record:
        """The record of an emptied bin: the pieces it held before this call and ``new``,
        those this call put there; assembled when its data is first read."""
        held = old + [pieces[i] for i in new] if new else old
        contributors = [c for p in held for c in p.contributors]
        mix: dict[int, int] = {}
        for p in held:
            for comp, w in p.mix.items():
                mix[comp] = mix.get(comp, 0) + w

        def build(_: Any) -> dict[str, np.ndarray]:
            return self._assemble(held)

        return LazyRecord(build, lane, contributors, mix)

    def _assemble(self, pieces: list[Piece]) -> dict[str, np.ndarray]:
        data = {}
        lengths = np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))
        total = int(lengths.sum())
        starts = np.cumsum(lengths) - lengths
        seg = np.zeros(self.seq_len, dtype=np.int32)
        seg[:total] = np.repeat(
            np.cumsum(lengths > 0, dtype=np.int32), lengths
        )  # empty pieces take no id
        pos = np.zeros(self.seq_len, dtype=np.int32)
        pos[:total] = np.arange(total, dtype=np.int32) - np.repeat(starts, lengths).astype(np.int32)
        for j, f in enumerate(self.features):
            parts = [p.arrays[j] for p in pieces]
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
        held = bins.pieces
        out = [self._record(lane_id, held[b], None, []) for b in range(self.num_bins) if held[b]]
        for b in range(self.num_bins):
            held[b] = []
        bins.fill[:] = 0
        bins.segments[:] = 0
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
    one set of bins per lane. Lazy arrays (not made yet) hold no buffer."""
    for pieces in held:
        for k, p in enumerate(pieces):
            arrays = p.arrays
            if type(arrays) is not tuple:
                continue
            if any(a.base is not None and a.base.nbytes > 2 * a.nbytes for a in arrays):
                pieces[k] = p._replace(arrays=tuple(a.copy() for a in arrays))
