"""``random_map``: a user function that draws random numbers, ``fn(data, rng) -> new data``.

``rng`` is a :class:`numpy.random.Generator` over PCG64 (numpy's default bit generator)
whose 128-bit state and 128-bit increment are a hash of the pipeline's seed, of which
``random_map`` of the pipeline draws (``stream``: 0 for the first, 1 for the second, ...)
and of the record's identity, its cursor ``(lane, chunk_id, offset, child)``. So the
numbers a record gets never depend on when or where it is processed: any worker count,
world size or restore point gives every record the same numbers, and two records get
unrelated ones (distinct increments are distinct PCG streams).

Cost: the hashes of a run of records are computed together (numpy, about 0.1 us a
record) and re-keying the one generator writes four words straight into its state
through the bit generator's ctypes interface (about 0.5 us). A check when the generator
is made compares that with numpy's own state setter and falls back to the setter (about
3 us) if the state's layout ever differs. Making a new generator per record would cost
10-30 us (numpy builds a ``SeedSequence`` for each).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from zephon._fingerprint import describe_callable
from zephon._native import load
from zephon.operators.base import Operator, OpTraits, Output, PipelineContext
from zephon.operators.map import returned_none
from zephon.records import Record
from zephon.work_sources.permutation import _fmix64_array, mix64

_NATIVE = load("_permute")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ODD = np.uint64(1)


def record_words(key: int, cursors: Sequence[tuple[int, int, int, int]]) -> list[Any]:
    """Each cursor's PCG64 state (high, low) and increment (high, low; odd), hashed from
    ``key`` and the cursor's four fields by splitmix64 chains: word ``w`` is ``h`` after
    ``h = fmix64(key ^ (w + 1))``, then ``h = fmix64((h + GOLDEN) ^ field)`` per field.
    In C (``zephon._permute.record_words``) when built; this numpy twin gives the same."""
    if _NATIVE is not None:
        return _NATIVE.record_words(key, cursors)  # type: ignore[no-any-return]
    c = np.array(cursors, dtype=np.uint64).reshape(-1, 4)
    h = _fmix64_array(np.uint64(key) ^ np.arange(1, 5, dtype=np.uint64))
    words = np.broadcast_to(h, (len(c), 4)).copy()
    with np.errstate(over="ignore"):
        for f in range(4):
            words = _fmix64_array(((words + _GOLDEN) ^ c[:, f : f + 1]).ravel()).reshape(-1, 4)
    words[:, 3] |= _ODD
    return words.tolist()


class RecordRandom:
    """The generator a record's ``fn`` call gets, re-keyed per record (one per thread)."""

    __slots__ = ("_bits", "generator", "key", "_words", "_has")

    def __init__(self, seed: int, stream: int) -> None:
        self._bits = np.random.PCG64(0)
        self.generator = np.random.Generator(self._bits)
        self.key = mix64(seed, stream)
        self._words: Any = None  # ctypes views, or None: numpy's setter
        self._has: Any = None
        try:
            self._find_layout()
        except (AttributeError, ValueError, OSError):  # no ctypes interface
            self._words = None

    def _find_layout(self) -> None:
        """numpy's ``pcg64_state`` is a pointer to ``{state, inc}`` (two 128-bit integers:
        ``__uint128_t``, low word first here, or a ``{high, low}`` struct), then ``int
        has_uint32``. Which one this numpy has is found by writing and comparing."""
        addr = self._bits.ctypes.state_address
        (pcg_at,) = (ctypes.c_void_p * 1).from_address(addr)
        if not pcg_at:
            raise ValueError("PCG64 state pointer is NULL")
        words = (ctypes.c_uint64 * 4).from_address(pcg_at)
        self._has = ctypes.c_int.from_address(addr + ctypes.sizeof(ctypes.c_void_p))
        probe = [0x0123456789ABCDEF, 0x1122334455667788, 0x0F0E0D0C0B0A0908, 0x1357924680ACE135]
        for order in ((1, 0, 3, 2), (0, 1, 2, 3)):  # (high, low) at these word offsets
            self._words = (words, order)
            self._write(probe)
            state = self._bits.state["state"]
            if state["state"] == (probe[0] << 64 | probe[1]) and state["inc"] == (
                probe[2] << 64 | probe[3]
            ):
                return
        self._words = None

    def _write(self, w: Sequence[int]) -> None:
        words, order = self._words
        words[order[0]] = w[0]
        words[order[1]] = w[1]
        words[order[2]] = w[2]
        words[order[3]] = w[3]
        self._has.value = 0

    def rekey(self, w: Sequence[int]) -> np.random.Generator:
        """The generator, set to the state and increment ``w`` (see :func:`record_words`)."""
        if self._words is not None:
            self._write(w)
        else:
            self._bits.state = {
                "bit_generator": "PCG64",
                "state": {"state": w[0] << 64 | w[1], "inc": w[2] << 64 | w[3]},
                "has_uint32": 0,
                "uinteger": 0,
            }
        return self.generator


class RandomMap(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "random_map"

    def __init__(
        self,
        fn: Callable[[Any, np.random.Generator], Any],
        stream: int | None = 0,
        parallelism: int = 1,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"random_map needs a callable fn(data, rng); got {type(fn).__name__} {fn!r}"
            )
        if stream is not None and (
            not isinstance(stream, int) or isinstance(stream, bool) or stream < 0
        ):
            raise ValueError(f"RandomMap(stream=...) must be an int >= 0; got {stream!r}")
        self.fn = fn
        self.stream = stream
        self.parallelism = parallelism
        self._seed = 0
        self._randoms: dict[int, RecordRandom] = {}
        #: The components' names, for the error that names a record's sample (see bind).
        self.names: tuple[str, ...] = ()

    def bind(self, ctx: PipelineContext) -> None:
        self._seed = int(ctx.seed)
        self._randoms = {}
        self.names = tuple(ctx.names)

    def _rng(self) -> RecordRandom:
        # One generator per thread: with parallelism > 1 the chain runner's pool calls
        # process_batch on slices of a run at once.
        ident = threading.get_ident()
        random = self._randoms.get(ident)
        if random is None:
            random = self._randoms[ident] = RecordRandom(self._seed, self.stream or 0)
        return random

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_randoms"] = {}  # generators are made where the operator runs
        return state

    def process(self, record: Record) -> Iterable[Output]:
        return self.process_batch([record])

    def process_batch(self, records: list[Record]) -> list[Output]:
        random, fn = self._rng(), self.fn
        words = record_words(random.key, [r.cursor for r in records])
        out: list[Output] = []
        for r, w in zip(records, words, strict=True):
            data = fn(r.data, random.rekey(w))
            if data is None:
                raise returned_none("random_map", fn, r, self.names)
            out.append(r.replace(data))
        return out

    def fresh(self) -> Operator:
        clone = RandomMap(self.fn, self.stream, self.parallelism)
        clone._seed = self._seed
        clone.names = self.names
        return clone

    def fingerprint(self) -> str:
        return (
            f"RandomMap(fn={describe_callable(self.fn)}, stream={self.stream}, seed={self._seed})"
        )

    def fingerprint_parts(self) -> dict[str, str]:
        return {
            "fn": describe_callable(self.fn),
            "stream": str(self.stream),
            "seed": str(self._seed),
        }

    def __repr__(self) -> str:
        return (
            f"RandomMap(fn={getattr(self.fn, '__qualname__', self.fn)!s}, stream={self.stream}, "
            f"parallelism={self.parallelism})"
        )
