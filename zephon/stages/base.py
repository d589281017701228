"""A step of a plan, and the read-only view of the replay that a step may be given."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zephon.operators.base import Operator


@dataclass(frozen=True)
class Step:
    """What the chain runner runs at one place of the chain.

    Args:
        run: an operator, or a stage with the operator methods (``process_batch``,
            ``flush``, ``pending``, ``on_sentinel``) standing for several operators.
        ops: the indices, in the plan's operators, of what ``run`` stands for. With one
            index the runner counts the step into that operator's counters; with several
            the stage counts into them itself (it gets them through ``counters``).
        name: how ``explain()`` shows it.
    """

    run: Any
    ops: tuple[int, ...]
    name: str

    @property
    def counts_itself(self) -> bool:
        return len(self.ops) > 1


def operator_step(op: Operator, index: int) -> Step:
    return Step(op, (index,), op.name)


class ReplayView:
    """Which lanes are replaying towards a restore's target: read-only, for a stage that
    can replay more cheaply (by length); only the replay filter drops records."""

    __slots__ = ("_targets",)

    def __init__(self, targets: Mapping[int, Any]) -> None:
        self._targets = targets

    def replaying(self, lane: int) -> bool:
        return lane in self._targets
