from __future__ import annotations

import numpy as np
import pytest

from zephon.sources import ArraySource


def test_list_of_objects(check_source):
    items = [{"x": i} for i in range(10)] + ["text", 3.5, None]
    check_source(ArraySource(items), items)


def test_numpy_rows(check_source):
    array = np.arange(24, dtype=np.int32).reshape(8, 3)
    ds = ArraySource(array)
    check_source(ds, list(array))
    assert ds[2].dtype == np.int32


def test_copies_a_list_so_later_edits_do_not_leak_in():
    items = [1, 2, 3]
    ds = ArraySource(items)
    items.append(4)
    items[0] = 100
    assert len(ds) == 3 and ds[0] == 1


def test_accepts_any_iterable():
    assert ArraySource(range(5)).read([4, 0]) == [4, 0]
    assert ArraySource(x * 2 for x in range(3))[2] == 4


def test_empty():
    ds = ArraySource([])
    assert len(ds) == 0
    with pytest.raises(IndexError, match="index 0 is out of range for length 0"):
        ds[0]


def test_rejects_a_0d_array():
    with pytest.raises(ValueError, match="0-d array"):
        ArraySource(np.array(5))


def test_read_checks_every_index_on_any_path():
    ds = ArraySource(["a", "b", "c"])
    assert ds.read([2, 0, 2]) == ["c", "a", "c"]
    assert ds.read([]) == []
    with pytest.raises(IndexError, match="index 3 is out of range for length 3"):
        ds.read([0, 3])
    with pytest.raises(IndexError, match="index -1 is out of range for length 3"):
        ds.read([1, -1])
    with pytest.raises(TypeError):
        ds.read([0, 1.0])
    assert ds.read([np.int64(1), True]) == ["b", "b"]  # anything with __index__, as ds[i]
