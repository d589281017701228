"""What an executor is given and what it owes: the seam between the engine and the runners.

The engine owns the lanes' trackers (what is in flight, what was delivered, the replay
cursors); an executor runs the plan over the lanes and hands back their outputs. It gets
everything it needs as values in a :class:`LaneRun`, never the engine itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from zephon.records import SampleCursor
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
    """

    lanes: list[int]
    pull: Pull
    targets: dict[int, SampleCursor]
    start_lane: int
    done: list[int]
    stopping: threading.Event
    pad_ended: bool = False


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
