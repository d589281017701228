"""What an executor is given and what it owes: the seam between the engine and the runners.

The engine owns the lanes' trackers (what is in flight, what was delivered, the replay
cursors); an executor runs the plan over the lanes and hands back their outputs. It gets
everything it needs as values in a :class:`LaneRun`, never the engine itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from zephon.records import FlushSentinel, SampleCursor
from zephon.runners.chain import LaneOutput
from zephon.runners.lanes import Pull


@dataclass(frozen=True)
class LaneRun:
    """What an executor runs.

    Attributes:
        lanes: the rank's lanes, ascending.
        pull: a lane's next feed unit, under the engine's lock.
        targets: after a restore, each replaying lane's replay target.
        start_lane: whose turn the consumer's next output is.
        done: lanes whose end was delivered already.
        stopping: set when the engine closes: nothing may wait on a worker after it.
        pad_ended: in lockstep, go on until every lane ended, padding the ended ones
            (``batch(pad_last=True)``; see :func:`~zephon.runners.lanes.schedule`).
        inflight: a lane's chunks that were pulled and are still in flight, as feed units
            (see :func:`pulled_inflight`), under the engine's lock: what an executor that
            moves a lane replays to run it again elsewhere.
    """

    lanes: list[int]
    pull: Pull
    targets: dict[int, SampleCursor]
    start_lane: int
    done: list[int]
    stopping: threading.Event
    pad_ended: bool = False
    inflight: Callable[[int], list[list[Any]]] | None = None


class Executor(Protocol):
    """Runs a plan over a rank's lanes: in this process, or in worker processes."""

    #: Where the operators run, as ``stats()`` reports it.
    place: str

    def start(self, run: LaneRun) -> None: ...

    def next_output(self, lane: int) -> LaneOutput:
        """``lane``'s next output, in the lane's order (the engine asks in output order)."""
        ...

    def extra_stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def pulled_inflight(tracker: Any) -> list[list[Any]]:
    """A :class:`~zephon.tracking.tracker.LaneTracker`'s chunks that were pulled and are
    still in flight, as feed units: each chunk, followed by a flush sentinel where the lane
    has a boundary after it (as a restore replays them). Chunks a restore has not handed
    out again yet are left out: they are still to come from ``pull``."""
    waiting = {it.chunk_id for it in tracker.replay if not isinstance(it, FlushSentinel)}
    bounds = set(tracker.boundaries)
    units: list[list[Any]] = []
    for chunk_id, track in tracker.inflight.items():
        if chunk_id in waiting:
            continue
        unit: list[Any] = [track.chunk]
        if chunk_id + 1 in bounds:
            unit.append(FlushSentinel(tracker.lane, chunk_id + 1))
        units.append(unit)
    return units
