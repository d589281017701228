"""``tokenize -> split -> pack`` run as one stage.

The chain runner fuses the three when they follow each other as built (``split`` and
``pack`` on ``"tokens"``, nothing between them): each sample's token array is cut and placed
straight into pack's bins, without a record, a data dict and a mix dict per sample and per
piece on the way. The records that leave are the ones the three operators would emit one
after the other: the same data, contributors, mix and order (tests compare the two paths).
It matters most on a restore, which replays every sample since the lane's epoch began
through this stage, and the fused stage does it for about half the work.

Anything off the common path (a tokenizer returning something other than a 1-D int32
array, a piece longer than ``seq_len``, a sample that is already a piece) takes the
operators' own code, with their own errors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np

from zephon.operators.base import Operator, OpStats, OpTraits, Output
from zephon.operators.pack import Pack, Piece
from zephon.operators.split import Split
from zephon.operators.tokenize import Tokenize
from zephon.records import Contributor, FlushSentinel, Record

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

    def process(self, record: Record) -> Iterable[Output]:
        return self.process_batch([record])

    def process_batch(self, records: list[Record]) -> list[Output]:
        tok, split, pack = self.tokenize, self.split, self.pack
        st_tok, st_split, st_pack = self.stats
        t0 = time.perf_counter()
        texts = [tok._text(r.data) for r in records]
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
        t3 = time.perf_counter()
        for st, n_in, n_out, seconds in (
            (st_tok, len(records), len(records), t1 - t0),
            (st_split, len(records), total, t2 - t1),
            (st_pack, total, len(out), t3 - t2),
        ):
            st.records_in += n_in
            st.records_out += n_out
            st.seconds += seconds
        return out

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
        out = list(self.pack.flush(reset, lane_id))
        st = self.stats[2]
        st.records_out += len(out)
        st.seconds += time.perf_counter() - t0
        return out

    def pending(self, lane_id: int) -> int:
        return self.pack.pending(lane_id)

    def fresh(self) -> Operator:
        raise TypeError("a fused stage is built by the chain runner from fresh operators")

    def __repr__(self) -> str:
        return f"TokenizeSplitPack({self.tokenize!r}, {self.split!r}, {self.pack!r})"
