"""LM layouts and per-record randomness: ``lm_targets`` checked against hand-built arrays
(and MaxText's ``ShiftData``, torchtitan's labels), ``trim_or_pad``, ``random_map``'s
identity-seeded numbers, ``batch(pad_last=True)`` and lockstep padding, and restoring into
another ``batch_size``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.errors import CheckpointError
from zephon.operators.lm import LmTargets, TrimOrPad
from zephon.records import Contributor, Record
from zephon.testing import assert_resumes_exactly, roundtrip, take

DOCS = [("ab" * ((i * 7919) % 40)) + f" d{i}" for i in range(160)]


def _record(data: dict[str, Any]) -> Record:
    return Record(data, 0, [Contributor(0, 0, 0, True)], {0: 1})


def _packed_row() -> dict[str, np.ndarray]:
    # two documents [5 6 7] and [8 9], then padding
    return {
        "tokens": np.array([5, 6, 7, 8, 9, 0, 0], np.int32),
        "tokens_segment_ids": np.array([1, 1, 1, 2, 2, 0, 0], np.int32),
        "tokens_positions": np.array([0, 1, 2, 0, 1, 0, 0], np.int32),
        "weight": np.float32(0.5),
    }


def _layout(data: dict[str, Any], **kw: Any) -> dict[str, Any]:
    (out,) = LmTargets(**kw).process(_record(data))
    return out.data  # type: ignore[union-attr]


# ------------------------------------------------------------------ lm_targets
def test_lm_targets_next_token_within_segment_by_hand() -> None:
    got = _layout(_packed_row())
    assert sorted(got) == [
        "inputs",
        "inputs_positions",
        "inputs_segment_ids",
        "targets",
        "targets_positions",
        "targets_segment_ids",
        "weight",
    ]
    np.testing.assert_array_equal(got["inputs"], [5, 6, 7, 8, 9, 0, 0])
    np.testing.assert_array_equal(got["targets"], [6, 7, -100, 9, -100, -100, -100])
    np.testing.assert_array_equal(got["inputs_segment_ids"], [1, 1, 1, 2, 2, 0, 0])
    np.testing.assert_array_equal(got["targets_segment_ids"], [1, 1, 0, 2, 0, 0, 0])
    np.testing.assert_array_equal(got["inputs_positions"], [0, 1, 2, 0, 1, 0, 0])
    np.testing.assert_array_equal(got["targets_positions"], [0, 1, 2, 0, 1, 0, 0])
    assert got["targets"].dtype == np.int32
    assert got["weight"] == np.float32(0.5)  # other features pass through


def test_lm_targets_maxtext_names_and_shiftdata_agree_where_the_loss_counts() -> None:
    row = _packed_row()
    got = _layout(row, ignore_id=0, names="maxtext")
    assert {
        "inputs_segmentation",
        "inputs_position",
        "targets_segmentation",
        "targets_position",
    } <= set(got)
    # MaxText's ShiftData on the same packed row (both features packed as "inputs" and
    # "targets"): targets shifted left with the pad id, targets_segmentation zeroed where the
    # target is an ignored id. Built by hand:
    mt_targets = np.array([6, 7, 8, 9, 0, 0, 0], np.int32)
    mt_seg = np.array([1, 1, 1, 2, 0, 0, 0], np.int32)
    mask = got["targets_segmentation"] != 0
    np.testing.assert_array_equal(got["targets"][mask], mt_targets[mask])
    np.testing.assert_array_equal(got["inputs"], row["tokens"])
    np.testing.assert_array_equal(got["inputs_segmentation"], row["tokens_segment_ids"])
    # the one deliberate difference: MaxText trains token 7 (end of document 1) to predict 8
    # (the next document's first token); Zephon does not cross a document boundary.
    assert (mt_seg != 0).sum() - mask.sum() == 1 and mt_seg[2] == 1 and not mask[2]


def test_lm_targets_matches_torchtitan_labels_on_one_document() -> None:
    # torchtitan: inputs = x[:-1], labels = x[1:] over a row of seq_len + 1 tokens.
    x = np.arange(10, 19, dtype=np.int32)
    row = {
        "tokens": x,
        "tokens_segment_ids": np.ones(9, np.int32),
        "tokens_positions": np.arange(9, dtype=np.int32),
    }
    got = _layout(row)
    np.testing.assert_array_equal(got["targets"][:-1], x[1:])
    assert got["targets"][-1] == -100


def test_lm_targets_after_batch_is_the_rows_layout() -> None:
    rows = [_packed_row(), {**_packed_row(), "tokens": np.arange(1, 8, dtype=np.int32)}]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    got = _layout(batch)
    for i, r in enumerate(rows):
        one = _layout(r)
        for k in one:
            np.testing.assert_array_equal(got[k][i], one[k])


def test_lm_targets_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(KeyError, match=r"tokens_segment_ids.*pack"):
        _layout({"tokens": np.arange(4, dtype=np.int32)})
    with pytest.raises(ValueError, match=r"names.*'maxtext'.*'llama'"):
        LmTargets(names="llama")
    with pytest.raises(ValueError, match=r"-100.*uint8"):
        _layout({**_packed_row(), "tokens": np.arange(7, dtype=np.uint8)})
    with pytest.raises(ValueError, match=r"already has \['targets'\]"):
        _layout({**_packed_row(), "targets": np.zeros(7, np.int32)})
    with pytest.raises(ValueError, match="ignore_id"):
        LmTargets(ignore_id=1.5)  # type: ignore[arg-type]


def test_lm_targets_in_a_pipeline_before_pack_is_a_clear_error() -> None:
    pipe = _source_pipe().fetch().tokenize(zp.ByteTokenizer()).lm_targets().batch(2)
    with pytest.raises(KeyError, match=r"put \.pack"):
        next(pipe)
    pipe.close()


# ------------------------------------------------------------------ trim_or_pad
def test_trim_or_pad_cuts_pads_and_masks() -> None:
    op = TrimOrPad(4, pad_values={"tokens": 9, "labels": -100})
    short = {"tokens": np.array([1, 2], np.int32), "labels": np.array([3, 4], np.int32), "id": 7}
    (out,) = op.process(_record(short))
    d = out.data
    np.testing.assert_array_equal(d["tokens"], [1, 2, 9, 9])
    np.testing.assert_array_equal(d["labels"], [3, 4, -100, -100])
    np.testing.assert_array_equal(d["tokens_segment_ids"], [1, 1, 0, 0])
    np.testing.assert_array_equal(d["tokens_positions"], [0, 1, 0, 0])
    np.testing.assert_array_equal(d["tokens_mask"], [True, True, False, False])
    assert d["id"] == 7
    long = {"tokens": np.arange(6, dtype=np.int32)}
    (out,) = op.process(Record(long, 0, [Contributor(0, 0, 0, True)], {2: 6}))
    np.testing.assert_array_equal(out.data["tokens"], [0, 1, 2, 3])
    assert out.component_tokens == {2: 4}  # the tokens kept, for ensure_mixture


def test_trim_or_pad_errors() -> None:
    with pytest.raises(ValueError, match="max_len"):
        TrimOrPad(0)
    with pytest.raises(ValueError, match=r"-1.*uint8"):
        TrimOrPad(4, {"tokens": -1}).process(_record({"tokens": np.arange(2, dtype=np.uint8)}))
    with pytest.raises(KeyError, match="tokenize first"):
        TrimOrPad(4).process(_record({"text": "x"}))
    with pytest.raises(TypeError, match="dict of feature name"):
        TrimOrPad(4, pad_values=[0])  # type: ignore[arg-type]


def test_every_written_value_is_checked_by_one_rule_with_one_message() -> None:
    """lm_targets' ignore_id, trim_or_pad's and batch's pad values (and pack's, tested with
    pack) go through one check: exact representation, no float into an integer feature."""
    from zephon.operators.batch import Batch

    fix = r"does not fit feature '{}' of dtype {}: give a value that .* or cast the feature"
    with pytest.raises(
        ValueError, match=r"lm_targets\(ignore_id=-100\) " + fix.format("targets", "uint16")
    ):
        _layout({**_packed_row(), "tokens": np.arange(7, dtype=np.uint16)})
    with pytest.raises(
        ValueError,
        match=r"trim_or_pad\(pad_values=\{'tokens': 1.0\}\) " + fix.format("tokens", "int32"),
    ):
        TrimOrPad(4, {"tokens": 1.0}).process(_record({"tokens": np.arange(2, dtype=np.int32)}))
    with pytest.raises(
        ValueError, match=r"batch\(pad_values=\{'x': 300\}\) " + fix.format("x", "int8")
    ):
        Batch(2, pad_last=True, pad_values={"x": 300})._pad_row({"x": np.zeros(3, np.int8)})
    row = Batch(2, pad_last=True, pad_values={"x": True})._pad_row({"x": np.zeros(3, bool)})
    assert row["x"].tolist() == [True, True, True]


# ------------------------------------------------------------------ random_map
def _noise(d: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {**d, "noise": rng.integers(0, 2**31, size=len(d["tokens"]), dtype=np.int64)}


def _more_noise(d: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {**d, "more": rng.integers(0, 2**31, size=len(d["tokens"]), dtype=np.int64)}


def _source_pipe(lanes: int = 3, seed: int = 5, **kw: Any) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource([zp.ArraySource(DOCS)], seed=seed, chunk_size=8, num_epochs=1)
    return zp.Pipeline(src, canonical_replicas=lanes, prefetch=0, **kw)


def _per_sample(pipe: zp.Pipeline) -> dict[str, tuple[int, ...]]:
    """The noise each document got, keyed by the document's text."""
    out = {}
    for rec in take(pipe):
        out[rec["text"]] = tuple(rec["noise"].tolist())
    return out


def _text_noise(**kw: Any) -> zp.Pipeline:
    def both(d: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {"text": d, "tokens": np.zeros(3), "noise": rng.integers(0, 2**31, 3)}

    return _source_pipe(**kw).fetch().random_map(both)


def test_random_map_numbers_follow_the_record_not_the_order() -> None:
    base = _per_sample(_text_noise())
    assert len(base) == len(DOCS)
    assert len(set(base.values())) == len(DOCS)  # every record its own numbers
    # another world size (each rank's lanes in another order of processing)
    ranked: dict[str, tuple[int, ...]] = {}
    for rank in range(3):
        ranked.update(_per_sample(_text_noise(rank=rank, world_size=3)))
    assert ranked == base
    assert _per_sample(_text_noise(seed=6)).keys() == base.keys()  # same docs, ...
    other_seed = _per_sample(_text_noise(seed=6))
    assert all(other_seed[k] != base[k] for k in base)  # ... other numbers


def _with_pipeline_seed(seed: int | None) -> zp.Pipeline:
    def both(d: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {"text": d, "tokens": np.zeros(3), "noise": rng.integers(0, 2**31, 3)}

    src = zp.StaticMixtureWorkSource([zp.ArraySource(DOCS)], seed=5, chunk_size=8, num_epochs=1)
    return zp.Pipeline(src, canonical_replicas=3, prefetch=0, seed=seed).fetch().random_map(both)


def test_random_map_pipeline_seed_is_the_root() -> None:
    base = _per_sample(_text_noise())  # source seed 5, no pipeline seed
    assert _per_sample(_with_pipeline_seed(None)) == base
    assert _per_sample(_with_pipeline_seed(5)) == base  # the source's seed is the default
    reseeded = _per_sample(_with_pipeline_seed(99))
    assert reseeded.keys() == base.keys()  # the same documents (the source's order) ...
    assert all(reseeded[k] != base[k] for k in base)  # ... other numbers
    with pytest.raises(ValueError, match="seed must be None or an int"):
        zp.Pipeline(zp.StaticMixtureWorkSource([zp.ArraySource(DOCS)]), seed="x")  # type: ignore[arg-type]


def test_two_random_maps_draw_apart_and_threads_change_nothing() -> None:
    def build(parallelism: int = 1) -> zp.Pipeline:
        return (
            _source_pipe()
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .random_map(_noise, parallelism=parallelism)
            .random_map(_more_noise, parallelism=parallelism)
            .batch(1)
        )

    ref = take(build())
    for b in ref:
        assert not np.array_equal(b["noise"], b["more"])
    threaded = take(build(parallelism=3))
    assert len(threaded) == len(ref)
    for a, b in zip(ref, threaded, strict=True):
        np.testing.assert_array_equal(a["noise"], b["noise"])
        np.testing.assert_array_equal(a["more"], b["more"])


def test_random_map_resumes_exactly() -> None:
    def build() -> zp.Pipeline:
        return (
            _source_pipe()
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .random_map(_noise)
            .split(24)
            .pack(24, 2, features=("tokens", "noise"))
            .batch(2)
        )

    ref = assert_resumes_exactly(build, cuts=[0, 1, 4, 13])
    assert len(ref) > 13


def test_random_map_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="fn\\(data, rng\\)"):
        _source_pipe().random_map(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------ pad_last
def _lm(
    output: str = "interleave", pad_last: bool = True, batch: int = 4, **kw: Any
) -> zp.Pipeline:
    return (
        _source_pipe(output=output, **kw)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(32)
        .pack(32, 2)
        .lm_targets()
        .batch(batch, pad_last=pad_last)
    )


def test_pad_last_pads_each_lanes_last_batch_with_the_pad_values() -> None:
    batches = take(_lm())
    whole = take(_lm_short())
    assert sum(int(b["batch_mask"].sum()) for b in batches) == sum(len(b["inputs"]) for b in whole)
    assert {b["inputs"].shape for b in batches} == {(4, 32)}
    partial = [b for b in batches if not b["batch_mask"].all()]
    assert 1 <= len(partial) <= 3  # at most one per lane
    for b in partial:
        pad = ~b["batch_mask"]
        assert (b["targets"][pad] == -100).all()  # lm_targets's ignore_id
        assert (b["inputs"][pad] == 0).all() and (b["inputs_segment_ids"][pad] == 0).all()


def _lm_short() -> zp.Pipeline:
    return (
        _source_pipe()
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(32)
        .pack(32, 2)
        .lm_targets()
        .batch(4, drop_last=False)
    )


def test_lockstep_pads_ended_lanes_until_every_lane_ends() -> None:
    steps = take(_lm(output="lockstep"))
    rows = sum(int(s["batch_mask"].sum()) for s in steps)
    assert rows == sum(len(b["inputs"]) for b in take(_lm_short()))  # every row once
    assert {s["inputs"].shape for s in steps} == {(12, 32)}  # 3 lanes x 4 rows, every step
    assert not steps[-1]["batch_mask"].all()
    # without padding lockstep stops at the first lane's end and drops the others' tails
    plain = take(_lm(output="lockstep", pad_last=False))
    assert len(plain) < len(steps)


def test_lockstep_padding_resumes_exactly_at_every_step() -> None:
    assert_resumes_exactly(lambda: _lm(output="lockstep"))


def test_pad_last_errors() -> None:
    pipe = _source_pipe().fetch().batch(2, pad_last=True)
    with pytest.raises(TypeError, match="dicts of features"):
        next(pipe)
    pipe.close()
    with pytest.raises(TypeError, match="pad_last"):
        zp.Pipeline(zp.StaticMixtureWorkSource([zp.ArraySource(DOCS)])).batch(2, pad_last=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_mask"):
        _source_pipe().batch(2, pad_last=True, pad_values={"batch_mask": 1})


# ------------------------------------------------------------------ another batch_size
def _rows_per_lane(pipe: zp.Pipeline, steps: int | None = None) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    n = 0
    for b in pipe:
        (lane,) = pipe.last_batch_lanes
        out.setdefault(lane, []).extend(row.tobytes() for row in b["inputs"])
        n += 1
        if steps is not None and n == steps:
            break
    return out


# batch(3) and batch(4) drop lanes' tails on purpose (the comparison leaves them out).
@pytest.mark.filterwarnings("ignore::zephon.errors.DroppedRecordsWarning")
def test_restore_into_another_batch_size_continues_the_record_stream() -> None:
    with _lm(pad_last=False, batch=4) as p:
        ref = _rows_per_lane(p)
    for cut in (0, 5, 11):
        with _lm(pad_last=False, batch=4) as p:
            head = _rows_per_lane(p, cut) if cut else {}
            state = roundtrip(p.checkpoint())
        with _lm(pad_last=False, batch=3) as q:
            q.restore(state)
            tail = _rows_per_lane(q)
        for lane, rows in ref.items():
            got = head.get(lane, []) + tail.get(lane, [])
            # batch(3) drops at most 2 rows of a lane's tail, batch(4) up to 3
            assert got[: len(rows) - 3] == rows[: len(rows) - 3], (cut, lane)
    # other parameters still refuse, naming the part
    with _lm(pad_last=False, batch=4) as p:
        next(p)
        state = roundtrip(p.checkpoint())
    other = (
        _source_pipe()
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(32)
        .pack(32, 3)
        .lm_targets()
        .batch(4)
    )
    with pytest.raises(CheckpointError, match="num_bins"):
        other.restore(state)
