"""Multi-rank checkpoint rounds: :class:`Aggregator`, one rank's side of every round.

The protocol, the key layout and what each rank gets back are described in
:mod:`zephon.checkpoint.rounds` (the leader, the follower, the keys and the waiting live
there); the stores are in :mod:`zephon.checkpoint.stores`, with :func:`open_store`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from zephon.checkpoint.rounds.context import RoundContext
from zephon.checkpoint.rounds.follower import Follower
from zephon.checkpoint.rounds.job import resolve_job_id
from zephon.checkpoint.rounds.keys import LEADER_RANK, Keys
from zephon.checkpoint.rounds.leader import Leader
from zephon.checkpoint.rounds.stats import RoundStats
from zephon.checkpoint.share import SHARE_KEY
from zephon.checkpoint.state import STEP
from zephon.checkpoint.stores import BaseStore, check_store, open_store
from zephon.errors import AggregationError

__all__ = ["LEADER_RANK", "SHARE_KEY", "Aggregator", "Keys", "RoundStats", "open_store"]

_log = logging.getLogger(__name__)


def round_step(state: dict[str, Any]) -> int:
    """The step a state names.

    Raises:
        ValueError: the state names no step (an int >= 0).
    """
    step = state.get(STEP) if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"a round's state must name its step (state[{STEP!r}], an int >= 0: the batches"
            f" delivered since the start of the data); got {step!r}"
        )
    return step


class Aggregator:
    """One rank's side of the multi-rank checkpoint round.

    Args:
        store: the shared store; every rank opens its own on the same location. A
            :class:`~zephon.checkpoint.stores.base.BaseStore` (one of ``open_store``'s, or
            a subclass of your own: see :mod:`zephon.checkpoint.stores.base`).
        rank, world_size: this process's global rank; rank 0 leads.
        timeout_s: the budget for a whole :meth:`round`, not per wait.
        expected_lanes: rank -> the lanes that rank must report (its whole DP group's), by
            the leader's lane mapping.
        merge: the per-rank states (index = rank) -> the merged state (run on the leader).
            It must return a dict whose ``"lanes"`` are lane states as the ranks reported
            them (choosing among identical DP peers), which the leader checks.
        lease_ttl_s: the leader's liveness key expires this long after the leader dies
            (on stores with leases), and followers then give the round up.
        job_id: what tells this job's rounds from another job's on the same location;
            default from the environment (:func:`~zephon.checkpoint.rounds.job.resolve_job_id`).
        fingerprint: the pipeline's fingerprint: two pipelines of one job checkpointing on
            one location run separate rounds, and a state of another pipeline is refused.
        probe_after_s: a follower that sees no announcement for this long checks once
            that the store still takes its writes (a store that refuses the leader's
            writes would leave it waiting for its whole budget).
        log: logger for ``[rank=i]`` lines (default ``zephon.checkpoint.aggregate``).
        own_store: :meth:`close` also closes ``store``.
    """

    def __init__(
        self,
        store: BaseStore,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        expected_lanes: Callable[[int], list[int]],
        merge: Callable[[list[dict[str, Any]]], dict[str, Any]],
        lease_ttl_s: float = 10.0,
        job_id: str | None = None,
        fingerprint: str = "",
        probe_after_s: float = 0.5,
        log: logging.Logger | None = None,
        own_store: bool = True,
    ) -> None:
        check_store(store, "Aggregator's store")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s!r}")
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0; got {lease_ttl_s!r}")
        if not isinstance(fingerprint, str):
            raise ValueError(f"fingerprint must be a str; got {fingerprint!r}")
        if not probe_after_s >= 0:
            raise ValueError(f"probe_after_s must be >= 0; got {probe_after_s!r}")
        resolved, source = resolve_job_id(job_id)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.lease_ttl_s = float(lease_ttl_s)
        self.job_id = resolved
        self.fingerprint = fingerprint
        self._own_store = own_store
        self._closed = False
        self._calls = 0
        self._ctx = RoundContext(
            store,
            rank=rank,
            world_size=world_size,
            timeout_s=self.timeout_s,
            lease_ttl_s=self.lease_ttl_s,
            expected_lanes=expected_lanes,
            merge=merge,
            job_id=resolved,
            job_source=source,
            fingerprint=fingerprint,
            log=log if log is not None else _log,
            probe_after_s=float(probe_after_s),
        )
        self._side: Leader | Follower = (
            Leader(self._ctx) if rank == LEADER_RANK else Follower(self._ctx)
        )

    def __repr__(self) -> str:
        return (
            f"Aggregator(rank={self.rank}, world_size={self.world_size},"
            f" timeout_s={self.timeout_s:g}, job_id={self.job_id!r},"
            f" store={self.store.describe()!r})"
        )

    @property
    def keys(self) -> Keys:
        """The key names of this job's and pipeline's rounds."""
        return self._ctx.keys

    @property
    def last_round(self) -> RoundStats | None:
        """Time and store traffic of this rank's last round (None before the first)."""
        return self._side.last

    def round(self, state: dict[str, Any]) -> dict[str, Any]:
        """Run one round; every rank calls it with its own state, at the same step.

        The state names its step (``state["step"]``, see :mod:`zephon.checkpoint.state`):
        a round is one step of one job. A follower joins only a round of its own step; one
        that finds the leader's round at another step fails this call (its state is behind)
        or ends that round (the leader's is), naming both steps, and the next call at a
        step every rank reaches runs a round as usual.

        Returns:
            On the leader, the merged state; on a follower, its share of it: the merged
            state's header with this rank's own lanes and a ``"share"`` entry (see
            :mod:`zephon.checkpoint.rounds`).

        Raises:
            AggregationError: the round failed, on every rank: a rank missing at the
                deadline (the leader's message names them and their lanes), a state that
                disagrees with the lane mapping or belongs to another job or pipeline, the
                leader's failure notice or death, a stale leader, a store that refuses
                writes or cannot be reached (its error is in the message).
        """
        if self._closed:
            raise AggregationError(f"{self._ctx.p} round() after close()")
        step = round_step(state)
        self._calls += 1  # (named in messages about ranks at other steps)
        try:
            return self._side.round(state, step, self._calls)
        except (AggregationError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # a store that cannot be reached, a disk that is full, ...
            raise AggregationError(
                f"{self._ctx.p} checkpoint round failed in {self.store.describe()}:"
                f" {type(e).__name__}: {e}"
            ) from e

    def close(self) -> None:
        """End this rank's part; idempotent. The leader releases its liveness key and
        deletes the commit kept as the last round's marker (and whatever else of its
        rounds is left); with ``own_store`` the store is closed too."""
        if self._closed:
            return
        self._closed = True
        try:
            self._side.close()
        finally:
            if self._own_store:
                self.store.close()
