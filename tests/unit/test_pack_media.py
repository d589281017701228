"""pack with media: items beside the tokens, media slots in placement, split pieces, errors,
the plan's choice of stage and exact resume (images made here as small arrays)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon._native import load
from zephon.checkpoint import dumps
from zephon.operators.pack.pack import Pack
from zephon.operators.pack.placement import place
from zephon.records import Contributor, Record
from zephon.testing import assert_resumes_exactly, take

SHAPE = (2, 3, 3)
MEDIA = {"image": SHAPE}


def img(value: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """An image whose every pixel is ``value``: each one recognisable in a row."""
    return np.full(shape, value, np.uint8)


def rec(
    n: int, offset: int, image: Any = None, *, child: int = 0, last: bool = True, lane: int = 0
) -> Record:
    """A piece of ``n`` tokens (each ``100 + offset``) of sample ``offset``, with ``image``."""
    data: dict[str, Any] = {"tokens": np.full(n, 100 + offset, np.int32)}
    if image is not None:
        data["image"] = image
    return Record(data, lane, [Contributor(0, offset, child, last)], {0: n})


def run(op: Pack, records: list[Record]) -> list[dict[str, np.ndarray]]:
    """The rows ``op`` makes of ``records`` one at a time, then its flush."""
    rows = [r for x in records for r in op.process(x)]
    rows += list(op.flush(True, 0))
    return [r.data for r in rows]


def values(row: dict[str, np.ndarray]) -> list[int]:
    """Each slot's pixel value (the image's number; 0 where unused)."""
    return [int(v) for v in row["image"][:, 0, 0, 0]]


def test_a_row_holds_its_items_mask_and_segment_ids_in_every_form() -> None:
    op = Pack(seq_len=12, num_bins=1, media=MEDIA, max_media=4)
    rows = run(
        op,
        [
            rec(2, 0, img(7)),  # one item: [H, W, C]
            rec(3, 1),  # a text document: no field
            rec(2, 2, np.stack([img(8), img(9)])),  # k items: [k, H, W, C]
            rec(1, 3, np.zeros((0, *SHAPE), np.uint8)),  # zero items
        ],
    )
    (row,) = rows
    assert row["tokens_segment_ids"].tolist() == [1, 1, 2, 2, 2, 3, 3, 4, 0, 0, 0, 0]
    assert row["image"].shape == (4, *SHAPE) and row["image"].dtype == np.uint8
    assert values(row) == [7, 8, 9, 0]
    assert not row["image"][3].any()
    assert row["image_mask"].tolist() == [True, True, True, False]
    assert row["image_mask"].dtype == np.bool_
    assert row["image_segment_ids"].tolist() == [1, 3, 3, 0]
    assert row["image_segment_ids"].dtype == np.int32
    # A list of items is the same as their stack.
    (again,) = run(
        Pack(seq_len=12, num_bins=1, media=MEDIA, max_media=4),
        [rec(2, 0, [img(7)]), rec(3, 1), rec(2, 2, [img(8), img(9)]), rec(1, 3, [])],
    )
    assert all(np.array_equal(row[k], again[k]) for k in row)


def test_a_row_without_media_has_zeros_and_an_empty_mask() -> None:
    (row,) = run(Pack(seq_len=4, num_bins=1, media=MEDIA, max_media=2), [rec(3, 0)])
    assert row["image"].shape == (2, *SHAPE) and not row["image"].any()
    assert row["image_mask"].tolist() == [False, False]
    assert row["image_segment_ids"].tolist() == [0, 0]


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_a_document_whose_items_do_not_fit_the_free_slots_goes_to_another_row(
    strategy: str,
) -> None:
    op = Pack(seq_len=10, num_bins=2, strategy=strategy, media=MEDIA, max_media=2)
    rows = run(
        op,
        [
            rec(2, 0, [img(1), img(2)]),  # bin 0: its 2 slots taken
            rec(2, 1, img(3)),  # fits bin 0 by tokens, not by slots: bin 1
            rec(2, 2),  # text: bin 0 (first fit; best fit too: both hold 2 tokens)
        ],
    )
    assert [r["tokens"][r["tokens"] > 0].tolist() for r in rows] == [
        [100, 100, 102, 102],
        [101, 101],
    ]
    assert [values(r) for r in rows] == [[1, 2], [3, 0]]
    assert [r["image_segment_ids"].tolist() for r in rows] == [[1, 1], [1, 0]]


def test_a_full_media_row_takes_text_and_the_fullest_row_goes_when_nothing_fits() -> None:
    op = Pack(seq_len=6, num_bins=2, media=MEDIA, max_media=1)
    out = [list(op.process(r)) for r in [rec(3, 0, img(1)), rec(1, 1, img(2)), rec(2, 2)]]
    assert out == [[], [], []]  # bins: [0 (image), 2] and [1 (image)]
    (gone,) = op.process(rec(2, 3, img(3)))  # fits no bin by slots: the fullest (bin 0) goes
    assert gone.data["tokens"][:5].tolist() == [100, 100, 100, 102, 102]
    assert values(gone.data) == [1]
    rest = [r.data for r in op.flush(True, 0)]
    assert [values(r) for r in rest] == [[3], [2]]  # bin 0 again, then bin 1


def test_concat_then_split_ends_a_row_for_items_and_gives_them_to_a_cut_head() -> None:
    op = Pack(seq_len=4, strategy="concat_then_split", media=MEDIA, max_media=1)
    rows = run(op, [rec(1, 0, img(1)), rec(6, 1, img(2)), rec(1, 2)])
    assert [r["tokens"].tolist() for r in rows] == [
        [100, 0, 0, 0],  # emptied: the next document's image has no free slot
        [101, 101, 101, 101],
        [101, 101, 102, 0],
    ]
    assert [values(r) for r in rows] == [[1], [2], [0]]
    assert [r["image_segment_ids"].tolist() for r in rows] == [[1], [1], [0]]


def _split_pipeline(**pack: Any) -> zp.Pipeline:
    docs = [
        {"tokens": np.arange(1, 11, dtype=np.int32), "image": img(5)},
        {"tokens": np.arange(20, 23, dtype=np.int32), "image": [img(6), img(7)]},
        {"tokens": np.arange(30, 34, dtype=np.int32)},
    ]
    src = zp.StaticMixtureWorkSource([docs], seed=0, shuffle=False, num_epochs=1)
    pipe = zp.Pipeline(src, canonical_replicas=1).fetch().split(max_len=4)
    return pipe.pack(8, num_bins=2, media=MEDIA, max_media=2, **pack).batch(1, drop_last=False)


@pytest.mark.parametrize("order", ["filled", "arrival"])
def test_split_pieces_carry_a_documents_items_once_with_its_first_piece(order: str) -> None:
    with _split_pipeline(order=order) as pipe:
        rows = [{k: v[0] for k, v in b.items()} for b in take(pipe)]
    items = sorted(int(v) for r in rows for v in r["image"][r["image_mask"], 0, 0, 0])
    assert items == [5, 6, 7]  # 5 once, though its document was cut into 3 pieces
    for r in rows:
        for slot in np.flatnonzero(r["image_mask"]):
            seg = r["image_segment_ids"][slot]
            first = int(r["tokens"][r["tokens_segment_ids"] == seg][0])
            # the item's segment is its document's first piece (tokens 1..4) or its whole
            assert (int(r["image"][slot, 0, 0, 0]), first) in {(5, 1), (6, 20), (7, 20)}


def test_the_plan_does_not_fuse_split_and_pack_with_media() -> None:
    with _split_pipeline() as pipe:
        assert "pack@p" in pipe.explain() and "split+pack" not in pipe.explain()
    src = zp.StaticMixtureWorkSource([[{"tokens": np.arange(3, dtype=np.int32)}]], seed=0)
    plain = zp.Pipeline(src, canonical_replicas=1).fetch().split(max_len=4).pack(8)
    with plain.batch(1) as pipe:
        assert "split+pack@p" in pipe.explain()  # (the same chain without media is fused)


def test_batch_writes_media_rows_as_the_rows_themselves_assemble_them() -> None:
    """batch writes packed rows straight into its arrays (the C row writer where built, then
    the media); each batch row equals the row assembled alone."""
    op = Pack(seq_len=8, num_bins=2, media=MEDIA, max_media=2)
    records = [rec(3, 0, img(1)), rec(4, 1), rec(2, 2, [img(2), img(3)]), rec(5, 3, img(4))]
    rows = [r for x in records for r in op.process(x)] + list(op.flush(True, 0))
    layout = rows[0].row_writer().batch_layout(rows)
    if load("_pack") is not None:  # the native path: media is in the batch's layout
        assert layout is not None and ("image", (2, *SHAPE), np.dtype(np.uint8)) in layout
    batch = zp.operators.Batch(len(rows))._stack(rows).data
    alone = Pack(seq_len=8, num_bins=2, media=MEDIA, max_media=2)
    rows2 = [r for x in records for r in alone.process(x)] + list(alone.flush(True, 0))
    for i, row in enumerate(rows2):
        for k, v in row.data.items():
            assert np.array_equal(batch[k][i], v), (k, i)
    assert batch["image"].shape == (len(rows), 2, *SHAPE)


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit", "concat_then_split"])
def test_placement_with_no_items_is_placement_without_media(strategy: str) -> None:
    rng = np.random.default_rng(3)
    bins = 1 if strategy == "concat_then_split" else 4
    cap = 16
    for _ in range(20):
        top = 40 if strategy == "concat_then_split" else cap
        lengths = rng.integers(0, top + 1, 30).astype(np.int64)
        fill = rng.integers(0, cap, bins).astype(np.int64)
        segs = (fill > 0).astype(np.int64)
        a = place(strategy, fill.copy(), segs.copy(), lengths, cap, 3)
        slots = np.zeros((bins, 1), np.int64)
        b = place(strategy, fill.copy(), segs.copy(), lengths, cap, 3, np.zeros((30, 1), np.int64),
                  slots, 2)  # fmt: skip
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)


def _bad(value: Any, *, n: int = 2, child: int = 0, last: bool = True) -> Record:
    return Record(
        {"tokens": np.ones(n, np.int32), "image": value},
        0,
        [Contributor(3, 5, child, last)],
        {0: n},
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"media": ("image",), "max_media": 2},
            "pack(media=...) must be a dict of media feature -> item shape (uint8) or (shape, "
            "dtype); got ('image',): a row without media still holds",
        ),
        ({"media": MEDIA}, "needs max_media=<int >= 1>"),
        ({"media": MEDIA, "max_media": 0}, "got max_media=0"),
        ({"max_media": 2}, "pack(max_media=2) needs media=...: name the media features"),
        ({"media": {}, "max_media": 2}, "pack(media={}) names no feature"),
        ({"media": {"image": (0, 3)}, "max_media": 2}, "give the shape of one item as a tuple"),
        ({"media": {"image": ((2, 2), "nope")}, "max_media": 2}, "'nope' is not a numpy dtype"),
        (
            {"media": {"tokens": SHAPE}, "max_media": 2},
            "pack would emit ['tokens', 'tokens_segment_ids'] more than once",
        ),
    ],
)
def test_bad_options_are_errors_naming_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Pack(8, **kwargs)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            img(1, (3, 3, 3)),
            "pack: media feature 'image' of the sample of component 0 at lane 0, chunk 3, "
            "offset 5 is an array of shape (3, 3, 3), where pack(media={'image': (2, 3, 3)}) "
            "takes items of shape (2, 3, 3)",
        ),
        ([img(1), img(1, (2, 3, 4))], "is an item of a list of shape (2, 3, 4), where"),
        (np.zeros(SHAPE, np.float32), "is float32, where pack(media=...) declares uint8"),
        ([img(1)] * 3, "has 3 items of media feature 'image', more than pack(max_media=2)"),
        (b"jpeg bytes", "is bytes; pack(media={'image': (2, 3, 3)}) takes an array of one item"),
    ],
)
def test_bad_items_are_errors_naming_the_sample_the_shapes_and_the_fix(
    value: Any, message: str
) -> None:
    op = Pack(8, media=MEDIA, max_media=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        op.process(_bad(value))


def test_items_without_tokens_are_an_error() -> None:
    op = Pack(8, media=MEDIA, max_media=2)
    with pytest.raises(ValueError, match=re.escape("has 1 items of media feature 'image' and no")):
        op.process(_bad(img(1), n=0))


def test_split_copies_an_image_as_tall_as_the_document_whole() -> None:
    """Only per-token arrays (the tokens' length and number of dimensions) are cut: an
    image 4 rows high beside 4 tokens goes whole to every piece, and pack keeps it once."""
    from zephon.operators.split import Split

    image = np.arange(4 * 3 * 3, dtype=np.uint8).reshape(4, 3, 3)
    mask = np.array([1, 0, 1, 1], np.int32)
    record = Record(
        {"tokens": np.arange(4, dtype=np.int32), "mask": mask, "image": image},
        0,
        [Contributor(3, 5, 0, True)],
        {0: 4},
    )
    pieces = list(Split(2).process(record))
    assert [p.data["mask"].tolist() for p in pieces] == [[1, 0], [1, 1]]
    assert all(p.data["image"] is image for p in pieces)
    (row,) = run(Pack(8, num_bins=1, media={"image": (4, 3, 3)}, max_media=2), pieces)
    assert row["image_mask"].tolist() == [True, False]
    assert np.array_equal(row["image"][0], image)


def test_later_pieces_of_a_split_document_bring_no_items() -> None:
    op = Pack(8, num_bins=1, media=MEDIA, max_media=1)
    records = [_bad(img(1), child=0, last=False), _bad(img(1), child=1, last=True)]
    (row,) = run(op, records)
    assert row["image_mask"].tolist() == [True]  # one item, not two (and no error: M is 1)


def test_the_fingerprint_names_media() -> None:
    op = Pack(8, media={"audio": ((16,), "float32")}, max_media=3)
    assert repr(op) == (
        "Pack(seq_len=8, num_bins=8, features=['tokens'], media={'audio': ((16,), 'float32')}, "
        "max_media=3)"
    )
    assert repr(Pack(8)) == "Pack(seq_len=8, num_bins=8, features=['tokens'])"


def _docs(size: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(60):
        doc: dict[str, Any] = {"tokens": np.full(int(rng.integers(1, 9)), i + 1, np.int32)}
        if i % 3:
            doc["image"] = [np.full((size, size, 3), i, np.uint8)] * int(rng.integers(1, 3))
        out.append(doc)
    return out


def _media_pipeline(size: int = 4, order: str = "filled") -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource([_docs(size)], seed=1, chunk_size=5, num_epochs=1)
    pipe = zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=3, prefetch=0).fetch()
    pipe = pipe.split(max_len=6).pack(
        12, num_bins=3, media={"image": (size, size, 3)}, max_media=2, order=order
    )
    return pipe.batch(2, drop_last=False)


@pytest.mark.parametrize("order", ["filled", "arrival"])
def test_resumes_exactly_with_media(order: str) -> None:
    reference = assert_resumes_exactly(lambda: _media_pipeline(order=order))
    images = sum(int(b["image_mask"].sum()) for b in reference)
    assert images == sum(len(d.get("image", ())) for d in _docs(4))  # each item once


def test_a_checkpoint_holds_no_media() -> None:
    """Open bins are rebuilt by replay, never saved: mid-epoch, the checkpoint of a pipeline
    of 64x64 images is the one of 4x4 images but for the fingerprint (which names the
    shape), and stays small."""
    states = []
    for size in (4, 64):
        with _media_pipeline(size) as pipe:
            take(pipe, 3)
            state = pipe.checkpoint()
        assert len(dumps(state)) < 2000  # one 64x64 image alone is 12,288 bytes
        states.append({k: v for k, v in state.items() if not k.startswith("fingerprint")})
    assert states[0] == states[1]


@pytest.mark.parametrize(
    ("strategy", "order"),
    [("first_fit", "filled"), ("best_fit", "arrival"), ("concat_then_split", "filled")],
)
def test_every_item_once_in_its_documents_segment_with_random_documents(
    strategy: str, order: str
) -> None:
    """Random documents of 0-3 items: each item in exactly one row, in the segment holding
    its document's tokens (token values name the document, pixel values the item)."""
    rng = np.random.default_rng(11)
    bins = 1 if strategy == "concat_then_split" else 3
    op = Pack(16, bins, strategy=strategy, order=order, media=MEDIA, max_media=3)
    records, want = [], []
    for d in range(200):
        n = int(rng.integers(1, 40 if strategy == "concat_then_split" else 17))
        k = int(rng.integers(0, 4))
        items = [img(1 + (d * 3 + j) % 250) for j in range(k)]
        want += [(100 + d, int(x[0, 0, 0])) for x in items]
        records.append(rec(n, d, items or None))
    rows = run(op, records)
    got = []
    for r in rows:
        assert r["image_mask"].sum() <= 3
        for slot in np.flatnonzero(r["image_mask"]):
            tokens = r["tokens"][r["tokens_segment_ids"] == r["image_segment_ids"][slot]]
            assert len(set(tokens.tolist())) == 1  # one document's segment
            got.append((int(tokens[0]), int(r["image"][slot, 0, 0, 0])))
        assert not r["image"][~r["image_mask"]].any()
    assert sorted(got) == sorted(want)
