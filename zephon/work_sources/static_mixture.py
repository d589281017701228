"""StaticMixtureWorkSource: a fixed-weight mixture of random-access datasets, one lane of it.

Per component ``c`` (dataset of length ``N``) the global sample stream is the concatenation
of dataset epochs ``e = 0, 1, 2, …``, epoch ``e`` being ``permute(range(N), N, key=mix64(seed,
c, e))`` (the identity without shuffling). Lane ``l`` of ``L`` takes global positions
``g = l + p * L`` for ``p = 0, 1, 2, …`` — so the lanes are disjoint within every dataset
epoch, together cover it, and every lane gets samples even when ``N < L``. Sample ``p`` of
the lane is ``permute(g % N, N, mix64(seed, c, g // N))``.

Components are interleaved by smooth weighted round robin (nginx's): no random draws, so
every window of the stream tracks the weights, and the whole mixture state is one float
per component. With ``num_epochs=E`` a component is exhausted for the lane once
``g >= E * N``; it then leaves the round robin and the others share its place.

State is ``(next_chunk_id, p per component, round-robin currents, exhausted flags)``:
constant size, and restoring it costs nothing whatever the position.
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
from zephon.work_sources.base import RandomAccessDataset
from zephon.work_sources.permutation import mix64, permute_runs

__all__ = ["StaticMixtureWorkSource"]

STATE_VERSION = 1
_STATE_KEYS = (
    "version",
    "lane",
    "num_lanes",
    "next_chunk_id",
    "positions",
    "current",
    "exhausted",
)

Datasets = Sequence[RandomAccessDataset] | Mapping[str, RandomAccessDataset]
Weights = Sequence[float] | Mapping[str, float] | np.ndarray | None


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


_AHEAD = 1024  # positions per component computed at once (see _sample_indices)
#: ... but no more dataset epochs of the lane than this: a lane of many that gets a few
#: samples per dataset epoch would otherwise compute (and keep) hundreds of epochs ahead.
_EPOCHS_AHEAD = 8


class StaticMixtureWorkSource:
    """One lane of a fixed-weight mixture of random-access datasets.

    Args:
        datasets: a list/tuple of datasets (anything with ``__len__`` and ``__getitem__``),
            named ``"0"``, ``"1"``, …; or a dict name -> dataset. Component ``c`` is the
            position in the list, or in the dict's order.
        weights: one non-negative finite weight per component (list/tuple in component
            order, or a dict with exactly the dataset names as keys when ``datasets`` is a
            dict); None means equal weights. Normalised to sum to 1. A zero-weight component
            is never drawn and may be empty.
        seed: seeds the per-epoch permutations and the per-chunk seeds.
        shuffle: permute every dataset epoch; False reads each dataset in order.
        chunk_size: pointers per work chunk (the last chunk of an exhausted lane may be
            shorter).
        num_epochs: passes over every dataset (counted over all lanes together) before the
            lane is exhausted; None repeats forever.
        lane: this source's lane, ``0 <= lane < num_lanes``.
        num_lanes: the number of lanes the stream is dealt across.

    Raises:
        ValueError: mismatched datasets/weights, a negative or non-finite weight, weights
            summing to zero, an empty dataset with positive weight, ``chunk_size < 1``,
            ``num_epochs < 1``, or a lane out of range.
        TypeError: a dataset without ``__len__``/``__getitem__``, or a non-int parameter.
    """

    def __init__(
        self,
        datasets: Datasets,
        weights: Weights = None,
        seed: int = 0,
        shuffle: bool = True,
        chunk_size: int = 64,
        num_epochs: int | None = None,
        *,
        lane: int = 0,
        num_lanes: int = 1,
    ) -> None:
        names, dsets = self._check_datasets(datasets)
        raw_weights = self._check_weights(weights, datasets, names)
        lengths = []
        for c, (name, ds) in enumerate(zip(names, dsets, strict=True)):
            n = len(ds)
            if n == 0 and raw_weights[c] > 0:
                raise ValueError(
                    f"dataset {name!r} (component {c}) is empty but has weight "
                    f"{raw_weights[c]!r}; give it weight 0 or remove it"
                )
            lengths.append(int(n))

        seed = _as_int("seed", seed)
        if not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits (msgpack-able); got seed={seed}")
        chunk_size = _as_int("chunk_size", chunk_size)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; got chunk_size={chunk_size}")
        if num_epochs is not None:
            num_epochs = _as_int("num_epochs", num_epochs)
            if num_epochs < 1:
                raise ValueError(
                    f"num_epochs must be >= 1, or None to repeat forever; got "
                    f"num_epochs={num_epochs}"
                )

        self._names: tuple[str, ...] = names
        self._datasets: tuple[RandomAccessDataset, ...] = dsets
        self._lengths: tuple[int, ...] = tuple(lengths)
        self._weights: tuple[float, ...] = self._normalise(raw_weights)
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._chunk_size = chunk_size
        self._num_epochs = num_epochs
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
                f"weights must be a list/tuple, a dict name -> weight, or None; got "
                f"{type(weights).__name__}"
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
        # Samples this lane may take from each component before it is exhausted.
        self._limits: tuple[int, ...] | None = None
        if self._num_epochs is not None:
            self._limits = tuple(
                max(0, -(-(self._num_epochs * n - self._lane) // self._num_lanes))
                for n in self._lengths
            )
        self._next_chunk_id = 0
        self._ahead: dict[int, tuple[int, np.ndarray]] = {}
        self._positions = [0] * self.num_components
        self._current = [0.0] * self.num_components
        self._exhausted = [self._is_exhausted(c, 0) for c in range(self.num_components)]
        self._refresh_active()

    def _is_exhausted(self, c: int, position: int) -> bool:
        return self._limits is not None and position >= self._limits[c]

    def _refresh_active(self) -> None:
        self._active = [
            c for c in range(self.num_components) if self._weights[c] > 0 and not self._exhausted[c]
        ]
        # Summed in component order, so a restored source gets the very same float.
        self._active_total = math.fsum(self._weights[c] for c in self._active)

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
        computed now from bounded reads.

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
        return {
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

    # ------------------------------------------------------------------------ properties

    @property
    def datasets(self) -> tuple[RandomAccessDataset, ...]:
        return self._datasets

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def lengths(self) -> tuple[int, ...]:
        return self._lengths

    @property
    def weights(self) -> tuple[float, ...]:
        """Normalised weights, summing to 1."""
        return self._weights

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
    def num_epochs(self) -> int | None:
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

    # ---------------------------------------------------------------------------- stream

    def _sample_indices(self, c: int, positions: np.ndarray) -> np.ndarray:
        """Dataset indices of this lane's consecutive samples ``positions`` of component c.

        Computed a block of ``_AHEAD`` positions at a time and sliced: one permutation of a
        thousand positions costs about what one of sixty does. The block is derived data,
        never state: a restored source recomputes it on demand.
        """
        start, k = int(positions[0]), len(positions)
        block = self._ahead.get(c)
        if block is None or not block[0] <= start or start + k > block[0] + len(block[1]):
            per_epoch = -(-self._lengths[c] // self._num_lanes)  # this lane's, about
            ahead = max(k, min(_AHEAD, _EPOCHS_AHEAD * per_epoch))
            span = np.arange(start, start + ahead, dtype=np.int64)
            block = self._ahead[c] = (start, self._compute_indices(c, span))
        return block[1][start - block[0] : start - block[0] + k]

    def _compute_indices(self, c: int, positions: np.ndarray) -> np.ndarray:
        n = self._lengths[c]
        g = self._lane + positions * self._num_lanes
        within = g % n
        if not self._shuffle:
            return within
        epochs = g // n  # ascending: positions ascend
        starts = [0, *(np.flatnonzero(np.diff(epochs)) + 1).tolist()]
        keys = [mix64(self._seed, c, e) for e in epochs[starts].tolist()]
        return permute_runs(within, n, keys, starts)

    def _weighted_picks(self) -> tuple[np.ndarray, np.ndarray]:
        comps: list[int] = []
        positions: list[int] = []
        pos, current, weights = self._positions, self._current, self._weights
        active, total = self._active, self._active_total
        for _ in range(self._chunk_size):
            # One smooth-weighted-round-robin pick over the active components.
            best, best_value = -1, -math.inf
            for c in active:
                value = current[c] + weights[c]
                current[c] = value
                if value > best_value:  # strict: ties go to the lowest component
                    best, best_value = c, value
            current[best] -= total
            p = pos[best]
            comps.append(best)
            positions.append(p)
            pos[best] = p + 1
            if self._limits is not None and p + 1 >= self._limits[best]:
                self._exhausted[best] = True
                current[best] = 0.0
                self._refresh_active()
                active, total = self._active, self._active_total
                if not active:
                    break
        return np.asarray(comps, dtype=np.int32), np.asarray(positions, dtype=np.int64)

    def _single_component_picks(self) -> tuple[np.ndarray, np.ndarray]:
        """What ``_weighted_picks`` does when one component is left, without a loop."""
        (c,) = self._active
        p = self._positions[c]
        k = self._chunk_size
        if self._limits is not None:
            k = min(k, self._limits[c] - p)
        # Each pick adds the weight and takes the total back off; in floating point that
        # is usually a fixed point, and when it is not the steps are replayed exactly.
        w, total, cur = self._weights[c], self._active_total, self._current[c]
        if (cur + w) - total != cur:
            for _ in range(k):
                cur = (cur + w) - total
        self._current[c] = cur
        self._positions[c] = p + k
        if self._is_exhausted(c, p + k):
            self._exhausted[c] = True
            self._current[c] = 0.0
            self._refresh_active()
        return np.full(k, c, dtype=np.int32), np.arange(p, p + k, dtype=np.int64)

    def next_chunk(self) -> WorkChunk | None:
        """The lane's next chunk of up to ``chunk_size`` pointers, or None once every
        component is exhausted."""
        if not self._active:
            return None
        if len(self._active) == 1:
            components, pos = self._single_component_picks()
            # A copy: the chunk must not share memory with the source's index cache.
            indices = self._sample_indices(int(components[0]), pos).copy()
        else:
            components, pos = self._weighted_picks()
            indices = np.empty(len(components), dtype=np.int64)
            for c in set(components.tolist()):
                sel = components == c
                indices[sel] = self._sample_indices(c, pos[sel])
        chunk_id = self._next_chunk_id
        self._next_chunk_id += 1
        return WorkChunk(
            self._lane, chunk_id, components, indices, mix64(self._seed, self._lane, chunk_id)
        )

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "lane", "num_lanes", "next_chunk_id", "positions", "current",
        "exhausted"}``: one int/float/bool per component, whatever the progress."""
        return {
            "version": STATE_VERSION,
            "lane": self._lane,
            "num_lanes": self._num_lanes,
            "next_chunk_id": self._next_chunk_id,
            "positions": list(self._positions),
            "current": list(self._current),
            "exhausted": list(self._exhausted),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the source that saved ``state`` stood. O(1).

        Raises:
            CheckpointError (a ValueError): unknown version, missing or unknown keys, a
                state for another lane / lane count / number of components, or values
                inconsistent with this source's parameters.
        """
        if not isinstance(state, Mapping):
            raise CheckpointError(
                f"StaticMixtureWorkSource state must be a dict; got {type(state).__name__}"
            )
        if "version" not in state or state["version"] != STATE_VERSION:
            raise CheckpointError(
                f"unknown StaticMixtureWorkSource state version {state.get('version')!r}; "
                f"this Zephon reads version {STATE_VERSION}"
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
        positions, current, exhausted = state["positions"], state["current"], state["exhausted"]
        for key, value in (
            ("positions", positions),
            ("current", current),
            ("exhausted", exhausted),
        ):
            if not isinstance(value, list):
                raise CheckpointError(
                    f"state {key} must be a list (one entry per component); got "
                    f"{type(value).__name__} {value!r:.80}"
                )
        k = self.num_components
        if not (len(positions) == len(current) == len(exhausted) == k):
            raise CheckpointError(
                f"state is for {len(positions)} components (current: {len(current)}, "
                f"exhausted: {len(exhausted)}) but this source has {k} ({list(self._names)})"
            )
        next_chunk_id = _checked_count("next_chunk_id", state["next_chunk_id"])
        new_positions = [_checked_count(f"positions[{c}]", p) for c, p in enumerate(positions)]
        if not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
            for x in current
        ):
            raise CheckpointError(f"state current must be finite floats; got {current!r:.200}")
        new_current = [float(x) for x in current]
        if not all(isinstance(x, bool) for x in exhausted):
            raise CheckpointError(f"state exhausted must be bools; got {exhausted!r:.200}")
        new_exhausted = list(exhausted)
        for c in range(k):
            expected = self._is_exhausted(c, new_positions[c])
            if new_exhausted[c] != expected:
                raise CheckpointError(
                    f"state says component {c} ({self._names[c]!r}) exhausted="
                    f"{new_exhausted[c]} at position {new_positions[c]}, but with "
                    f"num_epochs={self._num_epochs} it is exhausted={expected}; the state is "
                    f"from a source with other parameters"
                )
        self._next_chunk_id = next_chunk_id
        self._positions = new_positions
        self._ahead = {}  # derived data; cheap to rebuild
        self._current = new_current
        self._exhausted = new_exhausted
        self._refresh_active()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(names={self._names}, lengths={self._lengths}, "
            f"weights={self._weights}, seed={self._seed}, shuffle={self._shuffle}, "
            f"chunk_size={self._chunk_size}, num_epochs={self._num_epochs}, "
            f"lane={self._lane}, num_lanes={self._num_lanes})"
        )


def _checked_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"state {name} must be a non-negative int; got {value!r}")
    return value
