"""pack: first-fit bins, the fullest-bin rule, Grain's output features, conservation."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.operators.pack.assembly import RowAssembler
from zephon.operators.pack.pack import Pack
from zephon.records import Contributor, LazyRecord, Record, SampleCursor
from zephon.testing import assert_resumes_exactly, assert_resumes_through_breaks, take


def _feed(
    op: Pack, lengths: list[int], *, lane: int = 0, start_offset: int = 0
) -> list[list[Record]]:
    """Feed pieces of ``lengths`` (offsets counting up); per piece, the records emitted."""
    out = []
    for i, n in enumerate(lengths):
        off = start_offset + i
        out.append(list(op.process(_piece(n, off, lane))))
    return out


def _piece(n: int, offset: int, lane: int = 0) -> Record:
    # Token values encode the offset so every piece is recognisable in the output.
    tokens = np.full(n, 100 + offset, dtype=np.int32)
    return Record({"tokens": tokens}, lane, [Contributor(0, offset, 0, True)], {offset % 2: n})


def _offsets(rec: Record) -> list[int]:
    return [c.offset for c in rec.contributors]


def test_output_features_segment_ids_positions_dtypes() -> None:
    op = Pack(seq_len=10, num_bins=1)
    assert _feed(op, [3, 4]) == [[], []]
    (out,) = op.flush(True, 0)
    d = out.data
    assert set(d) == {"tokens", "tokens_segment_ids", "tokens_positions"}
    assert d["tokens"].tolist() == [100, 100, 100, 101, 101, 101, 101, 0, 0, 0]
    assert d["tokens_segment_ids"].tolist() == [1, 1, 1, 2, 2, 2, 2, 0, 0, 0]
    assert d["tokens_positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0, 0]
    for v in d.values():
        assert v.dtype == np.int32 and v.shape == (10,)
    assert out.contributors == [Contributor(0, 0, 0, True), Contributor(0, 1, 0, True)]
    assert out.cursor == SampleCursor(0, 0, 0, 0)  # the first fragment's cursor
    assert out.component_tokens == {0: 3, 1: 4}
    assert op.pending(0) == 0


def test_several_features_are_packed_alike() -> None:
    op = Pack(seq_len=6, num_bins=1, features=("tokens", "labels"))
    for off, n in enumerate([2, 3]):
        r = Record(
            {"tokens": np.arange(n, dtype=np.int32) + 1, "labels": np.full(n, -off - 1, np.int64)},
            0,
            [Contributor(0, off, 0, True)],
            {0: n},
        )
        assert list(op.process(r)) == []
    (out,) = op.flush(True, 0)
    assert out.data["tokens"].tolist() == [1, 2, 1, 2, 3, 0]
    assert out.data["labels"].tolist() == [-1, -1, -2, -2, -2, 0]
    assert out.data["labels"].dtype == np.int64
    assert out.data["labels_segment_ids"].tolist() == [1, 1, 2, 2, 2, 0]
    assert out.data["labels_positions"].tolist() == [0, 1, 0, 1, 2, 0]


def test_features_of_different_lengths_are_an_error() -> None:
    op = Pack(seq_len=6, num_bins=1, features=("tokens", "labels"))
    r = Record(
        {"tokens": np.arange(3), "labels": np.arange(2)}, 0, [Contributor(0, 0, 0, True)], {0: 3}
    )
    with pytest.raises(ValueError, match=r"differ in length \[3, 2\]"):
        op.process(r)


def test_first_fit_places_each_piece_in_the_lowest_bin_it_fits() -> None:
    # 6 -> bin0; 6 -> bin1; 3 -> bin0 (9); 5 -> bin2; 1 -> bin0 (10: full, emitted).
    op = Pack(seq_len=10, num_bins=3)
    emitted = _feed(op, [6, 6, 3, 5, 1])
    assert [[_offsets(r) for r in e] for e in emitted] == [[], [], [], [], [[0, 2, 4]]]
    assert op.pending(0) == 2
    flushed = list(op.flush(True, 0))
    assert [_offsets(r) for r in flushed] == [[1], [3]]  # bin order


def test_a_bin_is_emitted_as_soon_as_it_is_full() -> None:
    op = Pack(seq_len=10, num_bins=2)
    emitted = _feed(op, [4, 6, 10])
    assert [[_offsets(r) for r in e] for e in emitted] == [[], [[0, 1]], [[2]]]
    assert emitted[1][0].data["tokens_segment_ids"].tolist() == [1] * 4 + [2] * 6
    assert op.pending(0) == 0


def test_when_nothing_fits_the_fullest_bin_goes_and_its_slot_takes_the_piece() -> None:
    op = Pack(seq_len=10, num_bins=2)
    # 6 -> bin0; 8 -> bin1; 5 fits nowhere: bin1 (8) is fullest, emitted; 5 -> bin1.
    emitted = _feed(op, [6, 8, 5])
    assert [[_offsets(r) for r in e] for e in emitted] == [[], [], [[1]]]
    # 4 fits bin0 (6 + 4 = 10): full, emitted.
    assert [_offsets(r) for r in op.process(_piece(4, 3))] == [[0, 3]]
    assert [_offsets(r) for r in op.flush(True, 0)] == [[2]]


def test_fullest_bin_ties_go_to_the_lowest_index() -> None:
    op = Pack(seq_len=10, num_bins=3)
    # 7 -> bin0; 7 -> bin1; 2 -> bin0 (9); 2 -> bin1 (9); 5 -> bin2; 6: fits nowhere,
    # bins 0 and 1 tie at 9: bin0 goes and takes the 6.
    emitted = _feed(op, [7, 7, 2, 2, 5, 6])
    assert [[_offsets(r) for r in e] for e in emitted] == [[], [], [], [], [], [[0, 2]]]
    assert [_offsets(r) for r in op.flush(True, 0)] == [[5], [1, 3], [4]]


def _emission_steps(prefix: list[int], stream_len: int) -> tuple[list[int], list[list[int]]]:
    """Feed ``prefix`` then 3-token pieces; the (1-based) 3-piece numbers that trigger an
    emission, and the emitted bins' fills."""
    op = Pack(seq_len=10, num_bins=2)
    _feed(op, prefix, start_offset=1000)
    steps, fills = [], []
    for i in range(1, stream_len + 1):
        for r in op.process(_piece(3, i)):
            steps.append(i)
            fills.append(int((r.data["tokens_segment_ids"] > 0).sum()))
    return steps, fills


def test_phase_shift_example_of_the_seed_page() -> None:
    # Two bins of 10 fed [3, 3, 3, ...]: from empty bins (10, 10 free) the first bin fills
    # to 9, then the second; from then on a piece fits nowhere every third step and bin0
    # (tied at 9, lowest index) goes.
    empty_steps, empty_fills = _emission_steps([], 30)
    assert empty_steps == list(range(7, 31, 3))
    assert set(empty_fills) == {9}
    # From (5, 10 free) — a 5-token piece already in a bin — the same periodic cycle,
    # permanently phase-shifted: the packers never converge.
    shifted_steps, shifted_fills = _emission_steps([5], 30)
    assert shifted_steps == list(range(5, 31, 3))
    assert set(shifted_fills) == {9}
    assert not set(empty_steps) & set(shifted_steps)


def test_piece_longer_than_seq_len_names_split() -> None:
    with pytest.raises(
        ValueError, match=r"piece of 11 tokens is longer than seq_len=10.*\.split\(max_len=10\)"
    ):
        Pack(seq_len=10).process(_piece(11, 0))


def test_missing_feature_is_a_key_error() -> None:
    r = Record({"ids": np.arange(3)}, 0, [Contributor(0, 0, 0, True)], {0: 3})
    with pytest.raises(
        KeyError,
        match=r"no feature 'tokens' \(its features: \['ids'\]\); pack\(features=\['tokens'\]\) "
        r"needs every feature in each record: tokenize first",
    ):
        Pack(seq_len=10).process(r)


def test_pack_validation() -> None:
    with pytest.raises(ValueError, match=r"pack\(seq_len=\.\.\.\) must be a positive int; got 0"):
        Pack(0)
    with pytest.raises(ValueError, match=r"pack\(num_bins=\.\.\.\) must be a positive int; got 0"):
        Pack(8, num_bins=0)
    with pytest.raises(ValueError, match=r"pack\(features=\.\.\.\) must be a non-empty list"):
        Pack(8, features="tokens")
    with pytest.raises(ValueError, match=r"pack\(features=\.\.\.\) must be a non-empty list"):
        Pack(8, features=())


def test_a_seq_len_past_int32_positions_is_refused_at_construction() -> None:
    from zephon.operators.pack.pack import MAX_SEQ_LEN

    assert MAX_SEQ_LEN == 2**31 - 1
    Pack(MAX_SEQ_LEN)  # the limit itself is fine: nothing is allocated before a row
    with pytest.raises(
        ValueError,
        match=r"pack\(seq_len=\.\.\.\) must be at most 2147483647 \(2\*\*31 - 1: positions and "
        r"segment ids are int32\); got 1099511627776: give the model's context length",
    ):
        Pack(2**40)


def _docs_pipeline(docs: list[np.ndarray]) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        {"web": zp.ArraySource(docs)}, shuffle=False, num_epochs=1, chunk_size=8
    )
    return zp.Pipeline(src, canonical_replicas=1).fetch().map(lambda a: {"tokens": a})


def test_a_piece_of_another_dtype_in_a_row_names_its_sample_and_both_dtypes() -> None:
    docs = [np.arange(4, dtype=np.int64 if i == 3 else np.int32) for i in range(8)]
    with pytest.raises(
        ValueError,
        match=r"pack: feature 'tokens' of the sample of component 'web' \(0\) at lane 0, chunk "
        r"0, offset 3 is int64, where the row's first piece \(the sample of component 'web' "
        r"\(0\) at lane 0, chunk 0, offset 0\) has int32; every sample must give a feature one "
        r"dtype: cast it in \.map\(\) \(e\.g\. np\.asarray\(x, 'int32'\)\)",
    ):
        take(_docs_pipeline(docs).pack(16).batch(1))


def test_rows_of_two_dtypes_in_one_batch_name_the_row_and_both_dtypes() -> None:
    # One piece a row: each row is of one dtype, the batch of two is not.
    docs = [np.arange(8, dtype=np.int64 if i == 1 else np.int32) for i in range(4)]
    with pytest.raises(
        ValueError,
        match=r"batch: feature 'tokens' cannot be stacked: the sample of component 'web' \(0\) "
        r"at lane 0, chunk 0, offset 1 has dtype int64 \(the first record's: int32\)",
    ):
        take(_docs_pipeline(docs).pack(8, num_bins=1).batch(2))


def test_a_broadcast_field_of_two_number_types_in_a_row_names_the_sample() -> None:
    op = Pack(8, num_bins=1, broadcast=["loss_weight"])
    records = [
        Record({"tokens": np.arange(2), "loss_weight": w}, 0, [Contributor(5, k, 0, True)], {1: 2})
        for k, w in enumerate([1, 0.5])
    ]
    (row,) = list(op.process_batch(records)) + list(op.flush(True, 0))
    with pytest.raises(
        ValueError,
        match=r"pack: feature 'loss_weight' of the sample of component 1 at lane 0, chunk 5, "
        r"offset 1 is float64, where the row's first piece \(.* offset 0\) has int64; .* or "
        r"give it one in pack\(broadcast=\{'loss_weight': 'float64'\}\)",
    ):
        row.materialize(None)


def test_flush_emits_partial_bins_and_resets_only_that_lane() -> None:
    op = Pack(seq_len=10, num_bins=2)
    _feed(op, [6, 6], lane=0)
    _feed(op, [2], lane=1)
    assert (op.pending(0), op.pending(1)) == (2, 1)
    out = list(op.flush(True, 0))
    assert [int((r.data["tokens_segment_ids"] > 0).sum()) for r in out] == [6, 6]
    assert (op.pending(0), op.pending(1)) == (0, 1)
    assert list(op.flush(True, 0)) == []
    # Lane 0 starts over from empty bins (with the old 6s still there, the 4 would have
    # filled bin0 at once).
    assert [[_offsets(r) for r in e] for e in _feed(op, [4, 6], lane=0)] == [[], [[0, 1]]]
    assert [_offsets(r) for r in op.flush(True, 1)] == [[0]]


def test_fresh_copies_share_no_bins() -> None:
    op = Pack(seq_len=10, num_bins=2)
    _feed(op, [3])
    clone = op.fresh()
    assert clone.pending(0) == 0 and op.pending(0) == 1


def test_pack_conserves_every_token_and_reassembles_documents(h) -> None:
    tok = zp.ByteTokenizer()
    rec = h.Recorder()
    pipe = h.make_pipeline([list(h.DOCS)], lanes=1, k=3)
    pipe = pipe.fetch().tokenize(tok).split(8).pack(12, num_bins=3).apply(rec)
    outputs = take(pipe)
    all_tokens = Counter(t for d in h.DOCS for t in tok.encode(d).tolist())
    packed = Counter(t for o in outputs for t in o["tokens"][o["tokens_segment_ids"] > 0].tolist())
    assert packed == all_tokens
    # Every segment is one split piece; pieces of one document reassemble it exactly.
    pieces: dict[tuple[int, int], dict[int, list[int]]] = defaultdict(dict)
    for r in rec.seen:
        seg = r.data["tokens_segment_ids"]
        assert len(r.contributors) == seg.max()
        for s, c in enumerate(r.contributors, start=1):
            pieces[c.chunk_id, c.offset][c.child] = r.data["tokens"][seg == s].tolist()
            assert r.data["tokens_positions"][seg == s].tolist() == list(range((seg == s).sum()))
        assert (seg[: (seg > 0).sum()] > 0).all(), "padding only at the end"
    pointers = h.pointer_map(pipe.source, 1)
    assert {(c, o) for (_, c, o) in pointers} == set(pieces)
    for (chunk, offset), children in pieces.items():
        _, index = pointers[0, chunk, offset]
        whole = [t for c in sorted(children) for t in children[c]]
        assert whole == tok.encode(h.DOCS[index]).tolist()


def _pack_pipeline(h) -> zp.Pipeline:
    return (
        h.make_pipeline([list(h.DOCS), [d[::-1] * 2 for d in h.DOCS[:20]]], weights=[1, 1], k=2)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(10)
        .pack(16, num_bins=3)
        .batch(2)
    )


def test_pack_resumes_exactly(h) -> None:
    ref = assert_resumes_exactly(lambda: _pack_pipeline(h))
    assert 20 <= len(ref) <= 60
    for b in ref:
        assert b["tokens"].shape == b["tokens_segment_ids"].shape == (2, 16)


def test_pack_resumes_through_several_breaks(h) -> None:
    assert_resumes_through_breaks(lambda: _pack_pipeline(h), [1, 4, 5, 11, 17])


def test_packed_records_are_assembled_on_first_read_only() -> None:
    op = Pack(seq_len=4, num_bins=1)
    (rec,) = _feed(op, [2, 2])[1]
    assert isinstance(rec, LazyRecord) and not rec.built
    assert _offsets(rec) == [0, 1] and rec.component_tokens == {0: 2, 1: 2}  # known before assembly
    first = rec.data
    assert rec.built and rec.data is first
    np.testing.assert_array_equal(first["tokens"], [100, 100, 101, 101])
    rec.data = {"tokens": np.zeros(4, np.int32)}  # a later operator may replace it
    assert rec.data["tokens"].sum() == 0


def test_restore_never_assembles_the_bins_the_replay_filter_drops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = [f"w{i} " * (1 + (i * 37) % 90) for i in range(600)]

    def build() -> zp.Pipeline:
        src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=3, chunk_size=16)
        return (
            zp.Pipeline(src, canonical_replicas=1, flush_every_k_chunks=4, prefetch=0)
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .split(max_len=64)
            .pack(seq_len=64, num_bins=4)
            .batch(2)
        )

    with build() as p:
        take(p, 30)
        state = p.checkpoint()
        expected = take(p, 3)
    assembled = 0
    assemble, write = RowAssembler.assemble, RowAssembler.write_rows

    def counting(self: RowAssembler, *columns: Any) -> dict[str, np.ndarray]:
        nonlocal assembled
        assembled += 1
        return assemble(self, *columns)

    def counting_write(self: RowAssembler, records: list, out: dict[str, np.ndarray]) -> None:
        nonlocal assembled
        assembled += len(records)
        write(self, records, out)

    # A row is assembled on its own, or written straight into its batch's row.
    monkeypatch.setattr(RowAssembler, "assemble", counting)
    monkeypatch.setattr(RowAssembler, "write_rows", counting_write)
    with build() as q:
        q.restore(state)
        got = take(q, 3)
        stats = q.stats()
    for a, b in zip(expected, got, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    (batch_op,) = [o for o in stats["operators"] if o["name"] == "batch"]
    assert stats["replay_dropped_records"] > 0
    # Only the rows of the batches read were assembled (the in-process executor stacks a
    # batch when its data is read, and prefetch=0 reads ahead nothing): never a bin the
    # filter dropped, nor one still waiting in a batch nobody asked for.
    assert assembled == 2 * len(got) < batch_op["records_in"]


@pytest.mark.native  # the rows go straight in where C assembles them
@pytest.mark.parametrize(
    "pack_kw",
    [
        {"features": ("tokens",)},
        {"features": ("tokens", "labels"), "pad_values": {"labels": -100}},
        {"features": ("tokens",), "meta_features": ("mask",), "pad_values": {"mask": 7}},
    ],
)
def test_rows_written_into_the_batch_equal_rows_assembled_one_by_one(
    monkeypatch: pytest.MonkeyPatch, pack_kw: dict
) -> None:
    """batch writes packed rows straight into its arrays (``batch_layout``/``write_rows``);
    the same batches as each row assembled on its own and stacked: keys, order, dtypes."""
    from zephon.operators.pack.pack import PackedRow

    def build() -> zp.Pipeline:
        docs = [
            {
                "tokens": np.arange(1 + (i * 37) % 50, dtype=np.int32) + i,
                "labels": np.full(1 + (i * 37) % 50, i, dtype=np.int32),
                "mask": np.ones(1 + (i * 37) % 50, dtype=np.int8),
            }
            for i in range(300)
        ]
        src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=1, chunk_size=16)
        return (
            zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2, prefetch=0)
            .fetch()
            .pack(seq_len=64, num_bins=3, **pack_kw)
            .batch(3)
        )

    from zephon.operators.pack.assembly import RowAssembler

    written = 0
    write_rows = RowAssembler.write_rows

    def counting(self: RowAssembler, records: list, out: dict) -> None:
        nonlocal written
        written += len(records)
        write_rows(self, records, out)

    monkeypatch.setattr(RowAssembler, "write_rows", counting)
    with build() as p:
        direct = take(p, 25)
    assert written == 25 * 3  # every row of every batch went straight in
    monkeypatch.setattr(PackedRow, "row_writer", lambda self: None)
    with build() as q:
        one_by_one = take(q, 25)
    assert len(direct) == len(one_by_one) == 25
    for a, b in zip(direct, one_by_one, strict=True):
        assert list(a) == list(b)
        for k in a:
            assert a[k].dtype == b[k].dtype, k
            np.testing.assert_array_equal(a[k], b[k])


def test_a_piece_left_in_a_bin_holds_a_copy_not_a_view_of_its_samples_buffer() -> None:
    # A tokenizer may encode a whole chunk into one buffer; what waits in a lane's bins
    # must not keep that buffer alive (a process may hold thousands of lanes' bins).
    op = Pack(seq_len=10, num_bins=2)
    placed, rows = [], []
    for call in range(3):  # pieces placed by earlier calls stay copied too
        big = np.arange(1000, dtype=np.int32) + 1 + 1000 * call
        records = [
            Record({"tokens": big[i * 3 : i * 3 + 3]}, 0, [Contributor(call, i, 0, True)], {0: 3})
            for i in range(3)
        ]
        placed += big[:9].tolist()
        rows += op.process_batch(records)
        for pieces in op.bins(0).pieces:
            for p in pieces:
                tokens = p.arrays[0]
                assert tokens.base is None or tokens.base.nbytes <= 2 * tokens.nbytes
    rows += op.flush(True, 0)
    assert sorted(t for r in rows for t in r.data["tokens"].tolist() if t) == sorted(placed)
