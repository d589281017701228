"""``ensure_mixture``: correct the mixture so each component's *token* share tracks its weight.

Records wait in one queue per component (a packed record belongs to the component that
gave it most tokens). Whenever every positive-weight component has a record waiting, or
more than ``buffer_size`` records wait, the record from the component with the largest
deficit ``w_c * emitted_total - emitted_c`` goes out. Deficits are counted in the records'
``mix`` (tokens once tokenized) and reset with the lane at every flush.

After ``restore(allow_mixture_change=True)`` the pipeline may :meth:`EnsureMixture.hold` a
lane's old weights until the flush that ends the epochs being replayed, so that the
replayed records come out in the order they did before the restore.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zephon._args import positive_int
from zephon.operators.base import LaneStateOperator, OpTraits, Output, PipelineContext
from zephon.records import FlushSentinel, Record


class _Mix:
    __slots__ = ("queues", "emitted", "total", "waiting")

    def __init__(self, n: int) -> None:
        self.queues: list[deque[Record]] = [deque() for _ in range(n)]
        self.emitted = [0] * n
        self.total = 0
        self.waiting = 0


class EnsureMixture(LaneStateOperator):
    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    name = "ensure_mixture"

    def __init__(
        self, weights: Sequence[float] | Mapping[str, float] | None = None, buffer_size: int = 16
    ) -> None:
        super().__init__()
        buffer_size = positive_int("ensure_mixture(buffer_size=...)", buffer_size)
        if weights is None or isinstance(weights, Mapping):
            self.weights: Any = (
                None if weights is None else {str(k): float(v) for k, v in weights.items()}
            )
        else:
            self.weights = tuple(float(w) for w in weights)
        self.buffer_size = buffer_size
        self._w: tuple[float, ...] = ()
        self._active: tuple[int, ...] = ()
        # lane -> [(flush chunk id it holds until, weights, active components), ...]; hold()
        self._held: dict[int, list[tuple[int, tuple[float, ...], tuple[int, ...]]]] = {}
        self._releasing: dict[int, int] = {}  # lane -> boundary of the flush under way

    def bind(self, ctx: PipelineContext) -> None:
        weights = self.weights if self.weights is not None else ctx.weights
        if weights is None:
            raise ValueError(
                "ensure_mixture() has no weights: the work source has none; pass ensure_mixture(weights=[...])"
            )
        if isinstance(weights, Mapping):
            names = list(ctx.names)
            if sorted(weights) != sorted(names):
                raise ValueError(
                    f"ensure_mixture weights name {sorted(weights)} but the work source's datasets "
                    f"are {names}; give one weight per dataset name"
                )
            weights = [weights[n] for n in names]
        weights = list(weights)
        if ctx.num_components and len(weights) != ctx.num_components:
            raise ValueError(
                f"ensure_mixture: {len(weights)} weights for {ctx.num_components} components; "
                "give one weight per dataset of the work source"
            )
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"ensure_mixture weights must be finite, non-negative and sum to > 0; got {weights}"
            )
        s = sum(weights)
        self._w = tuple(w / s for w in weights)
        self._active = tuple(i for i, w in enumerate(self._w) if w > 0)

    def hold(self, held: Mapping[int, Sequence[tuple[int, Sequence[float]]]]) -> None:
        """Per lane, weights (in this pipeline's component order) to use instead of the
        bound ones until the flush sentinel of chunk ``until`` (or a later one) has passed:
        ``{lane: [(until, weights), ...]}`` in ascending ``until``; replaces what was held.
        A hook for ``Pipeline.restore(allow_mixture_change=True)``."""
        self._held = {
            lane: [
                (int(until), tuple(w), tuple(c for c, x in enumerate(w) if x > 0))
                for until, w in entries
            ]
            for lane, entries in held.items()
            if entries
        }
        self._releasing = {}

    def _weights(self, lane: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
        held = self._held.get(lane) if self._held else None
        return (self._w, self._active) if not held else (held[0][1], held[0][2])

    def on_sentinel(self, sentinel: FlushSentinel) -> None:
        held = self._held.get(sentinel.lane) if self._held else None
        if held:
            self._releasing[sentinel.lane] = -1 if sentinel.final else sentinel.boundary

    def _state(self, lane: int) -> _Mix:
        st = self._lanes.get(lane)
        if st is None:
            st = self._lanes[lane] = _Mix(len(self._w))
        return st

    def process(self, record: Record) -> Iterable[Output]:
        st = self._state(record.lane)
        mix = record.component_tokens
        comp = max(mix, key=lambda c: (mix[c], -c)) if len(mix) > 1 else next(iter(mix))
        if not 0 <= comp < len(self._w):
            raise ValueError(
                f"ensure_mixture: record of component {comp}, but weights cover {len(self._w)} components"
            )
        st.queues[comp].append(record)
        st.waiting += 1
        out: list[Output] = []
        w, active = self._weights(record.lane)
        while st.waiting and (st.waiting > self.buffer_size or all(st.queues[c] for c in active)):
            out.append(self._pop(st, w))
        return out

    def _pop(self, st: _Mix, w: tuple[float, ...]) -> Record:
        total, emitted = st.total, st.emitted
        best, best_deficit = -1, -math.inf
        for c, q in enumerate(st.queues):
            if q:
                deficit = w[c] * total - emitted[c]
                if deficit > best_deficit:
                    best, best_deficit = c, deficit
        rec = st.queues[best].popleft()
        st.waiting -= 1
        for c, n in rec.component_tokens.items():
            emitted[c] += n
            st.total += n
        return rec

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        st = self._lanes.get(lane_id)
        if st is None:
            if reset:
                self._release(lane_id)
            return ()
        w, _ = self._weights(lane_id)
        out = [self._pop(st, w) for _ in range(st.waiting)]
        if reset:
            del self._lanes[lane_id]
            self._release(lane_id)
        return out

    def _release(self, lane_id: int) -> None:
        boundary = self._releasing.pop(lane_id, None)
        if boundary is None:
            return
        held = [h for h in self._held.get(lane_id, []) if boundary >= 0 and h[0] > boundary]
        if held:
            self._held[lane_id] = held
        else:
            self._held.pop(lane_id, None)

    def fresh(self) -> EnsureMixture:
        clone = super().fresh()
        assert isinstance(clone, EnsureMixture)
        clone._held = {lane: list(entries) for lane, entries in self._held.items()}
        clone._releasing = {}
        return clone

    def pending(self, lane_id: int) -> int:
        st = self._lanes.get(lane_id)
        return 0 if st is None else st.waiting

    def fingerprint(self) -> str:
        return f"EnsureMixture(weights={list(self._w)}, buffer_size={self.buffer_size})"

    def __repr__(self) -> str:
        return f"EnsureMixture(weights={self.weights}, buffer_size={self.buffer_size})"
