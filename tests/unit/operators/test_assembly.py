"""A packed row's assembly (zephon.operators.pack.assembly): the row C writes is the row numpy
makes, and the C function checks what it is given."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.operators.pack import assembly
from zephon.operators.pack.assembly import Piece, columns
from zephon.operators.pack.pack import Pack
from zephon.records import Contributor


@pytest.mark.native
@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from([np.int32, np.uint16, np.int64, np.float32]),
    lengths=st.lists(st.integers(0, 9), max_size=6),
    pad=st.integers(0, 7),
    meta=st.booleans(),
    data=st.data(),
)
def test_a_row_assembled_in_c_is_the_numpy_row(dtype, lengths, pad, meta, data) -> None:
    assert assembly._NATIVE is not None, "zephon._pack is not built (native tests need it)"
    cap = max(sum(lengths), 1) + data.draw(st.integers(0, 5))
    kw = {"meta_features": ["mask"]} if meta else {}
    op = Pack(cap, 2, features=["tokens", "labels"], pad_values={"tokens": pad}, **kw)
    rng = np.random.default_rng(len(lengths) * 31 + pad)
    pieces = []
    for k, n in enumerate(lengths):
        arrays = [rng.integers(1, 100, n).astype(dtype) for _ in range(3 if meta else 2)]
        pieces.append(Piece([Contributor(0, k, 0, True)], {0: n}, tuple(arrays), n))
    fast = op.rows.assemble_native(pieces) if pieces else None
    if not pieces:
        return
    assert fast is not None
    slow = op.rows.assemble_numpy(*columns(pieces))
    assert list(fast) == list(slow)
    for k in slow:
        assert fast[k].dtype == slow[k].dtype, k
        np.testing.assert_array_equal(fast[k], slow[k], err_msg=k)


def _piece(arrays: Any) -> Piece:
    """A piece whose arrays are ``arrays`` (a tuple, one per column; or lazy ones, not a
    tuple), as a row holds it; an array alone is a tuple of it."""
    made = (arrays,) if isinstance(arrays, np.ndarray) else arrays
    return Piece((Contributor(0, 0, 0, True),), {0: 1}, made, 0)


@pytest.mark.native
def test_the_c_row_assembly_refuses_what_does_not_fit() -> None:
    native = assembly._NATIVE
    assert native is not None, "zephon._pack is not built (native tests need it)"
    out, seg = np.empty((1, 4), np.int32), np.empty((1, 4), np.int32)
    pad = np.int32(0).tobytes()
    with pytest.raises(ValueError, match="part 1 .* does not fit a row of 4 items"):
        native.assemble_rows(
            [[_piece(np.ones(3, np.int32)), _piece(np.ones(2, np.int32))]], 0, out, pad, seg, None
        )
    with pytest.raises(ValueError, match="part 0 \\(item size 8"):
        native.assemble_rows([[_piece(np.ones(2, np.int64))]], 0, out, pad, None, None)
    with pytest.raises(ValueError, match="pad one item"):
        native.assemble_rows([[]], 0, out, b"\0", None, None)
    with pytest.raises(ValueError, match="seg must be int32"):
        native.assemble_rows([[]], 0, out, pad, np.empty((1, 3), np.int32), None)
    with pytest.raises(TypeError, match="piece 0 must be a Piece"):
        native.assemble_rows([[(np.ones(2, np.int32),)]], 0, out, pad, None, None)
    native.assemble_rows([[_piece(np.arange(1, 3, dtype=np.int32))]], 0, out, pad, seg, None)
    assert out.tolist() == [[1, 2, 0, 0]] and seg.tolist() == [[1, 1, 0, 0]]


@pytest.mark.native
@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 6), max_size=4), min_size=1, max_size=5),
    extra=st.integers(0, 3),
    with_seg=st.booleans(),
)
def test_a_batch_of_rows_in_one_call_is_the_rows_one_by_one(rows, extra, with_seg) -> None:
    native = assembly._NATIVE
    assert native is not None, "zephon._pack is not built (native tests need it)"
    cap = max(sum(r) for r in rows) + extra or 1
    rng = np.random.default_rng(sum(map(sum, rows)))
    parts = [[_piece(rng.integers(1, 50, n).astype(np.int32)) for n in r] for r in rows]
    pad = np.int32(-7).tobytes()
    out = np.empty((len(rows), cap), np.int32)
    seg = np.empty((len(rows), cap), np.int32) if with_seg else None
    pos = np.empty((len(rows), cap), np.int32) if with_seg else None
    native.assemble_rows(parts, 0, out, pad, seg, pos)
    for i, row in enumerate(parts):
        one, s1, p1 = (np.empty((1, cap), np.int32) for _ in range(3))
        native.assemble_rows([row], 0, one, pad, s1, p1)
        np.testing.assert_array_equal(out[i], one[0])
        if with_seg:
            np.testing.assert_array_equal(seg[i], s1[0])
            np.testing.assert_array_equal(pos[i], p1[0])


@pytest.mark.native
def test_the_batch_row_assembly_refuses_what_does_not_fit() -> None:
    native = assembly._NATIVE
    assert native is not None, "zephon._pack is not built (native tests need it)"
    pad = np.int32(0).tobytes()
    out = np.empty((2, 4), np.int32)
    with pytest.raises(ValueError, match="a row per row of rows"):
        native.assemble_rows([[]], 0, out, pad, None, None)
    with pytest.raises(ValueError, match="a row per row of rows"):
        native.assemble_rows([[], []], 0, np.empty(8, np.int32), pad, None, None)
    with pytest.raises(ValueError, match="seg must be int32 and as long as out"):
        native.assemble_rows([[], []], 0, out, pad, np.empty((2, 3), np.int32), None)
    with pytest.raises(TypeError, match="row 1 of rows must be a tuple or list of pieces"):
        native.assemble_rows([[], np.ones(1, np.int32)], 0, out, pad, None, None)
    with pytest.raises(ValueError, match="part 0 .* does not fit a row of 4 items"):
        native.assemble_rows([[], [_piece(np.ones(5, np.int32))]], 0, out, pad, None, None)


class _Lazy:
    """A piece placed by length: its tokens are made when read."""

    def __getitem__(self, j: int) -> np.ndarray:
        assert j == 0
        return np.arange(3, dtype=np.int32)


@pytest.mark.native
def test_row_formats_says_where_c_writes_the_rows() -> None:
    native = assembly._NATIVE
    assert native is not None, "zephon._pack is not built (native tests need it)"
    i32 = assembly._INT32_FORMAT
    a, b = np.ones(3, np.int32), np.ones(2, np.int64)

    def formats(rows: list, columns: int = 1) -> tuple | None:
        as_pieces = [[_piece(p) for p in r] for r in rows]
        return native.row_formats(as_pieces, columns, np.ndarray, i32)

    assert formats([[(a,), (a,)], ((a,),)]) == (i32,)
    assert formats([[(a, b)], [(a, b)]], 2) == (i32, memoryview(b).format)
    assert formats([[(a,), _Lazy()]]) == (i32,)  # a lazy piece makes int32
    assert formats([[_Lazy(), (b,)]]) is None  # ... which int64 does not match
    assert formats([[_Lazy()]], 2) is None  # nor has it a second column
    assert formats([[(a,)], [(b,)]]) is None  # one dtype across the rows
    assert formats([[(a,)], []]) is None  # an empty row: numpy pads it
    assert formats([]) is None
    assert formats([[(np.ones(6, np.int32)[::2],)]]) is None  # not contiguous
    assert formats([[(np.ones((2, 2), np.int32),)]]) is None  # not 1-D
    assert formats([[(memoryview(a),)]]) is None  # not an ndarray
    assert formats([[(np.ma.masked_array(a),)]]) is None  # nor a subclass
    assert formats([[(a,)]], 2) is None  # a piece with fewer arrays
    assert native.row_formats([[(a,)]], 1, np.ndarray, i32) is None  # not a Piece
    with pytest.raises(ValueError, match="columns must be at least 1"):
        formats([[(a,)]], 0)


@pytest.mark.native
@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), max_size=3),
            st.dictionaries(st.integers(0, 4), st.integers(0, 2**40), max_size=3),
            st.integers(0, 50),
        ),
        max_size=6,
    ),
    as_list=st.booleans(),
)
def test_rows_parts_in_c_are_the_python_ones(rows, as_list) -> None:
    assert assembly._NATIVE is not None, "zephon._pack is not built (native tests need it)"
    pieces = []
    for k, (contribs, mix, n) in enumerate(rows):
        made = [Contributor(c, off, 0, True) for c, off in contribs]
        arrays = (np.arange(n, dtype=np.int32),)
        pieces.append(Piece(made if as_list else tuple(made), mix, arrays, n + k))
    for split in range(len(pieces) + 1):  # one row, or a batch of two
        grouped = [pieces] if not split else [pieces[:split], tuple(pieces[split:])]
        fast = assembly._NATIVE.parts(grouped)
        slow = assembly.parts(grouped)
        assert fast[0] == slow[0] and type(fast[0]) is list
        assert all(a is b for a, b in zip(fast[0], slow[0], strict=True))  # the same objects
        assert fast[1] == slow[1] and list(fast[1]) == list(slow[1])  # same order too


@pytest.mark.native
def test_the_c_parts_refuse_what_is_not_a_piece() -> None:
    native = assembly._NATIVE
    assert native is not None, "zephon._pack is not built (native tests need it)"
    good = Piece((Contributor(0, 0, 0, True),), {0: 2}, (np.zeros(2, np.int32),), 2)
    with pytest.raises(TypeError, match="list of rows"):
        native.parts(([good],))
    with pytest.raises(TypeError, match="row 1 must be a tuple or list of pieces"):
        native.parts([[good], 5])
    with pytest.raises(TypeError, match="piece 1 must be a Piece"):
        native.parts([[good, (1, 2)]])
    with pytest.raises(TypeError, match="piece 0's contributors"):
        native.parts([[good._replace(contributors=iter(()))]])
    with pytest.raises(TypeError, match="piece 0's component tokens"):
        native.parts([[good._replace(component_tokens=[(0, 2)])]])
    assert native.parts([]) == ([], {})
    assert native.parts([[], []]) == ([], {})
