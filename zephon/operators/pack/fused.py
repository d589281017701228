"""``[tokenize ->] split -> pack`` as one stage.

The compiler fuses them where they follow each other as built (``split`` and ``pack`` on
``"tokens"``, nothing between them): each sample's tokens are cut and placed straight into
pack's bins, without a record, a data dict and a mix dict per sample and per piece on the
way. The records that leave are the ones the operators would emit one after the other: the
same data, contributors, mix and order (tests compare the two).

A lane that is replaying after a restore (the plan gives the stage a read-only
:class:`~zephon.plan.steps.ReplayView`), with a tokenizer that can count its tokens
(``count_tokens``), is placed by its samples' lengths alone: each piece's tokens are made
when its bin is assembled, so the bins the replay filter drops never tokenize anything.
Where the plan says so (:attr:`~zephon.plan.compile.Plan.hold_text`: one process running
thousands of lanes), every lane is placed that way and a sample's tokens are made for its
piece's row and not kept: what waits in a lane's bins and rows is the samples' text.

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
from zephon.chunks import WorkChunk
from zephon.operators.base import OpStats, OpTraits, Output
from zephon.operators.pack.assembly import Piece
from zephon.operators.pack.pack import Pack
from zephon.operators.replay import ReplayView
from zephon.operators.split import Split, cut_bounds
from zephon.operators.tokenize import Tokenize
from zephon.records import Contributor, FlushSentinel, Record, whole_samples
from zephon.sources.token_span import NATIVE_SPAN, Span

_INT32 = np.dtype(np.int32)
#: ``zephon._pack.split_pieces``: a pre-tokenized run's pieces in one call, where it is built.
_NATIVE = load("_pack")
#: Samples a replay tokenizes at once when a bin of pieces placed by length is assembled.
FIRST_BATCH = 8


def fusable(ops: list[Any], i: int, threaded: bool) -> int:
    """How many operators from ``ops[i]`` on a :class:`SplitPack` stands for: 3 for a
    built-in ``tokenize, split, pack``, 2 for ``split, pack``, both on ``"tokens"`` alone
    (no meta features or broadcast fields) with a strategy that never cuts a piece
    (:attr:`~zephon.operators.pack.pack.Pack.fusable`); else 0. Every other option of pack
    (strategy, ``max_segments``, pad values, BOS, component feature) lives in its placement
    and assembly, which the stage calls as they are.

    Not a tokenize that asked for threads when there is a pool: it tokenizes a chunk in
    parallel slices, which the fused stage would give up.
    """
    head = ops[i] if i < len(ops) else None
    tok = head if type(head) is Tokenize else None
    if tok is not None and threaded and tok.parallelism > 1:
        return 0
    j = i + (tok is not None)
    if j + 2 > len(ops):
        return 0
    split, pack = ops[j], ops[j + 1]
    if type(split) is Split and type(pack) is Pack and split.feature == "tokens" and pack.fusable:
        return j + 2 - i
    return 0


class _Docs:
    """The samples of one call placed by their token counts, tokenized when first read.

    Kept (``keep``, a replaying lane): a sample's tokens are made in one batch with those
    of the next samples of the call not made yet (after a restore, the samples after the
    one a bin is assembled for are the ones delivered next; those before the replay target
    were dropped), a batch twice as big as the last each time, from :data:`FIRST_BATCH`.
    Not kept (text held): only the sample read is tokenized, and nothing is remembered
    (a row reads each of its pieces once, when it is written; a sample cut into several
    pieces is tokenized for each)."""

    __slots__ = ("texts", "counts", "ids", "tokenize", "batch", "keep")

    def __init__(
        self, texts: list[Any], counts: list[int], tokenize: Tokenize, keep: bool = True
    ) -> None:
        self.texts, self.counts, self.tokenize, self.keep = texts, counts, tokenize, keep
        self.ids: list[np.ndarray | None] = [None] * len(texts) if keep else []
        self.batch = FIRST_BATCH

    def tokens(self, k: int) -> np.ndarray:
        if not self.keep:
            return self._encode([k])[0]
        ids = self.ids[k]
        if ids is None:
            todo = [j for j in range(k, len(self.texts)) if self.ids[j] is None]
            todo = todo[: self.batch]
            self.batch *= 2
            for j, got in zip(todo, self._encode(todo), strict=True):
                self.ids[j] = got
            ids = self.ids[k]
        return ids  # type: ignore[return-value]

    def _encode(self, which: list[int]) -> list[np.ndarray]:
        """The tokens of samples ``which`` (int32, 1-D, contiguous), each checked against
        its count."""
        out = []
        encoded = self.tokenize.encode_texts([self.texts[j] for j in which])
        for j, got in zip(which, encoded, strict=True):
            got = np.ascontiguousarray(got, _INT32)
            if got.ndim != 1 or len(got) != self.counts[j]:
                raise ValueError(
                    f"{type(self.tokenize.tokenizer).__name__}.count_tokens said "
                    f"{self.counts[j]} tokens but encode returned shape {got.shape}; they "
                    "must agree"
                )
            out.append(got)
        return out


class _Doc:
    """As a piece's arrays (pack reads ``doc[0]``, the tokens), sample ``k`` of ``docs``
    whole; :class:`_Span` for a part of it."""

    __slots__ = ("docs", "k")

    def __init__(self, docs: _Docs, k: int) -> None:
        self.docs, self.k = docs, k

    def __len__(self) -> int:
        return 1

    def __getitem__(self, feature: int) -> np.ndarray:
        if feature != 0:
            raise IndexError(feature)
        return self.docs.tokens(self.k)


class _Span:
    """Tokens ``start:stop`` of sample ``k`` of ``docs``, made when pack assembles the
    piece's bin."""

    __slots__ = ("docs", "k", "start", "stop")

    def __init__(self, docs: _Docs, k: int, start: int, stop: int) -> None:
        self.docs, self.k, self.start, self.stop = docs, k, start, stop

    def __len__(self) -> int:
        return 1

    def __getitem__(self, feature: int) -> np.ndarray:
        if feature != 0:
            raise IndexError(feature)
        return self.docs.tokens(self.k)[self.start : self.stop]


class SplitPack:
    """The fused stage; ``counters`` are the operators' own (tokenize's if there is one,
    split's, pack's), set per lane by the runner."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    parallelism = 1
    stalls_at_boundaries = False

    def __init__(self, tokenize: Tokenize | None, split: Split, pack: Pack) -> None:
        self.tokenize, self.split, self.pack = tokenize, split, pack
        self.ops = [op for op in (tokenize, split, pack) if op is not None]
        self.name = pack.name  # what pending() reports on is pack's
        self.counters: list[OpStats] = [OpStats() for _ in self.ops]
        self.replay: ReplayView | None = None
        #: Every lane placed by length, its samples held as text (the plan's choice; see
        #: the module docstring); only where :attr:`can_hold_text`.
        self.hold_text = False
        self._count = getattr(tokenize.tokenizer, "count_tokens", None) if tokenize else None

    @property
    def can_hold_text(self) -> bool:
        """Whether samples can be placed by length: a tokenizer that counts its tokens, and
        pieces that never need cutting by pack."""
        return self._count is not None and self.split.max_len <= self.pack.seq_len

    def process(self, record: Record) -> Iterable[Output]:
        return self.process_batch([record])

    def process_batch(self, records: list[Record]) -> list[Output]:
        out: list[Output] = []
        i, n = 0, len(records)
        while i < n:  # one lane at a time
            lane = records[i].lane
            j = i + 1
            while j < n and records[j].lane == lane:
                j += 1
            run = records[i:j]
            out.extend(
                self._run(
                    lane,
                    [r.data for r in run],
                    [r.contributors for r in run],
                    [r.component_tokens for r in run],
                    run,
                )
            )
            i = j
        return out

    def process_samples(
        self, chunk: WorkChunk, comps: list[int], samples: list[Any], first: int, stop: int
    ) -> list[Output]:
        """:meth:`process_batch` of the records of offsets ``first:stop`` of ``chunk``
        (whose read samples are ``samples``), without making them: the plan's head hands a
        chunk's samples straight to this stage when it comes first."""
        contribs = whole_samples(chunk.chunk_id, first, stop)
        mixes = [{c: 1} for c in comps[first:stop]]
        return self._run(chunk.lane, samples[first:stop], contribs, mixes, None)

    def _run(
        self,
        lane: int,
        datas: list[Any],
        contribs: Sequence[Sequence[Contributor]],
        mixes: list[dict[int, int]],
        records: list[Record] | None,
    ) -> list[Output]:
        """One lane's samples (``datas[k]``, with its contributors and mix) through the
        stage; ``records`` are the records they came as, if they did."""
        t0 = time.perf_counter()
        tok = self.tokenize
        lazy, keep = False, True
        texts = datas
        if tok is None:
            arrays: list[Any] | None = None  # (the samples' "tokens": _Pieces reads them)
        else:
            texts = tok.texts(datas)
            replaying = self.replay is not None and self.replay.replaying(lane)
            lazy = self.can_hold_text and (replaying or self.hold_text)
            keep = replaying
            arrays = self._counts(texts) if lazy else list(tok.encode_texts(texts))
        t1 = time.perf_counter()
        pieces = _Pieces(
            self, lane, datas, contribs, mixes, records, arrays, texts, lazy, keep
        ).pieces
        t2 = time.perf_counter()
        out = self.pack.place(lane, pieces)
        t3 = time.perf_counter()
        self._tally(len(datas), len(pieces), len(out), (t0, t1, t2, t3))
        return out

    def _counts(self, texts: list[Any]) -> list[int]:
        assert self._count is not None and self.tokenize is not None
        counts = self._count(texts)
        if type(counts) is not list:
            counts = [int(n) for n in counts]
        if len(counts) != len(texts) or (counts and min(counts) < 0):
            raise ValueError(
                f"{type(self.tokenize.tokenizer).__name__}.count_tokens returned {len(counts)} "
                f"counts for {len(texts)} texts (least {min(counts, default=0)}); it must "
                "return one count >= 0 per text"
            )
        return counts

    def _tally(self, samples: int, pieces: int, outputs: int, times: tuple[float, ...]) -> None:
        """Counts a run into the operators' counters: ``samples`` (tokenized and) split into
        ``pieces``, which pack turned into ``outputs``; ``times`` are the four moments that
        bound (tokenize,) split and pack."""
        t0, t1, t2, t3 = times
        counts = [(samples, samples, t1 - t0)] if self.tokenize is not None else []
        split_s = t2 - t1 if self.tokenize is not None else t2 - t0
        counts += [(samples, pieces, split_s), (pieces, outputs, t3 - t2)]
        for st, (n_in, n_out, seconds) in zip(self.counters, counts, strict=True):
            st.records_in += n_in
            st.records_out += n_out
            st.seconds += seconds

    def on_sentinel(self, sentinel: FlushSentinel) -> None:
        for op in self.ops:
            op.on_sentinel(sentinel)

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        t0 = time.perf_counter()
        out = list(self.pack.flush(reset, lane_id))
        st = self.counters[-1]
        st.records_out += len(out)
        st.seconds += time.perf_counter() - t0
        return out

    def pending(self, lane_id: int) -> int:
        return self.pack.pending(lane_id)

    def __repr__(self) -> str:
        return f"SplitPack({self.tokenize!r}, {self.split!r}, {self.pack!r})"


class _Pieces:
    """The pieces of one lane's samples, made in one pass: sample ``k`` has ``contribs[k]``,
    ``mixes[k]`` and its tokens (``arrays[k]``) or, when ``lazy``, its text and token count
    (its pieces' tokens are made on assembly); anything off the common path goes through
    the operators' own code (and their errors)."""

    __slots__ = (
        "stage",
        "lane",
        "datas",
        "contribs",
        "mixes",
        "records",
        "texts",
        "lazy",
        "pieces",
    )

    def __init__(
        self,
        stage: SplitPack,
        lane: int,
        datas: list[Any],
        contribs: Sequence[Sequence[Contributor]],
        mixes: list[dict[int, int]],
        records: list[Record] | None,
        arrays: list[Any] | None,
        texts: list[Any],
        lazy: bool,
        keep: bool = True,
    ) -> None:
        self.stage, self.lane, self.datas, self.records = stage, lane, datas, records
        self.contribs, self.mixes, self.texts, self.lazy = contribs, mixes, texts, lazy
        max_len, cap = stage.split.max_len, stage.pack.seq_len
        tokenized = stage.tokenize is not None
        if arrays is None:  # pre-tokenized: the samples' own arrays, or token spans
            got = (
                _NATIVE.split_pieces(
                    Piece,
                    Contributor,
                    np.ndarray,
                    NATIVE_SPAN,
                    datas,
                    contribs,
                    mixes,
                    "tokens",
                    max_len,
                )  # fmt: skip
                if _NATIVE is not None and type(datas) is list and type(mixes) is list
                else None
            )
            if got is not None:  # the common path below, in one C call
                self.pieces = got
                return
            arrays = [
                d if type(d) is Span else d.get("tokens") if type(d) is dict else None
                for d in datas
            ]
        self.pieces = []
        pieces = self.pieces
        docs = _Docs(texts, arrays, stage.tokenize, keep) if lazy else None  # type: ignore[arg-type]
        ndarray = np.ndarray
        new = tuple.__new__
        for k, ids in enumerate(arrays):
            if docs is not None:
                n = ids  # a count
            elif not tokenized:
                if type(ids) is Span:
                    n = ids.hi - ids.lo
                elif not isinstance(ids, ndarray) or ids.ndim != 1:  # split and pack say why
                    self._slow(k, None)
                    continue
                else:
                    n = len(ids)
            else:
                if type(ids) is not ndarray or ids.dtype is not _INT32:
                    ids = np.asarray(ids, _INT32)
                n = len(ids)
                if ids.ndim != 1 or min(n, max_len) > cap:
                    self._slow(k, ids)  # pack's error
                    continue
            whole = contribs[k]
            if n <= max_len:
                # Tokenized, a sample weighs its tokens; pre-tokenized, split and pack
                # leave its mix as it came.
                mix = {next(iter(mixes[k])): n} if tokenized else mixes[k]
                if docs is not None:
                    arrays_k: Any = _Doc(docs, k)
                else:
                    arrays_k = ids if type(ids) is Span else (ids,)
                pieces.append(new(Piece, (whole, mix, arrays_k, n)))
            elif len(whole) != 1 or whole[0][2:] != (0, True):
                self._slow(k, ids if tokenized else None)  # split's error
            else:
                (component,) = mixes[k]
                chunk_id, offset = whole[0][0], whole[0][1]
                bounds = cut_bounds(n, max_len, max_len)
                last = len(bounds) - 2
                for child in range(last + 1):
                    lo, hi = bounds[child], bounds[child + 1]
                    one = (new(Contributor, (chunk_id, offset, child, child == last)),)
                    part: Any
                    if docs is not None:
                        part = _Span(docs, k, lo, hi)
                    elif type(ids) is Span:
                        part = Span(ids.tokens, ids.lo + lo, ids.lo + hi)
                    else:
                        part = (ids[lo:hi],)
                    pieces.append(new(Piece, (one, {component: hi - lo}, part, hi - lo)))

    def _slow(self, k: int, ids: Any) -> None:
        """Sample ``k`` through split's and pack's own code (and their errors)."""
        record = self._record(k)
        if ids is not None:
            (component,) = record.component_tokens
            record = Record(
                {"tokens": ids}, record.lane, record.contributors, {component: len(ids)}
            )
        split, pack = self.stage.split, self.stage.pack
        for part in split.process(record):
            assert isinstance(part, Record)
            self.pieces.append(pack.piece(part))

    def _record(self, k: int) -> Record:
        if self.records is not None:
            return self.records[k]
        if self.lazy:  # the operators' code wants tokens
            ids = np.asarray(self.stage.tokenize.tokenizer.encode(self.texts[k]), _INT32)  # type: ignore[union-attr]
            (component,) = self.mixes[k]
            return Record({"tokens": ids}, self.lane, list(self.contribs[k]), {component: len(ids)})
        data = self.datas[k]
        if type(data) is Span:  # a token span as the sample it stands for
            data = {"tokens": data[0]}
        return Record(data, self.lane, list(self.contribs[k]), self.mixes[k])
