"""The fingerprint covers what the datasets hold, and a mismatch names the part that differs
(operator and parameter, component and property, canonical_replicas, flush cadence)."""

from __future__ import annotations

import json
import re
import shutil

import msgpack
import numpy as np
import pytest

import zephon as zp
from zephon._fingerprint import call_parameters, describe_differences
from zephon.checkpoint.state import FINGERPRINT_PARTS, merge_states
from zephon.errors import AggregationError, CheckpointError
from zephon.testing import roundtrip, take

LINES = [json.dumps({"text": f"line {i:03d} " + "x" * (i % 7)}) for i in range(60)]


def write(path, lines=LINES):
    path.write_text("\n".join(lines) + "\n")
    return path


def jsonl_pipeline(path, *, seq_len: int = 16, k: int = 2, weight: float = 1.0, **kw):
    src = zp.StaticMixtureWorkSource(
        {"web": zp.JsonlSource(path, field="text"), "nums": zp.ArraySource(np.arange(50))},
        weights={"web": weight, "nums": 1.0},
        seed=kw.pop("seed", 1),
        chunk_size=4,
    )
    return (
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=k, **kw)
        .fetch()
        .map(str)
        .tokenize(zp.ByteTokenizer())
        .split(seq_len)
        .pack(seq_len, num_bins=2)
        .batch(2)
    )


def checkpoint_of(pipe: zp.Pipeline, steps: int = 3) -> dict:
    with pipe:
        take(pipe, steps)
        return roundtrip(pipe.checkpoint())


def mismatch(pipe: zp.Pipeline, state: dict) -> str:
    with pytest.raises(CheckpointError, match=r"checkpoint fingerprint \w+… does not match") as e:
        pipe.restore(state)
    return str(e.value)


def test_another_file_with_as_many_lines_is_refused_naming_the_component(tmp_path) -> None:
    state = checkpoint_of(jsonl_pipeline(write(tmp_path / "a.jsonl")))
    other = write(tmp_path / "b.jsonl", [line.replace("line", "LINE") for line in LINES])
    msg = mismatch(jsonl_pipeline(other), state)
    assert re.search(
        r"component 0 \('web'\) content identity sample: the checkpoint has '[0-9a-f]{16}', "
        r"this pipeline has '[0-9a-f]{16}'",
        msg,
    ), msg
    assert "another file, or the same one edited" in msg
    assert "component 1" not in msg  # only what differs is named


def test_an_edited_line_is_noticed_and_a_copy_elsewhere_restores(tmp_path) -> None:
    path = write(tmp_path / "a.jsonl")
    state = checkpoint_of(jsonl_pipeline(path))
    edited = LINES.copy()
    edited[30] = edited[30].replace("030", "031")  # same length
    assert "content identity sample" in mismatch(
        jsonl_pipeline(write(tmp_path / "e.jsonl", edited)), state
    )
    (tmp_path / "copy").mkdir()
    moved = shutil.copyfile(path, tmp_path / "copy" / "renamed.jsonl")
    with jsonl_pipeline(moved) as pipe:
        pipe.restore(state)  # the same bytes at another path: the same dataset
        assert take(pipe, 2)


def test_a_different_length_names_length_and_identity(tmp_path) -> None:
    state = checkpoint_of(jsonl_pipeline(write(tmp_path / "a.jsonl")))
    msg = mismatch(jsonl_pipeline(write(tmp_path / "b.jsonl", LINES[:-1])), state)
    assert "component 0 ('web') length: the checkpoint has 60, this pipeline has 59" in msg
    assert "component 0 ('web') content identity bytes" in msg


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"seq_len": 17},
            "operator 3 (split) parameter max_len: the checkpoint has 16, this pipeline has 17; "
            "operator 4 (pack) parameter seq_len: the checkpoint has 16, this pipeline has 17",
        ),
        (
            {"k": 3},
            "flush_every_k_chunks (the flush cadence): the checkpoint has 2, this pipeline has 3",
        ),
        ({"seed": 2}, "work source seed: the checkpoint has 1, this pipeline has 2"),
        (
            {"weight": 3.0},
            "component 0 ('web') weight: the checkpoint has 0.5, this pipeline has 0.75; "
            "component 1 ('nums') weight: the checkpoint has 0.5, this pipeline has 0.25",
        ),
    ],
    ids=["operator parameter", "flush cadence", "source seed", "weights"],
)
def test_every_mismatch_names_the_part(tmp_path, change: dict, expected: str) -> None:
    path = write(tmp_path / "a.jsonl")
    state = checkpoint_of(jsonl_pipeline(path))
    msg = mismatch(jsonl_pipeline(path, **change), state)
    assert expected in msg, msg
    assert "content identity" not in msg


def test_other_operators_are_named(tmp_path) -> None:
    path = write(tmp_path / "a.jsonl")
    state = checkpoint_of(jsonl_pipeline(path))
    src = jsonl_pipeline(path).source
    shorter = (
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2)
        .fetch()
        .map(str)
        .tokenize(zp.ByteTokenizer())
        .split(16)
        .pack(16, num_bins=2)
        .shuffle(4)
        .batch(2)
    )
    msg = mismatch(shorter, state)
    assert (
        "the checkpoint has 7 operators (fetch, map, tokenize, split, pack, "
        "batch_replay_filter, batch), this pipeline has 8 (fetch, map, tokenize, split, pack, "
        "shuffle, batch_replay_filter, batch)" in msg
    ), msg
    other_fn = (
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2)
        .fetch()
        .map(repr)
        .tokenize(zp.ByteTokenizer())
        .split(16)
        .pack(16, num_bins=2)
        .batch(2)
    )
    msg = mismatch(other_fn, state)
    assert (
        "operator 1 (map) parameter fn: the checkpoint has builtins.type:<class 'str'>, this "
        "pipeline has builtins.builtin_function_or_m…#" in msg
    ), msg


def test_a_checkpoint_without_parts_keeps_the_old_behaviour(tmp_path) -> None:
    path = write(tmp_path / "a.jsonl")
    pipe = jsonl_pipeline(path)
    state = checkpoint_of(pipe)
    legacy = {k: v for k, v in state.items() if k != FINGERPRINT_PARTS}
    legacy["fingerprint"] = jsonl_pipeline(path)._fingerprints()[2]  # what old Zephon wrote
    with pytest.warns(
        UserWarning, match=r"predates dataset content identities .* cannot be checked"
    ):
        jsonl_pipeline(path).restore(legacy)
    with pytest.raises(
        CheckpointError,
        match=r"does not match this pipeline's \w+…: the pipeline definition \(source, operators "
        r"or their parameters, flush_every_k_chunks\) differs from the one that was checkpointed",
    ):
        jsonl_pipeline(path, seq_len=17).restore(legacy)


def test_malformed_or_inconsistent_parts_are_checkpoint_errors(tmp_path) -> None:
    path = write(tmp_path / "a.jsonl")
    state = checkpoint_of(jsonl_pipeline(path))
    with pytest.raises(CheckpointError, match=r"'fingerprint_parts' is malformed \(a list"):
        jsonl_pipeline(path, seq_len=17).restore({**state, FINGERPRINT_PARTS: [1]})
    same = jsonl_pipeline(path).fingerprint_parts()
    with pytest.raises(
        CheckpointError,
        match=r"though every part it records agrees: what differs is something the parts do not show",
    ):
        jsonl_pipeline(path).restore({**state, "fingerprint": "0" * 64, FINGERPRINT_PARTS: same})
    # With the fingerprint intact, the parts are not even read.
    jsonl_pipeline(path).restore({**state, FINGERPRINT_PARTS: {"junk": "1"}})


def test_the_parts_stay_small(tmp_path) -> None:
    state = checkpoint_of(jsonl_pipeline(write(tmp_path / "a.jsonl")))
    parts = state[FINGERPRINT_PARTS]
    assert all(len(v) <= 48 for v in parts.values())
    assert len(msgpack.packb(parts)) < 1024
    assert len(msgpack.packb(state[FINGERPRINT_PARTS])) < len(msgpack.packb(state)) // 2


def test_call_parameters() -> None:
    assert call_parameters("Pack(seq_len=16, num_bins=2, features=['a', 'b'])") == {
        "seq_len": "16",
        "num_bins": "2",
        "features": "['a', 'b']",
    }
    assert call_parameters("Foo(1, x='a,b', y=(1, 2))") == {
        "arg1": "1",
        "x": "'a,b'",
        "y": "(1, 2)",
    }
    assert call_parameters("Fetch()") == {}
    assert call_parameters("not a call") == {"definition": "not a call"}
    assert call_parameters("Foo(a=[1, 2)") == {"definition": "Foo(a=[1, 2)"}


def test_describe_differences_says_only_what_differs() -> None:
    parts = {"ops": "1", "op.0": "batch", "op.0.batch_size": "2"}
    assert describe_differences(parts, dict(parts)) == []
    assert describe_differences(parts, {**parts, "op.0.batch_size": "4"}) == [
        "operator 0 (batch) parameter batch_size: the checkpoint has 2, this pipeline has 4"
    ]
    # Another operator in a place: its parameters say nothing more.
    assert describe_differences(parts, {"ops": "1", "op.0": "shuffle", "op.0.seed": "1"}) == [
        "operator 0: the checkpoint has batch, this pipeline has shuffle"
    ]


def test_merged_ranks_over_other_data_name_what_differs(tmp_path) -> None:
    a = checkpoint_of(jsonl_pipeline(write(tmp_path / "a.jsonl"), rank=0, world_size=2))
    b = checkpoint_of(
        jsonl_pipeline(write(tmp_path / "b.jsonl", LINES[::-1]), rank=1, world_size=2)
    )
    with pytest.raises(
        AggregationError,
        match=r"component 0 \('web'\) content identity sample: rank 1 has '\w+', rank 0 has",
    ):
        merge_states([a, b])


def test_the_legacy_fingerprint_is_what_zephon_wrote_before_parts() -> None:
    # Pinned from the last Zephon without fingerprint parts (commit d6e00cb): its checkpoints
    # of this pipeline hold this fingerprint, and must still restore.
    src = zp.StaticMixtureWorkSource(
        {"a": zp.ArraySource([f"doc {i}" for i in range(20)]), "b": zp.ArraySource(["x", "yy"])},
        weights=[3, 1],
        seed=7,
        chunk_size=4,
    )

    def build() -> zp.Pipeline:
        return (
            zp.Pipeline(src, canonical_replicas=2)
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .split(8)
            .pack(8, num_bins=2)
            .shuffle(4, seed=1)
            .batch(2)
        )

    old = "bda46447b144cb88c0f2aa93e06d830d5d4353863e09dc2ccd8394915cac5a6f"
    assert build()._fingerprints()[2] == old
    assert build().fingerprint() != old  # today's covers the datasets' contents too
    with build() as pipe:
        expected = take(pipe, 6)[3:]
    state = checkpoint_of(build(), 3)
    written_before_parts = {k: v for k, v in state.items() if k != FINGERPRINT_PARTS}
    written_before_parts["fingerprint"] = old
    with build() as pipe:
        with pytest.warns(UserWarning, match=r"predates dataset content identities"):
            pipe.restore(written_before_parts)
        got = take(pipe, 3)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(expected, got, strict=True) for k in a)
