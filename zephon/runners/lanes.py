"""Each lane's outputs, and the order in which the consumer takes them.

Both executors use these two pieces, so a lane's stream and the order of the rank's
stream cannot differ between running in this process and running in workers:

* :class:`LaneOutputs` runs the chain over a lane's feed units on demand and queues the
  lane's outputs (its records or batches, then one end output);
* :func:`schedule` walks the lanes in output order: round-robin for ``interleave``, every
  lane per step for ``lockstep``. The engine consumes it; a worker restricted to its own
  lanes writes its outputs into its ring in exactly this order.

The end of a lane is an output of its own (``LaneOutput.end``), taken in the lane's turn
like any batch: a lane whose last batch is partial yields that batch in one turn and its
end in the next. In ``lockstep`` the stream stops at the first step in which some lane
ends; that step is yielded (a worker writes all of it, the consumer reads all of it) and
not delivered. With ``pad_ended`` (``batch(pad_last=True)``) it goes on instead until
every lane has ended: a lane that ended takes part in each later step with a padding
output (:func:`padding`) that the schedule makes itself, so a worker writes nothing for
it and the parent reads nothing; the consumer fills its rows with padding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from zephon.runners.chain import ChainRunner, LaneOutput

INTERLEAVE = "interleave"
LOCKSTEP = "lockstep"
OUTPUTS = (INTERLEAVE, LOCKSTEP)

#: A lane's next feed unit: a chunk (maybe followed by a flush sentinel), the final
#: sentinel, or nothing once the lane has ended.
Pull = Callable[[int], list[Any]]

#: A process running more lanes than this makes each output lazily (see LaneOutputs): a
#: lane then waits for that many others between two of its turns, and whatever it made
#: ahead (tokens, packed rows, batches) would sit in memory all that time. With fewer
#: lanes, running a feed unit whole is cheaper (about 15% less CPU per batch).
LAZY_LANES = 64


class LaneOutputs:
    """A lane's outputs in order, made by ``runner`` from the feed units ``pull(lane)``
    returns (a lane is pulled only while it has not ended).

    A lane's first output is made as soon as it can be (the runner stops once an output
    is ready, the rest of the unit waits); with ``lazy`` every output is, so a lane holds
    no more than its next output needs: what a process owning many lanes wants, where a
    lane waits for hundreds of others between two of its turns.
    """

    def __init__(self, runner: ChainRunner, pull: Pull, num_lanes: int) -> None:
        self.runner = runner
        self.pull = pull
        self.lazy = num_lanes > LAZY_LANES
        self._ready: dict[int, deque[LaneOutput]] = {}
        self._producing: set[int] = set()  # lanes that have had an output with a record

    def next(self, lane: int) -> LaneOutput:
        ready = self._ready.get(lane)
        if ready is None:
            ready = self._ready[lane] = deque()
        runner = self.runner
        while not ready:
            first = self.lazy or lane not in self._producing
            if runner.suspended(lane):
                outs = runner.resume(lane, first)
            else:
                feed = self.pull(lane)
                if not feed:
                    raise RuntimeError(
                        f"lane {lane} was pulled after its end; this is a Zephon bug"
                    )
                outs = runner.feed(feed, first=first)
            for out in outs:
                ready.append(out)
                if out.record is not None:
                    self._producing.add(lane)
        return ready.popleft()


def padding(lane: int) -> LaneOutput:
    """A lockstep step's output for ``lane``, which ended in an earlier step."""
    out = LaneOutput(lane, None, [], end=True)
    out.padding = True
    return out


def schedule(
    lanes: Sequence[int],
    output: str,
    next_output: Callable[[int], LaneOutput],
    *,
    start_lane: int,
    done: Collection[int] = (),
    pad_ended: bool = False,
) -> Iterator[LaneOutput | list[LaneOutput]]:
    """The outputs of ``lanes`` (ascending) in the order the consumer takes them.

    ``interleave``: one output at a time, round-robin over the lanes that have not ended,
    from the first lane >= ``start_lane``; a lane leaves the rotation after its end output.
    ``lockstep``: a list with one output of every lane per step, until (and including) the
    first step in which some lane ends; nothing if a lane in ``done`` already ended. With
    ``pad_ended``: until every lane has ended, a lane that ended before the step taking
    part with :func:`padding`; the last step yielded holds only ends.
    """
    if output == LOCKSTEP:
        ended = {lane for lane in lanes if lane in done}
        if ended and not pad_ended:
            return
        while len(ended) < len(lanes):
            step = [padding(lane) if lane in ended else next_output(lane) for lane in lanes]
            yield step
            if not pad_ended:
                if any(out.end for out in step):
                    return
                continue
            ended.update(out.lane for out in step if out.end)
        return
    rot = [lane for lane in lanes if lane not in done]
    pos = next((i for i, lane in enumerate(rot) if lane >= start_lane), 0)
    while rot:
        pos %= len(rot)
        out = next_output(rot[pos])
        yield out
        if out.end:
            del rot[pos]
        else:
            pos += 1
