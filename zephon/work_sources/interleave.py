"""How one lane of a mixture interleaves its components: passes on a min-heap.

Each component ``c`` has a *pass*: the units it has received since the scheduler's origin,
less a carried credit, divided by its weight, ``pass_c = (received_c - carry_c) / w_c``.
The lane deals its next sample from the component with the lowest pass (ties: the lowest
component), then adds the sample's units to ``received_c``: 1 per sample when weights count
samples, its token count (at least 1) when they count tokens. This is stride scheduling
with the sample's own size as the stride: every component's units stay within one sample
of its weight's share of the lane's units (``|received_c - w_c * total| <=`` about one
longest sample), with no random draw and no history beyond one integer and one float per
component. The scale of the weights does not matter (a pass is a ratio), so a component
that runs out simply leaves the heap and the others share its place.

``picks`` runs that loop for up to ``k`` samples over arrays the caller owns: the C function
``zephon._permute.mixture_picks`` when it is built, else the same loop in Python below
(``ZEPHON_PURE_PYTHON=1`` forces it; the tests run both on the same inputs and compare every
array). The arrays:

* ``f64``: float64 ``[3, C]``, rows ``weights``, ``carry``, ``keys`` (the passes, kept
  current for every component in the heap);
* ``i64``: int64 ``[5, C]``, rows ``received``, ``positions`` (samples of ``c`` the lane
  has dealt), ``tokens`` (their token counts, for components with lengths), ``limits``
  (samples the lane may take of ``c``, or -1 without a limit) and ``sizes`` (dataset
  lengths);
* ``heap``: int32 ``[C]``, the first ``heap_len`` a binary min-heap of the components that
  may be drawn, ordered by ``(keys[c], c)`` (its layout does not affect the picks, only that
  order does);
* ``table``: a :class:`LengthTable` of every component's lengths array and its code: 0 no
  lengths, else the item size in bytes (1, 2, 4, 8) plus ``CODE_SIGNED`` for a signed dtype,
  or ``CODE_OFFSETS`` for an int64 array of ``N + 1`` offsets (length ``o[i + 1] - o[i]``);
  made once per work source and shared by its lanes (the C side holds the buffers, so a pick
  reads a count without asking numpy for one);
* ``out``: int64 ``[3, k]``: each pick's component, dataset index and token count (1 without
  lengths);
* ``flags``: ``FLAG_SHUFFLE``, ``FLAG_TOKEN_UNITS``, ``FLAG_STOP_ON_EXHAUST`` (return right
  after the pick that exhausts a component, naming it).

It returns ``(picked, heap_len, exhausted, chunk_seed)``: ``chunk_seed`` is ``mix64(seed,
lane, chunk_id)``, the chunk's seed, computed there because it is cheaper in C.

Sample ``p`` of component ``c`` in lane ``l`` of ``L`` is global position ``g = l + p * L``,
dataset index ``permute(g % N, N, mix64(seed, c, g // N))`` (or ``g % N`` unshuffled).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon._native import load
from zephon.work_sources.permutation import (
    NUM_ROUNDS,
    _half_bits,
    _permute_scalar,
    _round_keys,
    mix64,
)

__all__ = [
    "CODE_OFFSETS",
    "CODE_SIGNED",
    "FLAG_SHUFFLE",
    "FLAG_STOP_ON_EXHAUST",
    "FLAG_TOKEN_UNITS",
    "LengthTable",
    "build_heap",
    "length_code",
    "picks",
    "picks_python",
]

_NATIVE = load("_permute")
assert NUM_ROUNDS == 6, "native/permute_module.c hard-codes 6 rounds (PICK_ROUNDS)"

FLAG_SHUFFLE = 1
FLAG_TOKEN_UNITS = 2
FLAG_STOP_ON_EXHAUST = 4
CODE_SIGNED = 0x10
CODE_OFFSETS = 0x20

W, CARRY, KEYS = 0, 1, 2
RECV, POS, TOK, LIMIT, SIZE = 0, 1, 2, 3, 4


def length_code(array: np.ndarray | None, offsets: bool = False) -> int:
    """The code of a component whose lengths are ``array`` (None: none)."""
    if array is None:
        return 0
    if offsets:
        return CODE_OFFSETS | 8
    return int(array.dtype.itemsize) | (CODE_SIGNED if array.dtype.kind == "i" else 0)


class LengthTable:
    """Every component's lengths array (None for none) and its code, for :func:`picks`."""

    def __init__(self, arrays: tuple[np.ndarray | None, ...], codes: np.ndarray) -> None:
        self.arrays = arrays
        self.codes = codes
        self.native = None if _NATIVE is None else _NATIVE.length_table(arrays, codes)

    def __getstate__(self) -> dict[str, Any]:
        return {"arrays": self.arrays, "codes": self.codes}  # a capsule does not pickle

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["arrays"], state["codes"])  # type: ignore[misc]


def build_heap(f64: np.ndarray, i64: np.ndarray, heap: np.ndarray, drawable: np.ndarray) -> int:
    """Recompute every drawable component's pass and lay them out as a heap (sorted, which
    is a heap); returns ``heap_len``."""
    comps = np.flatnonzero(drawable)
    keys = f64[KEYS]
    keys[comps] = (i64[RECV, comps].astype(np.float64) - f64[CARRY, comps]) / f64[W, comps]
    order = comps[np.argsort(keys[comps], kind="stable")]  # ties: ascending component
    heap[: order.size] = order
    return int(order.size)


def picks(
    f64: np.ndarray,
    i64: np.ndarray,
    heap: np.ndarray,
    table: LengthTable,
    out: np.ndarray,
    k: int,
    heap_len: int,
    lane: int,
    num_lanes: int,
    seed: int,
    chunk_id: int,
    flags: int,
) -> tuple[int, int, int, int]:
    """Up to ``k`` picks (see the module docstring); returns ``(picked, heap_len,
    exhausted, chunk_seed)``, ``exhausted`` being the component a ``FLAG_STOP_ON_EXHAUST``
    call stopped at, or -1."""
    if table.native is not None and _NATIVE is not None:
        return _NATIVE.mixture_picks(  # type: ignore[no-any-return]
            f64, i64, heap, table.native, out, k, heap_len, lane, num_lanes, seed, chunk_id, flags
        )
    return picks_python(
        f64, i64, heap, table, out, k, heap_len, lane, num_lanes, seed, chunk_id, flags
    )


def _before(keys: np.ndarray, a: int, b: int) -> bool:
    ka, kb = keys[a], keys[b]
    return bool(ka < kb or (ka == kb and a < b))


def _sift_down(heap: np.ndarray, length: int, keys: np.ndarray) -> None:
    i, item = 0, int(heap[0])
    while True:
        child = 2 * i + 1
        if child >= length:
            break
        if child + 1 < length and _before(keys, int(heap[child + 1]), int(heap[child])):
            child += 1
        if not _before(keys, int(heap[child]), item):
            break
        heap[i] = heap[child]
        i = child
    heap[i] = item


def picks_python(
    f64: np.ndarray,
    i64: np.ndarray,
    heap: np.ndarray,
    table: LengthTable,
    out: np.ndarray,
    k: int,
    heap_len: int,
    lane: int,
    num_lanes: int,
    seed: int,
    chunk_id: int,
    flags: int,
) -> tuple[int, int, int, int]:
    """The pure-Python twin of the C ``mixture_picks``: the same arguments, the same result
    and the same changes to every array."""
    weights, carry, keys = f64[W], f64[CARRY], f64[KEYS]
    recv, positions, tokens, limits, sizes = (i64[r] for r in range(5))
    out_c, out_i, out_l = out[0], out[1], out[2]
    codes, lengths = table.codes, table.arrays
    shuffle = bool(flags & FLAG_SHUFFLE)
    token_units = bool(flags & FLAG_TOKEN_UNITS)
    picked = 0
    while picked < k and heap_len > 0:
        c = int(heap[0])
        n, p = int(sizes[c]), int(positions[c])
        g = lane + p * num_lanes
        within = g % n
        index = within
        if shuffle and n > 1:
            half_bits = _half_bits(n)
            round_keys = _round_keys(mix64(seed, c, g // n), half_bits)
            index = _permute_scalar(within, n, half_bits, round_keys)
        length = 1
        code = int(codes[c])
        if code:
            source = lengths[c]
            assert source is not None
            if code & CODE_OFFSETS:
                length = int(source[index + 1]) - int(source[index])
            else:
                length = int(source[index])
            if length < 0:
                raise ValueError(
                    f"mixture_picks: sample {index} of component {c} has length {length}"
                )
            tokens[c] += length
        out_c[picked], out_i[picked], out_l[picked] = c, index, length
        picked += 1
        positions[c] = p + 1
        recv[c] += max(length, 1) if token_units else 1
        if limits[c] >= 0 and p + 1 >= limits[c]:
            heap_len -= 1
            if heap_len > 0:
                heap[0] = heap[heap_len]
                _sift_down(heap, heap_len, keys)
            if flags & FLAG_STOP_ON_EXHAUST:
                return picked, heap_len, c, mix64(seed, lane, chunk_id)
            continue
        keys[c] = (float(recv[c]) - float(carry[c])) / float(weights[c])
        _sift_down(heap, heap_len, keys)
    return picked, heap_len, -1, mix64(seed, lane, chunk_id)


def rebase(
    f64: np.ndarray, i64: np.ndarray, heap: np.ndarray, heap_len: int, new_weights: np.ndarray
) -> None:
    """Move the scheduler's origin to now, for new weights: every component in the heap
    keeps its lead over the lowest pass, in units (``carry = -(pass - lowest) * w``, as a
    float32 so that it stays small in a checkpoint); the others start level with the
    lowest. ``received`` restarts at 0. The caller rebuilds the heap."""
    carry = np.zeros(f64.shape[1], dtype=np.float64)
    if heap_len:
        comps = heap[:heap_len]
        lowest = f64[KEYS, int(heap[0])]
        lead = -(f64[KEYS, comps] - lowest) * f64[W, comps]
        carry[comps] = lead.astype(np.float32).astype(np.float64)
    carry[carry == 0] = 0.0  # no -0.0: the state is compared bit for bit
    f64[CARRY] = carry
    f64[W] = new_weights
    i64[RECV] = 0
