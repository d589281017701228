"""JsonlSource and ParquetSource over fsspec URLs (``memory://``) in a resuming pipeline."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

import zephon as zp
from zephon.testing import assert_resumes_exactly, take

fsspec = pytest.importorskip("fsspec")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [f"doc {i}: " + "abcdéfgh€"[: i % 9] * (1 + i % 4) for i in range(30)]


@pytest.fixture
def memory_root():
    """A fresh directory in fsspec's process-wide memory filesystem, removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"memory://zephon-test-{uuid.uuid4().hex}"
    yield fs, root
    fs.rm(root.removeprefix("memory://"), recursive=True)


@pytest.fixture
def urls(memory_root):
    fs, root = memory_root
    jsonl = [f"{root}/part-{k}.jsonl" for k in range(2)]
    for k, url in enumerate(jsonl):
        lines = [json.dumps({"id": i, "text": DOCS[i]}) for i in range(k * 12, (k + 1) * 12)]
        fs.pipe(url, ("\n".join(lines) + "\n").encode())
    parquet = f"{root}/docs.parquet"
    sink = pa.BufferOutputStream()
    table = pa.Table.from_pylist([{"id": i, "text": DOCS[i][::-1]} for i in range(len(DOCS))])
    pq.write_table(table, sink, row_group_size=7)
    fs.pipe(parquet, sink.getvalue().to_pybytes())
    return jsonl, parquet


def _pipeline(jsonl, parquet) -> zp.Pipeline:
    source = zp.StaticMixtureWorkSource(
        {
            "jsonl": zp.JsonlSource(jsonl, field="text"),
            "parquet": zp.ParquetSource(parquet, columns=["id", "text"]),
        },
        {"jsonl": 1, "parquet": 2},
        seed=11,
        chunk_size=4,
        num_epochs=1,
    )
    return (
        zp.Pipeline(source, canonical_replicas=2)
        .fetch()
        .tokenize(zp.ByteTokenizer(), field="text")  # rows are dicts here, strings there
        .split(10)
        .pack(16, num_bins=2)
        .batch(2)
    )


def test_sources_read_memory_urls(urls):
    jsonl, parquet = urls
    assert zp.JsonlSource(jsonl, field="text").read([23, 0, 12]) == [DOCS[23], DOCS[0], DOCS[12]]
    assert zp.ParquetSource(parquet, field="text")[29] == DOCS[29][::-1]


def test_resumes_exactly_from_memory_urls(urls):
    jsonl, parquet = urls
    ref = assert_resumes_exactly(lambda: _pipeline(jsonl, parquet))
    assert len(ref) >= 8 and ref[0]["tokens"].shape == (2, 16)
    # Every document's bytes arrive: the stream holds exactly the corpus' tokens.
    tokens = np.concatenate([b["tokens"][b["tokens_segment_ids"] > 0] for b in ref])
    docs = DOCS[:24] + [d[::-1] for d in DOCS]
    want = sum(len(d.encode()) + 1 for d in docs)
    # drop_last may cut the final partial batch; nothing else is lost.
    assert want - 2 * 16 < len(tokens) <= want


def test_same_batches_as_local_files(urls, tmp_path):
    jsonl, parquet = urls
    fs = fsspec.filesystem("memory")
    local_jsonl = []
    for k, url in enumerate(jsonl):
        path = tmp_path / f"part-{k}.jsonl"
        path.write_bytes(fs.cat(url))
        local_jsonl.append(str(path))
    local_parquet = tmp_path / "docs.parquet"
    local_parquet.write_bytes(fs.cat(parquet))
    with _pipeline(jsonl, parquet) as remote, _pipeline(local_jsonl, local_parquet) as local:
        a, b = take(remote), take(local)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
