"""A seeded pseudo-random permutation of ``range(n)`` that is never materialised.

``permute(positions, n, key)`` maps each position to its image under a bijection of
``range(n)`` chosen by ``key``. It is stateless: the image of position ``i`` depends on
``(i, n, key)`` only, so a work source can jump to any point of any dataset epoch in O(1)
and a checkpoint never stores a permutation.

Construction: a balanced Feistel network of ``NUM_ROUNDS`` rounds over the smallest even
number of bits ``2h`` with ``2**(2h) >= n`` (a bijection of ``range(2**(2h))`` whatever the
round function), followed by cycle walking — re-applying the network to images that fall at
or above ``n`` — which restricts the bijection to ``range(n)``. Since ``2**(2h) < 4n``, an
element needs fewer than four applications on average.

The round function is the splitmix64 finaliser of ``right_half ^ round_key``, with one
64-bit round key per ``(key, round)`` from ``mix64``. All array arithmetic is on
``numpy.uint64`` arrays, where overflow wraps silently (no ``RuntimeWarning``), which is the
modular arithmetic the mixer wants.
"""

from __future__ import annotations

import functools
import operator

import numpy as np

from zephon._native import load

__all__ = ["NUM_ROUNDS", "MAX_N", "mix64", "permute", "permute_runs"]

NUM_ROUNDS = 6
# Positions and images are int64, so the domain must fit in int64.
MAX_N = 2**63
# Without the C module, below this many positions a pure-Python loop beats numpy's per-call
# overhead (a work chunk holds a handful of samples per component and dataset epoch). All
# paths compute the same function; the tests check that they agree.
_SCALAR_MAX = 16


_NATIVE = load("_permute")  # the C version of the array path

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB

_U_C1 = np.uint64(_C1)
_U_C2 = np.uint64(_C2)
_U_30 = np.uint64(30)
_U_27 = np.uint64(27)
_U_31 = np.uint64(31)


def _fmix64(z: int) -> int:
    """splitmix64 finaliser on a Python int in ``[0, 2**64)``: a bijection of 64-bit words."""
    z = ((z ^ (z >> 30)) * _C1) & _MASK64
    z = ((z ^ (z >> 27)) * _C2) & _MASK64
    return z ^ (z >> 31)


def _fmix64_array(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a 1-D uint64 array (wrap-around multiply, no warnings)."""
    z = z ^ (z >> _U_30)
    z = z * _U_C1
    z = z ^ (z >> _U_27)
    z = z * _U_C2
    return z ^ (z >> _U_31)


def mix64(*ints: int) -> int:
    """Deterministic 64-bit hash of several integers, for permutation keys and chunk seeds.

    Each argument is taken modulo ``2**64`` (so ``-1`` and ``2**64 - 1`` hash alike); the
    number of arguments is part of the hash, so ``mix64(0)`` differs from ``mix64(0, 0)``.
    Pure Python int arithmetic: identical on every platform and numpy version.

    Returns:
        An int in ``[0, 2**64)``.
    """
    h = _fmix64((len(ints) * _GOLDEN) & _MASK64)
    for x in ints:
        h = _fmix64(((h + _GOLDEN) & _MASK64) ^ (operator.index(x) & _MASK64))
    return h


def _half_bits(n: int) -> int:
    """Half of the smallest even bit count ``b >= 2`` with ``2**b >= n``."""
    bits = max((n - 1).bit_length(), 2)
    return (bits + 1) // 2


@functools.lru_cache(maxsize=4096)
def _round_keys(key: int, half_bits: int) -> tuple[int, ...]:
    return tuple(mix64(key, r, half_bits) for r in range(NUM_ROUNDS))


def _feistel(x: np.ndarray, half_bits: int, round_keys: tuple[int, ...]) -> np.ndarray:
    """One application of the balanced Feistel network to a 1-D uint64 array."""
    shift = np.uint64(half_bits)
    half_mask = np.uint64((1 << half_bits) - 1)
    left = x >> shift
    right = x & half_mask
    for rk in round_keys:
        left, right = right, left ^ (_fmix64_array(right ^ np.uint64(rk)) & half_mask)
    return (left << shift) | right


def _permute_scalar(x: int, n: int, half_bits: int, round_keys: tuple[int, ...]) -> int:
    """The same network and cycle walk as the array path, on one Python int."""
    half_mask = (1 << half_bits) - 1
    while True:
        left, right = x >> half_bits, x & half_mask
        for rk in round_keys:
            left, right = right, left ^ (_fmix64(right ^ rk) & half_mask)
        x = (left << half_bits) | right
        if x < n:
            return x


def permute(positions: np.ndarray | list[int] | int, n: int, key: int) -> np.ndarray:
    """Images of ``positions`` under the pseudo-random permutation of ``range(n)`` for ``key``.

    Args:
        positions: integers in ``[0, n)``, any shape.
        n: the size of the permuted domain, ``0 <= n <= 2**63``.
        key: any int; different keys give (with overwhelming probability) different
            permutations.

    Returns:
        An int64 array of the same shape as ``positions``.

    Raises:
        ValueError: ``n`` out of range, or a position outside ``[0, n)``.
    """
    n = operator.index(n)
    if not 0 <= n <= MAX_N:
        raise ValueError(f"permute: n must be in [0, 2**63]; got {n}")
    pos = np.asarray(positions)
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"permute: positions must be integers; got dtype {pos.dtype}")
    shape = pos.shape
    flat = pos.reshape(-1)
    if flat.size == 0:
        return np.zeros(shape, dtype=np.int64)
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= n:
        raise ValueError(
            f"permute: positions must lie in [0, n) = [0, {n}); got values in [{lo}, {hi}]"
        )
    if n == 1:
        return np.zeros(shape, dtype=np.int64)

    return _permute_valid(flat, n, operator.index(key)).reshape(shape)


def permute_runs(positions: np.ndarray, n: int, keys: list[int], starts: list[int]) -> np.ndarray:
    """:func:`permute` of consecutive runs of ``positions``, each with its own key: run
    ``r`` is ``positions[starts[r]:starts[r + 1]]`` (the last one to the end) under
    ``keys[r]``. For callers whose positions are known valid (a 1-D int64 array in
    ``[0, n)``, ``starts`` ascending from 0): no checks, one call per run."""
    out = np.empty(len(positions), dtype=np.int64)
    ends = [*starts[1:], len(positions)]
    for key, lo, hi in zip(keys, starts, ends, strict=True):
        out[lo:hi] = _permute_valid(positions[lo:hi], n, key)
    return out


def _permute_valid(flat: np.ndarray, n: int, key: int) -> np.ndarray:
    """The images of a 1-D integer array of valid positions (``permute`` without checks)."""
    if n == 1:
        return np.zeros(flat.size, dtype=np.int64)
    half_bits = _half_bits(n)
    round_keys = _round_keys(key & _MASK64, half_bits)
    if _NATIVE is not None:
        out = np.empty(flat.size, dtype=np.uint64)
        src = flat.view(np.uint64) if flat.dtype == np.int64 else flat.astype(np.uint64)
        _NATIVE.permute_into(np.ascontiguousarray(src), out, n, half_bits, round_keys)
        return out.view(np.int64)
    if flat.size <= _SCALAR_MAX:
        images = [_permute_scalar(int(x), n, half_bits, round_keys) for x in flat.tolist()]
        return np.array(images, dtype=np.int64)
    out = _feistel(flat.astype(np.uint64), half_bits, round_keys)
    # Cycle walking: the network permutes range(2**(2*half_bits)); following the cycle of
    # an out-of-range image until it re-enters range(n) gives a bijection of range(n).
    un = np.uint64(n)
    todo = np.flatnonzero(out >= un)
    while todo.size > _SCALAR_MAX:
        out[todo] = _feistel(out[todo], half_bits, round_keys)
        todo = todo[out[todo] >= un]
    # The walk's long tail (a few elements, several more steps each) is cheaper per element.
    for i in todo.tolist():
        out[i] = _permute_scalar(int(out[i]), n, half_bits, round_keys)
    return out.astype(np.int64)
