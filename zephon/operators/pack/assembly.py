"""What pack's rows are made of: a row assembled from the pieces of an emptied bin.

:mod:`~zephon.operators.pack.placement` decides where pieces go; this module makes the row of
the pieces a bin held when :class:`~zephon.operators.pack.pack.Pack` emptied it. A
:class:`RowAssembler`, built once from pack's options, lays each packed feature's pieces
one after another and pads the rest of ``seq_len``; segment ids (from 1, 0 marks padding)
and positions go with every packed feature, meta features and broadcast fields (one number
per piece, repeated over its tokens) without them, ``component_feature`` gives each token's
mixture component, and with a BOS id each piece's first token of every packed feature is
replaced by it. Pad and BOS values are checked to fit the feature's dtype exactly, once per
feature and dtype. Each media feature ``m`` gives ``m`` (``[max_media, *shape]``: the
pieces' items one after another, zeros after them), ``m_mask`` (``[max_media]`` bool, True
on an item) and ``m_segment_ids`` (``[max_media]`` int32: the segment id of the item's
piece, 0 where unused).

A :class:`PackedRow` is the record of such a row, assembled only when its data is first
read, or written straight into a row of a batch's arrays (its assembler's
``batch_layout`` and ``write_rows``): a packed row that the replay filter drops after a
restore never is.

The C version (``zephon._pack.assemble_rows``, ``native/pack_module.c``) covers rows of
packed and meta features only, whose pieces are 1-D contiguous arrays of one dtype per
feature; numpy assembles every other row, and every row with ``ZEPHON_PURE_PYTHON=1``. Media
is written by numpy in either case, straight into the row's (or the batch's) arrays.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon._native import load
from zephon.operators.base import check_fits, sample_text
from zephon.records import Contributor, LazyRecord, SampleCursor
from zephon.sources.token_span import NATIVE_SPAN

_INT32 = np.dtype(np.int32)
_SCALARS = (bool, int, float, np.bool_, np.integer, np.floating)

_NATIVE = load("_pack")  # the C module of placement too
#: The buffer format of int32 arrays (what a piece placed by length makes).
_INT32_FORMAT = memoryview(np.empty(0, np.int32).data).format


class Piece(NamedTuple):
    """A piece waiting in a bin: its contributors, its per-component token counts, its
    arrays (one per column of pack: its features, meta features, then broadcast fields as
    scalars; indexable; possibly made only when read) and its length."""

    contributors: Sequence[Contributor]
    component_tokens: dict[int, int]
    arrays: Sequence[np.ndarray] | Any
    length: int


class PackedRow(LazyRecord):
    """A row that ``pack`` emptied from a bin: assembled when its data is first read, or
    written straight into a row of a batch's arrays (:meth:`RowAssembler.write_rows`) where
    C assembles it (see :meth:`RowAssembler.batch_layout`).

    It keeps its pieces as the bin held them, and makes its contributors and mix (a list
    and a dict) only when something asks for them: a row that goes straight into a batch
    never does, because ``batch`` makes the batch's own in one call over its rows' pieces
    (:meth:`RowAssembler.parts`). Its cursor is its first piece's first contributor.
    """

    __slots__ = ("_rows", "_pieces", "_parts")

    def __init__(self, rows: RowAssembler, pieces: list[Piece], lane: int) -> None:
        # Not LazyRecord.__init__: a row has no builder object and no contributors list
        # until they are asked for (one row per few documents: these few lines count).
        self._build = _unbuilt
        self.lane = lane
        self._rows = rows
        self._pieces = pieces
        self._parts: tuple[list[Contributor], dict[int, int]] | None = None

    @property
    def contributors(self) -> list[Contributor]:  # type: ignore[override]
        return self._made()[0]

    @property
    def component_tokens(self) -> dict[int, int]:  # type: ignore[override]
        return self._made()[1]

    def _made(self) -> tuple[list[Contributor], dict[int, int]]:
        """Its contributors and mix, made on first use."""
        if self._parts is None:
            self._parts = parts_of([self._pieces])
        return self._parts

    @property
    def cursor(self) -> SampleCursor:
        first = self._pieces[0][0][0]
        return SampleCursor(self.lane, first[0], first[1], first[2])

    def materialize(self, allocate: Any) -> Any:
        if self._build is not None:  # the setter marks it built
            self.data = self._rows.assemble(self._pieces, self.lane)
        return super().materialize(allocate)

    def row_writer(self) -> RowAssembler | None:
        """Its pack's assembler until its data is read (see
        :meth:`zephon.records.Record.row_writer`): the rows of one pack go into their batch
        in one C call per feature where :meth:`RowAssembler.batch_layout` allows."""
        return self._rows if self._build is not None else None


def _unbuilt(_: Any) -> Any:
    """A :class:`PackedRow`'s builder until it is built (it assembles itself: a builder
    object per row would be one more object per waiting row)."""
    raise AssertionError("a PackedRow assembles itself")


class RowAssembler:
    """Makes the rows of one ``pack``, from its options (checking those that only rows
    read: no feature emitted twice, ``pad_values``), remembering which pads fit which
    dtype."""

    __slots__ = (
        "seq_len",
        "features",
        "broadcast",
        "component_feature",
        "bos_id",
        "columns",
        "pad_values",
        "_n_arrays",
        "_pads",
        "_component_pad",
        "_checked",
        "_pad_items",
        "_layouts",
        "names",
        "media",
        "max_media",
    )

    def __init__(
        self,
        seq_len: int,
        features: tuple[str, ...],
        meta_features: tuple[str, ...],
        broadcast: dict[str, np.dtype | None],
        component_feature: str | None,
        bos_id: int | None,
        pad_values: Mapping[str, Any] | None,
        media: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None,
        max_media: int = 0,
    ) -> None:
        self.seq_len = seq_len
        #: Media feature -> (item shape, dtype); each piece's items follow its columns.
        self.media = dict(media or {})
        self.max_media = max_media
        self.features = features
        self.broadcast = broadcast
        self.component_feature = component_feature
        self.bos_id = bos_id
        #: What a piece carries, in order: features, meta features, broadcast fields.
        self.columns = (*features, *meta_features, *broadcast)
        outputs = [n for f in features for n in (f, f"{f}_segment_ids", f"{f}_positions")]
        outputs += [*meta_features, *broadcast]
        outputs += [component_feature] if component_feature is not None else []
        outputs += [n for m in self.media for n in (m, f"{m}_mask", f"{m}_segment_ids")]
        repeated = sorted({n for n in outputs if outputs.count(n) > 1})
        if repeated:
            raise ValueError(
                f"pack would emit {repeated} more than once (features {list(features)}, "
                f"meta_features {list(meta_features)}, broadcast {list(broadcast)}, "
                f"component_feature {component_feature!r}"
                + (f", media {list(self.media)}" if self.media else "")
                + "); give each feature one role"
            )
        pads = dict(pad_values or {})
        if pad_values is not None and not isinstance(pad_values, Mapping):
            raise ValueError(
                f"pack(pad_values=...) must be a dict of feature -> pad value, such as "
                f"{{'targets': -100}}; got {pad_values!r}"
            )
        padded = [*self.columns, *([component_feature] if component_feature else [])]
        for key, value in pads.items():
            if key not in padded:
                raise ValueError(
                    f"pack(pad_values=...) names {key!r}, which pack does not pad; padded "
                    f"features are {padded} (segment ids and positions pad with 0)"
                )
            if not isinstance(value, _SCALARS):
                raise ValueError(
                    f"pack(pad_values={{{key!r}: {value!r}}}): a pad value must be a number "
                    f"(int, float or bool); got {type(value).__name__}"
                )
        self.pad_values = pads
        self._n_arrays = len(features) + len(meta_features)
        self._pads = tuple(pads.get(c, 0) for c in self.columns)
        self._component_pad = pads.get(component_feature, 0) if component_feature else 0
        self._checked: set[tuple[int, np.dtype]] = set()  # (column, dtype) whose pads fit
        self._pad_items: dict[tuple[int, np.dtype], bytes] = {}  # their bytes, for C
        #: buffer formats of the pieces' columns -> (row layout, batch layout)
        self._layouts: dict[tuple[str, ...], tuple[list[Any], list[Any]]] = {}
        #: The components' names, for errors that name a piece's sample (see :meth:`named`).
        self.names: tuple[str, ...] = ()

    def named(self, names: Sequence[str]) -> RowAssembler:
        """This assembler, or a copy of it, whose errors name components by ``names``."""
        names = tuple(names)
        if names == self.names:
            return self
        other = copy.copy(self)
        other.names = names
        return other

    def _buffer(self, column: int, name: str, dtype: np.dtype, pad: Any) -> np.ndarray:
        """A row of ``dtype`` filled with ``pad`` (checked to fit ``dtype`` exactly)."""
        if pad == 0 and type(pad) is not float:
            return np.zeros(self.seq_len, dtype=dtype)
        self._check_pad(column, name, pad, dtype)
        return np.full(self.seq_len, pad, dtype=dtype)

    def _check_pad(self, column: int, name: str, pad: Any, dtype: np.dtype) -> None:
        """``pad`` fits ``column``'s ``dtype`` exactly (checked once per column and dtype)."""
        if (column, dtype) not in self._checked:
            check_fits(f"pack(pad_values={{{name!r}: {pad!r}}})", name, pad, dtype)
            self._checked.add((column, dtype))

    def assemble(self, pieces: list[Piece], lane: int = -1) -> dict[str, np.ndarray]:
        """The packed row of ``pieces`` (of ``lane``, which errors name): its features (the
        pieces one after another, then the pad) and each feature's segment ids and
        positions; in C where it applies."""
        fast = self.assemble_native(pieces) if _NATIVE is not None else None
        if fast is not None:
            return fast
        return self.assemble_numpy(*columns(pieces), pieces=pieces, lane=lane)

    def assemble_numpy(
        self,
        arrays: Sequence[Any],
        lengths: Sequence[int],
        mixes: Sequence[dict[int, int]],
        *,
        pieces: Sequence[Piece] = (),
        lane: int = -1,
    ) -> dict[str, np.ndarray]:
        """:meth:`assemble` in numpy, of pieces given as columns (see :func:`columns`):
        every case (broadcast fields, BOS, components). Every piece's array of a feature
        must have the first piece's dtype and be 1-D; a broadcast field without a dtype of
        its own, the first piece's number's (``pieces`` and ``lane`` name the sample that
        does not)."""
        data = {}
        lens = np.asarray(lengths, dtype=np.int64)
        total = int(lens.sum())
        starts = np.cumsum(lens) - lens
        seg = np.zeros(self.seq_len, dtype=np.int32)
        seg[:total] = np.repeat(
            np.cumsum(lens > 0, dtype=np.int32), lens
        )  # empty pieces take no id
        pos = np.zeros(self.seq_len, dtype=np.int32)
        pos[:total] = np.arange(total, dtype=np.int32) - np.repeat(starts, lens).astype(np.int32)
        n_features, n_arrays = len(self.features), self._n_arrays
        bos = self.bos_id
        firsts = starts[lens > 0] if bos is not None else None
        for j, name in enumerate(self.columns):
            pad = self._pads[j]
            if j < n_arrays:
                parts = [a[j] for a in arrays]
                dtype = self._one_dtype(name, parts, pieces, lane, per_token=True)
                buf = self._buffer(j, name, dtype, pad)
                if parts:
                    np.concatenate(parts, out=buf[:total])
            else:  # a broadcast field: one number per piece
                scalars = [a[j] for a in arrays]
                given = self.broadcast[name]
                if given is None and len({type(v) for v in scalars}) > 1:
                    self._one_dtype(name, [np.asarray(v) for v in scalars], pieces, lane)
                values = np.asarray(scalars, dtype=given)
                buf = self._buffer(j, name, values.dtype, pad)
                buf[:total] = np.repeat(values, lens)
            data[name] = buf
            if j < n_features:
                if firsts is not None:
                    if (-1, buf.dtype) not in self._checked:
                        check_fits(f"pack(bos_id={bos!r})", name, bos, buf.dtype)
                        self._checked.add((-1, buf.dtype))
                    buf[firsts] = bos
                data[name + "_segment_ids"] = seg if j == 0 else seg.copy()
                data[name + "_positions"] = pos if j == 0 else pos.copy()
        if self.component_feature is not None:
            comps = np.fromiter((_component(m) for m in mixes), np.int32, len(mixes))
            buf = np.full(self.seq_len, self._component_pad, dtype=np.int32)
            buf[:total] = np.repeat(comps, lens)
            data[self.component_feature] = buf
        if self.media:
            data.update(self._media_row(arrays, lengths))
        return data

    def _media_row(self, arrays: Sequence[Any], lengths: Sequence[int]) -> dict[str, np.ndarray]:
        """The media arrays of one row (its pieces' ``arrays`` and ``lengths``)."""
        out = {}
        m = self.max_media
        for name, (shape, dtype) in self.media.items():
            out[name] = np.empty((m, *shape), dtype=dtype)
            out[name + "_mask"] = np.empty(m, dtype=np.bool_)
            out[name + "_segment_ids"] = np.empty(m, dtype=np.int32)
        self._write_media(arrays, lengths, out)
        return out

    def _write_media(
        self, arrays: Sequence[Any], lengths: Sequence[int], out: dict[str, np.ndarray]
    ) -> None:
        """One row's media (its pieces' ``arrays`` and ``lengths``) into ``out`` (one row
        of each media array, written whole: it may come uninitialised, from the ring). The
        segment ids count the pieces with tokens, as the tokens' do."""
        at = len(self.columns)
        for i, name in enumerate(self.media):
            items, mask, segs = out[name], out[name + "_mask"], out[name + "_segment_ids"]
            used = seg = 0
            for a, n in zip(arrays, lengths, strict=True):
                seg += n > 0
                got = a[at + i]
                if got is None:
                    continue
                k = len(got)
                items[used : used + k] = got
                segs[used : used + k] = seg
                used += k
            items[used:] = 0
            segs[used:] = 0
            mask[:used] = True
            mask[used:] = False

    def _one_dtype(
        self,
        name: str,
        parts: list[Any],
        pieces: Sequence[Piece],
        lane: int,
        per_token: bool = False,
    ) -> np.dtype:
        """The dtype of every one of ``parts`` (a feature's arrays, one per piece): the
        first's. A piece of another dtype (or, ``per_token``, not 1-D) is an error that
        names its sample: rows never upcast silently."""
        if not parts:
            return _INT32
        first = parts[0]
        dtype = getattr(first, "dtype", None)
        if dtype is None:
            first = np.asarray(first)
            dtype = first.dtype
        for k, part in enumerate(parts):
            got = getattr(part, "dtype", None)
            if got is None:
                part = np.asarray(part)
                got = part.dtype
            flat = not per_token or part.ndim == 1
            if got == dtype and flat:
                continue
            where = self._piece_text(pieces, k, lane)
            if not flat:
                raise ValueError(
                    f"pack: feature {name!r} of {where} has shape {part.shape}; packed and meta "
                    "features are 1-D, one value per token: flatten it or leave it out of pack"
                )
            raise ValueError(
                f"pack: feature {name!r} of {where} is {got}, where the row's first piece ("
                f"{self._piece_text(pieces, 0, lane)}) has {dtype}; every sample must give a "
                f"feature one dtype: cast it in .map() (e.g. np.asarray(x, {str(dtype)!r}))"
                + (
                    f", or give it one in pack(broadcast={{{name!r}: "
                    f"{str(np.result_type(got, dtype))!r}}})"
                    if name in self.broadcast
                    else ""
                )
            )
        return np.dtype(dtype)

    def _piece_text(self, pieces: Sequence[Piece], k: int, lane: int) -> str:
        """Piece ``k``'s sample, as an error names it."""
        if k >= len(pieces):
            return f"piece {k} of the row"
        p = pieces[k]
        return sample_text(lane, p.contributors[0], p.component_tokens, self.names)

    def assemble_native(self, pieces: list[Piece]) -> dict[str, np.ndarray] | None:
        """:meth:`assemble` with the row made by ``zephon._pack.assemble_rows`` (its pieces
        copied, the pad after them, segment ids and positions in one pass); None where it
        does not apply (see :meth:`batch_layout`)."""
        layout = self._layout([pieces])
        if layout is None:
            return None
        data = {name: np.empty(self.seq_len, dtype=dtype) for name, dtype in layout}
        self._write([pieces], {name: a[np.newaxis] for name, a in data.items()})
        if self.media:
            data.update(self._media_row(*columns(pieces)[:2]))
        return data

    def parts(self, records: Sequence[PackedRow]) -> tuple[list[Contributor], dict[int, int]]:
        """The contributors of the rows of ``records`` one after another and their
        per-component token counts summed: a batch's of them, in one call."""
        return parts_of([r._pieces for r in records])

    def batch_layout(
        self, records: Sequence[PackedRow]
    ) -> list[tuple[str, tuple[int, ...], np.dtype]] | None:
        """The features of the rows of ``records`` (each ``seq_len`` long), in order, with
        their dtypes, where C writes them into a batch's arrays (:meth:`write_rows`); None
        where it does not (see :meth:`_layout`)."""
        got = self._layouts_of([r._pieces for r in records])
        return None if got is None else got[1]

    def _layout(self, rows: list[list[Piece]]) -> list[tuple[str, np.dtype]] | None:
        """The features of ``rows`` (each its pieces) with their dtypes, where C
        assembles them; None where it does not: broadcast fields, a BOS id, a component
        feature, an empty row, or pieces whose arrays are not 1-D contiguous arrays of one
        dtype per column (``zephon._pack.row_formats`` checks them all in one call). A piece
        placed by length (its arrays not a tuple: the fused stage's, on ``"tokens"`` alone)
        makes int32 tokens, 1-D and contiguous, when it is written (a token span straight
        from its file): it is not read here."""
        got = self._layouts_of(rows)
        return None if got is None else got[0]

    def _layouts_of(self, rows: list[list[Piece]]) -> tuple[list[Any], list[Any]] | None:
        """:meth:`_layout` and :meth:`batch_layout` of ``rows``, made once per set of
        buffer formats the pieces have."""
        native = _NATIVE
        if native is None or self._n_arrays != len(self.columns) or self.bos_id is not None:
            return None
        if self.component_feature is not None:
            return None
        formats = native.row_formats(rows, len(self.columns), np.ndarray, _INT32_FORMAT)
        if formats is None:
            return None
        known = self._layouts.get(formats)
        if known is not None:
            return known
        first = next((p[2] for row in rows for p in row if type(p[2]) is tuple), None)
        layout = []
        n_features = len(self.features)
        for j, name in enumerate(self.columns):
            layout.append((name, _INT32 if first is None else first[j].dtype))
            if j < n_features:
                layout += [(name + "_segment_ids", _INT32), (name + "_positions", _INT32)]
        shape = (self.seq_len,)
        rows_layout: list[tuple[str, tuple[int, ...], np.dtype]] = [
            (n, shape, dtype) for n, dtype in layout
        ]
        m = self.max_media
        for name, (item, dtype) in self.media.items():
            rows_layout.append((name, (m, *item), dtype))
            rows_layout.append((name + "_mask", (m,), np.dtype(np.bool_)))
            rows_layout.append((name + "_segment_ids", (m,), _INT32))
        known = self._layouts[formats] = (layout, rows_layout)
        return known

    def write_rows(self, records: Sequence[PackedRow], out: dict[str, np.ndarray]) -> None:
        """Writes the rows of ``records`` (whose :meth:`batch_layout` is ``out``'s) into
        ``out`` (an array of ``(len(records), seq_len)`` per name), one C call a feature
        (and media, in numpy, straight into ``out``'s rows)."""
        rows = [r._pieces for r in records]
        self._write(rows, out)
        if self.media:
            names = [n for m in self.media for n in (m, f"{m}_mask", f"{m}_segment_ids")]
            for r, pieces in enumerate(rows):
                self._write_media(*columns(pieces)[:2], {k: out[k][r] for k in names})

    def _write(self, rows: list[list[Piece]], out: dict[str, np.ndarray]) -> None:
        """Rows (each its pieces) into ``out`` (``(len(rows), seq_len)`` per name) with
        ``zephon._pack.assemble_rows``: a feature's rows in one call, the segment ids and
        positions made with the first packed feature and copied for the others."""
        native = _NATIVE
        assert native is not None
        n_features = len(self.features)
        seg = pos = None
        for j, name in enumerate(self.columns):
            buf = out[name]
            pad = self._pad_item(j, name, buf.dtype)
            if j >= n_features:
                native.assemble_rows(rows, j, buf, pad, None, None, NATIVE_SPAN)
            elif seg is None:
                seg, pos = out[name + "_segment_ids"], out[name + "_positions"]
                native.assemble_rows(rows, j, buf, pad, seg, pos, NATIVE_SPAN)
            else:
                native.assemble_rows(rows, j, buf, pad, None, None, NATIVE_SPAN)
                out[name + "_segment_ids"][...] = seg
                out[name + "_positions"][...] = pos

    def _pad_item(self, column: int, name: str, dtype: np.dtype) -> bytes:
        """The bytes of one ``dtype`` item of ``column``'s pad value (checked to fit)."""
        key = (column, dtype)
        item = self._pad_items.get(key)
        if item is None:
            pad = self._pads[column]
            self._check_pad(column, name, pad, dtype)
            item = self._pad_items[key] = np.array(pad, dtype=dtype).tobytes()
        return item


def parts(rows: list[list[Piece]]) -> tuple[list[Contributor], dict[int, int]]:
    """The contributors of the pieces of ``rows`` one after another and their per-component
    token counts summed (``zephon._pack.parts`` is the same in C; :data:`parts_of` is
    whichever runs)."""
    contributors: list[Contributor] = []
    mix: dict[int, int] = {}
    for pieces in rows:
        for p in pieces:
            contributors.extend(p.contributors)
            for comp, w in p.component_tokens.items():
                mix[comp] = mix.get(comp, 0) + w
    return contributors, mix


#: :func:`parts`, in C where it is built.
parts_of: Callable[[list[list[Piece]]], tuple[list[Contributor], dict[int, int]]] = (
    _NATIVE.parts if _NATIVE is not None else parts
)


def columns(pieces: list[Piece]) -> tuple[list[Any], list[int], list[dict[int, int]]]:
    """``pieces`` as what :meth:`RowAssembler.assemble` reads: their arrays, their lengths
    and their per-component token counts."""
    return (
        [p.arrays for p in pieces],
        [p.length for p in pieces],
        [p.component_tokens for p in pieces],
    )


def _component(mix: dict[int, int]) -> int:
    """The mixture component of a piece of ``mix`` (a piece of one sample has one)."""
    if len(mix) != 1:
        raise ValueError(
            f"pack(component_feature=...): a piece carries {len(mix)} components "
            f"{sorted(mix)}; per-token components need pieces of one sample each"
        )
    return next(iter(mix))
