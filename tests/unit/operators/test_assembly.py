"""A packed row's assembly (zephon.operators.assembly): the row C writes is the row numpy
makes, and the C function checks what it is given."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.operators import assembly
from zephon.operators.assembly import Piece
from zephon.operators.pack import Pack
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
    if assembly._NATIVE is None:
        pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
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
    slow = op.rows.assemble_numpy(pieces)
    assert list(fast) == list(slow)
    for k in slow:
        assert fast[k].dtype == slow[k].dtype, k
        np.testing.assert_array_equal(fast[k], slow[k], err_msg=k)


@pytest.mark.native
def test_the_c_row_assembly_refuses_what_does_not_fit() -> None:
    native = assembly._NATIVE
    if native is None:
        pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
    out, seg = np.empty(4, np.int32), np.empty(4, np.int32)
    pad = np.int32(0).tobytes()
    with pytest.raises(ValueError, match="part 1 .* does not fit a row of 4 items"):
        native.assemble_into([np.ones(3, np.int32), np.ones(2, np.int32)], out, pad, seg, None)
    with pytest.raises(ValueError, match="part 0 \\(item size 8"):
        native.assemble_into([np.ones(2, np.int64)], out, pad, None, None)
    with pytest.raises(ValueError, match="pad one item"):
        native.assemble_into([], out, b"\0", None, None)
    with pytest.raises(ValueError, match="seg must be int32"):
        native.assemble_into([], out, pad, np.empty(3, np.int32), None)
    assert native.assemble_into([np.arange(1, 3, dtype=np.int32)], out, pad, seg, None) == 2
    assert out.tolist() == [1, 2, 0, 0] and seg.tolist() == [1, 1, 0, 0]
