"""A follower's checkpoint result: its share of a round's merged state.

After a multi-rank checkpoint round, rank 0 (the leader) holds the merged state, every
lane. Every other rank gets a :class:`Share`: a plain ``dict`` holding the merged state's
header (format, fingerprint, topology, every DP group's round-robin position) with the
rank's own lanes and a ``"share"`` entry naming the round. It restores the rank that made
it as it is, and the round reads no other rank's lanes for it (the rounds' fan-out stays
linear in the number of ranks).

It also knows where the whole merged state is: the leader leaves every rank's state
record of the round in the store until the next round has been acknowledged (or rank 0
closes its pipeline), and :meth:`Share.merged` reads them from there, checks them against
the round's commit and merges them as the leader did. :func:`zephon.save` and
:meth:`zephon.Pipeline.restore` do that when they need every lane, so a follower's
``checkpoint()`` result saved with ``zp.save`` restores on any rank and any world size, as
the merged state always did. Only a rank that saves (or restores other lanes) pays the
read. A plain ``dict`` copy of a share (``dict(share)``, a msgpack round trip) no longer
knows the store: it is the share alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zephon.errors import CheckpointError

__all__ = ["SHARE_KEY", "Share", "complete"]

#: the key of a follower's result that says it is one rank's share of a merged state
SHARE_KEY = "share"


class Share(dict):  # type: ignore[type-arg]
    """One rank's share of a round's merged state (see the module docstring)."""

    __slots__ = ("_fetch",)

    def __init__(self, state: dict[str, Any], fetch: Callable[[], dict[str, Any]]) -> None:
        super().__init__(state)
        self._fetch = fetch

    def merged(self) -> dict[str, Any]:
        """The round's whole merged state, every lane, read from the store.

        Raises:
            CheckpointError: the store no longer holds it (a later round was acknowledged,
                or the pipeline was closed) or it cannot be read.
        """
        fetch = getattr(self, "_fetch", None)
        if fetch is None:
            raise CheckpointError(f"{_what(self)} does not know its store; it is the share alone")
        return fetch()


def complete(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` itself, or for a :class:`Share` the merged state it is a share of."""
    return state.merged() if isinstance(state, Share) else state


def _what(state: dict[str, Any]) -> str:
    share = state.get(SHARE_KEY)
    if not isinstance(share, dict):
        return "this checkpoint"
    return f"rank {share.get('rank')}'s share of merged round {share.get('round_id')}"
