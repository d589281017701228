"""split: pieces of at most max_len, child numbering and is_last_child, exact reassembly."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

import zephon as zp
from zephon.errors import ContractViolation
from zephon.operators.split import Split
from zephon.records import Contributor, Record, SampleCursor
from zephon.testing import assert_resumes_exactly, take


def _tokens(n: int) -> Record:
    return Record(
        {"tokens": np.arange(10, 10 + n, dtype=np.int32), "labels": np.arange(n) * -1, "doc": "x"},
        3,
        [Contributor(9, 4, 0, True)],
        {2: n},
    )


def test_split_pieces_children_and_flags() -> None:
    out = list(Split(4).process(_tokens(10)))
    assert [p.data["tokens"].tolist() for p in out] == [
        [10, 11, 12, 13],
        [14, 15, 16, 17],
        [18, 19],
    ]
    assert [p.contributors for p in out] == [
        [Contributor(9, 4, 0, False)],
        [Contributor(9, 4, 1, False)],
        [Contributor(9, 4, 2, True)],
    ]
    assert [p.cursor for p in out] == [SampleCursor(3, 9, 4, c) for c in range(3)]
    assert [p.component_tokens for p in out] == [{2: 4}, {2: 4}, {2: 2}]
    # Features of the same length are cut along; others are copied to every piece.
    assert [p.data["labels"].tolist() for p in out] == [[0, -1, -2, -3], [-4, -5, -6, -7], [-8, -9]]
    assert [p.data["doc"] for p in out] == ["x", "x", "x"]


def test_split_exact_multiple_and_short_samples() -> None:
    out = list(Split(5).process(_tokens(10)))
    assert [len(p.data["tokens"]) for p in out] == [5, 5]
    assert [c.is_last_child for p in out for c in p.contributors] == [False, True]
    short = _tokens(5)
    (same,) = Split(5).process(short)
    assert same is short  # fits: passed through untouched, a single last child


def test_split_other_feature() -> None:
    r = Record(
        {"ids": np.arange(5), "tokens": np.arange(2)}, 0, [Contributor(0, 0, 0, True)], {0: 5}
    )
    out = list(Split(2, feature="ids").process(r))
    assert [p.data["ids"].tolist() for p in out] == [[0, 1], [2, 3], [4]]
    assert all(p.data["tokens"].tolist() == [0, 1] for p in out)  # not aligned: copied


def test_split_cuts_every_per_token_feature_together_and_copies_scalars() -> None:
    data = {
        "tokens": np.arange(5, dtype=np.int32),
        "targets": np.arange(5, dtype=np.int64) + 100,
        "mask": np.array([1, 1, 0, 1, 0], np.int8),
        "loss_weight": 0.5,
    }
    out = list(Split(2).process(Record(data, 0, [Contributor(0, 0, 0, True)], {0: 5})))
    assert [p.data["targets"].tolist() for p in out] == [[100, 101], [102, 103], [104]]
    assert [p.data["mask"].tolist() for p in out] == [[1, 1], [0, 1], [0]]
    assert [p.data["loss_weight"] for p in out] == [0.5] * 3
    assert [p.data["targets"].dtype for p in out] == [np.dtype(np.int64)] * 3


def test_split_validation() -> None:
    for bad in (0, -3, 2.5, "4", None):
        with pytest.raises(
            ValueError, match=rf"split\(max_len=\.\.\.\) must be a positive int; got {bad!r}"
        ):
            Split(bad)
    with pytest.raises(
        KeyError,
        match=r"no feature 'tokens' \(its data is a str, not a dict of features\); tokenize first",
    ):
        Split(3).process(Record("raw text", 0, [Contributor(0, 0, 0, True)], {0: 1}))


def test_a_record_without_the_feature_after_tokenize_shows_what_it_has() -> None:
    # Not "tokenize first" alone when the pipeline did tokenize: the message lists the
    # features a map before split left.
    src = zp.StaticMixtureWorkSource({"web": zp.ArraySource(["ab", "cd"])}, num_epochs=1)
    pipe = zp.Pipeline(src, canonical_replicas=1).fetch().tokenize(zp.ByteTokenizer())
    pipe = pipe.map(lambda d: {"ids": d["tokens"]}).split(4).batch(1)
    with pytest.raises(KeyError, match=r"no feature 'tokens' \(its features: \['ids'\]\)"):
        take(pipe)


def test_split_of_a_packed_record_is_a_contract_violation() -> None:
    r = Record(
        {"tokens": np.arange(8)},
        0,
        [Contributor(1, 0, 0, True), Contributor(1, 1, 0, True)],
        {0: 8},
    )
    with pytest.raises(
        ContractViolation, match=r"split got a record that is not a whole sample \(2 contributors"
    ):
        Split(4).process(r)


def test_split_in_a_pipeline_reassembles_every_document(h) -> None:
    tok = zp.ByteTokenizer()
    rec = h.Recorder()
    pipe = h.make_pipeline([list(h.DOCS)], lanes=2).fetch().tokenize(tok).split(6).apply(rec)
    outputs = take(pipe)
    assert len(outputs) == len(rec.seen)
    pieces: dict[tuple[int, int, int], dict[int, tuple[np.ndarray, bool]]] = defaultdict(dict)
    for r in rec.seen:
        assert len(r.contributors) == 1
        chunk, offset, child, last = r.contributors[0]
        assert r.cursor == SampleCursor(r.lane, chunk, offset, child)
        assert 1 <= len(r.data["tokens"]) <= 6
        assert child not in pieces[r.lane, chunk, offset], "duplicate child"
        pieces[r.lane, chunk, offset][child] = (r.data["tokens"], last)
    pointers = h.pointer_map(pipe.source, 2)
    assert set(pieces) == set(pointers)
    for key, children in pieces.items():
        n = len(children)
        assert sorted(children) == list(range(n))
        assert [children[c][1] for c in range(n)] == [False] * (n - 1) + [True]
        assert all(len(children[c][0]) == 6 for c in range(n - 1))  # only the last is short
        whole = np.concatenate([children[c][0] for c in range(n)])
        _, index = pointers[key]
        assert whole.tolist() == tok.encode(h.DOCS[index]).tolist()


def test_splitting_a_split_piece_never_duplicates_cursors(h) -> None:
    # 11 bytes + EOS = 12 tokens: split(8) -> [8 (child 0, not last), 4 (child 1, last)];
    # split(4) then cuts the 8-token piece into children 0 and 1 again.
    rec = h.Recorder()
    pipe = h.make_pipeline([["a" * 11, "b" * 3]], lanes=1)
    pipe = pipe.fetch().tokenize(zp.ByteTokenizer()).split(8).split(4).apply(rec)
    try:
        take(pipe)
    except ContractViolation:
        return  # refusing to split a piece is a fine answer too
    cursors = [r.cursor for r in rec.seen]
    assert len(cursors) == len(set(cursors)), cursors
    per_offset: dict[tuple[int, int], list[Contributor]] = defaultdict(list)
    for r in rec.seen:
        per_offset[r.contributors[0][:2]].extend(r.contributors)
    for contribs in per_offset.values():
        assert sum(c.is_last_child for c in contribs) == 1
        assert sorted(c.child for c in contribs) == list(range(len(contribs)))


def test_split_resumes_exactly(h) -> None:
    def build() -> zp.Pipeline:
        return (
            h.make_pipeline([list(h.DOCS), [d * 2 for d in h.DOCS[:15]]], weights=[0.5, 0.5])
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .split(7)
            .map(h.pad_to(7))
            .batch(4)
        )

    ref = assert_resumes_exactly(build)
    assert 30 <= len(ref) <= 60
