"""``tokenize -> split -> pack`` run as one stage.

The chain runner fuses the three when they follow each other as built (``split`` and
``pack`` on ``"tokens"``, nothing between them): each sample's token array is cut and placed
straight into pack's bins, without a record, a data dict and a mix dict per sample and per
piece on the way. The records that leave are the ones the three operators would emit one
after the other: the same data, contributors, mix and order (tests compare the two paths).
It matters most on a restore, which replays every sample since the lane's epoch began
through this stage, and the fused stage does it for about half the work.

After a restore, while a lane replays towards its replay target (``pack`` right before the
replay filter, which then drops every bin up to the target), a tokenizer that can count its
tokens (``count_tokens``) lets the stage place pieces by their lengths alone: a piece's
tokens are made only if its bin is ever assembled, and the bins the filter drops never are.

Anything off the common path (a tokenizer returning something other than a 1-D int32
array, a piece longer than ``seq_len``, a sample that is already a piece) takes the
operators' own code, with their own errors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from zephon._native import load
from zephon.operators.base import Operator, OpStats, OpTraits, Output
from zephon.operators.pack import Pack, Piece
from zephon.operators.split import Split
from zephon.operators.tokenize import Tokenize
from zephon.records import Contributor, FlushSentinel, Record, Tombstone

_INT32 = np.dtype(np.int32)


def fusable(ops: Sequence[Operator], i: int, threaded: bool) -> tuple[Tokenize, Split, Pack] | None:
    """``ops[i:i+3]`` when they are a built-in ``tokenize, split, pack`` on ``"tokens"``.

    Not when tokenize asked for threads and there is a pool: it then tokenizes a chunk in
    parallel slices, which the fused stage would give up.
    """
    if i + 3 > len(ops):
        return None
    tok, split, pack = ops[i : i + 3]
    if (
        type(tok) is Tokenize
        and type(split) is Split
        and type(pack) is Pack
        and split.feature == "tokens"
        and pack.features == ("tokens",)
        and not (threaded and tok.parallelism > 1)
    ):
        return tok, split, pack
    return None


class _Doc:
    """A sample's text whose ids are made on first use. As a piece's arrays (pack reads
    ``doc[0]``, the tokens) it stands for the whole sample; :class:`_Span` for a part."""

    __slots__ = ("text", "tokenize", "count", "ids")

    def __init__(self, text: Any, tokenize: Tokenize, count: int) -> None:
        self.text, self.tokenize, self.count = text, tokenize, count
        self.ids: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        if self.ids is None:
            self.accept(self.tokenize.tokenizer.encode(self.text))
            assert self.ids is not None
        return self.ids

    def accept(self, ids: Any) -> None:
        """Takes ``ids`` (the tokenizer's for ``text``) as this sample's tokens."""
        ids = np.asarray(ids, _INT32)
        if ids.ndim != 1 or len(ids) != self.count:
            raise ValueError(
                f"{type(self.tokenize.tokenizer).__name__}.count_tokens said {self.count} "
                f"tokens but encode returned shape {ids.shape}; they must agree"
            )
        self.ids = ids

    def __len__(self) -> int:
        return 1

    def __getitem__(self, feature: int) -> np.ndarray:
        if feature != 0:
            raise IndexError(feature)
        return self.tokens()


class _Span:
    """A piece's arrays (pack reads ``span[0]``, its tokens) before they exist: the ids of
    ``doc`` from ``start`` to ``stop``, made when pack assembles the piece's bin."""

    __slots__ = ("doc", "start", "stop")

    def __init__(self, doc: _Doc, start: int, stop: int) -> None:
        self.doc, self.start, self.stop = doc, start, stop

    def __len__(self) -> int:
        return 1

    def __getitem__(self, feature: int) -> np.ndarray:
        if feature != 0:
            raise IndexError(feature)
        return self.doc.tokens()[self.start : self.stop]


_NATIVE = load("_pack")  # TokenizeSplitPack.forward's drop phase in C


def _cuts(n: int, max_len: int) -> list[tuple[int, bool, int, int]]:
    """``(child, is_last, start, stop)`` of each piece that split cuts ``n`` tokens into."""
    last = (n - 1) // max_len
    return [
        (child, child == last, start, n if child == last else start + max_len)
        for child, start in enumerate(range(0, n, max_len))
    ]


def _real(pieces: list[Any], tokenize: Tokenize, docs: dict[tuple[int, int], _Doc]) -> list[Piece]:
    """``pieces`` with every bare piece made real (others pass as they are).

    A bare piece is ``((chunk_id, offset), child, is_last, start, stop, component, text,
    count)``: tokens ``start:stop`` of a sample whose text encodes to ``count`` tokens.
    ``docs`` shares one :class:`_Doc` between pieces of one sample.
    """
    out: list[Piece] = []
    new = tuple.__new__
    for p in pieces:
        if len(p) == 4:
            out.append(p)
            continue
        key, child, last, start, stop, component, text, count = p
        doc = docs.get(key)
        if doc is None:
            doc = docs[key] = _Doc(text, tokenize, count)
        out.append(
            (
                [new(Contributor, (key[0], key[1], child, last))],
                {component: stop - start},
                doc if start == 0 and last else _Span(doc, start, stop),  # type: ignore[arg-type]
                stop - start,
            )
        )
    return out


class TokenizeSplitPack(Operator):
    """The fused stage; ``stats`` are the three operators' own counters, kept up to date."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def __init__(
        self,
        tokenize: Tokenize,
        split: Split,
        pack: Pack,
        stats: tuple[OpStats, OpStats, OpStats],
    ) -> None:
        self.tokenize, self.split, self.pack = tokenize, split, pack
        self.name = pack.name  # what pending() reports on is pack's
        self.stats = stats
        self._count = getattr(tokenize.tokenizer, "count_tokens", None)
        self._bare: set[int] = set()  # lanes whose bins may hold bare pieces (see forward)

    def process(self, record: Record) -> Iterable[Output]:
        return self.process_batch([record])

    def realize(self, lane: int, docs: dict[tuple[int, int], _Doc] | None = None) -> None:
        """Turns the bare pieces in ``lane``'s bins into real ones (pack's own code may then
        touch them); ``docs`` collects their samples (pieces of one sample share one)."""
        if lane in self._bare:
            self._bare.discard(lane)
            bins = self.pack.bins(lane)
            docs = {} if docs is None else docs
            held = bins.pieces  # changed in place: forward() holds on to it
            for b, pieces in enumerate(held):
                held[b] = _real(pieces, self.tokenize, docs)

    def forwards(self, lane: int) -> bool:
        """Whether ``lane`` replays towards a target that pack's screen will drop bins up
        to, with a tokenizer that counts (see :meth:`forward`)."""
        screen = self.pack.screen
        return (
            self._count is not None
            and screen is not None
            and not screen.monotone  # (pack reorders: it is never)
            and screen.active(lane)
            and self.split.max_len <= self.pack.seq_len
        )

    def process_batch(self, records: list[Record]) -> list[Output]:
        lane = records[0].lane
        if self.forwards(lane) and all(
            r.lane == lane and len(r.contributors) == 1 and r.contributors[0][2:] == (0, True)
            for r in records
        ):
            return self.forward(
                lane,
                [r.contributors[0][:2] for r in records],
                [next(iter(r.mix)) for r in records],
                [r.data for r in records],
            )[0]
        for lane in {r.lane for r in records} & self._bare:
            self.realize(lane)
        tok, split, pack = self.tokenize, self.split, self.pack
        t0 = time.perf_counter()
        texts = tok.texts([r.data for r in records])
        encoded = tok.encode_texts(texts)
        t1 = time.perf_counter()
        pieces: list[Piece] = []
        lanes: list[int] = []  # each piece's lane
        max_len, cap = split.max_len, pack.seq_len
        new, ndarray = tuple.__new__, np.ndarray
        for r, ids in zip(records, encoded, strict=True):
            if type(ids) is not ndarray or ids.dtype is not _INT32:
                ids = np.asarray(ids, _INT32)
            (component,) = r.mix  # a sample: one component
            n = len(ids)
            if ids.ndim != 1 or min(n, max_len) > cap:
                self._slow(r, ids, component, pieces, lanes)  # pack's error
            elif n <= max_len:
                pieces.append((r.contributors, {component: n}, (ids,), n))
                lanes.append(r.lane)
            elif len(r.contributors) != 1 or r.contributors[0][2:] != (0, True):
                self._slow(r, ids, component, pieces, lanes)  # split's error
            else:
                chunk_id, offset = r.contributors[0][:2]
                last = (n - 1) // max_len
                for child, start in enumerate(range(0, n, max_len)):
                    stop = start + max_len if child < last else n
                    pieces.append(
                        (
                            [new(Contributor, (chunk_id, offset, child, child == last))],
                            {component: stop - start},
                            (ids[start:stop],),
                            stop - start,
                        )
                    )
                    lanes.append(r.lane)
        t2 = time.perf_counter()
        out = pack.place_runs(lanes, pieces)
        total = len(pieces)
        records_out = len(out) - sum(1 for o in out if type(o) is Tombstone)
        self._tally(len(records), total, records_out, (t0, t1, t2, time.perf_counter()))
        return out

    def forward(
        self,
        lane: int,
        keys: Sequence[tuple[int, int]],
        components: list[int],
        samples: list[Any],
        to_target: bool = False,
    ) -> tuple[list[Output], int]:
        """What :meth:`process_batch` returns for whole samples of ``lane`` while it replays
        (:meth:`forwards`), placed by their token counts alone, and how many samples that
        took: all of them, or with ``to_target`` those up to the one in which the replay target
        was found (the rest are then for :meth:`process_batch`). Sample ``k`` is offset
        ``keys[k][1]`` of chunk ``keys[k][0]``, of component ``components[k]``.

        A piece waits in its bin as a bare tuple (see :func:`_real`). The bins the replay
        filter would drop become one tombstone; once the target is found, the lane's pieces
        become real ones, whose tokens are made only if their bin is ever assembled.
        """
        assert self._count is not None and self.pack.screen is not None
        tok, pack, screen = self.tokenize, self.pack, self.pack.screen
        t0 = time.perf_counter()
        texts = tok.texts(samples)
        counts = self._count(texts)
        if type(counts) is not list:
            counts = [int(n) for n in counts]
        if len(counts) != len(texts) or (counts and min(counts) < 0):
            raise ValueError(
                f"{type(tok.tokenizer).__name__}.count_tokens returned {len(counts)} counts "
                f"for {len(texts)} texts (least {min(counts, default=0)}); it must return one "
                "count >= 0 per text"
            )
        t1 = time.perf_counter()
        bins = pack.bins(lane)
        fill, held = bins.fill, bins.pieces
        cap, max_len = pack.seq_len, self.split.max_len
        bin_ids = range(pack.num_bins)
        targets = screen.targets
        out: list[Output] = []
        dropped: list[Contributor] = []  # one tombstone for all the bins dropped here
        new = tuple.__new__
        self._bare.add(lane)
        target = targets[lane][1:]  # (chunk_id, offset, child) of the last delivered record
        drops = 0  # bins dropped that were not the target

        # The samples of the pieces made real once the target is found: every bin from then
        # on is delivered, so they are tokenized together before this returns.
        made: dict[tuple[int, int], _Doc] = {}

        def emit(b: int) -> None:
            nonlocal drops
            emptied = held[b]
            if lane not in targets:  # found: from here on, what pack would emit
                held[b] = _real(emptied, tok, made)
                out.append(pack.emit(lane, bins, b))
                return
            held[b] = []
            fill[b] = 0
            i = len(dropped)
            for p in emptied:
                if len(p) == 4:
                    dropped.extend(p[0])
                else:
                    dropped.append(new(Contributor, (*p[0], p[1], p[2])))
            c = dropped[i]  # the record's cursor
            if c[0] != target[0] or c[1] != target[1] or c[2] != target[2]:
                drops += 1  # what the filter does with a record that is not its target
            else:
                screen.drop(lane, c)  # the target: the filter lets go of the lane
                self.realize(lane, made)

        k0 = child0 = 0  # the first piece the loop below places
        if _NATIVE is not None and len(held) <= _NATIVE.MAX_BINS:
            # The same loop in C, for as long as every bin it empties is dropped.
            k0, child0, n, found = _NATIVE.drop_until_target(
                held, fill, cap, max_len, list(keys), components, texts, counts,
                target, Contributor, dropped,
            )  # fmt: skip
            drops += n
            if found is not None:
                screen.drop(lane, found)  # the target: the filter lets go of the lane
                self.realize(lane, made)
        done = len(counts)
        for k in range(k0, len(counts)):
            if to_target and lane not in targets and (k > k0 or not child0):
                done = k  # found, and sample k - 1 is placed whole
                break
            key, comp, text, n = keys[k], components[k], texts[k], counts[k]
            pieces: Sequence[tuple[int, bool, int, int]]
            pieces = ((0, True, 0, n),) if n <= max_len else _cuts(n, max_len)
            if k == k0 and child0:
                pieces = pieces[child0:]
            for child, last, start, stop in pieces:
                room = cap - (stop - start)
                for b in bin_ids:  # first fit
                    if fill[b] <= room:
                        break
                else:
                    b = fill.index(max(fill))  # the fullest goes, lowest index on ties
                    emit(b)
                held[b].append((key, child, last, start, stop, comp, text, n))  # type: ignore[arg-type]
                fill[b] += stop - start
                if fill[b] == cap:
                    emit(b)
        screen.count_dropped(lane, drops)
        n_pieces = done
        if done and max(counts) > max_len:
            n_pieces += sum((n - 1) // max_len for n in counts[:done] if n > max_len)
        self._bare.add(lane)  # again: pieces placed after the target was found are bare
        if lane not in targets:
            self.realize(lane, made)
            waiting = [doc for doc in made.values() if doc.ids is None]
            if waiting:
                encoded = tok.encode_texts([doc.text for doc in waiting])
                for doc, ids in zip(waiting, encoded, strict=True):
                    doc.accept(ids)
        records_out = len(out)  # (what emit() put there after the target: records)
        if dropped:
            out.append(Tombstone(lane, dropped))
        self._tally(done, n_pieces, records_out, (t0, t1, t1, time.perf_counter()))
        return out, done

    def _tally(self, samples: int, pieces: int, outputs: int, times: tuple[float, ...]) -> None:
        """Counts a run into the three operators' stats: ``samples`` tokenized and split into
        ``pieces``, which pack turned into ``outputs``; ``times`` are the four moments that
        bound tokenize, split and pack."""
        t0, t1, t2, t3 = times
        for st, n_in, n_out, seconds in zip(
            self.stats,
            (samples, samples, pieces),
            (samples, pieces, outputs),
            (t1 - t0, t2 - t1, t3 - t2),
            strict=True,
        ):
            st.records_in += n_in
            st.records_out += n_out
            st.seconds += seconds

    def _slow(
        self, record: Record, ids: np.ndarray, component: int, pieces: list[Piece], lanes: list[int]
    ) -> None:
        """One sample through split's and pack's own code."""
        tokenized = Record({"tokens": ids}, record.lane, record.contributors, {component: len(ids)})
        for p in self.split.process(tokenized):
            assert isinstance(p, Record)
            pieces.append(self.pack.piece(p))
            lanes.append(p.lane)

    def on_sentinel(self, sentinel: FlushSentinel) -> None:
        for op in (self.tokenize, self.split, self.pack):
            op.on_sentinel(sentinel)

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        t0 = time.perf_counter()
        self.realize(lane_id)
        out = list(self.pack.flush(reset, lane_id))
        st = self.stats[2]
        st.records_out += sum(1 for o in out if type(o) is not Tombstone)
        st.seconds += time.perf_counter() - t0
        return out

    def pending(self, lane_id: int) -> int:
        return self.pack.pending(lane_id)

    def fresh(self) -> Operator:
        raise TypeError("a fused stage is built by the chain runner from fresh operators")

    def __repr__(self) -> str:
        return f"TokenizeSplitPack({self.tokenize!r}, {self.split!r}, {self.pack!r})"
