"""Datasets reach worker processes by reference (issue 14, items 8-10): a memory-mapped array
reopens its file in each worker, an in-memory array is shared once, file sources reopen by
path, a dataset says how it reopens with ``__zephon_reopen__``, and one that cannot travel
is an error naming it. Every pipeline here gives the same batches as with ``workers=0``.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import multiprocess
import numpy as np
import pytest

import zephon as zp
from zephon.testing import assert_same_batches, take

pytestmark = pytest.mark.processes


def as_row(sample: Any) -> np.ndarray:
    """Any sample of these tests as 4 int64 values, so that batches stack."""
    values = sample["tokens"] if isinstance(sample, dict) else sample
    return np.resize(np.asarray(values, dtype=np.int64).ravel(), 4)


def pipeline(datasets: dict[str, Any], workers: int) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        datasets=datasets, weights=dict.fromkeys(datasets, 1.0), seed=3, chunk_size=8
    )
    pipe = zp.Pipeline(src, canonical_replicas=4, workers=workers)
    return pipe.fetch().map(as_row).batch(4)


def same_with_and_without_workers(datasets: dict[str, Any], n: int = 40) -> zp.Pipeline:
    """Checks the first ``n`` batches; returns the still open ``workers=2`` pipeline."""
    with pipeline(datasets, workers=0) as pipe:
        expected = take(pipe, n)
    pipe = pipeline(datasets, workers=2)
    try:
        assert_same_batches(expected, take(pipe, n))
    except BaseException:
        pipe.close()
        raise
    return pipe


def mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_memory_mapped_array_is_reopened_by_each_worker(tmp_path: Path) -> None:
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(600_000, dtype=np.float32).reshape(20_000, 30))
    rows = zp.ArraySource(np.load(path, mmap_mode="r"))
    with same_with_and_without_workers({"rows": rows}) as pipe:
        for worker in pipe.stats()["workers"]:
            maps = mapped(worker["pid"])
            assert str(path) in maps and "/memfd:zephon-data" not in maps


def test_an_in_memory_array_is_placed_once_in_shared_memory(tmp_path: Path) -> None:
    rows = np.random.default_rng(0).random((20_000, 30)).astype(np.float32)  # 2.4 MB
    with same_with_and_without_workers({"rows": zp.ArraySource(rows)}) as pipe:
        segments = {mapped(os.getpid()).count("/memfd:zephon-data")}
        for worker in pipe.stats()["workers"]:
            segments.add(mapped(worker["pid"]).count("/memfd:zephon-data"))
        assert segments == {1}  # the parent and each worker map the one copy


def test_file_sources_run_with_workers(tmp_path: Path) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(3000)))
    tokens = tmp_path / "tokens.bin"
    ids = (np.arange(60_000) % 97 + 1).astype(np.uint16)
    ids.tofile(tokens)
    datasets = {
        "jsonl": zp.JsonlSource(jsonl, field="n"),
        "tokens": zp.TokenFileSource(tokens, eos_id=97),
    }
    with same_with_and_without_workers(datasets, n=30):
        pass


def test_token_files_packed_from_spans_in_workers(tmp_path: Path) -> None:
    # fetch -> split -> pack reads a token file's documents as spans of each worker's own
    # mapping and writes rows from them into the ring: the batches of one process.
    rng = np.random.default_rng(4)
    lengths = np.minimum(rng.lognormal(3.0, 1.2, 400).astype(np.int64) + 1, 300)
    ids = rng.integers(2, 60_000, int(lengths.sum()), dtype=np.uint16)
    ids[np.cumsum(lengths) - 1] = 1
    ids.tofile(tmp_path / "tokens.bin")

    def build(workers: int) -> zp.Pipeline:
        src = zp.StaticMixtureWorkSource(
            [zp.TokenFileSource(tmp_path / "tokens.bin", eos_id=1)], seed=2, chunk_size=16
        )
        pipe = zp.Pipeline(src, canonical_replicas=4, workers=workers)
        return pipe.fetch().split(64).pack(64, 4).batch(4)

    with build(0) as pipe:
        assert "fetch[spans]" in pipe.explain()
        expected = take(pipe, 60)
    with build(2) as pipe:
        assert "fetch[spans]" in pipe.explain()
        assert_same_batches(expected, take(pipe, 60))


class SqliteRows:
    """A dataset over a SQLite table; it leaves a file named after each process that opens
    it. Its connection does not pickle."""

    def __init__(self, path: str, marks: str) -> None:
        self.path, self.marks = path, marks
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.size = self.db.execute("select count(*) from rows").fetchone()[0]
        Path(marks, str(os.getpid())).touch()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> list[int]:
        (text,) = self.db.execute("select text from rows where i = ?", (i,)).fetchone()
        return list(text.encode())


class ReopenedSqliteRows(SqliteRows):
    """The same, saying how a worker opens its own copy."""

    def __zephon_reopen__(self) -> tuple[type, tuple[str, str]]:
        return ReopenedSqliteRows, (self.path, self.marks)


@pytest.fixture
def db(tmp_path: Path) -> tuple[str, Path]:
    path = str(tmp_path / "rows.db")
    with sqlite3.connect(path) as conn:
        conn.execute("create table rows (i integer primary key, text text)")
        conn.executemany("insert into rows values (?, ?)", [(i, f"row {i}") for i in range(200)])
    marks = tmp_path / "opened"
    marks.mkdir()
    return path, marks


def test_a_dataset_with_a_reopen_method_is_opened_in_each_worker(db) -> None:
    path, marks = db
    with same_with_and_without_workers({"sql": ReopenedSqliteRows(path, str(marks))}) as pipe:
        workers = {w["pid"] for w in pipe.stats()["workers"]}
    assert {int(p.name) for p in marks.iterdir()} == {os.getpid(), *workers}


def test_a_dataset_that_cannot_travel_fails_at_the_first_next_naming_it(db) -> None:
    path, marks = db
    datasets = {
        "web": zp.ArraySource(np.zeros((10, 4), np.int64)),
        "sql": SqliteRows(path, str(marks)),
    }
    pipe = pipeline(datasets, workers=2)
    with pytest.raises(zp.TransferError) as info:
        next(pipe)
    pipe.close()
    text = str(info.value)
    assert text.startswith(
        "mixture component 'sql' (<tests.integration.test_workers_datasets.SqliteRows"
    ), text
    assert "cannot pickle 'sqlite3.Connection' object" in text and "__zephon_reopen__" in text
    assert "Traceback" not in text
    assert not multiprocess.active_children()  # it failed before starting any worker
