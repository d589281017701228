"""batch: stacks one lane's records; drop_last; must be last; spans epoch boundaries."""

from __future__ import annotations

import numpy as np
import pytest

import zephon as zp
from zephon.operators.batch import Batch
from zephon.records import BatchRecord, Contributor, Record, SampleCursor, Tombstone
from zephon.testing import assert_resumes_exactly, take

ROWS = np.arange(23 * 3, dtype=np.int64).reshape(23, 3)  # 23 rows of 3


def _rows_pipeline(
    h, *, drop_last: bool, batch_size: int = 5, k: int | None = None, reorder: bool = False
) -> zp.Pipeline:
    pipe = h.make_pipeline([ROWS], lanes=1, shuffle=False, chunk_size=5, k=k).fetch()
    if reorder:
        pipe = pipe.shuffle(1)  # an epoch pipeline that keeps the order
    return pipe.batch(batch_size, drop_last=drop_last)


def test_shapes_and_values_drop_last(h) -> None:
    out = take(_rows_pipeline(h, drop_last=True))
    assert len(out) == 4  # 23 rows: 4 batches of 5, the last 3 rows dropped
    for i, b in enumerate(out):
        assert b.shape == (5, 3) and b.dtype == np.int64
        assert np.array_equal(b, ROWS[5 * i : 5 * i + 5])


def test_keep_last_emits_the_remainder(h) -> None:
    out = take(_rows_pipeline(h, drop_last=False))
    assert [b.shape for b in out] == [(5, 3)] * 4 + [(3, 3)]
    assert np.array_equal(np.concatenate(out), ROWS)


def test_dict_records_are_stacked_per_key(h) -> None:
    pipe = h.make_pipeline([list(range(10))], lanes=1, shuffle=False).fetch()
    pipe = pipe.map(lambda i: {"x": np.full((2, 2), i, np.float32), "id": i}).batch(4)
    out = take(pipe)
    assert len(out) == 2
    assert out[0]["x"].shape == (4, 2, 2) and out[0]["x"].dtype == np.float32
    assert out[0]["id"].tolist() == [0, 1, 2, 3] and out[1]["id"].tolist() == [4, 5, 6, 7]
    assert np.array_equal(out[1]["x"][:, 0, 0], [4, 5, 6, 7])


def test_scalar_records_are_stacked(h) -> None:
    out = take(h.make_pipeline([list(range(9))], lanes=1, shuffle=False).fetch().batch(3))
    assert [b.tolist() for b in out] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert all(b.shape == (3,) for b in out)


def test_batches_never_mix_lanes(h) -> None:
    pipe = h.make_pipeline([list(range(40))], lanes=2, shuffle=False).fetch().batch(4)
    out = take(pipe)
    # Lane l of 2 takes samples l, l + 2, ...; interleave alternates lanes.
    assert len(out) == 10
    for i, b in enumerate(out):
        assert len(set(b % 2)) == 1 and b[0] % 2 == i % 2


def test_batch_spans_epoch_boundaries(h) -> None:
    # Epochs of 2 chunks x 5 = 10 rows; batches of 4 run straight across them.
    out = take(_rows_pipeline(h, drop_last=True, batch_size=4, k=2, reorder=True))
    assert [b[:, 0].tolist() for b in out][2] == [24, 27, 30, 33]  # rows 8..11
    assert np.array_equal(np.concatenate(out), ROWS[:20])


def test_mismatched_shapes_are_a_value_error_naming_the_feature(h) -> None:
    pipe = h.make_pipeline([list(range(6))], lanes=1, shuffle=False).fetch()
    pipe = pipe.map(lambda i: {"x": np.zeros(1 + i % 2)}).batch(2)
    with pytest.raises(
        ValueError,
        match=r"batch: feature 'x' cannot be stacked: the sample of component 0 at lane 0, "
        r"chunk 0, offset 1 has shape \(2,\) \(the first record's: \(1,\)\), where the "
        r"batch's first record is the sample of component 0 at lane 0, chunk 0, offset 0; .*"
        r"pad or pack records to one shape before batch",
    ):
        take(pipe)


def test_mismatched_shapes_of_plain_arrays_name_batch(h) -> None:
    pipe = h.make_pipeline([[np.zeros(3), np.zeros(4)]], lanes=1, shuffle=False).fetch().batch(2)
    with pytest.raises(
        ValueError,
        match=r"batch: records cannot be stacked: the sample of component 0 at lane 0, chunk 0, "
        r"offset 1 has shape \(4,\) \(the first record's: \(3,\)\).*; .*pad or pack",
    ):
        take(pipe)


def _named_source(docs: list, **kw) -> zp.StaticMixtureWorkSource:
    return zp.StaticMixtureWorkSource(
        {"web": zp.ArraySource(docs)}, shuffle=False, num_epochs=1, chunk_size=8, **kw
    )


def test_a_dtype_that_changes_within_a_feature_names_the_sample_and_both_dtypes() -> None:
    # Sample 3 gives int64 tokens where the others give int32: an error, never an upcast.
    docs = [np.arange(4, dtype=np.int64 if i == 3 else np.int32) for i in range(8)]
    pipe = zp.Pipeline(_named_source(docs), canonical_replicas=1).fetch()
    pipe = pipe.map(lambda a: {"tokens": a}).batch(4)
    with pytest.raises(
        ValueError,
        match=r"batch: feature 'tokens' cannot be stacked: the sample of component 'web' \(0\) "
        r"at lane 0, chunk 0, offset 3 has dtype int64 \(the first record's: int32\), where the "
        r"batch's first record is the sample of component 'web' \(0\) at lane 0, chunk 0, "
        r"offset 0; the records of a batch need one dtype and shape \(per feature\): cast it to "
        r"one dtype in \.map\(\) \(e\.g\. np\.asarray\(x, 'int32'\)\)",
    ):
        take(pipe)


def test_an_image_whose_shape_changes_names_the_sample_and_both_shapes() -> None:
    imgs = [np.zeros((32, 32) if i < 2 else (16, 16), np.uint8) for i in range(4)]
    pipe = zp.Pipeline(_named_source(imgs), canonical_replicas=1).fetch()
    with pytest.raises(
        ValueError,
        match=r"batch: records cannot be stacked: the sample of component 'web' \(0\) at lane "
        r"0, chunk 0, offset 2 has shape \(16, 16\) \(the first record's: \(32, 32\)\)",
    ):
        take(pipe.batch(4))
    with pytest.raises(
        ValueError,
        match=r"batch: feature 'image' cannot be stacked: .* offset 2 has shape \(16, 16\) "
        r"\(the first record's: \(32, 32\)\)",
    ):
        take(pipe.map(lambda a: {"image": a}).batch(4))


def test_strings_of_any_length_still_stack() -> None:
    pipe = zp.Pipeline(_named_source(["ab", "cdx"]), canonical_replicas=1).fetch()
    (out,) = take(pipe.map(lambda s: {"id": s}).batch(2))
    assert out["id"].tolist() == ["ab", "cdx"]


def test_a_batch_size_past_the_limit_is_refused_at_construction() -> None:
    from zephon.operators.batch import MAX_BATCH_SIZE

    assert MAX_BATCH_SIZE == 2**24
    Batch(MAX_BATCH_SIZE)  # the limit itself is fine
    with pytest.raises(
        ValueError,
        match=r"batch\(batch_size=\.\.\.\) must be at most 16777216 \(2\*\*24 records: .*\); got "
        r"1099511627776: give the batch of one lane",
    ):
        zp.Pipeline(_named_source(["a"])).fetch().batch(2**40)


def test_dict_records_of_a_wider_dtype_are_not_truncated(h) -> None:
    big = 2**40 + 5
    pipe = h.make_pipeline([[0, 1]], lanes=1, shuffle=False).fetch()
    pipe = pipe.map(lambda i: {"x": np.int32(1) if i == 0 else np.int64(big)}).batch(2)
    try:
        (out,) = take(pipe)
    except (ValueError, TypeError):
        return  # refusing to stack mixed dtypes is a fine answer too
    assert out["x"].tolist() == [1, big]


def test_batch_record_identity() -> None:
    op = Batch(2)
    a = Record({"t": np.arange(2)}, 1, [Contributor(0, 0, 0, True)], {0: 2})
    b = Record(
        {"t": np.arange(2)},
        1,
        [Contributor(0, 1, 0, False), Contributor(1, 0, 0, True)],
        {0: 1, 1: 1},
    )
    assert list(op.process(a)) == []
    assert op.pending(1) == 1
    (out,) = op.process(b)
    assert isinstance(out, BatchRecord)
    assert out.contributors == a.contributors + b.contributors
    assert out.cursor == SampleCursor(1, 0, 0, 0) and out.last_cursor == SampleCursor(1, 0, 1, 0)
    assert out.component_tokens == {0: 3, 1: 1} and out.num_records == 2
    assert op.pending(1) == 0


def test_flush_of_drop_last_tombstones_the_remainder() -> None:
    op = Batch(3, drop_last=True)
    a = Record(1, 0, [Contributor(2, 0, 0, True)], {0: 1})
    op.process(a)
    (t,) = op.flush(True, 0)
    assert type(t) is Tombstone and t.contributors == a.contributors
    op = Batch(3, drop_last=False)
    op.process(a)
    (b,) = op.flush(True, 0)
    assert isinstance(b, BatchRecord) and b.data.tolist() == [1]


def test_batch_must_be_last_and_unique(h) -> None:
    pipe = h.make_pipeline([list(range(4))]).fetch()
    with pytest.raises(ValueError, match=r"batch must be the last operator; got map after it"):
        pipe.batch(2).map(lambda b: b).explain()
    with pytest.raises(ValueError, match=r"a pipeline may have one batch operator; got 2"):
        pipe.batch(2).batch(2).explain()


def test_batch_validation(h) -> None:
    for bad in (0, -2, 1.0):
        with pytest.raises(
            ValueError, match=rf"batch\(batch_size=\.\.\.\) must be a positive int; got {bad!r}"
        ):
            Batch(bad)


@pytest.mark.parametrize("drop_last", [True, False])
def test_batch_resumes_exactly(h, drop_last: bool) -> None:
    docs = [np.array([i, -i], dtype=np.int32) for i in range(47)]

    def build() -> zp.Pipeline:
        return h.make_pipeline([docs], lanes=2, chunk_size=4).fetch().batch(3, drop_last=drop_last)

    ref = assert_resumes_exactly(build)
    # 24 + 23 rows per lane: 8 + 7 full batches, and with drop_last=False 1 partial one.
    assert len(ref) == (15 if drop_last else 16)
    assert sum(len(b) for b in ref) == (45 if drop_last else 47)


@pytest.mark.parametrize("seed", range(5))
def test_a_run_of_records_batches_as_one_at_a_time_does(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lanes = rng.integers(0, 3, 200).tolist()
    records = [
        Record(np.full(2, k), lane, [Contributor(0, k, 0, True)], {0: 1})
        for k, lane in enumerate(lanes)
    ]
    one, runs = Batch(4), Batch(4)
    want = [b for r in records for b in one.process(r)]
    got, at = [], 0
    while at < len(records):  # runs of random lengths, across lanes and batches
        n = int(rng.integers(1, 12))
        got += runs.process_batch(records[at : at + n])
        at += n
    assert [(b.lane, [c.offset for c in b.contributors]) for b in got] == [
        (b.lane, [c.offset for c in b.contributors]) for b in want
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(got, want, strict=True))
    assert [runs.pending(lane) for lane in range(3)] == [one.pending(lane) for lane in range(3)]
