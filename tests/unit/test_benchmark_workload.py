"""The shared benchmark workload: deterministic synthetic docs and the byte tokenizer.

Grain is not a test dependency, so the Grain baseline is not exercised here.
"""

from __future__ import annotations

import collections
import io
import json

import numpy as np
import pytest

import zephon as zp
from benchmarks.harness.results import write_results
from benchmarks.harness.stats import summarize
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, measure_throughput
from benchmarks.workload import (
    BATCH_SIZE,
    NUM_BINS,
    SEQ_LEN,
    SyntheticDocs,
    byte_tokenize,
    pregenerate,
    split_tokens,
    vocabulary,
)


def test_constants():
    assert (SEQ_LEN, NUM_BINS, BATCH_SIZE) == (2048, 8, 8)


def test_docs_deterministic_across_instances_and_access_order():
    a = SyntheticDocs(200, seed=7)
    b = SyntheticDocs(200, seed=7)
    forward = [a[i] for i in range(200)]
    backward = [b[i] for i in reversed(range(200))][::-1]
    assert forward == backward
    # A different corpus size does not change the documents either: (seed, i) alone.
    assert SyntheticDocs(10_000, seed=7)[123] == forward[123]


def test_different_seeds_differ():
    a = SyntheticDocs(50, seed=0)
    b = SyntheticDocs(50, seed=1)
    assert sum(a[i] != b[i] for i in range(50)) == 50
    # Different indices differ too.
    assert len({a[i] for i in range(50)}) == 50


def test_lengths_in_range_and_log_uniform_spread():
    ds = SyntheticDocs(2000, seed=3)
    lengths = np.array([len(d) for d in pregenerate(ds)])
    assert lengths.min() >= 50
    assert lengths.max() <= 5000
    # Log-uniform: median near sqrt(50 * 5000) = 500, both ends populated.
    assert 350 < np.median(lengths) < 700
    assert (lengths < 100).mean() > 0.05
    assert (lengths > 2500).mean() > 0.05


def test_text_is_pseudo_words():
    vocab = set(vocabulary())
    assert len(vocab) == 20_000  # distinct
    for doc in SyntheticDocs(20, seed=5).read(range(20)):
        assert doc.isascii()
        words = doc.split(" ")
        # Every word but the last (which may be cut) is a vocabulary word of 2-10 letters a-z.
        for w in words[:-1]:
            assert w in vocab
            assert 2 <= len(w) <= 10 and w.isalpha() and w.islower()
        assert words[-1] == "" or any(v.startswith(words[-1]) for v in vocab)


def test_word_frequency_is_heavy_tailed():
    counts = collections.Counter(
        w for d in pregenerate(SyntheticDocs(1000, seed=0)) for w in d.split()
    )
    ranked = [c for _, c in counts.most_common()]
    assert len(ranked) > 1000
    assert ranked[0] > 20 * ranked[99]
    assert ranked[0] > 1.5 * ranked[1]


def test_read_equals_getitem_and_indexing():
    ds = SyntheticDocs(30, seed=11)
    idx = [5, 0, 29, 5, 17]
    assert ds.read(idx) == [ds[i] for i in idx]
    assert ds.read(np.array(idx)) == [ds[i] for i in idx]
    assert len(ds) == 30
    assert ds[-1] == ds[29]
    with pytest.raises(IndexError):
        ds[30]
    with pytest.raises(IndexError):
        ds[-31]
    with pytest.raises(ValueError):
        SyntheticDocs(-1)


def test_pregenerate_is_a_plain_tuple_that_array_source_keeps():
    ds = SyntheticDocs(25, seed=2)
    docs = pregenerate(ds)
    assert type(docs) is tuple and len(docs) == 25
    assert docs == tuple(ds[i] for i in range(25))
    assert pregenerate(docs) == docs
    assert zp.ArraySource(docs)._items is docs  # no copy per loader built


def test_byte_tokenize_values():
    ids = byte_tokenize("ab")
    assert ids.dtype == np.int32
    assert ids.tolist() == [ord("a") + 3, ord("b") + 3, 1]
    assert byte_tokenize("").tolist() == [1]
    # UTF-8 bytes, not code points; 0xff -> 258, the largest id.
    assert byte_tokenize("é").tolist() == [0xC3 + 3, 0xA9 + 3, 1]
    assert byte_tokenize("\x00").tolist() == [3, 1]
    doc = SyntheticDocs(1, seed=0)[0]
    ids = byte_tokenize(doc)
    assert ids.size == len(doc) + 1
    assert ids[:-1].min() >= 3 and ids[-1] == 1  # no pad/eos/unk inside a document


def test_split_tokens():
    t = np.arange(5001, dtype=np.int32)
    pieces = split_tokens(t, 2048)
    assert [p.size for p in pieces] == [2048, 2048, 905]
    assert np.array_equal(np.concatenate(pieces), t)
    assert split_tokens(t[:10], 2048)[0].size == 10
    with pytest.raises(ValueError):
        split_tokens(t, 0)


# --- benchmarks.harness helpers (no Grain needed) --------------------------------------------


def _fake_batches(n):
    for _ in range(n):
        seg = np.zeros((2, 4), np.int32)
        seg[0, :3] = 1
        yield {"tokens": np.ones((2, 4), np.int32), "tokens_segment_ids": seg}


def test_measure_throughput_counts_tokens():
    r = measure_throughput(lambda: _fake_batches(20), num_batches=10, warmup=5)
    assert r["batches"] == 10
    assert r["real_tokens"] == 30 and r["padded_tokens"] == 80
    assert r["padding_fraction"] == pytest.approx(1 - 30 / 80)
    assert r["batches_per_s"] > 0 and r["parent_cpu_s"] >= 0 and r["children_cpu_s"] >= 0
    with pytest.raises(RuntimeError, match="ended after"):
        measure_throughput(lambda: _fake_batches(5), num_batches=10, warmup=1)


def test_interleaved_repeats_order_and_summary():
    calls = []
    cands = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "ABC"}
    res = interleaved_repeats(cands, repeats=2)
    assert calls == list("ABCABC")
    assert res == {"A": [1, 4], "B": [2, 5], "C": [3, 6]}
    s = summarize([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)


def test_write_results_and_table(tmp_path):
    path = write_results(
        "unit", [{"x": np.float64(1.5), "y": float("nan"), "n": np.int64(3)}], tmp_path
    )
    data = json.loads(path.read_text())
    assert data["rows"] == [{"x": 1.5, "y": None, "n": 3}]
    assert data["machine"]["nproc"] >= 1 and "numpy" in data["machine"]
    buf = io.StringIO()
    text = print_table(
        [{"name": "a", "v": 1.23456}, {"name": "bbb", "v": 1234.56}],
        ["name", ("v", "value")],
        file=buf,
    )
    lines = text.splitlines()
    assert lines[0].split() == ["name", "value"]
    assert len({len(line) for line in lines[:2]}) == 1  # header and rule align
    assert lines[2].endswith("1.235") and lines[3].endswith("1,235")
