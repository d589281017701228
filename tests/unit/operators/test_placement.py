"""The one placement function (zephon.operators.pack.placement): its C and Python versions are
the same function, and it does what first fit and best fit say."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.operators.pack import placement
from zephon.operators.pack.placement import STRATEGIES, place


def _python(strategy: str, fill, segments, lengths, cap: int, max_segments: int = 0):
    fill, segments = np.array(fill, np.int64), np.array(segments, np.int64)
    n = len(lengths)
    target, evict, full = (np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.uint8))
    cut_rows = sum(x // cap for x in lengths) if strategy == "concat_then_split" else 0
    instance, head, emitted, opened = (
        np.empty(n, np.int64), np.empty(n, np.int64), np.empty(2 * n + cut_rows, np.int64),
        np.empty(len(fill), np.int64),
    )  # fmt: skip
    count = placement._place(
        STRATEGIES.index(strategy), fill, segments, np.array(lengths, np.int64), cap,
        max_segments, target, evict, full, instance, head, emitted, opened,
    )  # fmt: skip
    return (
        target.tolist(), evict.tolist(), full.astype(bool).tolist(), fill.tolist(),
        instance.tolist(), emitted[:count].tolist(), opened.tolist(), head.tolist(),
    )  # fmt: skip


def _placed(strategy: str, fill, segments, lengths, cap: int, max_segments: int = 0):
    fill, segments = np.array(fill, np.int64), np.array(segments, np.int64)
    got = place(strategy, fill, segments, np.array(lengths, np.int64), cap, max_segments)
    return (
        got.target.tolist(), got.evict.tolist(), got.full.tolist(), fill.tolist(),
        got.instance.tolist(), got.emitted.tolist(), got.opened.tolist(), got.head.tolist(),
    )  # fmt: skip


@pytest.mark.parametrize("how", [_python, _placed], ids=["python", "selected"])
def test_first_fit_takes_the_lowest_bin_with_room_and_empties_the_fullest_when_none(how) -> None:
    # Bins of 10 holding 6 and 3: a 4 fits bin 0 (fills it: emptied), a 5 then fits the
    # empty bin 0 first, a 9 fits nowhere (5 and 3): bin 0, the fullest, is emptied and
    # the 9 starts it.
    target, evict, full, fill, instance, emitted, opened, head = how(
        "first_fit", [6, 3], [1, 1], [4, 5, 9], 10
    )
    assert head == [4, 5, 9]
    assert target == [0, 0, 0] and evict == [-1, -1, 0] and full == [True, False, False]
    assert fill == [9, 3]
    # Instances: s * bins + b. The 4 joins what bin 0 held (0), which empties; the 5 starts
    # its second filling (2), emptied before the 9, which starts the third (4).
    assert instance == [0, 2, 4] and emitted == [0, 2] and opened == [2, 0]


@pytest.mark.parametrize("how", [_python, _placed], ids=["python", "selected"])
def test_best_fit_takes_the_bin_with_the_least_room_that_fits(how) -> None:
    # Bins of 10 holding 2, 7 and 5: a 3 goes to bin 1 (7: least room that fits), a 2 to
    # bin 2 (5 + 2 beats 2 + 2), ties go to the lowest bin.
    target, evict, _, fill, *_ = how("best_fit", [2, 7, 5, 5], [1, 1, 1, 1], [3, 2, 1], 10)
    assert target == [1, 2, 2] and evict == [-1, -1, -1] and fill == [2, 0, 8, 5]


@pytest.mark.parametrize("how", [_python, _placed], ids=["python", "selected"])
def test_max_segments_empties_a_bin_at_that_many_pieces(how) -> None:
    target, _, full, fill, instance, emitted, opened, _ = how(
        "first_fit", [0, 0], [0, 0], [1, 1, 1, 1], 10, max_segments=2
    )
    assert target == [0, 0, 0, 0] and full == [False, True, False, True] and fill == [0, 0]
    assert instance == [0, 0, 2, 2] and emitted == [0, 2] and opened == [2, 0]


@pytest.mark.parametrize("how", [_python, _placed], ids=["python", "selected"])
def test_concat_then_split_cuts_what_does_not_fit_and_starts_the_next_row_with_the_rest(
    how,
) -> None:
    # One bin of 10 holding 4: a 3 fits (7); a 25 is cut: 3 fill the row (emitted), 10 fill
    # a row of their own (emitted), 10 another, and the last 2 start the next row; a 8 fills
    # it exactly (emitted); a 0 opens nothing.
    target, evict, full, fill, instance, emitted, opened, head = how(
        "concat_then_split", [4], [1], [3, 25, 8, 0], 10
    )
    assert target == [0, 0, 0, 0] and evict == [-1, -1, -1, -1]
    assert head == [3, 3, 8, 0] and instance == [0, 0, 3, 4]
    assert emitted == [0, 1, 2, 3] and opened == [4] and fill == [0]
    assert full == [False, False, True, False]
    # A cut that ends exactly at a row's end leaves the bin empty.
    _, _, full, fill, instance, emitted, opened, head = how(
        "concat_then_split", [0], [0], [20, 1], 10
    )
    assert head == [10, 1] and instance == [0, 2] and emitted == [0, 1] and full == [True, False]
    assert fill == [1] and opened == [2]


@pytest.mark.parametrize("how", [_python, _placed], ids=["python", "selected"])
def test_concat_then_split_with_max_segments_ends_a_row_at_that_many_pieces(how) -> None:
    # Rows of 10, at most 2 segments: 3 + 3 ends the row (padded); a 12 is cut 10 + 2 and
    # with max_segments=1 the 2 is a row by itself.
    _, _, full, fill, instance, emitted, _, head = how(
        "concat_then_split", [0], [0], [3, 3, 12], 10, max_segments=2
    )
    assert full == [False, True, False] and head == [3, 3, 10] and instance == [0, 0, 1]
    assert emitted == [0, 1] and fill == [2]
    _, _, full, fill, _, emitted, _, _ = how(
        "concat_then_split", [0], [0], [12], 10, max_segments=1
    )
    assert full == [True] and emitted == [0, 1] and fill == [0]


@pytest.mark.parametrize("how", [_python, _placed], ids=["python", "selected"])
def test_concat_then_split_needs_one_bin(how) -> None:
    with pytest.raises(ValueError, match="concat then split fills one bin; got 2"):
        how("concat_then_split", [0, 0], [0, 0], [3], 10)


@pytest.mark.native
@settings(max_examples=200, deadline=None)
@given(
    strategy=st.sampled_from(STRATEGIES),
    cap=st.integers(1, 40),
    bins=st.integers(1, 6),
    data=st.data(),
)
def test_the_c_and_python_versions_agree(strategy: str, cap: int, bins: int, data) -> None:
    if placement._NATIVE is None:
        pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
    cts = strategy == "concat_then_split"
    if cts:
        bins = 1
    lengths = data.draw(st.lists(st.integers(0, 3 * cap if cts else cap), max_size=60))
    fill = data.draw(st.lists(st.integers(0, cap - 1), min_size=bins, max_size=bins))
    segments = [1 if f else 0 for f in fill]
    max_segments = data.draw(st.integers(0, 4))
    assert _placed(strategy, fill, segments, lengths, cap, max_segments) == _python(
        strategy, fill, segments, lengths, cap, max_segments
    )


@pytest.mark.parametrize("how", [_python, _placed], ids=["python", "selected"])
def test_a_piece_longer_than_cap_is_refused(how) -> None:
    with pytest.raises(ValueError, match=r"piece 1 has length 11, outside \[0, cap=10\]"):
        how("first_fit", [0], [0], [3, 11], 10)


@pytest.mark.native
def test_the_c_version_checks_its_buffers() -> None:
    native = placement._NATIVE
    if native is None:
        pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
    z8, z4, z1 = np.zeros(2, np.int64), np.zeros(3, np.int32), np.zeros(3, np.uint8)
    lengths = np.ones(3, np.int64)
    inst, emit = np.zeros(3, np.int64), np.zeros(6, np.int64)

    def call(strategy=0, fill=z8, target=z4, emitted=emit, opened=z8, head=inst, lens=lengths):
        native.place_into(
            strategy, fill, fill.copy(), lens, 4, 0, target, z4.copy(), z1, inst,
            head.copy(), emitted, opened.copy(),
        )  # fmt: skip

    with pytest.raises(ValueError, match="strategy must be 0"):
        call(strategy=7)
    with pytest.raises(ValueError, match="one item per piece"):
        call(target=z4[:2])
    with pytest.raises(ValueError, match="one item per piece"):
        call(head=inst[:2])
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match=r"plus sum\(lengths\) / cap"):  # 9 // 4 cut rows
        call(strategy=2, fill=one, opened=one, lens=np.array([9, 1, 1], np.int64))
    with pytest.raises(ValueError, match="must be a buffer of 8-byte items"):
        call(fill=z4)
    with pytest.raises(ValueError, match=r"2 items per piece \(plus .*\) and opened one per bin"):
        call(emitted=emit[:5])
    with pytest.raises(ValueError, match=r"2 items per piece \(plus .*\) and opened one per bin"):
        call(opened=np.zeros(3, np.int64))


def _bookkeeping(how, strategy: str, cap: int, held_lengths, lengths, max_segments: int):
    """Pack's bookkeeping (``bin_rows``) after placing pieces named by their number."""
    held = [[("old", b, i) for i in range(len(h))] for b, h in enumerate(held_lengths)]
    fill = np.array([sum(h) for h in held_lengths], np.int64)
    segments = np.array([len(h) for h in held_lengths], np.int64)
    decided = place(strategy, fill, segments, np.array(lengths, np.int64), cap, max_segments)
    pieces = [("new", k) for k in range(len(lengths))]
    rows, new = how(pieces, decided.instance, decided.emitted, decided.opened, held)
    assert all(any(x is h for h in held) for x in new)  # compacting them compacts the bins
    return rows, new, held


@pytest.mark.native
@settings(max_examples=300, deadline=None)
@given(
    strategy=st.sampled_from(["first_fit", "best_fit"]),
    cap=st.integers(1, 30),
    bins=st.integers(1, 6),
    data=st.data(),
)
def test_pack_s_bookkeeping_in_c_and_python_agree(strategy: str, cap: int, bins: int, data) -> None:
    from zephon.operators.pack import bins as pack_bins

    assert pack_bins._NATIVE is not None, "zephon._pack is not built (native tests need it)"
    room = st.lists(st.integers(0, cap), max_size=3).filter(lambda h: sum(h) < cap)
    held_lengths = data.draw(st.lists(room, min_size=bins, max_size=bins))
    lengths = data.draw(st.lists(st.integers(0, cap), max_size=40))
    max_segments = data.draw(st.integers(0, 4))
    if max_segments:
        held_lengths = [h[: max_segments - 1] for h in held_lengths]
    args = (strategy, cap, held_lengths, lengths, max_segments)
    assert _bookkeeping(pack_bins._NATIVE.bin_rows, *args) == _bookkeeping(
        pack_bins._bin_rows, *args
    )


def test_pack_s_bookkeeping_keeps_old_pieces_first_and_empties_emitted_bins() -> None:
    from zephon.operators.pack import bins as pack_bins

    # Bin 0 holds 6 of 10. The 5 fits only bin 1; the 4 fills bin 0, which is emptied; the
    # 6 starts bin 0 again; the 9 fits nowhere: the fullest bin (0, holding 6) is emptied
    # and the 9 starts it again.
    rows, new, held = _bookkeeping(pack_bins.bin_rows, "first_fit", 10, [[6], []], [5, 4, 6, 9], 0)
    assert rows == [[("old", 0, 0), ("new", 1)], [("new", 2)]]
    assert held == [[("new", 3)], [("new", 0)]]
    assert new == held
