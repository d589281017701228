"""The in-process executor (``workers=0``): the plan runs on the engine's pump thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zephon.plan.compile import Plan
from zephon.runners.base import LaneRun
from zephon.runners.chain import ChainRunner, LaneOutput
from zephon.runners.lanes import LaneOutputs


def _nothing(lane: int) -> list[Any]:
    return []


class LocalExecutor:
    """Runs the chain in this process; pulls feed units on demand."""

    place = "local"

    def __init__(self, plan: Plan) -> None:
        cap = max(op.parallelism for op in plan.ops)
        self.pool = ThreadPoolExecutor(cap, thread_name_prefix="zephon-op") if cap > 1 else None
        self.runner = ChainRunner(plan, self.pool)
        self.outputs = LaneOutputs(self.runner, _nothing, 0)

    def start(self, run: LaneRun) -> None:
        for lane, cursor in run.targets.items():
            self.runner.replay_filter.set_target(lane, cursor)  # type: ignore[attr-defined]
        self.outputs = LaneOutputs(self.runner, run.pull, len(run.lanes))

    def next_output(self, lane: int) -> LaneOutput:
        return self.outputs.next(lane)

    def extra_stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.outputs.pull = _nothing  # the engine's method: a reference cycle, left to the GC
