"""Sharded file sets (lists and glob patterns as one dataset), index caches built once and
memory-mapped (sidecar or ``ZEPHON_CACHE_DIR``, stale ones rebuilt), the vectorised newline
scan, ArrayRecordSource, and bounded content identities over many files."""

from __future__ import annotations

import json
import os
import pickle
import random
import re

import numpy as np
import pytest

import zephon as zp
from zephon.sources import identity as identity_module
from zephon.sources import index_cache
from zephon.sources.jsonl import index_lines


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write_shards(folder, n_files, per_file, start=0):
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for k in range(n_files):
        lines = []
        for i in range(per_file):
            text = f"file {k} doc {i} " + "ab" * ((k * 7 + i) % 5)
            docs.append(text)
            lines.append(json.dumps({"text": text}))
        (folder / f"shard-{start + k:03d}.jsonl").write_text("\n".join(lines) + "\n")
    return docs


class _Spy:
    """Counts calls of a module function (the data reads a source makes)."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)


# ------------------------------------------------------------------ sharded file sets
def test_glob_is_one_dataset_in_sorted_order(tmp_path, check_source):
    # Written out of order: the pattern's files come sorted, lists keep their order.
    docs_b = _write_shards(tmp_path / "d", 2, 3, start=5)
    docs_a = _write_shards(tmp_path / "d", 2, 4, start=1)
    ds = zp.JsonlSource(str(tmp_path / "d" / "shard-*.jsonl"), field="text")
    check_source(ds, docs_a + docs_b)
    listed = zp.JsonlSource(
        [tmp_path / "d" / "shard-005.jsonl", str(tmp_path / "d" / "shard-00[12].jsonl")],
        field="text",
    )
    assert listed.read(list(range(len(listed)))) == docs_b[:3] + docs_a
    # The caches written next to the shards are never taken for shards.
    assert [p.name for p in (tmp_path / "d").iterdir() if p.name.endswith(".zephon-idx")]
    again = zp.JsonlSource(str(tmp_path / "d" / "*"), field="text")
    assert len(again) == len(docs_a + docs_b)


def test_a_pattern_that_matches_nothing_names_it(tmp_path):
    pattern = str(tmp_path / "nowhere-*.jsonl")
    with pytest.raises(FileNotFoundError, match=re.escape(f"the pattern '{pattern}' matches no")):
        zp.JsonlSource(pattern)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        zp.TokenFileSource(str(tmp_path / "*.bin"), eos_id=0)


def test_second_open_reads_no_data_file_and_builds_nothing(tmp_path, monkeypatch):
    docs = _write_shards(tmp_path / "d", 40, 5)
    first = zp.JsonlSource(str(tmp_path / "d" / "*.jsonl"), field="text")
    assert first._index.built == 40
    blocks = _Spy(monkeypatch, index_cache, "iter_blocks")
    ranges = _Spy(monkeypatch, index_cache, "read_ranges")
    again = zp.JsonlSource(str(tmp_path / "d" / "*.jsonl"), field="text")
    assert len(again) == len(docs)
    assert (blocks.calls, ranges.calls, again._index.built) == (0, 0, 0)
    assert again[137] == docs[137]  # the first read of a file checks its ends, once
    assert (blocks.calls, ranges.calls) == (0, 1)
    assert again.read([136, 138]) == docs[136:139:2]
    assert ranges.calls == 1
    assert isinstance(again._index.array(137 // 5), np.memmap)


def test_workers_map_the_cache_and_never_rebuild(tmp_path, monkeypatch):
    docs = _write_shards(tmp_path / "d", 3, 4)
    ds = zp.JsonlSource(str(tmp_path / "d" / "*.jsonl"), field="text")
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    blocks = _Spy(monkeypatch, index_cache, "iter_blocks")
    assert clone.read(list(range(len(docs)))) == docs
    assert blocks.calls == 0 and clone._index.built == 0
    assert all(isinstance(clone._index.array(f), np.memmap) for f in range(3))


def test_a_changed_file_is_reindexed_never_trusted(tmp_path):
    folder = tmp_path / "d"
    _write_shards(folder, 2, 4)
    path = folder / "shard-001.jsonl"
    zp.JsonlSource(str(folder / "*.jsonl"))
    # Another size: seen from metadata at open, rebuilt there.
    path.write_text(path.read_text() + json.dumps({"text": "new"}) + "\n")
    grown = zp.JsonlSource(str(folder / "*.jsonl"), field="text")
    assert grown._index.built == 1 and len(grown) == 9 and grown[8] == "new"
    # Same size and modification time, other contents: the digest of the file's ends
    # catches it at the first read; the count changed, so the read says to start again.
    stat = path.stat()
    opened = zp.JsonlSource(str(folder / "*.jsonl"), field="text")
    body = path.read_bytes()
    path.write_bytes(body.replace(b"\n{", b" {", 1))  # two lines become one
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(
        ValueError, match=rf"{path} changed after the dataset was opened .*start again"
    ):
        opened[5]
    # The cache was rewritten: a new start sees the new contents.
    assert len(zp.JsonlSource(str(folder / "*.jsonl"))) == 8


def test_same_count_edit_keeps_working_with_the_rebuilt_index(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "aaaa"}\n{"text": "bbbb"}\n')
    zp.JsonlSource(path, field="text")
    stat = path.stat()
    path.write_text('{"text": "cc"}\n  {"text": "dd"}\n')  # same size, lines moved
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    ds = zp.JsonlSource(path, field="text")
    assert ds.read([0, 1]) == ["cc", "dd"]


def test_unwritable_sidecar_falls_back_to_the_cache_dir(tmp_path, cache_dir):
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n{"x": 2}\n')
    sidecar = tmp_path / ".a.jsonl.lines.zephon-idx"
    sidecar.mkdir()  # nothing can be written there (root ignores a read-only mode)
    (sidecar / "keep").write_text("")
    ds = zp.JsonlSource(path, field="x")
    assert ds.read([1, 0]) == [2, 1]
    cached = list((cache_dir / "indexes").glob("*a.jsonl.zephon-idx"))
    assert len(cached) == 1
    assert zp.JsonlSource(path, field="x")._index.built == 0


def test_nowhere_to_write_keeps_the_index_in_memory_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "_warned_unwritable", False)
    monkeypatch.setattr(index_cache, "locations", lambda path, kind: [str(tmp_path / "f" / "x")])
    (tmp_path / "f").write_text("a file where a folder should be")
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n')
    with pytest.warns(UserWarning, match=r"could not write an index cache .* ZEPHON_CACHE_DIR"):
        ds = zp.JsonlSource(path, field="x")
    assert ds[0] == 1
    assert pickle.loads(pickle.dumps(ds))[0] == 1  # the in-memory index travels


def test_skip_mode_counts_come_back_from_the_cache(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\nnot json\n{"other": 1}\n{"text": "b"}\n')
    with pytest.warns(UserWarning, match=r"skipped 2 of 4 records"):
        first = zp.JsonlSource(path, field="text", on_error="skip")
    with pytest.warns(UserWarning, match=r"skipped 2 of 4 records .*first: line 2"):
        again = zp.JsonlSource(path, field="text", on_error="skip")
    assert again._index.built == 0
    assert again.skipped_records() == first.skipped_records()
    assert again.read([0, 1]) == ["a", "b"]
    # raise mode keeps its own index of the same file
    assert len(zp.JsonlSource(path)) == 4


# --------------------------------------------------------------------- newline scan
@pytest.mark.parametrize("seed", range(6))
def test_newline_scan_matches_a_line_by_line_reading(seed):
    rng = random.Random(seed)
    pieces = ['{"a": 1}', "", "   ", "\t", ' {"b": 2}', "\r", '{"c": "x y"}\r', "  \t x"]
    lines = [rng.choice(pieces) * rng.randint(1, 3) for _ in range(rng.randint(0, 400))]
    data = "\n".join(lines).encode() + (b"\n" if rng.random() < 0.5 else b"")
    want, offset = [], 0
    for line in data.split(b"\n"):
        if line.strip(b" \t\r\n"):
            want.append(offset)
        offset += len(line) + 1
    cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 30))))
    blocks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert index_lines(blocks).tolist() == want


def test_newline_scan_with_many_indented_lines():
    data = b"".join(b'  {"i": %d}\n\n   \n' % i for i in range(2000))
    want = [k for k in range(0, len(data)) if data.startswith(b"  {", k)]
    assert index_lines([data[:7000], data[7000:]]).tolist() == want


# ------------------------------------------------------------------------ token files
def test_token_files_as_one_dataset_with_a_cached_eos_scan(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    parts = []
    for k in range(3):
        tokens = rng.integers(1, 100, size=200 + 50 * k).astype("<u2")
        tokens[rng.integers(0, len(tokens), size=12)] = 0
        tokens.tofile(tmp_path / f"t{k}.bin")
        parts.append(tokens)
    ds = zp.TokenFileSource(str(tmp_path / "t*.bin"), eos_id=0)
    docs = []
    for tokens in parts:
        ends = np.flatnonzero(tokens == 0) + 1
        bounds = [0, *ends.tolist()] + (
            [] if ends.size and ends[-1] == len(tokens) else [len(tokens)]
        )
        docs += [tokens[a:b].astype(np.int32) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert len(ds) == len(docs)
    for i in [0, len(docs) - 1, 17]:
        np.testing.assert_array_equal(ds[i]["tokens"], docs[i])
    offsets = ds.token_offsets()
    np.testing.assert_array_equal(np.diff(offsets), [len(d) for d in docs])
    blocks = _Spy(monkeypatch, index_cache, "iter_blocks")
    again = zp.TokenFileSource(str(tmp_path / "t*.bin"), eos_id=0)
    assert blocks.calls == 0 and again._index.built == 0
    np.testing.assert_array_equal(again.token_offsets(), offsets)
    with pytest.raises(ValueError, match="index_path goes with one token file; got 3 files"):
        zp.TokenFileSource(str(tmp_path / "t*.bin"), index_path=tmp_path / "x.idx")


# ------------------------------------------------------------------------ ArrayRecord
def _write_array_records(path, records):
    writer_cls = pytest.importorskip("array_record.python.array_record_module").ArrayRecordWriter
    writer = writer_cls(str(path), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()


def test_array_record_source_over_shards(tmp_path, check_source):
    msgpack = pytest.importorskip("msgpack")
    items = [{"id": i, "text": f"record {i}"} for i in range(23)]
    _write_array_records(tmp_path / "b.array_record", [msgpack.packb(x) for x in items[10:]])
    _write_array_records(tmp_path / "a.array_record", [msgpack.packb(x) for x in items[:10]])
    ds = zp.ArrayRecordSource(str(tmp_path / "*.array_record"), decode=msgpack.unpackb)
    check_source(ds, items)
    raw = zp.ArrayRecordSource([tmp_path / "b.array_record"])
    assert raw[0] == msgpack.packb(items[10])
    assert zp.ArrayRecordSource(str(tmp_path / "*.array_record"))._index.built == 0


def test_array_record_identity_follows_the_content(tmp_path):
    _write_array_records(tmp_path / "a.array_record", [b"x" * 10, b"y"])
    before = zp.ArrayRecordSource(tmp_path / "a.array_record").content_identity()
    _write_array_records(tmp_path / "a.array_record", [b"x" * 10, b"z"])
    after = zp.ArrayRecordSource(tmp_path / "a.array_record").content_identity()
    assert before["sample"] != after["sample"]
    with pytest.raises(TypeError, match="decode must be a function"):
        zp.ArrayRecordSource(tmp_path / "a.array_record", decode="json")


def test_array_record_resumes_exactly_in_a_pipeline(tmp_path):
    from zephon.testing import assert_resumes_exactly

    _write_array_records(
        tmp_path / "a.array_record", [f"doc {i} ".encode() * (1 + i % 5) for i in range(40)]
    )

    def build():
        ds = zp.ArrayRecordSource(tmp_path / "a.array_record", decode=bytes.decode)
        source = zp.StaticMixtureWorkSource({"a": ds}, None, seed=2, chunk_size=4, num_epochs=1)
        return (
            zp.Pipeline(source, canonical_replicas=2)
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .split(24)
            .pack(24, num_bins=2)
            .batch(2)
        )

    ref = assert_resumes_exactly(build, cuts=[0, 2, 5, 100])
    assert len(ref) > 5


# ---------------------------------------------------------------- content identity
def test_identity_of_many_files_reads_a_bounded_sample(tmp_path, monkeypatch):
    _write_shards(tmp_path / "d", 60, 2)
    ds = zp.JsonlSource(str(tmp_path / "d" / "*.jsonl"))
    opened = _Spy(monkeypatch, identity_module, "open_binary")
    first = ds.content_identity()
    assert opened.calls == identity_module.SAMPLE_FILES
    assert first["files"] == 60
    # A file that is not sampled changes size: the identity changes with it.
    path = tmp_path / "d" / "shard-001.jsonl"
    path.write_text(path.read_text() + '{"text": "more"}\n')
    assert zp.JsonlSource(str(tmp_path / "d" / "*.jsonl")).content_identity() != first
