"""StaticMixtureWorkSource: a weighted mixture of random-access datasets, one lane of it.

Per component ``c`` (dataset of length ``N``, named ``name``) the global sample stream is the
concatenation of dataset epochs ``e = 0, 1, 2, …``, epoch ``e`` being ``permute(range(N), N,
key=mix64(seed, k, e))`` with ``k = component_key(name)`` (64 bits of the name's blake2b:
the order does not depend on the dataset's place in the mixture), or the identity without
shuffling. Lane ``l`` of ``L`` takes global positions ``g = l + p * L`` for ``p = 0, 1, 2,
…`` — so the lanes are disjoint within every dataset epoch, together cover it, and every lane
gets samples even when ``N < L``. Sample ``p`` of the lane is ``permute(g % N, N, mix64(seed,
k, g // N))``.

Components are interleaved by worst-case fair weighted fair queueing (WF2Q+, see
:mod:`zephon.work_sources.interleave`): every component stays within about one of its
samples of its share of the lane's units, a unit being a sample (``weight_unit="samples"``)
or a token (``"tokens"``: the sample's token count, from ``lengths``). No random draws, so
every window of the stream tracks the weights. With
``num_epochs`` a component is exhausted for the lane once ``g >= E * N``; it then leaves the
interleave and the others share its place (``on_exhausted="renormalize"``), or the lane ends
(``"stop"``). ``weights`` may be a :class:`~zephon.Schedule` of the lane's own progress.

State is ``(next_chunk_id, the lane's tokens, where the weights were last looked up, the
virtual time, and per component: position, tokens, units received since the last change of
weights, a carried credit)``: constant size, packed small, and restoring it costs nothing
whatever the position.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon.chunks import WorkChunk
from zephon.errors import CheckpointError
from zephon.sources.identity import dataset_identity
from zephon.work_sources import interleave as il
from zephon.work_sources.base import RandomAccessDataset
from zephon.work_sources.lengths import ComponentLengths, resolve_lengths
from zephon.work_sources.schedule import Schedule

__all__ = ["StaticMixtureWorkSource", "decode_state"]

STATE_VERSION = 2
_STATE_KEYS = (
    "version",
    "lane",
    "num_lanes",
    "next_chunk_id",
    "lane_tokens",
    "schedule_position",
    "virtual_time",
    "positions",
    "tokens",
    "received",
    "carry",
    "stopped",
)
WEIGHT_UNITS = ("samples", "tokens")
ON_EXHAUSTED = ("renormalize", "stop")

Datasets = Sequence[RandomAccessDataset] | Mapping[str, RandomAccessDataset]
Weights = Sequence[float] | Mapping[str, float] | np.ndarray | Schedule | None
Lengths = Sequence[Any] | Mapping[str, Any] | None
NumEpochs = int | Mapping[str, int | None] | None


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int; got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError as e:
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}") from e


def _validate_lane(lane: Any, num_lanes: Any) -> tuple[int, int]:
    lane = _as_int("lane", lane)
    num_lanes = _as_int("num_lanes", num_lanes)
    if num_lanes < 1:
        raise ValueError(f"num_lanes must be >= 1; got num_lanes={num_lanes}")
    if not 0 <= lane < num_lanes:
        raise ValueError(
            f"lane must satisfy 0 <= lane < num_lanes; got lane={lane}, num_lanes={num_lanes} "
            f"(use a lane in 0..{num_lanes - 1})"
        )
    return lane, num_lanes


# ----------------------------------------------------------------- packed int arrays
#
# A state's per-component arrays are bytes: one byte giving the width w (0: all zero, else
# 1, 2, 4 or 8), then the values as little-endian signed w-byte ints, byte plane by byte
# plane (every value's low byte, then every second byte, ...), which zstd compresses well
# when the values have similar magnitudes.


def pack_ints(values: np.ndarray) -> bytes:
    """Per-component ints as bytes (see above)."""
    if not values.size or not values.any():
        return b"\x00"
    lo, hi = int(values.min()), int(values.max())
    for width in (1, 2, 4, 8):
        bound = 1 << (8 * width - 1)
        if -bound <= lo and hi < bound:
            break
    planes = values.astype(f"<i{width}").view(np.uint8).reshape(-1, width).T
    return bytes([width]) + planes.tobytes()


def unpack_ints(data: Any, count: int, what: str) -> np.ndarray:
    """:func:`pack_ints`'s bytes back to ``count`` int64s.

    Raises:
        CheckpointError: not bytes, an unknown width, or another count of values.
    """
    if not isinstance(data, bytes) or not data:
        raise CheckpointError(
            f"state {what} must be packed bytes; got {type(data).__name__} {data!r:.40}"
        )
    width = data[0]
    if width == 0 and len(data) == 1:
        return np.zeros(count, dtype=np.int64)
    if width not in (1, 2, 4, 8) or len(data) != 1 + width * count:
        raise CheckpointError(
            f"state {what} holds {len(data) - 1} bytes of width {width}; expected "
            f"{count} values (one per component) of width 1, 2, 4 or 8"
        )
    planes = np.frombuffer(data, dtype=np.uint8, offset=1).reshape(width, count)
    return np.ascontiguousarray(planes.T).view(f"<i{width}").reshape(count).astype(np.int64)


def _pack_carry(carry: np.ndarray) -> bytes:
    return b"" if not carry.any() else carry.astype("<f4").tobytes()


def _unpack_carry(data: Any, count: int) -> np.ndarray:
    if not isinstance(data, bytes) or len(data) not in (0, 4 * count):
        raise CheckpointError(
            f"state carry must be b'' or {count} float32s; got {type(data).__name__} {data!r:.40}"
        )
    if not data:
        return np.zeros(count, dtype=np.float64)
    carry = np.frombuffer(data, dtype="<f4").astype(np.float64)
    if not np.all(np.isfinite(carry)):
        raise CheckpointError("state carry must be finite float32s")
    carry[carry == 0] = 0.0
    return carry


def decode_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A lane's work-source state as plain per-component lists (``positions``, ``tokens``),
    for ``zephon inspect``: no datasets needed. The count comes from the packed bytes."""
    out: dict[str, Any] = {}
    for key in ("positions", "tokens"):
        data = state.get(key)
        if not isinstance(data, bytes) or not data:
            return {}
        width = data[0]
        count = 0 if width == 0 else (len(data) - 1) // width
        if width == 0:
            out[key] = None  # all zero; the count is not recorded
            continue
        out[key] = unpack_ints(data, count, key).tolist()
    return out


class StaticMixtureWorkSource:
    """One lane of a weighted mixture of random-access datasets.

    Args:
        datasets: a list/tuple of datasets (anything with ``__len__`` and ``__getitem__``),
            named ``"0"``, ``"1"``, …; or a dict name -> dataset. Component ``c`` is the
            position in the list, or in the dict's order.
        weights: one non-negative finite weight per component (list/tuple in component
            order, or a dict with exactly the dataset names as keys when ``datasets`` is a
            dict); None means equal weights; or a :class:`~zephon.Schedule` of weights that
            change with the lane's progress. Normalised to sum to 1. A zero-weight component
            is never drawn and may be empty.
        seed: seeds the per-epoch permutations and the per-chunk seeds.
        shuffle: permute every dataset epoch; False reads each dataset in order.
        chunk_size: pointers per work chunk (the last chunk of an exhausted lane may be
            shorter).
        num_epochs: passes over every dataset (counted over all lanes together) before it
            is exhausted: an int for all, a dict name -> int or None (names left out repeat
            forever), or None to repeat forever.
        weight_unit: what the weights share out: ``"samples"`` (each component's share of
            the samples) or ``"tokens"`` (its share of the tokens, from ``lengths``).
        lengths: each component's token count per sample: None (asked of the dataset when
            needed: ``TokenFileSource``, an ``ArraySource`` of token arrays), or a dict
            name -> (an array of counts, a :func:`~zephon.open_length_index`, or a column
            name of a ``ParquetSource``), or a list of those in component order. Needed for
            ``weight_unit="tokens"`` and ``Schedule(unit="tokens")``; otherwise, when given,
            only counted (``zephon inspect`` shows the tokens dealt).
        on_exhausted: with ``num_epochs``, what a lane does when one of its components with
            a positive weight runs out: ``"renormalize"`` (the others share its place; the
            lane ends when none is left) or ``"stop"`` (the lane ends there).
        lane: this source's lane, ``0 <= lane < num_lanes``.
        num_lanes: the number of lanes the stream is dealt across.

    Example::

        src = zp.StaticMixtureWorkSource(
            {"web": zp.TokenFileSource("web.bin", eos_id=0), "code": code},
            weights={"web": 0.7, "code": 0.3}, weight_unit="tokens",
            lengths={"code": zp.open_length_index(code, tokenizer)})

    Raises:
        ValueError: mismatched datasets/weights, a negative or non-finite weight, weights
            summing to zero, an empty dataset with positive weight, ``chunk_size < 1``,
            ``num_epochs < 1``, a lane out of range, an unknown ``weight_unit`` or
            ``on_exhausted``, token weights for a dataset whose lengths are unknown.
        TypeError: a dataset without ``__len__``/``__getitem__``, or a non-int parameter.
    """

    def __init__(
        self,
        datasets: Datasets,
        weights: Weights = None,
        seed: int = 0,
        shuffle: bool = True,
        chunk_size: int = 64,
        num_epochs: NumEpochs = None,
        *,
        weight_unit: str = "samples",
        lengths: Lengths = None,
        on_exhausted: str = "renormalize",
        lane: int = 0,
        num_lanes: int = 1,
    ) -> None:
        names, dsets = self._check_datasets(datasets)
        if weight_unit not in WEIGHT_UNITS:
            raise ValueError(f"weight_unit must be one of {WEIGHT_UNITS}; got {weight_unit!r}")
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {ON_EXHAUSTED}; got {on_exhausted!r}")
        schedule: Schedule | None = None
        if isinstance(weights, Schedule):
            schedule = weights
            vectors = schedule.vectors_for(names)
            first = tuple(float(w) for w in vectors[0])
            most = np.max(np.vstack(vectors), axis=0)  # the largest weight a component gets
            raw_weights = tuple(float(w) for w in most)
        else:
            raw_weights = self._check_weights(weights, datasets, names)
            first = self._normalise(raw_weights)
            vectors = [np.asarray(first, dtype=np.float64)]
        sizes = []
        for c, (name, ds) in enumerate(zip(names, dsets, strict=True)):
            n = len(ds)
            if n == 0 and raw_weights[c] > 0:
                raise ValueError(
                    f"dataset {name!r} (component {c}) is empty but has weight "
                    f"{raw_weights[c]!r}; give it weight 0 or remove it"
                )
            sizes.append(int(n))

        seed = _as_int("seed", seed)
        if not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits (msgpack-able); got seed={seed}")
        chunk_size = _as_int("chunk_size", chunk_size)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; got chunk_size={chunk_size}")
        epochs = self._check_epochs(num_epochs, names)

        self._names: tuple[str, ...] = names
        self._datasets: tuple[RandomAccessDataset, ...] = dsets
        self._lengths: tuple[int, ...] = tuple(sizes)
        self._schedule = schedule
        self._vectors = vectors
        self._weights: tuple[float, ...] = first
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._chunk_size = chunk_size
        self._num_epochs: Any = dict(num_epochs) if isinstance(num_epochs, Mapping) else num_epochs
        self._epochs: tuple[int | None, ...] = epochs
        self._weight_unit = weight_unit
        self._on_exhausted = on_exhausted
        needs_tokens = weight_unit == "tokens" or (
            schedule is not None and schedule.unit == "tokens"
        )
        self._token_lengths = self._resolve_lengths(lengths, raw_weights, needs_tokens)
        self._codes = np.array(
            [
                il.length_code(None if t is None else t.array, t is not None and t.offsets)
                for t in self._token_lengths
            ],
            dtype=np.uint8,
        )
        self._table = il.LengthTable(
            tuple(None if t is None else t.array for t in self._token_lengths),
            self._codes,
            np.array([il.component_key(n) for n in names], dtype=np.uint64),
        )
        self._all_lengths = all(t is not None for t in self._token_lengths)
        self._has_lengths = any(t is not None for t in self._token_lengths)
        self._flags = (
            (il.FLAG_SHUFFLE if self._shuffle else 0)
            | (il.FLAG_TOKEN_UNITS if weight_unit == "tokens" else 0)
            | (il.FLAG_STOP_ON_EXHAUST if on_exhausted == "stop" else 0)
        )
        self._bind_lane(lane, num_lanes)

    # ----------------------------------------------------------------------- validation

    @staticmethod
    def _check_datasets(
        datasets: Datasets,
    ) -> tuple[tuple[str, ...], tuple[RandomAccessDataset, ...]]:
        if isinstance(datasets, Mapping):
            for k in datasets:
                if not isinstance(k, str):
                    raise TypeError(
                        f"dataset names (dict keys) must be str; got {type(k).__name__} {k!r}"
                    )
            names = tuple(datasets)
            dsets = tuple(datasets.values())
        elif isinstance(datasets, list | tuple):
            dsets = tuple(datasets)
            names = tuple(str(c) for c in range(len(dsets)))
        else:
            raise TypeError(
                f"datasets must be a list/tuple of datasets or a dict name -> dataset; got "
                f"{type(datasets).__name__}"
            )
        if not dsets:
            raise ValueError("datasets is empty; pass at least one dataset")
        for c, (name, ds) in enumerate(zip(names, dsets, strict=True)):
            if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
                raise TypeError(
                    f"dataset {name!r} (component {c}) of type {type(ds).__name__} is not "
                    f"random-access: it needs __len__ and __getitem__ (wrap it in a source "
                    f"such as ArraySource)"
                )
        return names, dsets

    @staticmethod
    def _check_weights(
        weights: Weights, datasets: Datasets, names: tuple[str, ...]
    ) -> tuple[float, ...]:
        if weights is None:
            return tuple(1.0 for _ in names)
        if isinstance(weights, Mapping):
            if not isinstance(datasets, Mapping):
                raise ValueError(
                    f"weights is a dict (keys {sorted(map(str, weights))}) but datasets is a "
                    f"{type(datasets).__name__}; pass weights as a list in dataset order, or "
                    f"datasets as a dict"
                )
            missing = [n for n in names if n not in weights]
            extra = [k for k in weights if k not in datasets]
            if missing or extra:
                raise ValueError(
                    f"weights keys must equal datasets keys; missing weights for {missing}, "
                    f"weights for unknown datasets {extra}"
                )
            values = [weights[n] for n in names]
        elif isinstance(weights, list | tuple | np.ndarray):
            values = list(weights)
            if len(values) != len(names):
                raise ValueError(
                    f"got {len(values)} weights for {len(names)} datasets; pass one weight per "
                    f"dataset"
                )
        else:
            raise TypeError(
                f"weights must be a list/tuple, a dict name -> weight, a zp.Schedule or None; "
                f"got {type(weights).__name__}"
            )
        out = []
        for c, (name, w) in enumerate(zip(names, values, strict=True)):
            try:
                wf = float(w)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"weight of dataset {name!r} (component {c}) must be a number; got {w!r}"
                ) from e
            if not math.isfinite(wf) or wf < 0:
                raise ValueError(
                    f"weight of dataset {name!r} (component {c}) must be finite and >= 0; got {w!r}"
                )
            out.append(wf)
        if not any(w > 0 for w in out):
            raise ValueError(
                f"weights must have a positive sum; got {out} (give at least one dataset a "
                f"positive weight)"
            )
        return tuple(out)

    @staticmethod
    def _check_epochs(num_epochs: NumEpochs, names: tuple[str, ...]) -> tuple[int | None, ...]:
        def one(value: Any, what: str) -> int | None:
            if value is None:
                return None
            value = _as_int(what, value)
            if value < 1:
                raise ValueError(
                    f"{what} must be >= 1, or None to repeat forever; got {what}={value}"
                )
            return value

        if isinstance(num_epochs, Mapping):
            unknown = [k for k in num_epochs if k not in names]
            if unknown:
                raise ValueError(
                    f"num_epochs names unknown datasets {unknown}; the datasets are {list(names)}"
                )
            return tuple(one(num_epochs.get(n), f"num_epochs[{n!r}]") for n in names)
        epochs = one(num_epochs, "num_epochs")
        if epochs is not None:
            return tuple(epochs for _ in names)
        return tuple(None for _ in names)

    def _resolve_lengths(
        self, lengths: Lengths, raw_weights: tuple[float, ...], needed: bool
    ) -> tuple[ComponentLengths | None, ...]:
        names = self._names
        if lengths is None:
            specs: list[Any] = [None] * len(names)
            given = [False] * len(names)
        elif isinstance(lengths, Mapping):
            unknown = [k for k in lengths if k not in names]
            if unknown:
                raise ValueError(
                    f"lengths names unknown datasets {unknown}; the datasets are {list(names)}"
                )
            specs = [lengths.get(n) for n in names]
            given = [n in lengths for n in names]
        elif isinstance(lengths, list | tuple):
            if len(lengths) != len(names):
                raise ValueError(
                    f"got lengths for {len(lengths)} datasets, there are {len(names)}; give "
                    "one entry (or None) per dataset, or a dict"
                )
            specs = list(lengths)
            given = [s is not None for s in lengths]
        else:
            raise TypeError(
                f"lengths must be None, a dict name -> lengths or a list; got "
                f"{type(lengths).__name__}"
            )
        out: list[ComponentLengths | None] = []
        for c, (name, ds, spec) in enumerate(zip(names, self._datasets, specs, strict=True)):
            if given[c] or (needed and raw_weights[c] > 0):
                out.append(resolve_lengths(name, c, ds, spec))
            else:
                out.append(None)
        return tuple(out)

    @staticmethod
    def _normalise(weights: tuple[float, ...]) -> tuple[float, ...]:
        # Divide by the max first so a sum of huge finite weights cannot overflow to inf.
        top = max(weights)
        scaled = [w / top for w in weights]
        total = math.fsum(scaled)
        return tuple(w / total for w in scaled)

    # ---------------------------------------------------------------------- lane binding

    def _bind_lane(self, lane: int, num_lanes: int) -> None:
        """Bind to a lane and rewind to the start of its stream."""
        self._lane, self._num_lanes = _validate_lane(lane, num_lanes)
        k = self.num_components
        self._f64 = np.zeros((il.F64_ROWS, k), dtype=np.float64)
        self._i64 = np.zeros((il.I64_ROWS, k), dtype=np.int64)
        self._i64[il.NLEN] = -1
        self._i64[il.SIZE] = self._lengths
        self._i64[il.LIMIT] = [
            -1 if e is None else max(0, -(-(e * n - self._lane) // self._num_lanes))
            for e, n in zip(self._epochs, self._lengths, strict=True)
        ]
        self._heaps = np.zeros((2, k), dtype=np.int32)
        self._vtime = 0.0
        self._out = np.empty((3, self._chunk_size), dtype=np.int64)
        self._next_chunk_id = 0
        self._lane_tokens = 0
        self._schedule_position = 0
        self._stopped = False
        self._set_weights(0)
        self._stopped = self._on_exhausted == "stop" and bool(
            np.any((self._f64[il.W] > 0) & self._exhausted_mask())
        )
        self._rebuild()

    def _exhausted_mask(self) -> np.ndarray:
        limits = self._i64[il.LIMIT]
        return (limits >= 0) & (self._i64[il.POS] >= limits)

    def _rebuild(self) -> None:
        self._eligible, self._waiting, self._weight_sum = il.rebuild(
            self._f64,
            self._i64,
            self._heaps,
            self._table,
            self._lane,
            self._num_lanes,
            self._seed & 0xFFFFFFFFFFFFFFFF,
            self._flags,
            self._vtime,
        )

    def _set_weights(self, position: int) -> None:
        """The weights at schedule ``position`` into the weight row (no rebase)."""
        self._schedule_position = position
        if self._schedule is None:
            self._f64[il.W] = self._vectors[0]
            self._segment = 0
        else:
            self._f64[il.W] = self._schedule.weights_at(self._vectors, position)
            self._segment = self._schedule.segment(position)

    def _progress(self) -> int:
        assert self._schedule is not None
        return self._next_chunk_id if self._schedule.unit == "chunks" else self._lane_tokens

    def _follow_schedule(self) -> None:
        """Before a chunk: the weights at the lane's progress; if they changed, move the
        interleave's origin (see :func:`~zephon.work_sources.interleave.rebase`)."""
        schedule = self._schedule
        assert schedule is not None
        position = self._progress()
        segment = schedule.segment(position)
        last = segment == len(schedule.positions) - 1
        if segment == self._segment and (schedule.interpolate == "step" or last):
            return
        new = schedule.weights_at(self._vectors, position)
        if np.array_equal(new, self._f64[il.W]):
            self._segment = segment
            return
        il.rebase(
            self._f64, self._i64, self._heaps, self._eligible, self._waiting, self._vtime, new
        )
        self._vtime = 0.0
        self._schedule_position = position
        self._segment = segment
        self._rebuild()

    def for_lane(self, lane: int, num_lanes: int) -> StaticMixtureWorkSource:
        """A fresh source for ``lane`` of ``num_lanes`` sharing this one's datasets and
        parameters."""
        lane, num_lanes = _validate_lane(lane, num_lanes)
        new = copy.copy(self)
        new._bind_lane(lane, num_lanes)
        return new

    def config(self) -> dict[str, Any]:
        """Msgpack-able description for the pipeline fingerprint (no lane, no progress).

        ``identities`` holds each dataset's content identity (its ``content_identity()``,
        or its type's name for a dataset without one; see :mod:`zephon.sources.identity`),
        computed now from bounded reads. Options left at their defaults are left out, so a
        pipeline that does not use them keeps its fingerprint.

        Raises:
            TypeError: a dataset's ``content_identity()`` returned something that is not a
                dict of plain values; the message names the component.
        """
        identities = []
        for c, (name, ds) in enumerate(zip(self._names, self._datasets, strict=True)):
            try:
                identities.append(dataset_identity(ds))
            except TypeError as e:
                raise TypeError(f"dataset {name!r} (component {c}): {e}") from e
        config: dict[str, Any] = {
            "class": type(self).__name__,
            "names": list(self._names),
            "lengths": list(self._lengths),
            "weights": list(self._weights),
            "seed": self._seed,
            "shuffle": self._shuffle,
            "chunk_size": self._chunk_size,
            "num_epochs": self._num_epochs,
            # Last, so that the config without it is the one checkpoints held before.
            "identities": identities,
        }
        if self._weight_unit != "samples":
            config["weight_unit"] = self._weight_unit
        if any(t is not None for t in self._token_lengths):
            config["token_lengths"] = [
                None if t is None else t.description for t in self._token_lengths
            ]
        if self._schedule is not None:
            config["schedule"] = self._schedule.config()
        if self._on_exhausted != "renormalize":
            config["on_exhausted"] = self._on_exhausted
        return config

    # ------------------------------------------------------------------------ properties

    @property
    def datasets(self) -> tuple[RandomAccessDataset, ...]:
        return self._datasets

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each dataset's length (samples)."""
        return self._lengths

    @property
    def weights(self) -> tuple[float, ...] | None:
        """Normalised weights, summing to 1; None when they follow a :class:`Schedule`."""
        return None if self._schedule is not None else self._weights

    @property
    def schedule(self) -> Schedule | None:
        return self._schedule

    @property
    def weight_unit(self) -> str:
        return self._weight_unit

    @property
    def token_lengths(self) -> tuple[ComponentLengths | None, ...]:
        """Each component's token counts, where known."""
        return self._token_lengths

    @property
    def on_exhausted(self) -> str:
        return self._on_exhausted

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def num_epochs(self) -> Any:
        """As given: an int, a dict name -> int or None, or None."""
        return self._num_epochs

    @property
    def lane(self) -> int:
        return self._lane

    @property
    def next_chunk_id(self) -> int:
        """The id of the chunk :meth:`next_chunk` returns next."""
        return self._next_chunk_id

    @property
    def num_lanes(self) -> int:
        return self._num_lanes

    @property
    def num_components(self) -> int:
        return len(self._datasets)

    @property
    def positions(self) -> tuple[int, ...]:
        """Samples of each component this lane has dealt."""
        return tuple(self._i64[il.POS].tolist())

    @property
    def tokens_dealt(self) -> tuple[int, ...]:
        """Tokens of each component this lane has dealt (0 where lengths are unknown)."""
        return tuple(self._i64[il.TOK].tolist())

    @property
    def current_weights(self) -> tuple[float, ...]:
        """The weights the next chunk is dealt with (a schedule's, at the lane's progress)."""
        return tuple(self._f64[il.W].tolist())

    # ---------------------------------------------------------------------------- stream

    def next_chunk(self) -> WorkChunk | None:
        """The lane's next chunk of up to ``chunk_size`` pointers, or None once it is
        exhausted (every component with a positive weight is, or with ``on_exhausted=
        "stop"`` one of them)."""
        if self._stopped:
            return None
        if self._schedule is not None:
            self._follow_schedule()
        if self._eligible + self._waiting == 0:
            return None
        chunk_id = self._next_chunk_id
        out = self._out
        (
            picked,
            self._eligible,
            self._waiting,
            self._vtime,
            self._weight_sum,
            exhausted,
            chunk_seed,
        ) = il.picks(
            self._f64,
            self._i64,
            self._heaps,
            self._table,
            out,
            self._chunk_size,
            self._eligible,
            self._waiting,
            self._vtime,
            self._weight_sum,
            self._lane,
            self._num_lanes,
            self._seed & 0xFFFFFFFFFFFFFFFF,
            chunk_id,
            self._flags,
        )
        if exhausted >= 0:
            self._stopped = True
        components = out[0, :picked].astype(np.int32)
        if self._all_lengths:
            self._lane_tokens += int(out[2, :picked].sum())
        elif self._has_lengths:
            self._lane_tokens += int(out[2, :picked][self._codes[components] != 0].sum())
        self._next_chunk_id = chunk_id + 1
        return WorkChunk(self._lane, chunk_id, components, out[1, :picked].copy(), chunk_seed)

    # ----------------------------------------------------------------------------- state

    def _received_base(self) -> np.ndarray:
        return self._i64[il.TOK] if self._weight_unit == "tokens" else self._i64[il.POS]

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "lane", "num_lanes", "next_chunk_id", "lane_tokens",
        "schedule_position", "virtual_time", "positions", "tokens", "received", "carry",
        "stopped"}``: a few numbers, and per component packed bytes whose size does not grow with the progress
        (``received`` is stored as its difference from the samples or tokens dealt, zero
        until the weights first change; ``carry`` is empty until then)."""
        return {
            "version": STATE_VERSION,
            "lane": self._lane,
            "num_lanes": self._num_lanes,
            "next_chunk_id": self._next_chunk_id,
            "lane_tokens": self._lane_tokens,
            "schedule_position": self._schedule_position,
            "virtual_time": self._vtime,
            "positions": pack_ints(self._i64[il.POS]),
            "tokens": pack_ints(self._i64[il.TOK]),
            "received": pack_ints(self._received_base() - self._i64[il.RECV]),
            "carry": _pack_carry(self._f64[il.CARRY]),
            "stopped": self._stopped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the source that saved ``state`` stood. O(1) in the
        progress (O(C) in the components).

        Raises:
            CheckpointError (a ValueError): unknown version, missing or unknown keys, a
                state for another lane / lane count / number of components, or values
                inconsistent with this source's parameters.
        """
        if not isinstance(state, Mapping):
            raise CheckpointError(
                f"StaticMixtureWorkSource state must be a dict; got {type(state).__name__}"
            )
        version = state.get("version")
        if version != STATE_VERSION:
            older = (
                "; it was written by an earlier Zephon, which interleaved components by "
                "smooth weighted round robin: resume it with that version"
                if version == 1
                else ""
            )
            raise CheckpointError(
                f"unknown StaticMixtureWorkSource state version {version!r}; this Zephon "
                f"reads version {STATE_VERSION}{older}"
            )
        missing = [k for k in _STATE_KEYS if k not in state]
        extra = sorted(str(k) for k in state if k not in _STATE_KEYS)
        if missing or extra:
            raise CheckpointError(
                f"StaticMixtureWorkSource state has missing keys {missing} and unknown keys "
                f"{extra}; expected exactly {list(_STATE_KEYS)}"
            )
        lane, num_lanes = state["lane"], state["num_lanes"]
        if type(lane) is not int or type(num_lanes) is not int:
            raise CheckpointError(
                f"state lane and num_lanes must be ints; got {lane!r} and {num_lanes!r}"
            )
        if lane != self._lane or num_lanes != self._num_lanes:
            raise CheckpointError(
                f"state belongs to lane {lane} of {num_lanes} but this source is lane "
                f"{self._lane} of {self._num_lanes}; load it into for_lane({lane}, {num_lanes})"
            )
        k = self.num_components
        next_chunk_id = _checked_count("next_chunk_id", state["next_chunk_id"])
        lane_tokens = _checked_count("lane_tokens", state["lane_tokens"])
        position = _checked_count("schedule_position", state["schedule_position"])
        vtime = state["virtual_time"]
        if not isinstance(vtime, float) or not math.isfinite(vtime):
            raise CheckpointError(f"state virtual_time must be a finite float; got {vtime!r:.40}")
        stopped = state["stopped"]
        if not isinstance(stopped, bool):
            raise CheckpointError(f"state stopped must be a bool; got {stopped!r:.40}")
        positions = self._unpack(state["positions"], k, "positions")
        tokens = self._unpack(state["tokens"], k, "tokens")
        diff = self._unpack(state["received"], k, "received")
        carry = _unpack_carry(state["carry"], k)
        for name, array in (("positions", positions), ("tokens", tokens)):
            if np.any(array < 0):
                at = int(np.flatnonzero(array < 0)[0])
                raise CheckpointError(
                    f"state {name}[{at}] ({self._names[at]!r}) must be >= 0; got {int(array[at])}"
                )
        if self._schedule is not None:
            progress = next_chunk_id if self._schedule.unit == "chunks" else lane_tokens
            if position > progress:
                raise CheckpointError(
                    f"state schedule_position {position} is past the lane's progress "
                    f"{progress} ({self._schedule.unit}); the state is inconsistent"
                )
        elif position != 0:
            raise CheckpointError(
                f"state schedule_position must be 0 without a Schedule; got {position}"
            )
        base = tokens if self._weight_unit == "tokens" else positions
        received = base - diff
        if np.any(received < 0):
            at = int(np.flatnonzero(received < 0)[0])
            raise CheckpointError(
                f"state received[{at}] ({self._names[at]!r}) is negative "
                f"({int(received[at])}); the state is inconsistent"
            )
        self._next_chunk_id = next_chunk_id
        self._lane_tokens = lane_tokens
        self._stopped = stopped
        self._i64[il.POS] = positions
        self._i64[il.TOK] = tokens
        self._i64[il.RECV] = received
        self._f64[il.CARRY] = carry
        self._i64[il.NLEN] = -1
        self._vtime = vtime
        self._set_weights(position)
        self._rebuild()

    def _unpack(self, data: Any, k: int, what: str) -> np.ndarray:
        try:
            return unpack_ints(data, k, what)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (this source has {k}: {list(self._names)[:8]})") from e

    def remapped_state(
        self,
        state: Mapping[str, Any],
        old_names: Sequence[str],
        kept: Mapping[str, str],
    ) -> dict[str, Any]:
        """A lane's state saved by a source over other components (``old_names``), for
        this one: what ``pipeline.restore(allow_mixture_change=True)`` loads.

        ``kept`` maps each of this source's names whose dataset stays to its old name:
        those keep their position and tokens; every other component starts at its
        beginning. The interleave starts afresh at the lane's progress (the new weights
        from now on); the chunk id and the lane's tokens go on.

        Raises:
            CheckpointError: the state is not a readable state of ``len(old_names)``
                components.
        """
        if not isinstance(state, Mapping):
            raise CheckpointError(f"work source state must be a dict; got {type(state).__name__}")
        count = len(old_names)
        positions = self._unpack(state.get("positions"), count, "positions")
        tokens = self._unpack(state.get("tokens"), count, "tokens")
        new_pos = np.zeros(self.num_components, dtype=np.int64)
        new_tok = np.zeros(self.num_components, dtype=np.int64)
        index = {n: c for c, n in enumerate(old_names)}
        for c, name in enumerate(self._names):
            if name in kept:
                new_pos[c] = positions[index[kept[name]]]
                new_tok[c] = tokens[index[kept[name]]]
        next_chunk_id = _checked_count("next_chunk_id", state.get("next_chunk_id"))
        lane_tokens = _checked_count("lane_tokens", state.get("lane_tokens"))
        position = 0
        if self._schedule is not None:
            position = next_chunk_id if self._schedule.unit == "chunks" else lane_tokens
        fresh = self.for_lane(self._lane, self._num_lanes)
        fresh._i64[il.POS] = new_pos
        fresh._i64[il.TOK] = new_tok
        fresh._next_chunk_id = next_chunk_id
        fresh._lane_tokens = lane_tokens
        fresh._set_weights(position)
        fresh._i64[il.RECV] = 0  # the interleave's origin: now
        fresh._vtime = 0.0
        weighted = fresh._f64[il.W] > 0
        fresh._stopped = self._on_exhausted == "stop" and bool(
            np.any(weighted & fresh._exhausted_mask())
        )
        return fresh.state_dict()

    def __repr__(self) -> str:
        extra = ""
        if self._weight_unit != "samples":
            extra += f", weight_unit={self._weight_unit!r}"
        if self._schedule is not None:
            extra += f", schedule={self._schedule!r}"
        if self._on_exhausted != "renormalize":
            extra += f", on_exhausted={self._on_exhausted!r}"
        return (
            f"{type(self).__name__}(names={self._names}, lengths={self._lengths}, "
            f"weights={self._weights}, seed={self._seed}, shuffle={self._shuffle}, "
            f"chunk_size={self._chunk_size}, num_epochs={self._num_epochs}{extra}, "
            f"lane={self._lane}, num_lanes={self._num_lanes})"
        )


def _checked_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"state {name} must be a non-negative int; got {value!r}")
    return value
