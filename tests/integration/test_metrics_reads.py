"""Bytes, requests and retries read per source, end to end: a JSONL mixture of known size
read once, in process and with 2 worker processes, against ``stats()["reads"]`` and the
scraped endpoint's ``zephon_source_read_*_total``; an S3 source whose requests a proxy
drops, with the retries counted per source.

Under ``CI=true`` a missing prometheus_client, s3fs or moto fails (the conftest turns skips
into failures)."""

from __future__ import annotations

import json
import urllib.request

import pytest

import zephon as zp
from tests.s3_server import need, s3_server

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.processes]

BUCKET = "zephon-reads"


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """``(name, source)`` -> value of the ``zephon_source_read_*`` samples."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, s.labels["source"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("zephon_source_read_") and s.name.endswith("_total")
    }


def _jsonl(path, lines: list[str]) -> int:
    data = "".join(json.dumps({"text": t}) + "\n" for t in lines).encode()
    path.write_bytes(data)
    return len(data)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_jsonl_mixture_read_once_counts_its_bytes_and_requests(tmp_path, workers):
    sizes = {
        "a": _jsonl(tmp_path / "a.jsonl", ["a" * (30 + i) for i in range(40)]),
        "b": _jsonl(tmp_path / "b.jsonl", ["b" * (300 + i) for i in range(25)]),
    }
    src = zp.StaticMixtureWorkSource(
        {k: zp.JsonlSource(tmp_path / f"{k}.jsonl") for k in sizes},
        weights={"a": 0.5, "b": 0.5},
        seed=0,
        chunk_size=1,  # one document a read: one request a document
        num_epochs=1,
    )
    pipe = zp.Pipeline(src, canonical_replicas=4, workers=workers, metrics_port=0)
    with pipe.fetch().batch(4, drop_last=False) as pipe:
        docs = {"a": 0, "b": 0}
        for batch in pipe:
            for text in batch["text"]:
                docs[text[0]] += 1
        st = pipe.stats()
        got = _scrape(pipe._metrics.url)
    assert docs == {"a": 40, "b": 25}
    for k, size in sizes.items():  # every line read once, whole: a request a line
        assert st["reads"][k] == {"bytes": size, "requests": docs[k], "retries": 0}
        assert got[("zephon_source_read_bytes_total", k)] == size
        assert got[("zephon_source_read_requests_total", k)] == docs[k]
        assert got[("zephon_source_read_retries_total", k)] == 0


def test_a_restored_pipeline_counts_its_own_reads_the_replay_included(tmp_path):
    size = _jsonl(tmp_path / "a.jsonl", ["a" * (30 + i) for i in range(40)])
    ds = zp.JsonlSource(tmp_path / "a.jsonl")  # one: a new one checks its index cache on use

    def build() -> zp.Pipeline:
        src = zp.StaticMixtureWorkSource({"a": ds}, None, seed=0, chunk_size=1, num_epochs=1)
        pipe = zp.Pipeline(src, canonical_replicas=2, prefetch=0)
        return pipe.fetch().batch(4, drop_last=False)

    with build() as pipe:
        for _ in range(5):
            next(pipe)
        before = pipe.stats()["reads"]["a"]
        state = pipe.checkpoint()
    assert before["requests"] == 20  # 5 batches of 4, a line a request
    with build() as pipe:
        pipe.restore(state)
        rest = sum(len(batch["text"]) for batch in pipe)
        st = pipe.stats()
    assert rest == 40 - 20
    # from zero again (a new pipeline), every document not delivered before the
    # checkpoint read once, and those of the chunks replayed (already delivered) again
    r = st["reads"]["a"]
    assert rest <= r["requests"] <= rest + st["replayed_chunks"]
    assert r["bytes"] < size and r["retries"] == 0


def test_s3_reads_count_their_requests_and_the_retries_a_proxy_forces(tmp_path, monkeypatch):
    need("s3fs")
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    lines = [f"doc {i}: " + "xyz" * (i % 7) for i in range(30)]
    local = tmp_path / "d.jsonl"
    size = _jsonl(local, lines)
    with s3_server(BUCKET) as s3:
        s3.client().put_object(Bucket=BUCKET, Key="d.jsonl", Body=local.read_bytes())
        proxy = s3.proxy()
        ds = zp.JsonlSource(f"s3://{BUCKET}/d.jsonl", storage_options=proxy.storage_options)
        src = zp.StaticMixtureWorkSource({"d": ds}, None, seed=1, chunk_size=4, num_epochs=1)
        pipe = zp.Pipeline(src, canonical_replicas=1, prefetch=0).fetch().batch(4, drop_last=False)
        with pipe:
            proxy.fail_next(8)  # each request in flight is dropped more than once: retried
            got = [t for batch in pipe for t in batch["text"]]
            st = pipe.stats()
    assert sorted(got) == sorted(lines)
    r = st["reads"]["d"]
    assert r["retries"] >= 1 and r["retries"] == st["io_retries"]
    # ceil(30 / 4) = 8 reads, each one GET (a chunk's lines are one neighbourhood, with
    # the lines between them), and a GET again for each retry
    assert r["requests"] == 8 + r["retries"]
    assert size <= r["bytes"] <= 8 * size
