"""The random-access contract every source's tests run through `check_source`."""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest


def assert_same(actual: Any, expected: Any) -> None:
    """Equality that also looks inside dicts and lists of numpy arrays."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys()
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected)
    else:
        assert actual == expected


def _check_reads(ds: Any, expected: list[Any], seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        i = rng.randrange(len(expected))
        assert_same(ds[i], expected[i])
    indices = [rng.randrange(len(expected)) for _ in range(20)]
    assert_same(ds.read(indices), [expected[i] for i in indices])


def _check_source(ds: Any, expected: list[Any]) -> None:
    n = len(expected)
    assert len(ds) == n
    assert f"len={n}" in repr(ds)
    for i in range(n):
        assert_same(ds[i], expected[i])
        assert_same(ds[np.int64(i)], expected[i])
    # Out of order, repeated, and numpy ints, as a permutation would hand them over.
    indices = [*reversed(range(n)), 0, 0, *np.arange(n)]
    assert_same(ds.read(indices), [expected[int(i)] for i in indices])
    assert ds.read([]) == []

    for bad in (-1, n, n + 10):
        with pytest.raises(IndexError, match=rf"index {bad} is out of range for length {n}"):
            ds[bad]
        with pytest.raises(IndexError, match=rf"index {bad} is out of range"):
            ds.read([0, bad])

    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone) == n
    assert_same(clone.read(list(range(n))), expected)

    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(_check_reads, ds, expected, seed) for seed in range(8)]:
            future.result()

    if hasattr(os, "fork"):
        pid = os.fork()
        if pid == 0:  # child: report success through the exit status, never return
            code = 1
            try:
                _check_reads(ds, expected, seed=99)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "reads in a forked child failed"


@pytest.fixture
def check_source() -> Callable[[Any, list[Any]], None]:
    """Assert the random-access contract on `ds` against the `expected` items: len, repr,
    every item by index, read() matching indexing, IndexError for negative and
    out-of-range indices, a pickle round trip, 8 concurrent reader threads and reads after
    fork."""
    return _check_source
