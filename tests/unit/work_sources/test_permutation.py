"""The stateless Feistel permutation and mix64."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.work_sources.permutation import MAX_N, mix64, permute, permute_runs

KEYS = [0, 1, 2, 12345, -1, 2**64 - 1, 2**80 + 3]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16, 17, 64, 65, 1000])
@pytest.mark.parametrize("key", KEYS)
def test_bijective_small(n: int, key: int) -> None:
    images = permute(np.arange(n), n, key)
    assert images.dtype == np.int64
    assert sorted(images.tolist()) == list(range(n))


def test_bijective_2_pow_20() -> None:
    n = 2**20
    images = permute(np.arange(n), n, 7)
    assert np.array_equal(np.sort(images), np.arange(n))
    # Not a power of 4: the domain is 2**22 and cycle walking does real work.
    n = 2**20 + 1
    images = permute(np.arange(n), n, 7)
    assert np.array_equal(np.sort(images), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), key=st.integers(-(2**70), 2**70))
def test_bijective_property(n: int, key: int) -> None:
    images = permute(np.arange(n), n, key)
    assert np.array_equal(np.sort(images), np.arange(n))


def test_scalar_and_array_paths_agree() -> None:
    # Small inputs take a pure-Python path, large ones the numpy path: same function.
    for n, key in itertools.product([2, 3, 17, 1000, 2**40 + 5], [0, 9, -1]):
        m = min(n, 500)
        whole = permute(np.arange(m), n, key)
        one_by_one = [int(permute(np.array([i]), n, key)[0]) for i in range(m)]
        assert whole.tolist() == one_by_one


def test_golden() -> None:
    # Pins the algorithm: changing it silently would change every shuffled data order.
    assert permute(np.arange(10), 10, 0).tolist() == [5, 4, 2, 3, 8, 0, 7, 9, 1, 6]
    assert mix64(0) == 12035550249420947055
    assert mix64(1, 2, 3) == 239743636466269267


def test_different_keys_give_different_permutations() -> None:
    perms = {tuple(permute(np.arange(1000), 1000, key).tolist()) for key in range(50)}
    assert len(perms) == 50
    assert not np.array_equal(permute(np.arange(1000), 1000, 0), np.arange(1000))


def test_roughly_uniform_image() -> None:
    # Where position 0 lands, over 2000 keys: about 200 times in each of 10 places.
    counts = np.bincount([int(permute(np.array([0]), 10, key)[0]) for key in range(2000)])
    assert counts.shape == (10,)
    assert counts.min() > 130 and counts.max() < 270


def test_huge_n_on_a_sample() -> None:
    n = 2**40
    rng = np.random.default_rng(0)
    positions = np.concatenate(
        [np.arange(50_000), np.arange(n - 50_000, n), rng.integers(0, n, 50_000)]
    )
    positions = np.unique(positions)
    images = permute(positions, n, 3)
    assert images.min() >= 0 and images.max() < n
    assert np.unique(images).size == positions.size
    assert np.array_equal(images, permute(positions, n, 3))
    # Also when n is not a power of four (cycle walking at 2**41 + 3).
    m = 2**41 + 3
    images = permute(positions, m, 3)
    assert images.max() < m and np.unique(images).size == positions.size


def test_largest_n() -> None:
    n = MAX_N
    positions = np.array([0, 1, n - 2, n - 1], dtype=np.uint64)
    images = permute(positions, n, 11)
    assert images.dtype == np.int64
    assert (images >= 0).all() and np.unique(images).size == 4


def test_edge_sizes() -> None:
    assert permute(np.array([], dtype=np.int64), 0, 1).shape == (0,)
    assert permute(np.zeros(5, dtype=np.int64), 1, 1).tolist() == [0] * 5
    with pytest.raises(ValueError, match=r"positions must lie in \[0, n\) = \[0, 0\)"):
        permute(np.array([0]), 0, 1)


def test_shapes_and_input_kinds() -> None:
    grid = np.arange(12).reshape(3, 4)
    images = permute(grid, 12, 5)
    assert images.shape == (3, 4)
    assert np.array_equal(images.reshape(-1), permute(np.arange(12), 12, 5))
    assert permute([3, 1], 12, 5).tolist() == permute(np.array([3, 1]), 12, 5).tolist()
    assert permute(3, 12, 5).shape == ()
    assert permute(np.arange(12, dtype=np.int32), 12, np.int64(5)).tolist() == (
        permute(np.arange(12), 12, 5).tolist()
    )


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"got values in \[-1, 3\]"):
        permute(np.array([-1, 3]), 10, 0)
    with pytest.raises(ValueError, match=r"got values in \[0, 10\]"):
        permute(np.array([0, 10]), 10, 0)
    with pytest.raises(ValueError, match=r"n must be in \[0, 2\*\*63\]; got -1"):
        permute(np.array([], dtype=np.int64), -1, 0)
    with pytest.raises(ValueError, match=r"got 9223372036854775809"):
        permute(np.array([0]), 2**63 + 1, 0)
    with pytest.raises(ValueError, match="positions must be integers; got dtype float64"):
        permute(np.array([0.5]), 10, 0)


def test_mix64() -> None:
    values = [mix64(*args) for args in [(), (0,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]]
    assert len(set(values)) == len(values)
    assert all(0 <= v < 2**64 for v in values)
    assert mix64(5, 6) == mix64(5, 6)
    assert mix64(np.int64(5), 6) == mix64(5, 6)
    assert mix64(-1) == mix64(2**64 - 1)  # documented: arguments are taken modulo 2**64
    with pytest.raises(TypeError):
        mix64(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [2, 17, 1000, 20000, 2**20 + 1, 2**40 + 5, MAX_N])
@pytest.mark.native
@pytest.mark.parametrize("key", [0, 9, -1])
def test_native_numpy_and_scalar_paths_agree(n: int, key: int, monkeypatch) -> None:
    """zephon._permute (C), the numpy network and the pure-Python scalar walk are one
    function: a native build must not change any data order."""
    from zephon.work_sources import permutation

    native = permutation._NATIVE
    if native is None:
        pytest.skip("zephon._permute is not built (or ZEPHON_PURE_PYTHON=1)")
    rng = np.random.default_rng(n % 1000 + key % 7)
    positions = np.unique(rng.integers(0, n, size=min(n, 3000), dtype=np.int64))
    fast = permute(positions, n, key)
    monkeypatch.setattr(permutation, "_NATIVE", None)
    assert fast.tolist() == permute(positions, n, key).tolist()
    assert fast[:40].tolist() == [int(permute(np.array([p]), n, key)[0]) for p in positions[:40]]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_permute_runs_is_permute_of_each_run_with_its_key(native: bool, monkeypatch) -> None:
    from zephon.work_sources import permutation

    if not native:
        monkeypatch.setattr(permutation, "_NATIVE", None)
    n = 1013
    rng = np.random.default_rng(5)
    positions = rng.integers(0, n, size=300, dtype=np.int64)
    starts = [0, 1, 2, 40, 41, 250]  # runs of 1, 1, 38, 1, 209 and 50 positions
    keys = [mix64(7, r) for r in range(len(starts))]
    got = permute_runs(positions, n, keys, starts)
    ends = [*starts[1:], len(positions)]
    want = np.concatenate(
        [permute(positions[a:b], n, k) for k, a, b in zip(keys, starts, ends, strict=True)]
    )
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert permute_runs(np.zeros(3, dtype=np.int64), 1, [5], [0]).tolist() == [0, 0, 0]


@pytest.mark.native
def test_native_permute_rejects_bad_arguments() -> None:
    from zephon.work_sources import permutation

    native = permutation._NATIVE
    if native is None:
        pytest.skip("zephon._permute is not built (or ZEPHON_PURE_PYTHON=1)")
    src, out = np.arange(4, dtype=np.uint64), np.empty(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="position 3 is not below n=3"):
        native.permute_into(src, out, 3, 1, (1, 2))
    with pytest.raises(ValueError, match="same length"):
        native.permute_into(src, out[:2], 10, 2, (1, 2))
    with pytest.raises(ValueError, match="half_bits"):
        native.permute_into(src, out, 10, 0, (1, 2))
    with pytest.raises(ValueError, match="round keys"):
        native.permute_into(src, out, 10, 2, ())
