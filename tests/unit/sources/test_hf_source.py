"""HFSource over a local Hugging Face dataset, in memory and memory-mapped from disk."""

from __future__ import annotations

import os
import pickle
import re
import sys

import numpy as np
import pytest

# Nothing here may reach a hub: these are read when `datasets` is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

datasets = pytest.importorskip("datasets")

import zephon as zp  # noqa: E402
from zephon.sources.hf import HFSource  # noqa: E402
from zephon.testing import assert_resumes_exactly, take  # noqa: E402

ROWS = [
    {"id": i, "text": f"row {i} " + "é€"[: i % 3] * (i % 5), "tags": ["t"] * (i % 3)}
    for i in range(23)
]


def columns(rows):
    return {key: [r[key] for r in rows] for key in rows[0]}


@pytest.fixture
def in_memory():
    return datasets.Dataset.from_dict(columns(ROWS))


@pytest.fixture
def saved(tmp_path, in_memory):
    path = tmp_path / "saved"
    # Two shards: rows come from two memory-mapped Arrow files.
    in_memory.save_to_disk(str(path), num_shards=2)
    return path


def test_in_memory_dataset(in_memory, check_source):
    check_source(HFSource(in_memory), ROWS)


def test_from_disk(saved, check_source):
    ds = HFSource.from_disk(saved)
    assert len(ds.dataset.cache_files) == 2  # memory-mapped, not loaded
    check_source(ds, ROWS)
    assert repr(ds) == f"HFSource(path={str(saved)!r}, field=None, len=23)"


def test_field(in_memory, saved, check_source):
    texts = [r["text"] for r in ROWS]
    check_source(HFSource(in_memory, field="text"), texts)
    ds = HFSource.from_disk(saved, field="tags")
    check_source(ds, [r["tags"] for r in ROWS])
    assert ds.dataset.column_names == ["tags"]  # only the field's column is decoded
    assert repr(HFSource(in_memory, field="text")) == (
        "HFSource(columns=['id', 'text', 'tags'], field='text', len=23)"
    )


def test_a_dataset_dict_split(tmp_path, in_memory, check_source):
    path = tmp_path / "dict"
    datasets.DatasetDict({"train": in_memory, "test": in_memory.select(range(3))}).save_to_disk(
        str(path)
    )
    check_source(HFSource.from_disk(path, split="test", field="id"), [0, 1, 2])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "holds a DatasetDict with splits ['test', 'train']; got no split; pass split="
        ),
    ):
        HFSource.from_disk(path)
    with pytest.raises(ValueError, match=re.escape("got split='dev'; pass split= one of them")):
        HFSource.from_disk(path, split="dev")


def test_numpy_format_reads_match_indexing(saved):
    dataset = datasets.load_from_disk(str(saved)).with_format("numpy")
    ds = HFSource(dataset)
    indices = [5, 0, 22, 5, 13]
    got = ds.read(indices)
    for i, row in zip(indices, got, strict=True):
        want = dataset[i]
        assert row.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(row[key], want[key])
            assert np.asarray(row[key]).dtype == np.asarray(want[key]).dtype
    assert HFSource(dataset, field="id").read(indices) == indices


def test_formats_without_dict_batches_read_row_by_row(in_memory):
    ds = HFSource(in_memory.with_format("pandas"))
    (frame,) = ds.read([4])
    assert frame.equals(in_memory.with_format("pandas")[4])


def test_transform_may_add_fields(in_memory):
    dataset = in_memory.with_transform(lambda b: {"n": [len(t) for t in b["text"]]})
    ds = HFSource(dataset, field="n")
    assert ds[3] == len(ROWS[3]["text"])
    assert ds.read([1, 0]) == [len(ROWS[1]["text"]), len(ROWS[0]["text"])]
    bad = HFSource(dataset, field="missing")
    with pytest.raises(
        KeyError, match=re.escape("row 2 has no field 'missing' (found fields ['n'])")
    ):
        bad[2]
    with pytest.raises(KeyError, match=re.escape("row 2 has no field 'missing'")):
        bad.read([2, 0])


def test_memory_mapped_dataset_pickles_by_path(saved, in_memory):
    dill = pytest.importorskip("dill")
    disk = HFSource.from_disk(saved, field="text")
    memory = HFSource(in_memory)
    # What a spawned worker receives: the file paths, not the rows.
    for dumps in (pickle.dumps, lambda x: dill.dumps(x, recurse=True)):
        blob = dumps(disk)
        assert len(blob) < 4096 and str(saved).encode() in blob
        clone = pickle.loads(blob)
        assert clone.read(list(range(23))) == [r["text"] for r in ROWS]
        assert repr(clone) == repr(disk)
    # An in-memory dataset carries its whole table.
    assert len(pickle.dumps(memory)) > len(pickle.dumps(disk))


def test_unknown_field_names_the_columns(in_memory):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "field 'body' is not a column of the dataset; its columns are ['id', 'text', 'tags']"
        ),
    ):
        HFSource(in_memory, field="body")


def test_wrong_kinds_of_dataset(in_memory):
    with pytest.raises(TypeError, match=re.escape("not a DatasetDict; pass dataset[split]")):
        HFSource(datasets.DatasetDict({"train": in_memory}))
    with pytest.raises(TypeError, match="streaming IterableDataset has none"):
        HFSource(in_memory.to_iterable_dataset())
    with pytest.raises(
        TypeError, match=r"takes a datasets.Dataset; got list; use HFSource.from_disk"
    ):
        HFSource(ROWS)


def test_from_disk_errors(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match=r"holds no saved dataset .*Dataset.save_to_disk"):
        HFSource.from_disk(tmp_path / "nothing")
    with pytest.raises(ValueError, match=re.escape("holds a single Dataset, not a DatasetDict")):
        HFSource.from_disk(saved, split="train")


def test_datasets_missing_names_the_extra(monkeypatch, in_memory):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=re.escape("pip install zephon[hf]")):
        HFSource(in_memory)


def _pipeline(saved, in_memory, workers: int = 0) -> zp.Pipeline:
    source = zp.StaticMixtureWorkSource(
        [HFSource.from_disk(saved), HFSource(in_memory.select(range(10)), field="text")],
        [2, 1],
        seed=3,
        chunk_size=4,
        num_epochs=1,
    )
    return (
        zp.Pipeline(source, canonical_replicas=2, workers=workers)
        .fetch()
        .tokenize(zp.ByteTokenizer(), field="text")
        .split(12)
        .pack(16, num_bins=2)
        .batch(2)
    )


def test_resumes_exactly_in_a_pipeline(saved, in_memory):
    ref = assert_resumes_exactly(lambda: _pipeline(saved, in_memory))
    assert len(ref) >= 8 and ref[0]["tokens"].shape == (2, 16)


@pytest.mark.processes
def test_spawned_worker_reads_the_same(saved, in_memory):
    # A spawned worker unpickles the memory-mapped source by path (dill, spawn).
    with _pipeline(saved, in_memory) as inline, _pipeline(saved, in_memory, workers=1) as worker:
        want, got = take(inline), take(worker)
    assert len(got) == len(want) > 0
    for a, b in zip(want, got, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
