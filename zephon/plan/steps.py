"""A step of a plan: one operator, or a stage that stands for several."""

from __future__ import annotations

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
