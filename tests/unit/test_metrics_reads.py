"""Bytes, requests and retries read per source: counted on the reading thread by the range
reads (``zephon.sources._fs``), per lane and component by the fetch operator, summed per
source name for ``stats()["reads"]`` (a lane whose counters restart in a new process keeps
what its old one read)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np

import zephon as zp
from zephon.metrics.observe import reads
from zephon.operators.base import PipelineContext
from zephon.operators.fetch import Fetch
from zephon.pipeline.engine import Engine
from zephon.sources import _fs


def _jsonl(path, lines: list[str]) -> int:
    data = "".join(json.dumps({"text": t}) + "\n" for t in lines).encode()
    path.write_bytes(data)
    return len(data)


def test_range_reads_count_bytes_and_requests_on_the_reading_thread(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(bytes(range(256)) * 1024)  # 256 KiB
    b.write_bytes(b"x" * 1000)
    before = _fs.thread_reads()
    got = _fs.read_ranges(
        "T",
        [
            (str(a), 0, 10),
            (str(a), 20, 30),  # 10 bytes after the first: one request with it
            (str(a), 200_000, 200_100),  # farther than COALESCE_GAP_BYTES: its own
            (str(b), 5, 1000),
        ],
    )
    assert [len(g) for g in got] == [10, 10, 100, 995]
    after = _fs.thread_reads()
    # (0..30) + (200_000..200_100) + (5..1000): 3 requests of 30 + 100 + 995 bytes
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1125, 3, 0)

    seen: list[tuple[int, int, int]] = []
    thread = threading.Thread(target=lambda: seen.append(_fs.thread_reads()))
    thread.start()
    thread.join()
    assert seen == [(0, 0, 0)]  # another thread counts its own reads


def test_fetch_counts_each_lanes_reads_per_component_and_a_fresh_copy_starts_at_zero(
    tmp_path,
):
    size_a = _jsonl(tmp_path / "a.jsonl", ["a" * n for n in range(1, 9)])
    size_b = _jsonl(tmp_path / "b.jsonl", ["b" * n for n in range(1, 5)])
    datasets = (zp.JsonlSource(tmp_path / "a.jsonl"), zp.JsonlSource(tmp_path / "b.jsonl"))
    op = Fetch()
    op.bind(PipelineContext(datasets=datasets, names=("a", "b")))
    assert op.read([0] * 8, list(range(8)), lane=3) == [{"text": "a" * n} for n in range(1, 9)]
    assert op.read([1, 1, 0], [0, 3, 0], lane=5)[1] == {"text": "bbbb"}
    assert op.lane_reads(3) == ((0, size_a, 1, 0),)  # one neighbourhood: one pread
    first_a = len(json.dumps({"text": "a"})) + 1
    first_b = len(json.dumps({"text": "b"})) + 1
    assert op.lane_reads(5) == ((0, first_a, 1, 0), (1, size_b, 1, 0))
    assert op.lane_reads(7) == ()
    op.read([0], [1])  # no lane (a read outside a chain): not counted
    assert op.lane_reads(3) == ((0, size_a, 1, 0),)
    more = op.read([1], [0], lane=3)  # a lane asked about already reads again: it grows
    assert more == [{"text": "b"}] and op.lane_reads(3) == ((0, size_a, 1, 0), (1, first_b, 1, 0))
    op.read([0], [7], lane=3)
    assert op.lane_reads(3)[0] == (0, size_a + len(json.dumps({"text": "a" * 8})) + 1, 2, 0)
    clone = op.fresh()
    assert clone.lane_reads(3) == () and op.lane_reads(3) != ()
    assert clone.read([1], [2], lane=3) == [{"text": "bbb"}]  # the datasets stay bound
    assert clone.lane_reads(3)[0][:3] == (1, len(json.dumps({"text": "bbb"})) + 1, 1)


class _Counts(NamedTuple):  # a lane's counters as the chain sends them (the fields read here)
    ops: list[tuple[int, int, float]]
    reads: tuple[tuple[int, int, int, int], ...]


def _engine() -> Any:
    engine: Any = Engine.__new__(Engine)
    engine.lock = threading.RLock()
    engine.lane_counts = {}
    engine.moved_reads = []
    return engine


def test_reads_are_summed_per_source_and_a_restarted_lane_keeps_what_it_had_read():
    engine = _engine()
    pipe = SimpleNamespace(source=SimpleNamespace(names=("web", "code")))
    assert reads(pipe, engine) == {
        "web": {"bytes": 0, "requests": 0, "retries": 0},
        "code": {"bytes": 0, "requests": 0, "retries": 0},
    }
    engine._merge_counts(0, _Counts([(8, 8, 0.1)], ((0, 100, 2, 1), (1, 50, 1, 0))))
    engine._merge_counts(1, _Counts([(4, 4, 0.1)], ((1, 30, 1, 0),)))
    engine._merge_counts(0, _Counts([(16, 16, 0.2)], ((0, 300, 4, 1), (1, 50, 1, 0))))
    assert reads(pipe, engine) == {
        "web": {"bytes": 300, "requests": 4, "retries": 1},
        "code": {"bytes": 80, "requests": 2, "retries": 0},
    }
    # lane 0 moved to a new process: its counters start again, what it had read stays
    engine._merge_counts(0, _Counts([(2, 2, 0.0)], ((0, 20, 1, 0),)))
    assert reads(pipe, engine) == {
        "web": {"bytes": 320, "requests": 5, "retries": 1},
        "code": {"bytes": 80, "requests": 2, "retries": 0},
    }
    # a source without names: by component index
    nameless = SimpleNamespace(source=SimpleNamespace(datasets=(np.arange(3), np.arange(3))))
    assert reads(nameless, engine)["0"]["bytes"] == 320


def test_stats_reads_of_an_in_memory_source_are_zero():
    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(64))], seed=0, chunk_size=8)
    with zp.Pipeline(src, canonical_replicas=1, prefetch=0).fetch().batch(4) as pipe:
        next(pipe)
        assert pipe.stats()["reads"] == {"0": {"bytes": 0, "requests": 0, "retries": 0}}
