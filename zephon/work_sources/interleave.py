"""How one lane of a mixture interleaves its components: worst-case fair weighted queueing.

Each component ``c`` has a *start tag* ``S_c = (received_c - carry_c) / w_c``: the units it
has received since the scheduler's origin, less a carried credit, over its weight; and a
*finish tag* ``F_c = S_c + u_c / w_c``, ``u_c`` being the units of its next sample: 1 when
weights count samples, its token count (at least 1) when they count tokens. The lane keeps
a virtual time ``V``: it grows by ``u / W`` with every sample dealt (``W`` the sum of the
weights still drawable, summed in component order). The next sample comes from the
component with the lowest finish tag among those whose start tag ``V`` has reached (ties:
the lowest component); if none has, ``V`` jumps to the lowest start tag. This is WF2Q+
(Bennett and Zhang), which keeps every component within about one of its samples of its
share, ``|received_c - w_c / W * total| <= max(u)`` for every prefix, with no random draw
and no history beyond two numbers per component and one per lane. A component that runs out
leaves the heaps and the others share its place.

The work is done over arrays the caller owns, by the C functions
``zephon._permute.mixture_rebuild`` / ``mixture_picks`` when they are built, else by the
same functions in Python below (``ZEPHON_PURE_PYTHON=1`` forces them; the tests run both on
the same inputs and compare every array):

* ``f64``: float64 ``[4, C]``, rows ``weights``, ``carry`` (a float32 value: a credit in
  units carried over a change of weights), ``start`` and ``finish`` (the tags, kept current
  for every drawable component);
* ``i64``: int64 ``[7, C]``, rows ``received`` (units since the origin), ``positions``
  (samples of ``c`` the lane has dealt), ``tokens`` (their token counts, for components with
  lengths), ``limits`` (samples the lane may take of ``c``, or -1), ``sizes`` (dataset
  lengths), ``next_index`` and ``next_length`` (the component's next sample, computed when
  ``next_length < 0``);
* ``heaps``: int32 ``[2, C]``: row 0 the *eligible* components (start tag reached) as a
  binary min-heap by ``(finish, c)``, row 1 the *waiting* ones by ``(start, c)``; their
  layout does not change the picks;
* ``table``: a :class:`LengthTable` of every component's lengths array and code: 0 no
  lengths, else the item size in bytes (1, 2, 4, 8) plus ``CODE_SIGNED`` for a signed dtype,
  or ``CODE_OFFSETS`` for an int64 array of ``N + 1`` offsets (length ``o[i + 1] - o[i]``);
  made once per work source and shared by its lanes (the C side holds the buffers);
* ``out``: int64 ``[3, k]``: each pick's component, dataset index and token count (1 without
  lengths);
* ``flags``: ``FLAG_SHUFFLE``, ``FLAG_TOKEN_UNITS``, ``FLAG_STOP_ON_EXHAUST`` (return right
  after the pick that exhausts a component, naming it).

Sample ``p`` of component ``c`` in lane ``l`` of ``L`` is global position ``g = l + p * L``,
dataset index ``permute(g % N, N, mix64(seed, component_key(name_c), g // N))`` (or ``g % N``
unshuffled).
"""

from __future__ import annotations

import hashlib
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
    "component_key",
    "length_code",
    "picks",
    "rebase",
    "rebuild",
]

_NATIVE = load("_permute")
assert NUM_ROUNDS == 6, "native/permute_module.c hard-codes 6 rounds (PICK_ROUNDS)"

FLAG_SHUFFLE = 1
FLAG_TOKEN_UNITS = 2
FLAG_STOP_ON_EXHAUST = 4
CODE_SIGNED = 0x10
CODE_OFFSETS = 0x20

W, CARRY, START, FINISH = 0, 1, 2, 3
RECV, POS, TOK, LIMIT, SIZE, NIDX, NLEN = 0, 1, 2, 3, 4, 5, 6
F64_ROWS, I64_ROWS = 4, 7


def length_code(array: np.ndarray | None, offsets: bool = False) -> int:
    """The code of a component whose lengths are ``array`` (None: none)."""
    if array is None:
        return 0
    if offsets:
        return CODE_OFFSETS | 8
    return int(array.dtype.itemsize) | (CODE_SIGNED if array.dtype.kind == "i" else 0)


def component_key(name: str) -> int:
    """The 64-bit key of a component's permutations, from its name: a dataset's sample
    order does not depend on where it sits in the mixture (a restore into an edited mixture
    keeps it)."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class LengthTable:
    """Every component's lengths array (None for none), its code and its permutation key,
    for :func:`picks`."""

    def __init__(
        self, arrays: tuple[np.ndarray | None, ...], codes: np.ndarray, keys: np.ndarray
    ) -> None:
        self.arrays = arrays
        self.codes = codes
        self.keys = np.ascontiguousarray(keys, dtype=np.uint64)
        self.native = None if _NATIVE is None else _NATIVE.length_table(arrays, codes, self.keys)

    def __getstate__(self) -> dict[str, Any]:
        # A capsule does not pickle: the receiver builds its own.
        return {"arrays": self.arrays, "codes": self.codes, "keys": self.keys}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["arrays"], state["codes"], state["keys"])  # type: ignore[misc]


def rebuild(
    f64: np.ndarray,
    i64: np.ndarray,
    heaps: np.ndarray,
    table: LengthTable,
    lane: int,
    num_lanes: int,
    seed: int,
    flags: int,
    vtime: float,
) -> tuple[int, int, float]:
    """Tags and heaps of every drawable component (weight > 0, not exhausted), computing
    its next sample where ``next_length < 0``; returns ``(eligible, waiting, W)``."""
    if table.native is not None and _NATIVE is not None:
        return _NATIVE.mixture_rebuild(  # type: ignore[no-any-return]
            f64, i64, heaps, table.native, lane, num_lanes, seed, flags, vtime
        )
    return _Python(f64, i64, heaps, table, lane, num_lanes, seed, flags).rebuild(vtime)


def picks(
    f64: np.ndarray,
    i64: np.ndarray,
    heaps: np.ndarray,
    table: LengthTable,
    out: np.ndarray,
    k: int,
    eligible: int,
    waiting: int,
    vtime: float,
    weight_sum: float,
    lane: int,
    num_lanes: int,
    seed: int,
    chunk_id: int,
    flags: int,
) -> tuple[int, int, int, float, float, int, int]:
    """Up to ``k`` picks; returns ``(picked, eligible, waiting, vtime, W, exhausted,
    chunk_seed)``: ``exhausted`` is the component a ``FLAG_STOP_ON_EXHAUST`` call stopped
    at, or -1; ``chunk_seed`` is ``mix64(seed, lane, chunk_id)`` (cheaper in C)."""
    if table.native is not None and _NATIVE is not None:
        return _NATIVE.mixture_picks(  # type: ignore[no-any-return]
            f64,
            i64,
            heaps,
            table.native,
            out,
            k,
            eligible,
            waiting,
            vtime,
            weight_sum,
            lane,
            num_lanes,
            seed,
            chunk_id,
            flags,
        )
    return _Python(f64, i64, heaps, table, lane, num_lanes, seed, flags).picks(
        out, k, eligible, waiting, vtime, weight_sum, chunk_id
    )


def rebase(
    f64: np.ndarray,
    i64: np.ndarray,
    heaps: np.ndarray,
    eligible: int,
    waiting: int,
    vtime: float,
    new_weights: np.ndarray,
) -> None:
    """Move the scheduler's origin to now, for new weights: every drawable component keeps
    its lead over the virtual time in units (``carry = -(S - V) * w``, rounded to a float32 so
    that a checkpoint stores it in 4 bytes); the others start level with it. ``received``
    restarts at 0; the caller sets the virtual time to 0 and rebuilds."""
    carry = np.zeros(f64.shape[1], dtype=np.float64)
    comps = np.concatenate([heaps[0, :eligible], heaps[1, :waiting]]).astype(np.int64)
    if comps.size:
        lead = (f64[START, comps] - vtime) * f64[W, comps]
        carry[comps] = (-lead).astype(np.float32).astype(np.float64)
    carry[carry == 0] = 0.0  # no -0.0: states are compared bit for bit
    f64[CARRY] = carry
    f64[W] = new_weights
    i64[RECV] = 0


class _Python:
    """The pure-Python twin of the C functions: the same results, the same changes to every
    array (heap layouts included)."""

    def __init__(
        self,
        f64: np.ndarray,
        i64: np.ndarray,
        heaps: np.ndarray,
        table: LengthTable,
        lane: int,
        num_lanes: int,
        seed: int,
        flags: int,
    ) -> None:
        self.f64, self.i64, self.heaps, self.table = f64, i64, heaps, table
        self.lane, self.num_lanes, self.seed, self.flags = lane, num_lanes, seed, flags
        self.weights = f64[W].tolist()
        self.carry = f64[CARRY].tolist()
        self.start = f64[START].tolist()
        self.finish = f64[FINISH].tolist()
        self.recv, self.pos, self.tok, self.limits, self.sizes, self.nidx, self.nlen = (
            i64[r].tolist() for r in range(I64_ROWS)
        )
        self.elig = heaps[0].tolist()
        self.wait = heaps[1].tolist()

    def _store(self) -> None:
        f64, i64 = self.f64, self.i64
        f64[START], f64[FINISH] = self.start, self.finish
        for r, row in enumerate(
            (self.recv, self.pos, self.tok, self.limits, self.sizes, self.nidx, self.nlen)
        ):
            i64[r] = row
        self.heaps[0], self.heaps[1] = self.elig, self.wait

    def _units(self, length: int) -> int:
        return max(length, 1) if self.flags & FLAG_TOKEN_UNITS else 1

    def _drawable(self, c: int) -> bool:
        limit = self.limits[c]
        return self.weights[c] > 0 and (limit < 0 or self.pos[c] < limit)

    def _weight_sum(self) -> float:
        total = 0.0
        for c in range(len(self.weights)):
            if self._drawable(c):
                total += self.weights[c]
        return total

    def _next_sample(self, c: int) -> None:
        n, p = self.sizes[c], self.pos[c]
        g = self.lane + p * self.num_lanes
        index = g % n
        if self.flags & FLAG_SHUFFLE and n > 1:
            half_bits = _half_bits(n)
            key = int(self.table.keys[c])
            round_keys = _round_keys(mix64(self.seed, key, g // n), half_bits)
            index = _permute_scalar(index, n, half_bits, round_keys)
        length = 1
        code = int(self.table.codes[c])
        if code:
            source = self.table.arrays[c]
            assert source is not None
            if code & CODE_OFFSETS:
                length = int(source[index + 1]) - int(source[index])
            else:
                length = int(source[index])
            if length < 0:
                raise ValueError(f"mixture: sample {index} of component {c} has length {length}")
        self.nidx[c], self.nlen[c] = index, length

    def _tag(self, c: int) -> None:
        w = self.weights[c]
        self.start[c] = (float(self.recv[c]) - self.carry[c]) / w
        self.finish[c] = self.start[c] + float(self._units(self.nlen[c])) / w

    @staticmethod
    def _before(key: list[float], a: int, b: int) -> bool:
        return key[a] < key[b] or (key[a] == key[b] and a < b)

    def _push(self, heap: list[int], length: int, item: int, key: list[float]) -> int:
        i = length
        while i > 0:
            parent = (i - 1) // 2
            if not self._before(key, item, heap[parent]):
                break
            heap[i] = heap[parent]
            i = parent
        heap[i] = item
        return length + 1

    def _pop(self, heap: list[int], length: int, key: list[float]) -> tuple[int, int]:
        top = heap[0]
        length -= 1
        if length > 0:
            item, i = heap[length], 0
            heap[0] = item
            while True:
                child = 2 * i + 1
                if child >= length:
                    break
                if child + 1 < length and self._before(key, heap[child + 1], heap[child]):
                    child += 1
                if not self._before(key, heap[child], item):
                    break
                heap[i] = heap[child]
                i = child
            heap[i] = item
        return top, length

    def rebuild(self, vtime: float) -> tuple[int, int, float]:
        n_elig = n_wait = 0
        for c in range(len(self.weights)):
            if not self._drawable(c):
                continue
            if self.nlen[c] < 0:
                self._next_sample(c)
            self._tag(c)
            if self.start[c] <= vtime:
                n_elig = self._push(self.elig, n_elig, c, self.finish)
            else:
                n_wait = self._push(self.wait, n_wait, c, self.start)
        self._store()
        return n_elig, n_wait, self._weight_sum()

    def picks(
        self,
        out: np.ndarray,
        k: int,
        n_elig: int,
        n_wait: int,
        vtime: float,
        wsum: float,
        chunk_id: int,
    ) -> tuple[int, int, int, float, float, int, int]:
        picked, exhausted = 0, -1
        got_c, got_i, got_l = [], [], []
        while picked < k and n_elig + n_wait > 0:
            while n_wait > 0 and self.start[self.wait[0]] <= vtime:
                c, n_wait = self._pop(self.wait, n_wait, self.start)
                n_elig = self._push(self.elig, n_elig, c, self.finish)
            if n_elig == 0:
                vtime = self.start[self.wait[0]]  # nothing eligible: time jumps ahead
                continue
            c, n_elig = self._pop(self.elig, n_elig, self.finish)
            length = self.nlen[c]
            units = self._units(length)
            got_c.append(c)
            got_i.append(self.nidx[c])
            got_l.append(length)
            picked += 1
            self.pos[c] += 1
            self.recv[c] += units
            if self.table.codes[c]:
                self.tok[c] += length
            vtime += float(units) / wsum
            if self.limits[c] >= 0 and self.pos[c] >= self.limits[c]:
                self.nlen[c] = -1
                wsum = self._weight_sum()
                if self.flags & FLAG_STOP_ON_EXHAUST:
                    exhausted = c
                    break
                continue
            self._next_sample(c)
            self._tag(c)
            n_wait = self._push(self.wait, n_wait, c, self.start)
        out[0, :picked], out[1, :picked], out[2, :picked] = got_c, got_i, got_l
        self._store()
        seed = mix64(self.seed, self.lane, chunk_id)
        return picked, n_elig, n_wait, vtime, wsum, exhausted, seed
