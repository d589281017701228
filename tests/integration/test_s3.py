"""Every file source over ``s3://`` against real S3-compatible servers on 127.0.0.1, each test
once per server (moto's server mode and SeaweedFS's compiled gateway, each started once for
the module and stopped here; no mock objects): the same samples as the local files, exact
resume with workers, index caches that spare the second start every GET, errors that name
the URL within the timeout, transient failures retried and counted, and servers that listen
on 127.0.0.1 only (and leave nothing behind: ``tests/s3_server.py`` checks it).

With ``CI=true`` a server that cannot start fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import zephon as zp
from tests.s3_server import SERVERS, need, s3_server
from zephon.sources import _fs
from zephon.testing import assert_resumes_exactly, take

ROOT = Path(__file__).resolve().parents[2]

BUCKET = "zephon-data"
FILES = 5
PER_FILE = 12


@pytest.fixture(scope="module", params=SERVERS)
def s3(request):
    with s3_server(BUCKET, request.param) as server:
        yield server


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory):
    """The same files locally and in the bucket: JSONL shards, a Parquet file, a token
    file, ArrayRecord shards."""
    local = tmp_path_factory.mktemp("corpus")
    client = s3.client()
    docs = [f"doc {i}: " + "xyz" * (i % 7) for i in range(FILES * PER_FILE)]
    for k in range(FILES):
        lines = [json.dumps({"text": d}) for d in docs[k * PER_FILE : (k + 1) * PER_FILE]]
        (local / f"part-{k:02d}.jsonl").write_text("\n".join(lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"text": d} for d in docs]), local / "docs.parquet", row_group_size=9
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 500, size=3000).astype("<u2")
    tokens[rng.integers(0, 3000, size=40)] = 0
    tokens.tofile(local / "tokens.bin")
    from array_record.python.array_record_module import ArrayRecordWriter

    for k in range(2):
        writer = ArrayRecordWriter(str(local / f"rec-{k}.array_record"), "group_size:1")
        for d in docs[k * 30 : (k + 1) * 30]:
            writer.write(d.encode())
        writer.close()
    for path in local.iterdir():
        if path.is_file() and not path.name.startswith("."):
            client.put_object(Bucket=BUCKET, Key=f"corpus/{path.name}", Body=path.read_bytes())
    return local, docs


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _url(name: str) -> str:
    return f"s3://{BUCKET}/corpus/{name}"


def test_every_source_reads_the_bucket_like_local_files(s3, corpus, cache_dir):
    local, docs = corpus
    opts = s3.storage_options
    jsonl = zp.JsonlSource(_url("part-*.jsonl"), field="text", storage_options=opts)
    assert len(jsonl) == len(docs)
    assert jsonl.read([59, 0, 13, 13]) == [docs[59], docs[0], docs[13], docs[13]]
    local_jsonl = zp.JsonlSource(str(local / "part-*.jsonl"), field="text")
    assert jsonl.content_identity() == local_jsonl.content_identity()

    parquet = zp.ParquetSource(_url("docs.parquet"), field="text", storage_options=opts)
    assert parquet.read([0, 40, 59]) == [docs[0], docs[40], docs[59]]

    remote_tokens = zp.TokenFileSource(_url("tokens.bin"), eos_id=0, storage_options=opts)
    local_tokens = zp.TokenFileSource(local / "tokens.bin", eos_id=0)
    assert len(remote_tokens) == len(local_tokens) > 10
    idx = [len(local_tokens) - 1, 0, 5]
    for got, want in zip(remote_tokens.read(idx), local_tokens.read(idx), strict=True):
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(remote_tokens.token_offsets(), local_tokens.token_offsets())

    records = zp.ArrayRecordSource(
        _url("rec-*.array_record"), decode=bytes.decode, storage_options=opts
    )
    assert len(records) == 60
    assert records.read([59, 0, 31]) == [docs[59], docs[0], docs[31]]
    # Every index cache went to the cache directory: nothing is written to the bucket.
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert not [k for k in keys if k.endswith(".zephon-idx")]
    assert list((cache_dir / "indexes").glob("*.zephon-idx"))


def test_second_start_reads_no_object(s3, corpus, cache_dir):
    proxy = s3.proxy()
    opts = proxy.storage_options
    first = zp.JsonlSource(_url("part-*.jsonl"), field="text", storage_options=opts)
    assert proxy.methods.get("GET", 0) > FILES  # a listing and one scan per shard
    proxy.reset_counts()
    again = zp.JsonlSource(_url("part-*.jsonl"), field="text", storage_options=opts)
    assert len(again) == len(first)
    # Only the listing: sizes and ETags come with it, the indexes from the cache.
    assert proxy.methods.get("GET", 0) <= 2, proxy.methods
    assert again[30] == first[30]


def test_parquet_row_groups_of_a_bucket_are_read_concurrently(s3, corpus, cache_dir):
    _, docs = corpus
    proxy = s3.proxy(delay_s=0.05)  # so that requests that overlap are seen overlapping
    parquet = zp.ParquetSource(
        _url("docs.parquet"), field="text", storage_options=proxy.storage_options
    )
    proxy.reset_counts()
    wanted = [59, 0, 45, 9, 27, 18, 36, 1]  # row groups of 9 rows: 7 of them
    assert parquet.read(wanted) == [docs[i] for i in wanted]
    assert proxy.max_in_flight >= 3, proxy.max_in_flight  # one after another would be 1
    proxy.reset_counts()
    assert parquet.read([54, 59]) == [docs[54], docs[59]]  # cached in this thread: no request
    assert proxy.requests == 0


def test_pipeline_over_the_bucket_resumes_exactly_with_workers(s3, corpus, cache_dir):
    opts = s3.storage_options

    def build(workers: int = 0) -> zp.Pipeline:
        source = zp.StaticMixtureWorkSource(
            {
                "jsonl": zp.JsonlSource(_url("part-*.jsonl"), field="text", storage_options=opts),
                "records": zp.ArrayRecordSource(
                    _url("rec-*.array_record"), decode=bytes.decode, storage_options=opts
                ),
            },
            None,
            seed=3,
            chunk_size=4,
            num_epochs=1,
        )
        return (
            zp.Pipeline(source, canonical_replicas=2, workers=workers)
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .split(16)
            .pack(32, num_bins=2)
            .batch(2)
        )

    ref = assert_resumes_exactly(build, cuts=[0, 3, 7])
    with build(workers=2) as pipe:
        got = take(pipe)
    assert len(got) == len(ref) > 5
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_the_server_listens_on_loopback_only(s3):
    psutil = need("psutil")
    pid = getattr(s3, "pid", None)
    listening = [
        c.laddr
        for c in psutil.Process(pid or os.getpid()).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    if pid is None:  # moto's server is a thread of this process: its socket alone
        listening = [a for a in listening if a.port == s3.port]
    assert s3.port in {a.port for a in listening}
    assert {a.ip for a in listening} == {"127.0.0.1"}, listening


def test_missing_object_names_the_url(s3, corpus, cache_dir):
    url = f"s3://{BUCKET}/corpus/nope.jsonl"
    with pytest.raises(FileNotFoundError, match=f"{url} does not exist"):
        zp.JsonlSource(url, storage_options=s3.storage_options)
    with pytest.raises(FileNotFoundError, match=r"pattern .*nothing-\*\.jsonl.* matches no file"):
        zp.JsonlSource(f"s3://{BUCKET}/corpus/nothing-*.jsonl", storage_options=s3.storage_options)


def test_unreachable_endpoint_fails_within_the_timeout_naming_the_url(cache_dir):
    need("s3fs")
    from benchmarks.s3_local import _free_port, storage_options_for

    opts = storage_options_for(f"http://127.0.0.1:{_free_port()}")  # nobody listens
    url = f"s3://{BUCKET}/corpus/part-00.jsonl"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"{url} within timeout_s=1\.5 .*check the endpoint"):
        zp.JsonlSource(url, storage_options=opts, timeout_s=1.5)
    assert time.monotonic() - start < 5


def test_transient_failures_are_retried_and_counted(s3, corpus, cache_dir):
    proxy = s3.proxy()
    opts = proxy.storage_options
    ds = zp.JsonlSource(_url("part-0*.jsonl"), field="text", storage_options=opts)
    _, docs = corpus
    assert ds[3] == docs[3]  # file 0 checked and mapped
    before = _fs.io_retries()
    proxy.fail_next(4)  # more than the client's own reconnect covers
    assert ds.read([1, 2]) == [docs[1], docs[2]]
    assert proxy.dropped == 4
    assert _fs.io_retries() > before

    def build() -> zp.Pipeline:
        source = zp.StaticMixtureWorkSource({"d": ds}, None, seed=1, chunk_size=4, num_epochs=1)
        pipe = zp.Pipeline(source, canonical_replicas=1, prefetch=0)
        return pipe.fetch().batch(4, drop_last=False)

    with build() as pipe:
        proxy.fail_next(8)  # each request in flight is dropped more than once
        got = take(pipe)
        stats = pipe.stats()
    assert sorted(t for batch in got for t in batch) == sorted(docs)
    assert stats["io_retries"] >= 1, stats
