"""``pack``: pieces into rows of ``seq_len``, placed first fit, best fit or concatenated
and cut.

Emits ``{f, f_segment_ids, f_positions}`` per packed feature (Grain's naming), padded to
``seq_len`` with the feature's pad value (0 unless ``pad_values`` says otherwise); segment
ids start at 1 and 0 marks padding. Meta features (and broadcast scalar fields) are packed
alongside, without segment ids or positions; ``component_feature`` gives each token's
mixture component. Where a piece goes is decided by
:func:`~zephon.operators.pack.placement.place` over the bins' token and piece counts alone (one
seam for every strategy): with first fit and best fit a bin is emitted when it becomes full
(``seq_len`` tokens or ``max_segments`` pieces), or when a piece fits nowhere (then the
fullest bin goes, lowest index on ties); concat-then-split keeps one row and cuts the
piece that does not fit, the rest starting the next row. The bins' state depends on all
history, which is why flush sentinels exist.

Rows leave as they are emptied (``order="filled"``, the default, as Grain's packers do), or
in the order their first pieces arrived (``order="arrival"``): the same rows, but an emptied
row waits while a bin holding an older piece is still open. First fit keeps short pieces
waiting in open bins while long ones fill rows at once, so filled rows leave out of the
order their pieces came in; in arrival order the token share of each component over a few
batches follows what the work source dealt. Waiting rows are lane state like the bins
(rebuilt by replay, never saved) and leave by the next flush at the latest.

Media (``media={"image": (224, 224, 3)}, max_media=M``) rides beside the tokens: a piece
brings its document's items of each media feature, a bin has ``M`` slots per feature, and
a piece goes only to a bin where its tokens and its items both fit (see
:mod:`~zephon.operators.pack.placement`). A row holds ``image`` ``[M, 224, 224, 3]`` (the
row's items in piece order, zeros after them), ``image_mask`` ``[M]`` (bool, True on an
item) and ``image_segment_ids`` ``[M]`` (int32, the segment id of the item's piece, as in
``tokens_segment_ids``; 0 where unused). A document's items go with its first piece only:
``split`` copies fields that are not per-token to every piece, and pack keeps them from
piece 0 alone (``concat_then_split`` gives them to a cut document's head).

A packed record is assembled when its data is first read (by
:mod:`~zephon.operators.pack.assembly`, the counterpart of placement): one that the replay filter
drops after a restore never is, and a piece whose arrays are lazy (see
:class:`~zephon.operators.pack.fused.SplitPack`) makes its tokens only then.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from zephon.errors import ContractViolation
from zephon.operators.base import (
    LaneStateOperator,
    OpTraits,
    Output,
    PipelineContext,
    data_text,
    sample_text,
)
from zephon.operators.pack.assembly import _SCALARS, PackedRow, Piece, RowAssembler
from zephon.operators.pack.bins import Bins, bin_rows, compact, grouped, rows_of
from zephon.operators.pack.placement import CONCAT_THEN_SPLIT, STRATEGIES, place
from zephon.operators.split import cut_bounds
from zephon.records import Contributor, Record

#: ``bos_handling`` values (Grain's ``BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS``).
REPLACE_FIRST_TOKEN = "replace_first_token"
#: ``order`` values: rows leave as they are emptied, or in the order of their first pieces.
ORDERS = ("filled", "arrival")
#: The longest row ``pack`` makes: positions and segment ids are int32 (Grain's layout; the
#: C assembler writes them as ``int32_t``), so a row of 2**31 tokens or more would overflow
#: them. (Long before that a row stops fitting in memory: ``seq_len=2**40`` asks for 4 TiB an
#: int32 feature a row.)
MAX_SEQ_LEN = 2**31 - 1
#: The dtype of a media item declared by its shape alone (what decode_image and
#: decode_video write).
MEDIA_DTYPE: np.dtype = np.dtype(np.uint8)


class Pack(LaneStateOperator):
    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    name = "pack"

    def __init__(
        self,
        seq_len: int,
        num_bins: int | None = None,
        features: Sequence[str] = ("tokens",),
        *,
        strategy: str = "first_fit",
        max_segments: int | None = None,
        pad_values: Mapping[str, Any] | None = None,
        meta_features: Sequence[str] = (),
        broadcast: Sequence[str] | Mapping[str, Any] = (),
        component_feature: str | None = None,
        bos_id: int | None = None,
        bos_handling: str | None = None,
        order: str = "filled",
        media: Mapping[str, Any] | None = None,
        max_media: int | None = None,
    ) -> None:
        super().__init__()
        if not _is_int(seq_len) or seq_len < 1:
            raise ValueError(f"pack(seq_len=...) must be a positive int; got {seq_len!r}")
        if seq_len > MAX_SEQ_LEN:
            raise ValueError(
                f"pack(seq_len=...) must be at most {MAX_SEQ_LEN} (2**31 - 1: positions and "
                f"segment ids are int32); got {seq_len}: give the model's context length"
            )
        if strategy not in STRATEGIES:
            raise ValueError(
                f"pack(strategy=...) must be one of {', '.join(map(repr, STRATEGIES))}; got "
                f"{strategy!r}"
            )
        cuts = strategy == CONCAT_THEN_SPLIT
        if num_bins is None:
            num_bins = 1 if cuts else 8
        if not _is_int(num_bins) or num_bins < 1:
            raise ValueError(f"pack(num_bins=...) must be a positive int; got {num_bins!r}")
        if cuts and num_bins != 1:
            raise ValueError(
                f"pack(strategy='concat_then_split') fills one row at a time; got "
                f"num_bins={num_bins}: leave num_bins out (or pass 1)"
            )
        if isinstance(features, str) or not features:
            hint = (
                f"; to choose a strategy pass strategy={features!r}"
                if features in STRATEGIES
                else ""
            )
            raise ValueError(
                f"pack(features=...) must be a non-empty list of names; got {features!r}{hint}"
            )
        if max_segments is not None and (not _is_int(max_segments) or max_segments < 1):
            raise ValueError(
                f"pack(max_segments=...) must be None (no cap) or an int >= 1, the most "
                f"segments a row may hold (Grain's max_sequences_per_bin); got {max_segments!r}"
            )
        self.seq_len = seq_len
        self.num_bins = num_bins
        self.features = tuple(features)
        self.strategy = strategy
        self.max_segments = max_segments
        self.meta_features = _names("meta_features", meta_features)
        if isinstance(broadcast, Mapping):
            self.broadcast: dict[str, np.dtype | None] = {}
            for key, dtype in broadcast.items():
                try:
                    self.broadcast[key] = None if dtype is None else np.dtype(dtype)
                except TypeError as e:
                    raise ValueError(
                        f"pack(broadcast={{{key!r}: {dtype!r}}}): not a numpy dtype; give one "
                        "such as 'float32', or None to keep the field's own"
                    ) from e
            _names("broadcast", tuple(self.broadcast))
        else:
            self.broadcast = dict.fromkeys(_names("broadcast", broadcast))
        if component_feature is not None and not (
            isinstance(component_feature, str) and component_feature
        ):
            raise ValueError(
                f"pack(component_feature=...) must be None or a feature name such as "
                f"'tokens_component'; got {component_feature!r}"
            )
        self.component_feature = component_feature
        if bos_handling not in (None, REPLACE_FIRST_TOKEN):
            raise ValueError(
                f"pack(bos_handling=...) must be None or {REPLACE_FIRST_TOKEN!r}; got "
                f"{bos_handling!r}"
            )
        if bos_handling is None and bos_id is not None:
            raise ValueError(
                f"pack(bos_id={bos_id!r}) needs bos_handling={REPLACE_FIRST_TOKEN!r} (Grain's "
                "REPLACE_FIRST_TOKEN_WITH_BOS); without it no BOS is written"
            )
        if bos_handling is not None and not _is_int(bos_id):
            raise ValueError(
                f"pack(bos_handling={bos_handling!r}) needs bos_id=<int token id>; got "
                f"bos_id={bos_id!r}"
            )
        self.bos_id = bos_id
        self.bos_handling = bos_handling
        if order not in ORDERS:
            raise ValueError(
                f"pack(order=...) must be one of {', '.join(map(repr, ORDERS))}; got {order!r}"
            )
        self.order = order
        #: Media feature -> (item shape, dtype); see :func:`media_specs`.
        self.media = media_specs(media, max_media)
        self.max_media = max_media if self.media else None
        #: Rows are held back for order: with one bin they always leave in arrival order.
        self._in_order = order == "arrival" and num_bins > 1
        #: Makes the rows of the bins this pack empties (and checks what only rows read).
        self.rows = RowAssembler(
            seq_len,
            self.features,
            self.meta_features,
            self.broadcast,
            component_feature,
            bos_id,
            pad_values,
            self.media,
            self.max_media or 0,
        )
        #: What a piece carries, in order: features, meta features, broadcast fields.
        self.columns = self.rows.columns
        self.pad_values = self.rows.pad_values
        self._n_arrays = len(self.features) + len(self.meta_features)
        self._n_columns = len(self.columns)
        self._cuts = cuts
        self._max_segments = max_segments or 0
        #: One array column, no cuts: the common case, checked with no call per record.
        self._simple = len(self.columns) == 1 and not cuts and not self.media

    @property
    def fusable(self) -> bool:
        """Whether :class:`~zephon.operators.pack.fused.SplitPack` may stand for ``split`` and
        this pack: one packed feature, ``"tokens"``, no media, and pieces that are never
        cut."""
        return (
            self.features == ("tokens",)
            and len(self.columns) == 1
            and not self._cuts
            and not self.media
        )

    def _length(self, record: Record) -> int:
        data = record.data
        lengths = []
        for f in self.columns[: self._n_arrays]:
            try:
                lengths.append(len(data[f]))
            except (KeyError, TypeError):
                raise KeyError(
                    f"pack: record has no feature {f!r} ({data_text(data)}); "
                    f"pack(features={list(self.features)}"
                    + (f", meta_features={list(self.meta_features)}" if self.meta_features else "")
                    + ") needs every feature in each record: tokenize first, or name the "
                    "features the records have"
                ) from None
        n = lengths[0]
        if any(m != n for m in lengths):
            names = self.columns[: self._n_arrays]
            raise ValueError(
                f"pack: features {names} differ in length {lengths} in one record; packed "
                "and meta features are per-token"
            )
        self.check_length(n)
        return n

    def check_length(self, n: int) -> None:
        """Raises the error for a piece that cannot fit any bin."""
        if n > self.seq_len and not self._cuts:
            raise ValueError(
                f"pack: a piece of {n} tokens is longer than seq_len={self.seq_len}; "
                f"put .split(max_len={self.seq_len}) before .pack() (or use "
                "strategy='concat_then_split', which cuts documents itself)"
            )

    def _scalar(self, data: Any, key: str) -> Any:
        try:
            value = data[key]
        except (KeyError, TypeError):
            raise KeyError(
                f"pack(broadcast=...): record has no field {key!r} (fields: "
                f"{sorted(data) if isinstance(data, dict) else type(data).__name__}); "
                "tokenize keeps a sample's fields, so give the sample that field"
            ) from None
        if not isinstance(value, _SCALARS):
            shape = getattr(value, "shape", None)
            if shape == () and isinstance(value, np.ndarray):
                return value[()]
            raise ValueError(
                f"pack(broadcast=...): field {key!r} is {type(value).__name__}"
                + (f" of shape {shape}" if shape is not None else "")
                + ", not a number; broadcast takes one number per document (a per-token "
                "feature goes in meta_features)"
            )
        return value

    def piece(self, record: Record) -> Piece:
        """What a bin keeps of ``record`` (checked: every feature, one length, that fits)."""
        data = record.data
        if self._simple and type(data) is dict:
            tokens = data.get(self.features[0])
            if type(tokens) is np.ndarray and tokens.ndim == 1 and len(tokens) <= self.seq_len:
                return Piece(record.contributors, record.component_tokens, (tokens,), len(tokens))
        n = self._length(record)
        arrays = [data[f] for f in self.columns[: self._n_arrays]]
        arrays += [self._scalar(data, key) for key in self.broadcast]
        if self.media:
            arrays += self._media_of(record, n)
        return Piece(record.contributors, record.component_tokens, tuple(arrays), n)

    def _media_of(self, record: Record, n: int) -> list[np.ndarray | None]:
        """The record's items of each media feature, as ``[k, *shape]`` arrays (None: no
        item); none for a piece after a document's first (``split`` copied its fields to
        every piece: the items go with the first alone)."""
        first = record.contributors[0]
        if first[2] != 0:
            return [None] * len(self.media)
        data = record.data
        out: list[np.ndarray | None] = []
        for name, (shape, dtype) in self.media.items():
            value = data.get(name) if isinstance(data, dict) else None
            items = None if value is None else self._items(record, name, value, shape, dtype, n)
            out.append(items)
        return out

    def _items(
        self, record: Record, name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype, n: int
    ) -> np.ndarray | None:
        """``value`` (one item, ``[k, *shape]`` items or a list of items) as ``[k, *shape]``
        items of ``dtype``, checked; None for no item."""
        declared = f"pack(media={{{name!r}: {shape}}})"
        if isinstance(value, (list, tuple)):
            if not value:
                return None
            parts = [np.asarray(v) if not isinstance(v, np.ndarray) else v for v in value]
            for part in parts:
                if part.shape != shape:
                    self._bad_shape(record, name, part.shape, shape, n, "an item of a list")
                self._check_dtype(record, name, part.dtype, dtype)
            items = np.stack(parts)
        elif isinstance(value, np.ndarray):
            if value.shape == shape:
                items = value[np.newaxis]
            elif value.ndim == len(shape) + 1 and value.shape[1:] == shape:
                items = value
            else:
                self._bad_shape(record, name, value.shape, shape, n, "an array")
            self._check_dtype(record, name, value.dtype, dtype)
        else:
            raise ValueError(
                f"pack: media feature {name!r} of {self._where(record)} is "
                f"{type(value).__name__}; {declared} takes an array of one item {shape}, "
                f"an array of k items (k, {', '.join(map(str, shape))}), or a list of items "
                "(decode it first, e.g. .decode_image(...))"
            )
        k = len(items)
        if k == 0:
            return None
        if k > (self.max_media or 0):
            raise ValueError(
                f"pack: {self._where(record)} has {k} items of media feature {name!r}, more "
                f"than pack(max_media={self.max_media}) slots a row has; raise max_media to "
                f"at least {k}, or keep fewer items per document in .map()"
            )
        if n == 0:
            raise ValueError(
                f"pack: {self._where(record)} has {k} items of media feature {name!r} and no "
                "tokens; an item belongs to the segment of its document's tokens: give the "
                "document its placeholder tokens"
            )
        return items

    def _bad_shape(
        self,
        record: Record,
        name: str,
        got: tuple[int, ...],
        shape: tuple[int, ...],
        n: int,
        what: str,
    ) -> NoReturn:
        raise ValueError(
            f"pack: media feature {name!r} of {self._where(record)} is {what} of shape "
            f"{got}, where pack(media={{{name!r}: {shape}}}) takes items of shape {shape} "
            f"(one item {shape}, k items (k, {', '.join(map(str, shape))}), or a list of "
            f"items); every item of a feature has one shape: resize them to {shape} in "
            f".map() or .random_map(), or declare the shape they have"
        )

    def _check_dtype(self, record: Record, name: str, got: np.dtype, dtype: np.dtype) -> None:
        if got != dtype:
            raise ValueError(
                f"pack: media feature {name!r} of {self._where(record)} is {got}, where "
                f"pack(media=...) declares {dtype}; cast it in .map() (e.g. "
                f"np.asarray(x, {str(dtype)!r})), or declare ({{...}}: (shape, {str(got)!r}))"
            )

    def _where(self, record: Record) -> str:
        return sample_text(
            record.lane, record.contributors[0], record.component_tokens, self.rows.names
        )

    def process(self, record: Record) -> Iterable[Output]:
        return self.place(record.lane, [self.piece(record)])

    def bind(self, ctx: PipelineContext) -> None:
        self.rows = self.rows.named(ctx.names)  # errors name a piece's component by its name

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
            bins = self._lanes[lane] = Bins(self.num_bins, len(self.media))
        return bins  # type: ignore[no-any-return]

    def place(self, lane: int, pieces: list[Piece]) -> list[Output]:
        """Places ``lane``'s pieces, in order; the records of the bins it emits."""
        if not pieces:
            return []
        bins = self.bins(lane)
        lengths = np.fromiter(map(_LENGTH, pieces), dtype=np.int64, count=len(pieces))
        if self.media:
            at = self._n_columns
            counts = np.array(
                [[0 if a is None else len(a) for a in p.arrays[at:]] for p in pieces],
                dtype=np.int64,
            ).reshape(len(pieces), len(self.media))
            decided = place(
                self.strategy, bins.fill, bins.segments, lengths, self.seq_len,
                self._max_segments, counts, bins.media, self.max_media or 0,
            )  # fmt: skip
        else:
            decided = place(
                self.strategy, bins.fill, bins.segments, lengths, self.seq_len, self._max_segments
            )
        held = bins.pieces
        if self._in_order or self._cuts:
            placed = self._placed(pieces, decided)
            if self._in_order:
                return self._place_in_order(lane, bins, decided, placed)
            rows, new = rows_of(placed, decided.emitted, decided.opened, held)
        else:  # every piece whole in one instance: grouped in C where it is built
            rows, new = bin_rows(pieces, decided.instance, decided.emitted, decided.opened, held)
        compact(new)  # (what waited before was compacted when it came, and is kept)
        return self._records(lane, rows)

    def _placed(self, pieces: list[Piece], decided: Any) -> dict[int, list[Piece]]:
        """Instance -> the pieces this call put in it (cut ones in parts)."""
        if not self._cuts:
            return grouped(pieces, decided.instance)
        placed: dict[int, list[Piece]] = {}
        for p, key, head in zip(
            pieces, decided.instance.tolist(), decided.head.tolist(), strict=True
        ):
            for at, part in self._cut(p, key, head) if head != p.length else ((key, p),):
                placed.setdefault(at, []).append(part)
        return placed

    def _place_in_order(
        self, lane: int, bins: Bins, decided: Any, placed: dict[int, list[Piece]]
    ) -> list[Output]:
        """The rest of :meth:`place` for ``order="arrival"``: the emptied rows join the
        waiting ones, and those older than every open bin's first piece leave, oldest
        first."""
        held, first, num_bins = bins.pieces, bins.first, self.num_bins
        base = bins.arrived
        firsts: dict[int, int] = {}  # instance -> arrival number of its first piece
        for k, key in enumerate(decided.instance.tolist()):
            if key not in firsts:
                firsts[key] = base + k
        bins.arrived = base + len(decided.instance)
        waiting = bins.waiting
        pushed = []  # (arrival of its first piece, row) of the rows with pieces of this call
        for key in decided.emitted.tolist():
            old = held[key] if key < num_bins else []
            new = placed.get(key)
            row = old + new if new else old
            entry = (first[key] if old else firsts[key], row)
            heapq.heappush(waiting, entry)
            bins.waiting_pieces += len(row)
            if new:
                pushed.append(entry)
        for b, filling in enumerate(decided.opened.tolist()):
            kept = held[b] if filling == 0 else []
            if not kept:
                first[b] = -1
            new = placed.get(filling * num_bins + b)
            if new:
                if not kept:
                    first[b] = firsts[filling * num_bins + b]
                kept = kept + new
            held[b] = kept
        oldest_open = min((f for f in first if f >= 0), default=bins.arrived)
        leaving = []
        while waiting and waiting[0][0] < oldest_open:
            row = heapq.heappop(waiting)[1]
            bins.waiting_pieces -= len(row)
            leaving.append(row)
        compact(held)
        compact([row for at, row in pushed if at >= oldest_open])  # those that wait
        return self._records(lane, leaving)

    def _cut(self, p: Piece, key: int, head: int) -> list[tuple[int, Piece]]:
        """A piece cut across rows: its first ``head`` tokens in instance ``key``, then
        ``seq_len`` at a time in the instances after it. Fragment ``j`` of ``m`` is child
        ``j`` of the sample (the last flagged), as :class:`~zephon.operators.split.Split`
        numbers its pieces; so a cut piece must be a whole sample."""
        whole = p.contributors
        if len(whole) != 1 or whole[0][2:] != (0, True) or len(p.component_tokens) != 1:
            raise ContractViolation(
                f"pack(strategy='concat_then_split') cuts documents and needs whole samples; "
                f"got a record of {len(whole)} contributors, first {tuple(whole[0])}: remove "
                ".split() (and anything that merges records) before .pack()"
            )
        chunk_id, offset = whole[0][0], whole[0][1]
        (component,) = p.component_tokens
        bounds = cut_bounds(p.length, self.seq_len, head)
        last = len(bounds) - 2
        arrays, n_arrays, n_columns = p.arrays, self._n_arrays, self._n_columns
        out = []
        for j in range(last + 1):
            lo, hi = bounds[j], bounds[j + 1]
            part = tuple(
                a[lo:hi] if c < n_arrays else a if c < n_columns or j == 0 else None
                for c, a in enumerate(arrays)
            )  # a document's media goes with its head
            piece = Piece(
                [Contributor(chunk_id, offset, j, j == last)], {component: hi - lo}, part, hi - lo
            )
            out.append((key + j, piece))
        return out

    def _records(self, lane: int, rows: Iterable[list[Piece]]) -> list[Output]:
        """The records of emptied bins' pieces, each assembled when its data is first read
        (one call a batch of rows: this runs for every row ``pack`` makes)."""
        assembler = self.rows
        return [PackedRow(assembler, row, lane) for row in rows]

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        bins = self._lanes.get(lane_id)
        if bins is None:
            return ()
        held = bins.pieces
        if self._in_order:  # the waiting rows and the open bins, oldest first
            opened = [(bins.first[b], held[b]) for b in range(self.num_bins) if held[b]]
            rows = bins.waiting + opened
            rows.sort(key=_arrival)
            out = self._records(lane_id, (row for _, row in rows))
            bins.waiting, bins.waiting_pieces, bins.arrived = [], 0, 0
            bins.first[:] = [-1] * self.num_bins
        else:
            out = self._records(lane_id, (row for row in held if row))
        for b in range(self.num_bins):
            held[b] = []
        bins.fill[:] = 0
        bins.segments[:] = 0
        bins.media[:] = 0
        if reset:
            del self._lanes[lane_id]
        return out

    def pending(self, lane_id: int) -> int:
        bins = self._lanes.get(lane_id)
        return 0 if bins is None else sum(len(p) for p in bins.pieces) + bins.waiting_pieces

    def __repr__(self) -> str:
        # Only what differs from the defaults: pipelines built before these options existed
        # keep their fingerprint.
        extra = ""
        if self.strategy != "first_fit":
            extra += f", strategy={self.strategy!r}"
        if self.max_segments is not None:
            extra += f", max_segments={self.max_segments}"
        if self.pad_values:
            extra += f", pad_values={self.pad_values!r}"
        if self.meta_features:
            extra += f", meta_features={list(self.meta_features)}"
        if self.broadcast:
            shown = {k: (None if v is None else str(v)) for k, v in self.broadcast.items()}
            extra += f", broadcast={shown!r}"
        if self.component_feature is not None:
            extra += f", component_feature={self.component_feature!r}"
        if self.bos_handling is not None:
            extra += f", bos_id={self.bos_id!r}, bos_handling={self.bos_handling!r}"
        if self.order != "filled":
            extra += f", order={self.order!r}"
        if self.media:
            specs = ", ".join(f"{k!r}: ({v[0]}, {str(v[1])!r})" for k, v in self.media.items())
            extra += f", media={{{specs}}}, max_media={self.max_media}"
        return (
            f"Pack(seq_len={self.seq_len}, num_bins={self.num_bins}, "
            f"features={list(self.features)}{extra})"
        )


def media_specs(
    media: Mapping[str, Any] | None, max_media: int | None
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``pack(media=..., max_media=...)`` checked: media feature -> (item shape, dtype),
    from ``{name: shape}`` (uint8, :data:`MEDIA_DTYPE`) or ``{name: (shape, dtype)}``."""
    example = "media={'image': (224, 224, 3)}, max_media=4"
    if media is None:
        if max_media is not None:
            raise ValueError(
                f"pack(max_media={max_media!r}) needs media=...: name the media features "
                f"and their item shapes, e.g. pack(..., {example})"
            )
        return {}
    if not isinstance(media, Mapping):
        raise ValueError(
            f"pack(media=...) must be a dict of media feature -> item shape (uint8) or "
            f"(shape, dtype); got {media!r}: a row without media still holds the feature's "
            f"[max_media, *shape] zeros, so pack needs the shape, e.g. pack(..., {example})"
        )
    if not media:
        raise ValueError(f"pack(media={{}}) names no feature; leave media out, or {example}")
    if not _is_int(max_media) or max_media < 1:  # type: ignore[operator]
        raise ValueError(
            f"pack(media=...) needs max_media=<int >= 1>, the items of each media feature a "
            f"row holds; got max_media={max_media!r}"
        )
    specs = {}
    for name, spec in media.items():
        if not (isinstance(name, str) and name):
            raise ValueError(f"pack(media=...) keys must be feature names; got {name!r}")
        shape, dtype = spec, np.dtype(MEDIA_DTYPE)
        if (
            isinstance(spec, tuple)
            and len(spec) == 2
            and isinstance(spec[0], (tuple, list))
            and not _is_int(spec[1])
        ):
            shape, given = spec
            try:
                dtype = np.dtype(given)
            except TypeError as e:
                raise ValueError(
                    f"pack(media={{{name!r}: {spec!r}}}): {given!r} is not a numpy dtype; give "
                    "one such as 'uint8' or 'float32'"
                ) from e
        if not (
            isinstance(shape, (tuple, list)) and shape and all(_is_int(d) and d >= 1 for d in shape)
        ):
            raise ValueError(
                f"pack(media={{{name!r}: {spec!r}}}): give the shape of one item as a tuple "
                f"of positive ints, e.g. (224, 224, 3) for HWC images (uint8), or "
                f"((16000,), 'float32') with a dtype"
            )
        specs[name] = (tuple(int(d) for d in shape), dtype)
    return specs


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _names(what: str, names: Any) -> tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"pack({what}=...) must be a list of feature names; got {names!r}")
    return tuple(names)


def _arrival(row: tuple[int, list[Piece]]) -> int:
    return row[0]


_LENGTH = operator.itemgetter(3)  # a Piece's length
