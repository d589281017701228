"""One lane of a mixture as it runs: where it stands in the interleave, how it deals a
chunk, how it follows a Schedule, and its checkpoint state.

A :class:`~zephon.StaticMixtureWorkSource` holds what all its lanes share, built once as
:class:`LaneInputs` (the datasets' sizes and lengths, the weights, the seed, the flags); a
:class:`MixtureLane` holds what one lane has done over the arrays of
:mod:`zephon.work_sources.interleave` (the C functions or their Python twins do the work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.chunks import WorkChunk
from zephon.work_sources import interleave as il
from zephon.work_sources.lane_state import STATE_VERSION, pack_carry, pack_counts, read_state
from zephon.work_sources.lengths import ComponentLengths
from zephon.work_sources.schedule import Schedule

__all__ = ["LaneInputs", "MixtureLane"]

#: ``zephon._permute.mixture_counts``: a lane state's four packed counts in one call
#: (:func:`~zephon.work_sources.lane_state.pack_counts` and ``pack_carry`` in C).
_COUNTS = getattr(il._NATIVE, "mixture_counts", None)


@dataclass(frozen=True, eq=False, slots=True)
class LaneInputs:
    """What every lane of one mixture runs on; made once per source and shared by its
    lanes (never copied per lane)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    epochs: tuple[int | None, ...]
    schedule: Schedule | None
    vectors: list[np.ndarray]
    table: il.LengthTable
    seed: int  # the source's seed as the unsigned 64 bits the interleave takes
    flags: int
    chunk_size: int
    all_lengths: bool
    has_lengths: bool

    @classmethod
    def build(
        cls,
        names: tuple[str, ...],
        sizes: tuple[int, ...],
        epochs: tuple[int | None, ...],
        schedule: Schedule | None,
        vectors: list[np.ndarray],
        token_lengths: tuple[ComponentLengths | None, ...],
        seed: int,
        shuffle: bool,
        chunk_size: int,
        weight_unit: str,
        on_exhausted: str,
    ) -> LaneInputs:
        codes = np.array(
            [
                il.length_code(None if t is None else t.array, t is not None and t.offsets)
                for t in token_lengths
            ],
            dtype=np.uint8,
        )
        table = il.LengthTable(
            tuple(None if t is None else t.array for t in token_lengths),
            codes,
            np.array([il.component_key(n) for n in names], dtype=np.uint64),
        )
        flags = (
            (il.FLAG_SHUFFLE if shuffle else 0)
            | (il.FLAG_TOKEN_UNITS if weight_unit == "tokens" else 0)
            | (il.FLAG_STOP_ON_EXHAUST if on_exhausted == "stop" else 0)
        )
        return cls(
            names,
            sizes,
            epochs,
            schedule,
            vectors,
            table,
            seed & 0xFFFFFFFFFFFFFFFF,
            flags,
            chunk_size,
            all(t is not None for t in token_lengths),
            any(t is not None for t in token_lengths),
        )

    @property
    def token_units(self) -> bool:
        """Whether the weights share out tokens (else samples)."""
        return bool(self.flags & il.FLAG_TOKEN_UNITS)

    @property
    def stop_on_exhausted(self) -> bool:
        return bool(self.flags & il.FLAG_STOP_ON_EXHAUST)


class MixtureLane:
    """Lane ``lane`` of ``num_lanes`` of a mixture, at the start of its stream.

    ``f64``, ``i64`` and ``heaps`` are the interleave's arrays (see
    :mod:`zephon.work_sources.interleave`); the rest is the lane's progress: the next chunk's
    id, its tokens, where the weights were last looked up, the virtual time.
    """

    # Slots: a checkpoint of a rank of thousands of lanes reads every lane that dealt a
    # chunk since the last one, each cold; a slot is read from the object itself.
    __slots__ = (
        "inputs",
        "lane",
        "num_lanes",
        "f64",
        "i64",
        "heaps",
        "_vtime",
        "_out",
        "next_chunk_id",
        "_lane_tokens",
        "_schedule_position",
        "_segment",
        "_stopped",
        "_state",
        "_eligible",
        "_waiting",
        "_weight_sum",
    )

    def __init__(self, inputs: LaneInputs, lane: int, num_lanes: int) -> None:
        self.inputs = inputs
        self.lane, self.num_lanes = lane, num_lanes
        k = len(inputs.sizes)
        self.f64 = np.zeros((il.F64_ROWS, k), dtype=np.float64)
        self.i64 = np.zeros((il.I64_ROWS, k), dtype=np.int64)
        self.i64[il.NLEN] = -1
        self.i64[il.SIZE] = inputs.sizes
        self.i64[il.LIMIT] = [
            -1 if e is None else max(0, -(-(e * n - lane) // num_lanes))
            for e, n in zip(inputs.epochs, inputs.sizes, strict=True)
        ]
        self.heaps = np.zeros((2, k), dtype=np.int32)
        self._vtime = 0.0
        self._out = np.empty((3, inputs.chunk_size), dtype=np.int64)
        self.next_chunk_id = 0
        self._lane_tokens = 0
        self._schedule_position = 0
        self._stopped = False
        self._state: dict[str, Any] | None = None  # state_dict() until the lane changes
        self._set_weights(0)
        self._stopped = inputs.stop_on_exhausted and bool(
            np.any((self.f64[il.W] > 0) & self._exhausted_mask())
        )
        self._rebuild()

    def _exhausted_mask(self) -> np.ndarray:
        limits = self.i64[il.LIMIT]
        return (limits >= 0) & (self.i64[il.POS] >= limits)

    def _rebuild(self) -> None:
        inputs = self.inputs
        self._eligible, self._waiting, self._weight_sum = il.rebuild(
            self.f64,
            self.i64,
            self.heaps,
            inputs.table,
            self.lane,
            self.num_lanes,
            inputs.seed,
            inputs.flags,
            self._vtime,
        )

    def _set_weights(self, position: int) -> None:
        """The weights at schedule ``position`` into the weight row (no rebase)."""
        schedule = self.inputs.schedule
        self._state = None
        self._schedule_position = position
        if schedule is None:
            self.f64[il.W] = self.inputs.vectors[0]
            self._segment = 0
        else:
            self.f64[il.W] = schedule.weights_at(self.inputs.vectors, position)
            self._segment = schedule.segment(position)

    def _progress(self) -> int:
        assert self.inputs.schedule is not None
        return self.next_chunk_id if self.inputs.schedule.unit == "chunks" else self._lane_tokens

    def _follow_schedule(self) -> None:
        """Before a chunk: the weights at the lane's progress; if they changed, move the
        interleave's origin (see :func:`~zephon.work_sources.interleave.rebase`)."""
        schedule = self.inputs.schedule
        assert schedule is not None
        position = self._progress()
        segment = schedule.segment(position)
        last = segment == len(schedule.positions) - 1
        if segment == self._segment and (schedule.interpolate == "step" or last):
            return
        new = schedule.weights_at(self.inputs.vectors, position)
        if np.array_equal(new, self.f64[il.W]):
            self._segment = segment
            return
        il.rebase(self.f64, self.i64, self.heaps, self._eligible, self._waiting, self._vtime, new)
        self._vtime = 0.0
        self._schedule_position = position
        self._segment = segment
        self._rebuild()

    # ---------------------------------------------------------------------------- stream

    def next_chunk(self) -> WorkChunk | None:
        """The lane's next chunk, or None once it is exhausted (see
        :meth:`~zephon.StaticMixtureWorkSource.next_chunk`)."""
        self._state = None
        if self._stopped:
            return None
        inputs = self.inputs
        if inputs.schedule is not None:
            self._follow_schedule()
        if self._eligible + self._waiting == 0:
            return None
        chunk_id = self.next_chunk_id
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
            self.f64,
            self.i64,
            self.heaps,
            inputs.table,
            out,
            inputs.chunk_size,
            self._eligible,
            self._waiting,
            self._vtime,
            self._weight_sum,
            self.lane,
            self.num_lanes,
            inputs.seed,
            chunk_id,
            inputs.flags,
        )
        if exhausted >= 0:
            self._stopped = True
        # The arrays as the bytes a checkpoint stores (WorkChunk.of_bytes).
        chunk = WorkChunk.of_bytes(
            self.lane,
            chunk_id,
            out[0, :picked].astype("<i4").tobytes(),
            out[1, :picked].astype("<i8", copy=False).tobytes(),
            chunk_seed,
        )
        if inputs.all_lengths:
            self._lane_tokens += int(out[2, :picked].sum())
        elif inputs.has_lengths:
            codes = inputs.table.codes[chunk.components]
            self._lane_tokens += int(out[2, :picked][codes != 0].sum())
        self.next_chunk_id = chunk_id + 1
        # The state now, while the lane's arrays are in the cache (0.6 us): made at the
        # next checkpoint instead it reads them cold, 3 us a lane, and a rank of thousands
        # of lanes checkpoints every lane that dealt since the last (see LaneTracker.state).
        self._state = self._make_state()
        return chunk

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The lane's state (see :mod:`zephon.work_sources.lane_state`). Shared with later
        calls until the lane deals a chunk or is loaded: read it, never change it in
        place (a rank of thousands of lanes checkpoints only the lanes that moved)."""
        if self._state is None:
            self._state = self._make_state()
        return self._state

    def _make_state(self) -> dict[str, Any]:
        if _COUNTS is not None:  # the four packed entries in one C call
            positions, tokens, received, carry = _COUNTS(
                self.f64, self.i64, self.inputs.token_units
            )
        else:
            i64 = self.i64
            positions, tokens, received = pack_counts(
                i64[il.POS], i64[il.TOK], i64[il.RECV], self.inputs.token_units
            )
            carry = pack_carry(self.f64[il.CARRY])
        return {
            "version": STATE_VERSION,
            "lane": self.lane,
            "num_lanes": self.num_lanes,
            "next_chunk_id": self.next_chunk_id,
            "lane_tokens": self._lane_tokens,
            "schedule_position": self._schedule_position,
            "virtual_time": self._vtime,
            "positions": positions,
            "tokens": tokens,
            "received": received,
            "carry": carry,
            "stopped": self._stopped,
        }

    def load_state_dict(self, state: Any) -> None:
        """Continue exactly where the lane that saved ``state`` stood (checked by
        :func:`~zephon.work_sources.lane_state.read_state`)."""
        inputs = self.inputs
        self._state = None
        saved = read_state(
            state, self.lane, self.num_lanes, inputs.names, inputs.schedule, inputs.token_units
        )
        self.next_chunk_id = saved.next_chunk_id
        self._lane_tokens = saved.lane_tokens
        self._stopped = saved.stopped
        self.i64[il.POS] = saved.positions
        self.i64[il.TOK] = saved.tokens
        self.i64[il.RECV] = saved.received
        self.f64[il.CARRY] = saved.carry
        self.i64[il.NLEN] = -1
        self._vtime = saved.virtual_time
        self._set_weights(saved.schedule_position)
        self._rebuild()

    def restarted_state(
        self,
        positions: np.ndarray,
        tokens: np.ndarray,
        next_chunk_id: int,
        lane_tokens: int,
    ) -> dict[str, Any]:
        """The state of this (fresh) lane moved on to ``positions`` and ``tokens`` per
        component and the lane's progress, with the interleave's origin there: the state
        :meth:`~zephon.StaticMixtureWorkSource.remapped_state` returns. Leaves this lane to
        be dropped (its heaps are not rebuilt)."""
        self._state = None
        self.i64[il.POS] = positions
        self.i64[il.TOK] = tokens
        self.next_chunk_id = next_chunk_id
        self._lane_tokens = lane_tokens
        self._set_weights(0 if self.inputs.schedule is None else self._progress())
        self.i64[il.RECV] = 0  # the interleave's origin: now
        self._vtime = 0.0
        weighted = self.f64[il.W] > 0
        self._stopped = self.inputs.stop_on_exhausted and bool(
            np.any(weighted & self._exhausted_mask())
        )
        return self.state_dict()

    # -------------------------------------------------------------------------- reading

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(self.i64[il.POS].tolist())

    @property
    def tokens_dealt(self) -> tuple[int, ...]:
        return tuple(self.i64[il.TOK].tolist())

    @property
    def current_weights(self) -> tuple[float, ...]:
        return tuple(self.f64[il.W].tolist())
