"""Token spans: a token file's documents as spans of the mapped file (the C type and its
Python twin), read by ``TokenFileSource.token_spans``: the same tokens as ``read``."""

from __future__ import annotations

import fsspec
import numpy as np
import pytest

from zephon.sources import token_span
from zephon.sources.token_file import TokenFileSource
from zephon.sources.token_span import Span, TokenSpan

from .test_token_file_source import write_tokens


def _tokens(dtype: str, n: int = 4_000, seed: int = 3) -> np.ndarray:
    """Ids over the whole range of ``dtype`` (past int32's for uint32), 0 as EOS."""
    rng = np.random.default_rng(seed)
    top = np.iinfo(dtype).max
    tokens = rng.integers(1, top, n, dtype=np.uint64, endpoint=True).astype(dtype)
    tokens[[0, 1, 2]] = [top, 2**15, 1]
    tokens[rng.choice(n, n // 25, replace=False)] = 0
    return tokens


def _native():
    native = token_span._NATIVE
    assert native is not None, "zephon._tokens is not built (native tests need it)"
    return native


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_spans_read_the_same_tokens_as_read(tmp_path, dtype) -> None:
    tokens = _tokens(dtype)
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", tokens, dtype), dtype, eos_id=0)
    order = np.random.default_rng(1).permutation(len(ds)).tolist() + [0, np.int64(3), 0]
    spans = ds.token_spans(order)
    assert spans is not None and len(spans) == len(order)
    for span, doc in zip(spans, ds.read(order), strict=True):
        assert type(span) is Span and len(span) == 1
        got = span[0]
        assert got.dtype == np.int32 and got.base is None
        np.testing.assert_array_equal(got, doc["tokens"])  # (uint32 ids wrap as astype does)
        assert span.hi - span.lo == len(doc["tokens"])
    assert ds.token_spans([]) == []


def test_token_spans_over_several_files_number_documents_across_them(tmp_path) -> None:
    parts = [[5, 6, 0, 7, 0], [8, 0], [9, 9, 9, 0, 1, 0]]
    paths = [write_tokens(tmp_path / f"{i}.bin", p) for i, p in enumerate(parts)]
    ds = TokenFileSource(paths, eos_id=0)
    order = [4, 0, 2, 3, 1, 2]
    spans = ds.token_spans(order)
    assert [s[0].tolist() for s in spans] == [d["tokens"].tolist() for d in ds.read(order)]
    assert spans[0].tokens is not spans[1].tokens  # each file's own mapping


def test_token_spans_name_a_bad_index_as_read_does(tmp_path) -> None:
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", [5, 6, 0, 7, 0]), eos_id=0)
    for bad in (-1, 2, 1.5, "0"):
        with pytest.raises((IndexError, TypeError)) as spans_error:
            ds.token_spans([0, bad])
        with pytest.raises((IndexError, TypeError)) as read_error:
            ds.read([0, bad])
        assert str(spans_error.value) == str(read_error.value)


def test_token_spans_are_none_behind_a_url() -> None:
    fs = fsspec.filesystem("memory")
    with fs.open("/spans/t.bin", "wb") as f:
        f.write(np.array([5, 6, 0, 7, 0], "<u2").tobytes())
    ds = TokenFileSource("memory://spans/t.bin", eos_id=0)
    assert ds.token_spans([0, 1]) is None  # read by ranges instead
    assert [d["tokens"].tolist() for d in ds.read([1, 0])] == [[7, 0], [5, 6, 0]]


@pytest.mark.parametrize("kind", ["python", pytest.param("c", marks=pytest.mark.native)])
def test_a_span_checks_what_it_spans(kind) -> None:
    make = _native().Span if kind == "c" else TokenSpan
    tokens = np.arange(10, dtype=np.uint16)
    span = make(tokens, 2, 7)
    assert (span.lo, span.hi, span.tokens is tokens, len(span)) == (2, 7, True, 1)
    assert span[0].tolist() == [2, 3, 4, 5, 6] and span[0] is not span[0]
    assert repr(span) == "Span(2:7, uint16)"
    with pytest.raises(IndexError, match="one column"):
        span[1]
    assert make(tokens, 10, 10)[0].tolist() == []
    with pytest.raises(ValueError, match="span 3:11 is not inside the 10 tokens"):
        make(tokens, 3, 11)
    with pytest.raises(ValueError, match="span 5:4 is not inside"):
        make(tokens, 5, 4)
    with pytest.raises(ValueError, match="1-D contiguous array of uint16 or uint32"):
        make(tokens.astype(np.int32), 0, 1)
    with pytest.raises(ValueError, match="1-D contiguous array of uint16 or uint32"):
        make(tokens[::2], 0, 1)
    with pytest.raises(TypeError, match="numpy array"):
        make(b"\0\0", 0, 1)


@pytest.mark.native
def test_c_and_python_spans_of_a_file_agree() -> None:
    native = _native()
    for dtype in ("uint16", "uint32"):
        tokens = _tokens(dtype)
        bounds = np.concatenate([[0], np.flatnonzero(tokens == 0) + 1]).astype(np.int64)
        indices = [0, 5, np.int64(2), True, len(bounds) - 2]
        c, py = native.spans(tokens, bounds, indices), token_span._spans(tokens, bounds, indices)
        assert [(s.lo, s.hi) for s in c] == [(s.lo, s.hi) for s in py]
        assert all(np.array_equal(a[0], b[0]) for a, b in zip(c, py, strict=True))
        for bad in (-1, len(bounds) - 1, 2**70, 1.5, "0", None):
            assert native.spans(tokens, bounds, [0, bad]) is None
            assert token_span._spans(tokens, bounds, [0, bad]) is None
    with pytest.raises(ValueError, match="N \\+ 1 int64 offsets"):
        native.spans(np.zeros(4, np.uint16), np.zeros(1, np.int32), [0])
    with pytest.raises(ValueError, match=r"document 0 \(tokens 0:9\) is not inside the 4"):
        native.spans(np.zeros(4, np.uint16), np.array([0, 9], np.int64), [0])
    with pytest.raises(TypeError, match="indices must be a sequence"):
        native.spans(np.zeros(4, np.uint16), np.array([0, 4], np.int64), 0)


def test_a_span_keeps_its_file_mapped_after_the_source_is_gone(tmp_path) -> None:
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", [5, 6, 0, 7, 0]), eos_id=0)
    (span,) = ds.token_spans([1])
    del ds
    assert span[0].tolist() == [7, 0]
