"""What the leader leaves in the store for the followers' shares after a commit, written on
a thread of its own while the followers acknowledge (see :class:`MergedPublisher`)."""

from __future__ import annotations

import threading

from zephon.checkpoint.rounds.context import RoundContext
from zephon.checkpoint.rounds.keys import MERGED

__all__ = ["MergedPublisher"]


class MergedPublisher:
    """Leaves what the merged state is made of in the store (``-m.<rid>``: every rank's
    state record as the leader received it, whose digests the commit lists) for the
    followers' shares (:class:`zephon.checkpoint.share.Share`): nobody reads it in the
    round; a follower that saves its share, or restores lanes it does not own, does, and
    merges them as the leader did. The records are already encoded, so this costs the
    leader one write, not an encoding of every lane. On a thread of its own after the
    commit, while the followers acknowledge it (a share waits for it, within one round
    budget); never fails the round (a share that cannot find it says so when it is
    saved)."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self._thread: threading.Thread | None = None
        self._published: str | None = None  # the key the thread wrote

    def start(self, rid: str, records: list[bytes]) -> None:
        """Write round ``rid``'s ``records`` on a thread; :meth:`join` before the round
        returns."""
        self._thread = threading.Thread(
            target=self._publish,
            args=(rid, records),
            name=f"zephon-publish-{rid}",
            daemon=True,
        )
        self._thread.start()

    def join(self) -> str | None:
        """Wait for the write; the key it wrote (for the leader to delete later), or None
        if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        published, self._published = self._published, None
        return published

    def _publish(self, rid: str, records: list[bytes]) -> None:
        ctx, keys = self.ctx, self.ctx.keys
        try:
            ctx.store.put(keys.merged(rid), ctx.record(MERGED, rid, records=records))
        except Exception as e:  # noqa: BLE001
            ctx.log.warning(
                "%s round %s: could not leave the round's state records in %s for the followers'"
                " shares (saving a share will fail): %s: %s",
                ctx.p,
                rid,
                ctx.where,
                type(e).__name__,
                e,
            )
            return
        self._published = keys.merged(rid)
