"""``Schedule``: mixture weights that change with each lane's own progress.

A lane's progress is what it has dealt itself: its chunks (``unit="chunks"``: the id of the
chunk it makes next) or its tokens (``unit="tokens"``: the token count of every sample it
has dealt). Never the step, the wall clock or another lane: so the stream stays a pure
function of the lane, and a checkpoint restores it exactly into any world size.

Weights are looked up once per chunk, at the progress the chunk starts at; a chunk never
mixes two weight vectors.

Mapping training steps to lane progress. Take ``L`` lanes (``canonical_replicas``), batches
of ``batch_size`` rows of ``seq_len`` and a padding fraction ``pad`` (``pipe.stats()`` or the
benchmarks show it; a few percent when packing). With ``output="interleave"`` a step delivers
one lane's batch, so by step ``S`` each lane has delivered ``S / L`` batches, about ``S *
batch_size * seq_len * (1 - pad) / L`` real tokens; with ``output="lockstep"`` a step holds a
batch of every lane: ``S * batch_size * seq_len * (1 - pad)`` tokens per lane. A boundary meant
for step ``S`` therefore goes at that many lane tokens (``unit="tokens"``), or at that divided
by ``chunk_size`` times the mean tokens per sample (``unit="chunks"``). Lanes deal a few
chunks ahead of what is delivered (the in-flight chunks), so the new weights reach the
batches a little after the step they were meant for.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Schedule"]

UNITS = ("chunks", "tokens")
INTERPOLATIONS = ("step", "linear")


class Schedule:
    """Mixture weights as a function of each lane's own progress.

    Args:
        points: ``[(0, w0), (p1, w1), ...]``: from position ``p_i`` on, the weights are
            ``w_i`` (``"step"``), or go linearly from ``w_i`` at ``p_i`` to ``w_{i+1}`` at
            ``p_{i+1}`` (``"linear"``); after the last point they stay. Positions are ints,
            the first 0, strictly ascending. Each ``w_i`` is a list in component order or a
            dict name -> weight (all points alike); non-negative, finite, with a positive
            sum; each is normalised to sum to 1 before interpolating.
        unit: what a position counts: ``"chunks"`` (the lane's chunk id) or ``"tokens"``
            (tokens the lane has dealt; the work source must know its datasets' lengths).
        interpolate: ``"step"`` or ``"linear"``.

    Example::

        # warm up on web, then 50/50, then anneal on code after 4,000 chunks per lane
        weights = zp.Schedule(
            [(0, {"web": 1, "code": 0}), (1_000, {"web": 1, "code": 1}),
             (4_000, {"web": 1, "code": 3})],
            unit="chunks")
        src = zp.StaticMixtureWorkSource({"web": web, "code": code}, weights)

    Raises:
        ValueError: no points, a first position other than 0, positions not ascending,
            weights of other shapes or keys, a negative or non-finite weight, weights
            summing to zero, an unknown unit or interpolation.
        TypeError: a position that is not an int, weights that are not a list or dict.
    """

    def __init__(
        self,
        points: Sequence[tuple[int, Sequence[float] | Mapping[str, float]]],
        unit: str = "chunks",
        interpolate: str = "step",
    ) -> None:
        if unit not in UNITS:
            raise ValueError(f"Schedule: unit must be one of {UNITS}; got {unit!r}")
        if interpolate not in INTERPOLATIONS:
            raise ValueError(
                f"Schedule: interpolate must be one of {INTERPOLATIONS}; got {interpolate!r}"
            )
        points = list(points)
        if not points:
            raise ValueError("Schedule needs at least one point, e.g. [(0, [0.5, 0.5])]")
        positions: list[int] = []
        raw: list[Sequence[float] | Mapping[str, float]] = []
        for i, point in enumerate(points):
            if not (isinstance(point, tuple | list) and len(point) == 2):
                raise TypeError(
                    f"Schedule point {i} must be a (position, weights) pair; got {point!r:.80}"
                )
            pos, w = point
            if isinstance(pos, bool) or not isinstance(pos, int | np.integer):
                raise TypeError(f"Schedule point {i}: position must be an int; got {pos!r}")
            positions.append(int(pos))
            raw.append(w)
        if positions[0] != 0:
            raise ValueError(
                f"Schedule: the first point must be at position 0; got {positions[0]} (add "
                "(0, weights) for the start)"
            )
        for i in range(1, len(positions)):
            if positions[i] <= positions[i - 1]:
                raise ValueError(
                    f"Schedule: positions must ascend strictly; point {i} is at {positions[i]}, "
                    f"after {positions[i - 1]}"
                )
        self._by_name = isinstance(raw[0], Mapping)
        names: tuple[str, ...] | None = None
        vectors: list[list[float]] = []
        for i, w in enumerate(raw):
            if self._by_name != isinstance(w, Mapping):
                raise TypeError(
                    f"Schedule point {i}: weights must all be dicts or all be lists; point 0 "
                    f"is a {type(raw[0]).__name__}, point {i} a {type(w).__name__}"
                )
            if isinstance(w, Mapping):
                keys = tuple(str(k) for k in w)
                if names is None:
                    names = keys
                elif sorted(keys) != sorted(names):
                    raise ValueError(
                        f"Schedule point {i} names {sorted(keys)} but point 0 names "
                        f"{sorted(names)}; every point must weigh the same components"
                    )
                values = [w[n] for n in names]
            elif isinstance(w, Sequence | np.ndarray) and not isinstance(w, str):
                values = list(w)
                if vectors and len(values) != len(vectors[0]):
                    raise ValueError(
                        f"Schedule point {i} has {len(values)} weights but point 0 has "
                        f"{len(vectors[0])}; give one weight per component at every point"
                    )
            else:
                raise TypeError(
                    f"Schedule point {i}: weights must be a list or a dict name -> weight; "
                    f"got {type(w).__name__}"
                )
            vectors.append(_normalised(values, f"Schedule point {i}"))
        self._names = names
        self._positions = positions
        self._vectors = [np.asarray(v, dtype=np.float64) for v in vectors]
        self.unit = unit
        self.interpolate = interpolate

    # ------------------------------------------------------------------ binding

    @property
    def names(self) -> tuple[str, ...] | None:
        """The component names the weights are given for (None: given as lists)."""
        return self._names

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(self._positions)

    def vectors_for(self, names: Sequence[str]) -> list[np.ndarray]:
        """Each point's normalised weights in the order of ``names`` (a work source's).

        Raises:
            ValueError: the schedule names other components, or has another count of them.
        """
        if self._names is None:
            if len(self._vectors[0]) != len(names):
                raise ValueError(
                    f"Schedule has {len(self._vectors[0])} weights per point for "
                    f"{len(names)} datasets; give one weight per dataset"
                )
            return list(self._vectors)
        missing = [n for n in names if n not in self._names]
        extra = [n for n in self._names if n not in names]
        if missing or extra:
            raise ValueError(
                f"Schedule weights must name exactly the datasets; missing {missing}, unknown "
                f"{extra}"
            )
        order = [self._names.index(n) for n in names]
        return [v[order] for v in self._vectors]

    def segment(self, position: int) -> int:
        """The index of the last point at or before ``position``."""
        return bisect.bisect_right(self._positions, position) - 1

    def weights_at(self, vectors: Sequence[np.ndarray], position: int) -> np.ndarray:
        """The weights at ``position``, from ``vectors_for``'s result. Step: the vector of
        the segment. Linear: ``w_i + (w_{i+1} - w_i) * t`` with ``t = (position - p_i) /
        (p_{i+1} - p_i)``, elementwise in float64 (the same bits on every machine)."""
        i = self.segment(position)
        if self.interpolate == "step" or i == len(self._positions) - 1:
            return vectors[i]
        lo, hi = self._positions[i], self._positions[i + 1]
        t = (position - lo) / (hi - lo)
        a, b = vectors[i], vectors[i + 1]
        out: np.ndarray = a + (b - a) * t
        out[out < 0] = 0.0  # rounding of a weight going to 0
        return out

    def config(self) -> dict[str, Any]:
        """Msgpack-able description, for the pipeline fingerprint."""
        return {
            "unit": self.unit,
            "interpolate": self.interpolate,
            "positions": list(self._positions),
            "names": None if self._names is None else list(self._names),
            "weights": [v.tolist() for v in self._vectors],
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash((self.unit, self.interpolate, tuple(self._positions)))

    def __repr__(self) -> str:
        pts = ", ".join(
            f"({p}, {dict(zip(self._names, v.tolist(), strict=True)) if self._names else v.tolist()})"
            for p, v in zip(self._positions, self._vectors, strict=True)
        )
        return f"Schedule([{pts}], unit={self.unit!r}, interpolate={self.interpolate!r})"


def not_a_number(w: Any) -> str:
    """What is wrong with weight ``w`` that ``float(w)`` would take but a weight must not be
    (a string, which ``float`` parses; a boolean, which it turns into 1.0 or 0.0), with the
    fix; "" for anything else."""
    if isinstance(w, str | bytes):
        return f"the string {w!r}: give the number itself (e.g. 0.5, not '0.5')"
    if isinstance(w, bool | np.bool_):
        return f"the boolean {bool(w)!r}: give 1.0 or 0.0 (a weight of 0 is never drawn)"
    return ""


def _normalised(values: Sequence[Any], what: str) -> list[float]:
    out = []
    for c, w in enumerate(values):
        not_number = not_a_number(w)
        if not_number:
            raise ValueError(f"{what}: weight {c} must be a number; got {not_number}")
        try:
            wf = float(w)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{what}: weight {c} must be a number; got {w!r}") from e
        if not math.isfinite(wf) or wf < 0:
            raise ValueError(f"{what}: weight {c} must be finite and >= 0; got {w!r}")
        out.append(wf)
    if not any(w > 0 for w in out):
        raise ValueError(f"{what}: weights must have a positive sum; got {out}")
    top = max(out)
    scaled = [w / top for w in out]
    total = math.fsum(scaled)
    return [w / total for w in scaled]
