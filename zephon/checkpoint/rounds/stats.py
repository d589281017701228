"""What one rank's round cost (:attr:`zephon.checkpoint.aggregate.Aggregator.last_round`):
its wall time and the traffic of its store object during the round, for the leader and
the followers alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zephon.checkpoint.rounds.context import RoundContext
    from zephon.checkpoint.rounds.wait import Deadline

__all__ = ["RoundStats", "round_stats"]


@dataclass(frozen=True)
class RoundStats:
    """What one rank's last round cost: wall time and the store traffic of this rank's
    store object during it (requests sent, value bytes read and written, events pushed)."""

    round_id: str | None
    role: str
    ok: bool
    elapsed_ms: float
    requests: int
    bytes_read: int
    bytes_written: int
    events: int


def round_stats(
    ctx: RoundContext, rid: str, role: str, ok: bool, deadline: Deadline, before: dict[str, int]
) -> RoundStats:
    """The round ``rid`` so far: ``before`` is ``ctx.counters()`` at its start."""
    after = ctx.counters()
    return RoundStats(
        round_id=rid,
        role=role,
        ok=ok,
        elapsed_ms=deadline.elapsed_ms(),
        requests=after["requests"] - before["requests"],
        bytes_read=after["bytes_read"] - before["bytes_read"],
        bytes_written=after["bytes_written"] - before["bytes_written"],
        events=after["events"] - before["events"],
    )
