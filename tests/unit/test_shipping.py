"""Shipping operators to workers: datasets travel by reference (zephon/runners/shipping.py).

Each test packs objects as ``ProcessExecutor.start`` does, places the shared buffers, and
loads them back through a read-only mapping, as a worker does.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.runners.shipping import SHARED_ARRAY_MIN_BYTES, Shipment, load_operators, pack_operators
from zephon.shm import attach_segment


def ship(obj: Any, *, dataset: bool = True) -> tuple[Any, Shipment]:
    """``obj`` as a worker gets it, and the shipment it travelled in: as a dataset of the
    mixture (and referred to by the operators), or held by an operator only."""
    shipment = pack_operators([obj], [("data", obj)] if dataset else [])
    segment = shipment.place()
    if segment is None:
        return load_operators(shipment.payload, None)[0], shipment
    with segment:
        view = attach_segment(os.dup(segment.fileno()), writable=False)
        (loaded,) = load_operators(shipment.payload, view)
        view.close()  # arrays loaded from it keep the mapping until they go
    return loaded, shipment


# ------------------------------------------------------------------------- in memory
def test_a_large_array_is_placed_once_in_shared_memory_and_read_only() -> None:
    big = np.random.default_rng(0).random((512, 256))  # 1 MiB
    (a, b, again), shipment = ship((big, big.T, big))
    assert shipment.shared_bytes == big.nbytes  # one copy: the transposed view shares it
    assert len(shipment.payload) < 2_000
    for got, want in ((a, big), (b, big.T)):
        np.testing.assert_array_equal(got, want)
        assert got.strides == want.strides and not got.flags.writeable
    assert again is a
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0] = 1.0


def test_arrays_of_any_plain_dtype_are_shared() -> None:
    n = 40_000  # every array 64 KiB or more
    cases = (
        np.arange(n).astype("datetime64[s]"),
        np.zeros(n, dtype=[("a", "<i4"), ("b", "<f8")]),
        np.arange(n, dtype=np.float16),
        np.ones((n, 3), dtype=bool),
    )
    got, shipment = ship(cases)
    assert shipment.shared_bytes >= sum(a.nbytes for a in cases)
    for a, want in zip(got, cases, strict=True):
        assert a.dtype == want.dtype and a.shape == want.shape
        np.testing.assert_array_equal(a, want)


def test_arrays_an_operator_holds_are_pickled_by_value_and_stay_writable() -> None:
    state = np.zeros((512, 256))  # say, a buffer an operator fills
    (got,), shipment = ship((state,), dataset=False)
    assert shipment.shared_bytes == 0 and len(shipment.payload) > state.nbytes
    got[0, 0] = 1.0
    assert got.flags.writeable


def test_a_dataset_referred_to_by_operators_travels_once() -> None:
    rows = zp.ArraySource(np.random.default_rng(3).random((512, 256)))
    shipment = pack_operators([("fetch", rows), ("other", [rows])], [("rows", rows)])
    assert shipment.shared_bytes == 512 * 256 * 8 and len(shipment.payload) < 4_000
    with shipment.place() as segment:
        first, second = load_operators(shipment.payload, segment)
    assert first[1] is second[1][0]


def test_small_and_object_arrays_are_pickled_by_value() -> None:
    small = np.arange(SHARED_ARRAY_MIN_BYTES // 8 - 1, dtype=np.int64)
    objects = np.array([{"a": i} for i in range(20_000)], dtype=object)
    (a, b), shipment = ship((small, objects))
    assert shipment.shared_bytes == 0 and shipment.place() is None
    np.testing.assert_array_equal(a, small)
    assert a.flags.writeable and list(b) == list(objects)


def test_strided_and_fortran_arrays_keep_their_values() -> None:
    big = np.arange(300_000, dtype=np.int32).reshape(600, 500)
    cases = (big[::2, 3::5], np.asfortranarray(big), big[:, ::-1], big[10:20])
    got, _ = ship(cases)
    for a, want in zip(got, cases, strict=True):
        np.testing.assert_array_equal(a, want)


def test_an_array_source_travels_with_its_rows_in_shared_memory() -> None:
    rows = np.random.default_rng(1).random((2000, 64)).astype(np.float32)
    source, shipment = ship(zp.ArraySource(rows))
    assert shipment.shared_bytes == rows.nbytes and len(shipment.payload) < 2_000
    np.testing.assert_array_equal(np.stack(source.read([5, 1999, 0])), rows[[5, 1999, 0]])


def test_in_memory_hugging_face_tables_go_through_shared_memory() -> None:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"text": [f"document {i} " * 20 for i in range(5000)]})
    source, shipment = ship(zp.HFSource(table, field="text"))
    assert shipment.shared_bytes > 500_000 and len(shipment.payload) < 40_000
    assert source.read([3, 4999]) == [f"document {i} " * 20 for i in (3, 4999)]


# ----------------------------------------------------------------------- memory-mapped
@pytest.fixture
def npy(tmp_path: Path) -> tuple[Path, np.ndarray]:
    data = np.arange(400_000, dtype=np.int64).reshape(800, 500)
    path = tmp_path / "rows.npy"
    np.save(path, data)
    return path, data


def test_a_memory_mapped_array_reopens_its_file_instead_of_being_copied(npy) -> None:
    path, data = npy
    mapped = np.load(path, mmap_mode="r")
    views = (mapped, mapped[100:200], mapped[::-3, 7::11], mapped.T, np.asarray(mapped)[5])
    got, shipment = ship(views)
    assert shipment.shared_bytes == 0 and len(shipment.payload) < 8_000  # a small view: by value
    for a, view in zip(got, views, strict=True):
        np.testing.assert_array_equal(a, view)
        assert a.flags.writeable == (view.nbytes < SHARED_ARRAY_MIN_BYTES)  # mapped read-only
    np.testing.assert_array_equal(got[0], data)


def test_an_array_source_over_np_load_mmap_travels(npy) -> None:
    # It failed with dill's raw "TypeError: cannot pickle 'mmap.mmap' object".
    path, data = npy
    source, shipment = ship(zp.ArraySource(np.load(path, mmap_mode="r")))
    assert shipment.shared_bytes == 0
    np.testing.assert_array_equal(np.stack(source.read([0, 799])), data[[0, 799]])


def test_a_replaced_memory_mapped_file_is_an_error_naming_it(npy) -> None:
    path, data = npy
    shipment = pack_operators([np.load(path, mmap_mode="r")])
    np.save(path.with_suffix(".new.npy"), data + 1)
    os.replace(path.with_suffix(".new.npy"), path)
    with pytest.raises(FileNotFoundError, match=f"{path} was replaced by another; .*keep the file"):
        load_operators(shipment.payload, None)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=f"{path} is gone"):
        load_operators(shipment.payload, None)


# --------------------------------------------------------------------- file sources
def test_file_sources_travel_as_paths_and_small_indexes(tmp_path: Path) -> None:
    lines = [json.dumps({"text": "x" * 200, "i": i}) for i in range(20_000)]  # 4.5 MB
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    tokens = tmp_path / "tokens.bin"
    ids = np.random.default_rng(2).integers(2, 50_000, 1_000_000).astype(np.uint16)
    ids[::500] = 1
    ids.tofile(tokens)
    sources = [zp.JsonlSource(jsonl, field="i"), zp.TokenFileSource(tokens, eos_id=1)]
    got, shipment = ship(sources)
    files_bytes = jsonl.stat().st_size + tokens.stat().st_size
    # The JSONL index (8 bytes a record) goes to shared memory; the files' contents nowhere.
    assert len(shipment.payload) < 40_000 and shipment.shared_bytes < files_bytes / 20
    assert got[0].read([0, 19_999]) == [0, 19_999]
    np.testing.assert_array_equal(got[1][3]["tokens"], sources[1][3]["tokens"])


def test_parquet_and_saved_hugging_face_sources_travel_as_paths(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa

    texts = [f"row {i} " * 30 for i in range(10_000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "rows.parquet", row_group_size=1000)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    sources = [
        zp.ParquetSource(tmp_path / "rows.parquet", field="text"),
        zp.HFSource.from_disk(tmp_path / "hf", field="text"),
    ]
    got, shipment = ship(sources)
    assert shipment.shared_bytes == 0 and len(shipment.payload) < 20_000
    for source in got:
        assert source.read([0, 9_999]) == [texts[0], texts[9_999]]


# ---------------------------------------------------------------- the reopen protocol
class SqliteSource:
    """A dataset holding a database connection, which does not pickle."""

    def __init__(self, path: str, opened_in: list[int] | None = None) -> None:
        self.path = path
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.size = self.db.execute("select count(*) from rows").fetchone()[0]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> str:
        return self.db.execute("select text from rows where i = ?", (i,)).fetchone()[0]


class ReopenedSqliteSource(SqliteSource):
    def __zephon_reopen__(self) -> tuple[type, tuple[str]]:
        return ReopenedSqliteSource, (self.path,)


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "rows.db")
    with sqlite3.connect(path) as conn:
        conn.execute("create table rows (i integer primary key, text text)")
        conn.executemany("insert into rows values (?, ?)", [(i, f"row {i}") for i in range(50)])
    return path


def test_a_dataset_with_a_reopen_method_is_rebuilt_from_its_recipe(db: str) -> None:
    original = ReopenedSqliteSource(db)
    got, _ = ship(original)
    assert type(got) is ReopenedSqliteSource and got is not original and got.db is not original.db
    assert [got[i] for i in (0, 49)] == ["row 0", "row 49"]


def test_a_dataset_that_cannot_travel_is_an_error_naming_the_component_and_the_fix(db) -> None:
    components = [("web", zp.ArraySource(["a", "b"])), ("sql", SqliteSource(db))]
    with pytest.raises(zp.TransferError) as info:
        pack_operators([[ds for _, ds in components]], components)
    text = str(info.value)
    assert text.startswith(
        "mixture component 'sql' (<tests.unit.test_shipping.SqliteSource object"
    ), text
    assert "TypeError: cannot pickle 'sqlite3.Connection' object" in text
    assert "Give SqliteSource a __zephon_reopen__(self) method returning (factory, args)" in text
    assert "`return SqliteSource, (self.path,)`" in text and "Pipeline(workers=0)" in text
    assert isinstance(info.value, TypeError) and isinstance(info.value.__cause__, TypeError)


def test_an_operator_that_cannot_travel_is_an_error_naming_it() -> None:
    from zephon.operators.fetch import Fetch
    from zephon.operators.map import Map

    sock = socket.socket()
    try:
        with pytest.raises(zp.TransferError) as info:
            pack_operators([Fetch(), Map(lambda x: sock.fileno() + x)])
    finally:
        sock.close()
    text = str(info.value)
    assert text.startswith("operator 'map' (position 1, Map(fn="), text
    assert "cannot pickle 'socket' object" in text and "inside the function on first use" in text


class BadRecipe:
    def __zephon_reopen__(self) -> Any:
        return "not callable", 3


def test_a_bad_reopen_recipe_says_what_it_must_return() -> None:
    with pytest.raises(
        zp.TransferError,
        match=r"BadRecipe.__zephon_reopen__\(\) must return "
        r"\(factory, args\).*got \('not callable', 3\)",
    ):
        pack_operators([BadRecipe()], [("bad", BadRecipe())])
