from __future__ import annotations

import re
import sys
import uuid

import pytest

from zephon.sources import ParquetSource

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [
    {"id": i, "text": f"row {i}", "tags": ["t"] * (i % 3), "score": None if i % 4 else i / 2}
    for i in range(17)
]


def write_rows(path, rows, row_group_size=3):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def two_files(tmp_path):
    # 10 rows in row groups of 3 (3+3+3+1), then 7 rows in groups of 2 (2+2+2+1).
    return [
        write_rows(tmp_path / "a.parquet", ROWS[:10], row_group_size=3),
        str(write_rows(tmp_path / "b.parquet", ROWS[10:], row_group_size=2)),
    ]


def test_rows_across_files_and_row_groups(two_files, check_source):
    assert pq.ParquetFile(two_files[0]).num_row_groups == 4
    check_source(ParquetSource(two_files), ROWS)


def test_empty_file_in_the_middle(tmp_path, two_files, check_source):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[:1]).slice(0, 0), empty)
    check_source(ParquetSource([two_files[0], empty, two_files[1]]), ROWS)


def test_columns_subset(two_files, check_source):
    ds = ParquetSource(two_files, columns=["text", "id"])
    check_source(ds, [{"text": r["text"], "id": r["id"]} for r in ROWS])


def test_field(two_files, check_source):
    check_source(ParquetSource(two_files, field="tags"), [r["tags"] for r in ROWS])
    check_source(
        ParquetSource(two_files, columns=["id", "score"], field="score"), [r["score"] for r in ROWS]
    )


def test_keeps_a_few_row_groups_per_thread(two_files):
    ds = ParquetSource(two_files)
    assert ds.read(range(len(ROWS))) == ROWS
    assert len(ds._local.row_groups) == 4
    ds[0]  # row group 0 was evicted: decoded again, pushing out the oldest
    assert len(ds._local.row_groups) == 4 and 0 in ds._local.row_groups


def test_unknown_column_names_the_file(two_files):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{two_files[0]} has no column(s) ['nope']; its columns are ['id', 'text', 'tags', 'score']"
        ),
    ):
        ParquetSource(two_files, columns=["id", "nope"])
    with pytest.raises(ValueError, match=re.escape("has no column(s) ['nope']")):
        ParquetSource(two_files, field="nope")


def test_field_outside_columns(two_files):
    with pytest.raises(ValueError, match=re.escape("field 'text' is not among columns ['id']")):
        ParquetSource(two_files, columns=["id"], field="text")


def test_fsspec_url(check_source):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    url = f"memory://zephon-test-{uuid.uuid4().hex}/a.parquet"
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(ROWS), sink, row_group_size=5)
    fs.pipe(url, sink.getvalue().to_pybytes())
    try:
        check_source(ParquetSource(url), ROWS)
    finally:
        fs.rm(url)


def test_pyarrow_missing_names_the_extra(monkeypatch, two_files):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=re.escape("pip install zephon[parquet]")):
        ParquetSource(two_files)
