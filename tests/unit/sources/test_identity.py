"""Content identities: equal for the same data wherever it lives, different for other data,
and cheap (bounded reads) however large the dataset."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest

import zephon as zp
import zephon.sources.identity as identity_module
from zephon.sources.identity import (
    SAMPLE_BLOCK_BYTES,
    SAMPLE_BLOCKS,
    dataset_identity,
    sample_positions,
    sample_spans,
)

LINES = [json.dumps({"id": i, "text": f"record number {i:04d}"}) for i in range(200)]


def write_jsonl(path, lines=LINES):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sample_spans_cover_small_ranges_whole_and_large_ones_at_fixed_places() -> None:
    assert sample_spans(0) == []
    assert sample_spans(1000) == [(0, 1000)]
    whole = SAMPLE_BLOCK_BYTES * SAMPLE_BLOCKS
    assert sample_spans(whole) == [(0, whole)]
    size = 10 * whole + 3
    spans = sample_spans(size)
    assert len(spans) == SAMPLE_BLOCKS
    assert spans[0] == (0, SAMPLE_BLOCK_BYTES)
    assert spans[-1] == (size - SAMPLE_BLOCK_BYTES, SAMPLE_BLOCK_BYTES)
    assert all(a[0] < b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert sample_spans(size) == spans  # deterministic
    assert sample_positions(5) == [0, 1, 2, 3, 4]
    positions = sample_positions(10_000)
    assert positions[0] == 0 and positions[-1] == 9_999 and len(positions) == 64


# ------------------------------------------------------------------------ files


def test_jsonl_identity_ignores_the_path_and_sees_other_or_edited_data(tmp_path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl")
    copy_dir = tmp_path / "elsewhere"
    copy_dir.mkdir()
    b = copy_dir / "renamed.jsonl"
    shutil.copyfile(a, b)
    ident = zp.JsonlSource(a, field="text").content_identity()
    assert ident == zp.JsonlSource(b, field="text").content_identity()
    assert ident["kind"] == "jsonl" and ident["bytes"] == a.stat().st_size
    assert str(tmp_path) not in json.dumps(ident)

    # Another file with the same number of lines.
    other = write_jsonl(
        tmp_path / "other.jsonl", [line.replace("record", "RECORD") for line in LINES]
    )
    assert len(zp.JsonlSource(other)) == len(zp.JsonlSource(a))
    assert zp.JsonlSource(other, field="text").content_identity() != ident
    # One line edited in place (same size): a small file is digested whole.
    edited = write_jsonl(
        tmp_path / "edited.jsonl", [*LINES[:100], LINES[100].replace("0100", "0999"), *LINES[101:]]
    )
    assert edited.stat().st_size == a.stat().st_size
    assert zp.JsonlSource(edited, field="text").content_identity()["sample"] != ident["sample"]
    # What is read is part of it too.
    assert zp.JsonlSource(a, field="id").content_identity() != ident


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads: list[int] = []
    real = identity_module.open_binary

    class Counting(io.RawIOBase):
        def __init__(self, f):
            self._f = f

        def seek(self, offset, whence=os.SEEK_SET):
            return self._f.seek(offset, whence)

        def read(self, n=-1):
            data = self._f.read(n)
            reads.append(len(data))
            return data

        def close(self):
            self._f.close()
            super().close()

    monkeypatch.setattr(
        identity_module, "open_binary", lambda owner, p, *a: Counting(real(owner, p, *a))
    )
    return reads


def test_identifying_a_large_file_reads_a_bounded_sample(tmp_path, monkeypatch) -> None:
    big = tmp_path / "tokens.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: a full scan would read all of it
    reads = _counting_reads(monkeypatch)
    src = zp.TokenFileSource(big, dtype="uint16", index_path=_index(tmp_path, 1 << 29))
    first = src.content_identity()
    assert sum(reads) <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES + 64  # + the small index file
    assert first["bytes"] == 1 << 30
    # A byte changed inside a sampled block (the last one) is seen.
    with open(big, "r+b") as f:
        f.seek((1 << 30) - 10)
        f.write(b"\x01")
    assert src.content_identity()["sample"] != first["sample"]


def _index(tmp_path, num_tokens: int):
    path = tmp_path / "tokens.idx"
    np.array([0, num_tokens // 2, num_tokens], dtype="<i8").tofile(path)
    return path


def test_token_file_identity_covers_dtype_split_and_index(tmp_path) -> None:
    tokens = tmp_path / "t.bin"
    np.array([5, 6, 0, 7, 0, 9, 9, 0], dtype="<u2").tofile(tokens)
    by_eos = zp.TokenFileSource(tokens, eos_id=0).content_identity()
    moved = tmp_path / "moved.bin"
    shutil.copyfile(tokens, moved)
    assert zp.TokenFileSource(moved, eos_id=0).content_identity() == by_eos
    assert zp.TokenFileSource(tokens, eos_id=9).content_identity() != by_eos
    index = tmp_path / "t.idx"
    np.array([0, 3, 8], dtype="<i8").tofile(index)
    by_index = zp.TokenFileSource(tokens, index_path=index).content_identity()
    np.array([0, 5, 8], dtype="<i8").tofile(index)
    assert zp.TokenFileSource(tokens, index_path=index).content_identity() != by_index


def test_parquet_identity(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"id": i, "text": f"row {i}"} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=7)
    shutil.copyfile(tmp_path / "a.parquet", tmp_path / "b.parquet")
    rows[3]["text"] = "row X"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=7)
    ident = zp.ParquetSource(tmp_path / "a.parquet").content_identity()
    assert ident["kind"] == "parquet" and ident["files"] == 1
    assert zp.ParquetSource(tmp_path / "b.parquet").content_identity() == ident
    assert zp.ParquetSource(tmp_path / "c.parquet").content_identity() != ident
    assert zp.ParquetSource(tmp_path / "a.parquet", field="id").content_identity() != ident


def test_hf_identity(tmp_path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    cols = {"id": list(range(50)), "text": [f"row {i}" for i in range(50)]}
    ds = datasets.Dataset.from_dict(cols)
    ident = zp.HFSource(ds).content_identity()
    ds.save_to_disk(str(tmp_path / "saved"))
    assert zp.HFSource.from_disk(tmp_path / "saved").content_identity() == ident
    cols["text"][0] = "changed"
    assert zp.HFSource(datasets.Dataset.from_dict(cols)).content_identity() != ident
    assert zp.HFSource(ds, field="text").content_identity() != ident


# ---------------------------------------------------------------------- memory


def test_array_identity_is_by_value_and_bounded_for_huge_arrays() -> None:
    a = np.arange(100_000, dtype=np.int64)
    ident = zp.ArraySource(a).content_identity()
    assert ident == zp.ArraySource(a.copy()).content_identity()
    assert ident["kind"] == "array" and ident["shape"] == [100_000] and ident["dtype"] == "int64"
    b = a.copy()
    b[0] = -1  # in the first sampled block
    assert zp.ArraySource(b).content_identity() != ident
    assert zp.ArraySource(a.astype(np.int32)).content_identity() != ident
    # 10**12 elements, 8 TB if it were real: only the sampled elements are ever touched.
    huge = np.broadcast_to(np.arange(10, dtype=np.int64), (10**11, 10))
    assert zp.ArraySource(huge).content_identity()["shape"] == [10**11, 10]
    # A strided view reads by value, like a contiguous copy with the same elements.
    view = np.arange(40_000, dtype=np.int64).reshape(200, 200)[:, ::2]
    assert array_sample_of(view) == array_sample_of(np.ascontiguousarray(view))


def array_sample_of(a: np.ndarray) -> str:
    return zp.ArraySource(a).content_identity()["sample"]


def test_items_identity_encodes_values_not_addresses() -> None:
    items = [{"text": f"doc {i}", "n": i, "arr": np.arange(i)} for i in range(500)]
    ident = zp.ArraySource(items).content_identity()
    again = [{"text": f"doc {i}", "n": i, "arr": np.arange(i)} for i in range(500)]
    assert zp.ArraySource(again).content_identity() == ident
    assert ident["kind"] == "items"
    again[0]["text"] = "changed"
    assert zp.ArraySource(again).content_identity() != ident
    # An object array is read item by item too, never by its pointers.
    objs = np.array([f"s{i}" for i in range(10)], dtype=object)
    assert array_sample_of(objs) == array_sample_of(
        np.array([f"s{i}" for i in range(10)], dtype=object)
    )
    assert array_sample_of(objs) != array_sample_of(
        np.array([f"t{i}" for i in range(10)], dtype=object)
    )
    # Plain lists and arrays handed to the work source are identified the same way.
    assert dataset_identity(items) == ident
    assert dataset_identity(np.arange(5)) == zp.ArraySource(np.arange(5)).content_identity()


class _Opaque:
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> int:
        return i


class _Offers(_Opaque):
    def __init__(self, version: int) -> None:
        self.version = version

    def content_identity(self) -> dict:
        return {"kind": "table", "version": self.version}


class _Bad(_Opaque):
    def content_identity(self) -> dict:
        return {"kind": object()}


def test_user_datasets_offer_an_identity_or_are_known_by_type() -> None:
    assert dataset_identity(_Opaque()) == {"kind": "type", "type": "_Opaque"}
    assert dataset_identity(_Offers(2)) == {"kind": "table", "version": 2}
    with pytest.raises(
        TypeError, match=r"_Bad.content_identity\(\) must return a dict of str keys"
    ):
        dataset_identity(_Bad())
    src = zp.StaticMixtureWorkSource({"ok": _Opaque(), "bad": _Bad()})
    with pytest.raises(TypeError, match=r"dataset 'bad' \(component 1\): _Bad.content_identity"):
        src.config()
