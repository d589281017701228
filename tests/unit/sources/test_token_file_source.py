from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from zephon.sources import TokenFileSource


def write_tokens(path, tokens, dtype="<u2"):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def docs(*lists):
    return [{"tokens": np.array(d, dtype=np.int32)} for d in lists]


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([5, 6, 0, 7, 0], [[5, 6, 0], [7, 0]]),
        ([0, 5, 6, 0], [[0], [5, 6, 0]]),  # leading EOS: a one-token document
        ([5, 0, 0, 0, 6, 0], [[5, 0], [0], [0], [6, 0]]),  # consecutive EOS
        ([5, 0, 6, 7], [[5, 0], [6, 7]]),  # no trailing EOS: the tail is a document
        ([5, 6, 7], [[5, 6, 7]]),  # no EOS at all
        ([0], [[0]]),
    ],
)
def test_eos_split(tmp_path, check_source, tokens, expected):
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", tokens), eos_id=0)
    check_source(ds, docs(*expected))


def test_eos_split_uint32_across_scan_blocks(tmp_path, monkeypatch, check_source):
    # Small scan blocks so that documents straddle block edges.
    monkeypatch.setattr("zephon.sources.token_file._SCAN_TOKENS", 4)
    eos = 70_000  # does not fit uint16
    tokens = [1, 2, eos, 3, 4, 5, 6, 7, eos, eos, 8, 9, 10, 11]
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", tokens, "<u4"), "uint32", eos_id=eos)
    check_source(ds, docs([1, 2, eos], [3, 4, 5, 6, 7, eos], [eos], [8, 9, 10, 11]))


def test_empty_file_has_no_documents(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"")
    assert len(TokenFileSource(tmp_path / "t.bin", eos_id=0)) == 0
    np.array([0], dtype="<i8").tofile(tmp_path / "t.idx")
    assert len(TokenFileSource(tmp_path / "t.bin", index_path=tmp_path / "t.idx")) == 0


def test_index_split(tmp_path, check_source):
    path = write_tokens(tmp_path / "t.bin", range(10, 20))
    np.array([0, 3, 3, 9, 10], dtype="<i8").tofile(tmp_path / "t.idx")
    ds = TokenFileSource(path, index_path=tmp_path / "t.idx")
    check_source(ds, docs([10, 11, 12], [], [13, 14, 15, 16, 17, 18], [19]))


@pytest.mark.parametrize(
    ("offsets", "error"),
    [
        ([1, 3, 10], "must start at offset 0; position 0 holds 1"),
        ([0, 5, 4, 10], "must be non-decreasing; position 2 holds 4, less than 5"),
        ([0, 5, 9], "must end at the token count 10; its last position 2 holds 9"),
        ([0, 5, 11], "must end at the token count 10; its last position 2 holds 11"),
        ([], "holds 0 bytes"),
    ],
)
def test_bad_index_file(tmp_path, offsets, error):
    path = write_tokens(tmp_path / "t.bin", range(10))
    np.array(offsets, dtype="<i8").tofile(tmp_path / "t.idx")
    with pytest.raises(ValueError, match=re.escape(f"index file {tmp_path / 't.idx'}")) as info:
        TokenFileSource(path, index_path=tmp_path / "t.idx")
    assert error in str(info.value)


def test_index_file_of_odd_size(tmp_path):
    path = write_tokens(tmp_path / "t.bin", range(10))
    (tmp_path / "t.idx").write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match="holds 12 bytes"):
        TokenFileSource(path, index_path=tmp_path / "t.idx")


def test_file_size_not_a_multiple_of_the_dtype(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\0" * 6)
    with pytest.raises(ValueError, match=r"holds 6 bytes, not a multiple of 4 \(uint32\)"):
        TokenFileSource(tmp_path / "t.bin", "uint32", eos_id=0)


def test_needs_exactly_one_split(tmp_path):
    path = write_tokens(tmp_path / "t.bin", range(4))
    with pytest.raises(ValueError, match="exactly one of eos_id"):
        TokenFileSource(path)
    with pytest.raises(ValueError, match="exactly one of eos_id"):
        TokenFileSource(path, eos_id=0, index_path=path)


def test_rejects_bad_dtype_and_eos_id(tmp_path):
    path = write_tokens(tmp_path / "t.bin", range(4))
    with pytest.raises(ValueError, match="dtype must be one of"):
        TokenFileSource(path, "int64", eos_id=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eos_id 70000 does not fit uint16"):
        TokenFileSource(path, eos_id=70_000)


def test_reads_are_copies(tmp_path):
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", [1, 2, 0]), eos_id=0)
    ds[0]["tokens"][0] = 99
    assert ds[0]["tokens"][0] == 1


def test_pickle_does_not_carry_the_tokens(tmp_path):
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", [7] * 100_000 + [0]), eos_id=0)
    assert len(pickle.dumps(ds)) < 10_000


def test_read_takes_index_arrays_and_refuses_non_integers(tmp_path):
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", [5, 0, 6, 7, 0, 8, 0]), eos_id=0)
    expected = [[6, 7, 0], [5, 0], [6, 7, 0]]
    for indices in (np.array([1, 0, 1]), np.array([1, 0, 1], np.uint32), [1, np.int16(0), 1]):
        got = ds.read(indices)
        assert [d["tokens"].tolist() for d in got] == expected
        assert all(d["tokens"].dtype == np.int32 for d in got)
    with pytest.raises(TypeError):
        ds.read([1.0])
    with pytest.raises(IndexError, match="index -1 is out of range for length 3"):
        ds.read(np.array([0, -1]))


def test_read_across_files_keeps_the_order_asked(tmp_path):
    for k, tokens in enumerate(([1, 0, 2, 0], [3, 0], [4, 4, 0, 5, 0])):
        write_tokens(tmp_path / f"s{k}.bin", tokens)
    ds = TokenFileSource(str(tmp_path / "s*.bin"), eos_id=0)
    assert len(ds) == 5
    got = ds.read([4, 0, 2, 3, 1, 4])
    assert [d["tokens"].tolist() for d in got] == [
        [5, 0],
        [1, 0],
        [3, 0],
        [4, 4, 0],
        [2, 0],
        [5, 0],
    ]


@pytest.mark.native
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_documents_copied_in_c_are_numpys(tmp_path, dtype):
    from zephon.sources import token_file

    native = token_file._NATIVE
    assert native is not None, "zephon._tokens is not built (native tests need it)"
    rng = np.random.default_rng(3)
    top = np.iinfo(dtype).max
    tokens = rng.integers(1, top, 5_000, dtype=np.uint64, endpoint=True).astype(dtype)
    tokens[[0, 1, 2]] = [top, 2**15, 1]  # past int32 (uint32) and int16 (uint16) limits
    tokens[rng.choice(5_000, 200, replace=False)] = 0
    ds = TokenFileSource(write_tokens(tmp_path / "t.bin", tokens, dtype), dtype, eos_id=0)
    order = rng.permutation(len(ds)).tolist() + [0, 0]
    mapped = np.fromfile(tmp_path / "t.bin", dtype)
    bounds = ds.token_offsets()
    got = ds.read(order)
    for k, d in zip(order, got, strict=True):
        want = mapped[bounds[k] : bounds[k + 1]].astype(np.int32)
        assert d["tokens"].dtype == np.int32 and d["tokens"].base is None
        np.testing.assert_array_equal(d["tokens"], want)


@pytest.mark.native
def test_the_c_copy_refuses_what_does_not_fit():
    from zephon.sources import token_file

    native = token_file._NATIVE
    assert native is not None, "zephon._tokens is not built (native tests need it)"
    src = np.arange(10, dtype=np.uint16)
    bounds = np.array([0, 3, 3, 10], np.int64)
    with pytest.raises(ValueError, match="itemsize must be 2 or 4; got 8"):
        native.documents(src, 8, bounds, [0], "tokens")
    with pytest.raises(ValueError, match="N \\+ 1 int64 offsets"):
        native.documents(src, 2, bounds.astype(np.int32)[:3], [0], "tokens")
    with pytest.raises(ValueError, match=r"document 1 \(tokens 8:11\) is not inside the 10 tokens"):
        native.documents(src, 2, np.array([0, 8, 11], np.int64), [0, 1], "tokens")
    with pytest.raises(ValueError, match=r"document 0 \(tokens 3:2\)"):
        native.documents(src, 2, np.array([3, 2], np.int64), [0], "tokens")
    with pytest.raises(TypeError, match="indices must be a sequence"):
        native.documents(src, 2, bounds, 3, "tokens")
    # Not a document number: None, and the source's own check names it.
    for bad in (-1, 3, 2**70, 1.5, "0"):
        assert native.documents(src, 2, bounds, [0, bad], "tokens") is None
    got = native.documents(src, 2, bounds, [2, np.int64(0), 1, 2], "tokens")
    assert [list(d) for d in got] == [["tokens"]] * 4
    assert [d["tokens"].tolist() for d in got] == [
        list(range(3, 10)),
        [0, 1, 2],
        [],
        list(range(3, 10)),
    ]
    assert got[0]["tokens"] is not got[3]["tokens"]
    assert native.documents(src, 2, bounds, [], "tokens") == []
