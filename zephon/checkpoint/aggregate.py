"""Multi-rank checkpoint rounds: every rank's state merged into one through a shared store.

The leader/follower round of the seed page ("Multi-rank aggregation"), over any
:class:`~zephon.checkpoint.stores.base.Store`. The leader is global rank 0.

Leader::

    keep_alive("leader")                  once, held until close(): followers see it alive
    announce("generation") -> fence       what a stale leader's late publish is checked against
    put("round")                          the announcement: round id, world size
    put("process_0-of-N")                 own state
    wait until every rank r wrote "process_r-of-N" for this round id, reporting exactly
        expected_lanes(r); a state that disagrees with the lane mapping raises at once
    delete("round")                       the round is closed
    merge; put("merged-<id>", fence=fence)
    delete("process_0-of-N")
    wait for every "process_r-of-N.ack" of this round id
    delete the acks and the previous round's "merged-<id>"

Follower r::

    poll "round" -> round id; put("process_r-of-N")
    poll "merged-<id>" (or "failed-<id>"); read it; delete("process_r-of-N"); put(ack)

Round ids are ``<session>-<counter>``: a random session per leader ``Aggregator`` and a
counter per round. Every state and ack carries its round id and only the current id counts,
so a round never mixes states from two rounds.

Leftovers of a dead earlier job (same location, same namespace) are ignored: its states
and acks carry another round id; its announcement may be joined by a follower, which then
switches (re-writing its state) as soon as a leader of another session announces; and its
failure notice does not count, because a follower only trusts a notice once the round is
shown to be live: its leader's liveness key (tagged with the session) was seen, the
announcement was absent at some point of this call, or the follower already worked with
that leader. A follower that sees its own leader announce a later round fails: the round it
joined was abandoned.

One ``timeout_s`` budget covers the whole round. If the leader fails before publishing it
writes ``failed-<id>`` and leaves the announcement up, so followers fail at once, even one
that arrives after the failure; a follower whose leader's liveness key vanishes fails about
``lease_ttl_s`` after the leader died (stores without leases: at the deadline).

The merged result stays in the store as the "round closed" marker until the next round has
been acknowledged by every rank (or :meth:`Aggregator.close`); if acks time out it stays for
the followers that have not read it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from zephon.checkpoint.io import dumps, loads
from zephon.checkpoint.stores.base import StaleRoundError, Store, get_many, poll_delays
from zephon.errors import AggregationError, CheckpointError

__all__ = [
    "ANNOUNCE_KEY",
    "GENERATION_KEY",
    "LEADER_KEY",
    "LEADER_RANK",
    "Aggregator",
    "ack_key",
    "failed_key",
    "merged_key",
    "open_store",
    "state_key",
]

LEADER_RANK = 0
ANNOUNCE_KEY = "round"
GENERATION_KEY = "generation"
LEADER_KEY = "leader"


_UNREAD: Any = object()  # "not read yet" for helpers that may be handed a value already read


def state_key(rank: int, world_size: int) -> str:
    """The key a rank writes its state to: ``process_{rank}-of-{world_size}``."""
    return f"process_{rank}-of-{world_size}"


def ack_key(rank: int, world_size: int) -> str:
    return f"process_{rank}-of-{world_size}.ack"


def merged_key(round_id: str) -> str:
    return f"merged-{round_id}"


def failed_key(round_id: str) -> str:
    return f"failed-{round_id}"


_log = logging.getLogger(__name__)


class _Deadline:
    """One time budget for the whole round."""

    def __init__(self, timeout_s: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + timeout_s

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.start) * 1e3


class _Poller:
    """Sleeps between polls, backing off as far as the store allows, never past the deadline."""

    def __init__(self, store: Store, deadline: _Deadline) -> None:
        first = float(store.poll_interval_s)
        cap = float(getattr(store, "poll_max_interval_s", first))
        self._delays = poll_delays(first, max(first, cap))
        self._deadline = deadline

    def sleep(self) -> bool:
        """Sleep one poll interval; False (without sleeping) once the budget is spent."""
        remaining = self._deadline.remaining()
        if remaining <= 0:
            return False
        time.sleep(min(next(self._delays), remaining))
        return True


class _Announcement:
    __slots__ = ("counter", "round_id", "session", "world_size")

    def __init__(self, round_id: str, session: str, counter: int, world_size: int) -> None:
        self.round_id = round_id
        self.session = session
        self.counter = counter
        self.world_size = world_size

    def encode(self) -> bytes:
        return dumps(
            {
                "round_id": self.round_id,
                "session": self.session,
                "counter": self.counter,
                "world_size": self.world_size,
                "leader_rank": LEADER_RANK,
            }
        )

    @classmethod
    def decode(cls, blob: bytes) -> _Announcement | None:
        try:
            d = loads(blob)
            return cls(
                str(d["round_id"]), str(d["session"]), int(d["counter"]), int(d["world_size"])
            )
        except (CheckpointError, KeyError, TypeError, ValueError):
            return None  # not an announcement this version wrote: treat as absent


class _Joined:
    """The round a follower joined and what it has learnt about it."""

    def __init__(self) -> None:
        self.ann: Any = None
        self.fresh = False  # proven to be this job's live round (not a leftover)
        self.leader_seen = False  # its leader's liveness key seen: only then is absence death
        self.gone_since: float | None = None
        self.problem: str | None = None  # a notice that did not count yet (maybe a leftover)

    def join(self, ann: _Announcement, fresh: bool) -> None:
        self.ann, self.fresh = ann, fresh
        self.leader_seen, self.gone_since, self.problem = False, None, None

    def problem_suffix(self) -> str:
        return f"; found: {self.problem}" if self.problem else ""


class _StateNotSerialisable(AggregationError):
    pass


class Aggregator:
    """One rank's side of the multi-rank checkpoint round.

    Args:
        store: the shared store; every rank opens its own on the same location.
        rank, world_size: this process's global rank; rank 0 leads.
        timeout_s: the budget for a whole :meth:`round`, not per wait.
        expected_lanes: rank -> the lanes that rank must report (its whole DP group's), by
            the leader's lane mapping.
        merge: the per-rank states (index = rank) -> the merged state (run on the leader).
        lease_ttl_s: the leader's liveness key expires this long after the leader dies
            (on stores with leases), and followers then fail.
        log: logger for ``[rank=i]`` lines (default ``zephon.checkpoint.aggregate``).
        own_store: :meth:`close` also closes ``store``.
    """

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        expected_lanes: Callable[[int], list[int]],
        merge: Callable[[list[dict[str, Any]]], dict[str, Any]],
        lease_ttl_s: float = 10.0,
        log: logging.Logger | None = None,
        own_store: bool = True,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s!r}")
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0; got {lease_ttl_s!r}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.lease_ttl_s = float(lease_ttl_s)
        self._expected_lanes = expected_lanes
        self._merge = merge
        self._log = log if log is not None else _log
        self._own_store = own_store
        self._p = f"[rank={rank}]"
        self._closed = False
        # leader
        self._session = uuid.uuid4().hex[:12]
        self._counter = 0
        self._kept: list[str] = []  # merged results (and failure notices) not yet safe to delete
        self._lease: Any = None  # the leader's liveness key, held until close()
        self._failed: str | None = None  # the failure notice of the last round, if it failed
        # follower: the last round it took part in, so a leftover announcement is not rejoined
        self._last_round: tuple[str, int] | None = None
        self._ann_cache: tuple[bytes, _Announcement | None] | None = None

    def __repr__(self) -> str:
        return (
            f"Aggregator(rank={self.rank}, world_size={self.world_size},"
            f" timeout_s={self.timeout_s:g}, store={self.store.describe()!r})"
        )

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER_RANK

    def round(self, state: dict[str, Any]) -> dict[str, Any]:
        """Run one round; every rank calls it with its own state and gets the merged one.

        Raises:
            AggregationError: the round failed: a rank missing at the deadline (the leader's
                message names them and their lanes), a state that disagrees with the lane
                mapping, the leader's failure notice or death, a stale leader, a store error.
        """
        if self._closed:
            raise AggregationError(f"{self._p} round() after close()")
        if self.is_leader:
            return self._lead(state)
        try:
            return self._follow(state)
        except (AggregationError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # a store that cannot be reached, a disk that is full, ...
            raise AggregationError(
                f"{self._p} checkpoint round failed in {self.store.describe()}:"
                f" {type(e).__name__}: {e}"
            ) from e

    def close(self) -> None:
        """End this rank's part; idempotent. The leader releases its liveness key and
        deletes the merged result kept as the last round's marker (and whatever else of its
        rounds is left: the fence key, acks that timed out, failure notices); with
        ``own_store`` the store is closed too."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.is_leader:
                if self._lease is not None:
                    try:
                        self._lease.stop()
                    except Exception as e:
                        self._log.warning("%s could not release the liveness key: %s", self._p, e)
                    self._lease = None
                # A failed last round keeps its announcement and notice: followers that
                # have not looked yet must still find out (a later job ignores them).
                keep = [] if self._failed is None else [self._failed, ANNOUNCE_KEY]
                for key in [*self._kept, GENERATION_KEY, ANNOUNCE_KEY, LEADER_KEY]:
                    if key not in keep:
                        self._delete_quietly(key)
                # Acks of a round whose acks timed out, error records of followers that
                # could not serialise their state: nobody reads them any more.
                for r in range(self.world_size):
                    self._delete_quietly(ack_key(r, self.world_size))
                    self._delete_quietly(state_key(r, self.world_size))
                self._kept = []
        finally:
            if self._own_store:
                self.store.close()

    # ------------------------------------------------------------------------- leader

    def _lead(self, state: dict[str, Any]) -> dict[str, Any]:
        deadline = _Deadline(self.timeout_s)
        self._counter += 1
        ann = _Announcement(
            f"{self._session}-{self._counter}", self._session, self._counter, self.world_size
        )
        rid = ann.round_id
        n = self.world_size
        self._failed = None
        try:
            self._hold_liveness()
            self._clear_leftover_announcement()
            fence = self.store.announce(GENERATION_KEY, rid.encode())
            self.store.put(ANNOUNCE_KEY, ann.encode())
            self._log.debug("%s round %s announced (%d ranks)", self._p, rid, n)
            self.store.put(state_key(self.rank, n), _state_record(rid, self.rank, n, state))
            states = self._collect(rid, state, deadline)
            t_collect = deadline.elapsed_ms()
            self.store.delete(ANNOUNCE_KEY)  # close the round
            try:
                merged = self._merge(states)
            except Exception as e:
                raise AggregationError(
                    f"{self._p} merging the states of round {rid} failed: {type(e).__name__}: {e}"
                ) from e
            blob = dumps({"round_id": rid, "merged": merged})
            if getattr(self._lease, "lost", False):
                # Followers may have declared this leader dead and given up.
                raise AggregationError(
                    f"{self._p} this leader's liveness key {LEADER_KEY!r} in"
                    f" {self.store.describe()} lapsed during round {rid} (was the process"
                    f" paused longer than lease_ttl_s={self.lease_ttl_s:g}?); not publishing"
                )
            try:
                self.store.put(merged_key(rid), blob, fence=fence)
            except StaleRoundError as e:
                raise AggregationError(
                    f"{self._p} round {rid} cannot publish its merged result: a newer round"
                    f" was announced in {self.store.describe()} meanwhile, so this leader is"
                    f" stale ({e})"
                ) from e
        except BaseException as e:
            self._fail(rid, e)
            if isinstance(e, AggregationError | KeyboardInterrupt | SystemExit):
                raise
            if isinstance(e, CheckpointError):
                raise AggregationError(f"{self._p} round {rid}: {e}") from e
            if isinstance(e, Exception):
                raise AggregationError(
                    f"{self._p} round {rid} failed in {self.store.describe()}:"
                    f" {type(e).__name__}: {e}"
                ) from e
            raise
        self._kept.append(merged_key(rid))
        self._delete_quietly(state_key(self.rank, n))
        # The merged result is out: from here on nothing fails the round, store errors only
        # leave keys behind for close() or the next round.
        try:
            missing = self._wait_acks(rid, deadline)
        except Exception as e:
            self._log.warning("%s round %s: waiting for acks failed: %s", self._p, rid, e)
            missing = [r for r in range(n) if r != self.rank]
        if missing:
            self._log.warning(
                "%s round %s: ranks %s did not acknowledge the merged result within the"
                " round's %g s budget; it stays in %s for them",
                self._p,
                rid,
                missing,
                self.timeout_s,
                self.store.describe(),
            )
        else:
            for r in range(n):
                if r != self.rank:
                    self._delete_quietly(ack_key(r, n))
            # Every rank has read this round's result, so none still needs an earlier one.
            for key in self._kept[:-1]:
                self._delete_quietly(key)
            self._kept = self._kept[-1:]
        self._log.debug(
            "%s round %s done in %.1f ms (states collected at %.1f ms)",
            self._p,
            rid,
            deadline.elapsed_ms(),
            t_collect,
        )
        return merged

    def _hold_liveness(self) -> None:
        """Hold the leader's liveness key from the first round until close().

        Held across rounds, not per round: a follower that reaches a round the leader has
        already failed still sees the leader alive, so it trusts the failure notice it finds
        (where the announcement of a dead job's leader, whose key has expired, is ignored).
        """
        if self._lease is not None and not getattr(self._lease, "lost", False):
            return
        if self._lease is not None:
            self._log.warning("%s liveness lease was lost; taking a new one", self._p)
            with contextlib.suppress(Exception):
                self._lease.stop()
        value = f"{self._session} rank={self.rank} pid={os.getpid()} host={socket.gethostname()}"
        self._lease = self.store.keep_alive(LEADER_KEY, value.encode(), self.lease_ttl_s)

    def _clear_leftover_announcement(self) -> None:
        """An announcement of another session is a finished job's failed round (one
        namespace serves one job at a time): its failure notice can go with it."""
        blob = self.store.get(ANNOUNCE_KEY)
        old = _Announcement.decode(blob) if blob is not None else None
        if old is not None and old.session != self._session:
            self._log.debug("%s replacing round %s left by another job", self._p, old.round_id)
            self._delete_quietly(failed_key(old.round_id))

    def _collect(self, rid: str, own: dict[str, Any], deadline: _Deadline) -> list[dict[str, Any]]:
        n = self.world_size
        ref = own.get("topology") if isinstance(own, dict) else None
        if not isinstance(ref, dict):
            raise AggregationError(
                f"{self._p} the leader's own state has no 'topology' dict; got {type(ref).__name__}"
            )
        self._check_state(rid, self.rank, own, ref)
        states: list[Any] = [None] * n
        states[self.rank] = own
        missing = [r for r in range(n) if r != self.rank]
        not_counted: dict[int, str] = {}  # rank -> why what it wrote does not count
        judged: dict[int, bytes] = {}  # rank -> the blob not_counted[rank] is about
        poller = _Poller(self.store, deadline)
        while True:
            still: list[int] = []
            blobs = get_many(self.store, [state_key(r, n) for r in missing])
            for r, blob in zip(missing, blobs, strict=True):
                if blob is None:
                    not_counted.pop(r, None)
                    still.append(r)
                    continue
                if judged.get(r) == blob:  # the same leftover as last poll: don't decode again
                    still.append(r)
                    continue
                judged[r] = blob
                try:
                    rec = loads(blob)
                except CheckpointError as e:
                    not_counted[r] = f"its {state_key(r, n)} is unreadable: {e}"
                    still.append(r)
                    continue
                if rec.get("round_id") != rid:
                    not_counted[r] = (
                        f"its {state_key(r, n)} belongs to round {rec.get('round_id')!r}, not"
                        f" {rid!r}"
                    )
                    still.append(r)
                    continue
                if "error" in rec:
                    raise AggregationError(
                        f"{self._p} rank {r} could not take part in round {rid}: {rec['error']}"
                    )
                self._check_state(rid, r, rec.get("state"), ref)
                states[r] = rec["state"]
            missing = still
            if not missing:
                return states
            if not poller.sleep():
                raise AggregationError(self._missing_message(rid, missing, not_counted))

    def _check_state(self, rid: str, r: int, st: Any, ref: dict[str, Any]) -> None:
        """Raise at once if rank ``r``'s state disagrees with the leader's lane mapping."""
        problems: list[str] = []
        topo = st.get("topology") if isinstance(st, dict) else None
        if not isinstance(topo, dict):
            problems.append("it has no 'topology' dict")
        else:
            wanted = {
                "rank": r,
                "world_size": self.world_size,
                "dp_size": ref.get("dp_size"),
                "canonical_replicas": ref.get("canonical_replicas"),
            }
            for field, want in wanted.items():
                if topo.get(field) != want:
                    problems.append(f"{field}={topo.get(field)!r} (the leader has {want!r})")
        expected = sorted(int(x) for x in self._expected_lanes(r))
        lanes = st.get("lanes") if isinstance(st, dict) else None
        if not isinstance(lanes, list) or not all(isinstance(x, dict) for x in lanes):
            problems.append("its 'lanes' is not a list of {'lane': int, ...} dicts")
        else:
            raw = [x.get("lane") for x in lanes]
            ids = [x for x in raw if isinstance(x, int) and not isinstance(x, bool)]
            if len(ids) != len(raw):
                problems.append(f"its lane ids {raw!r} are not all ints")
            elif sorted(ids) != expected:
                problems.append(f"it reports lanes {sorted(ids)}, the leader expects {expected}")
        if problems:
            raise AggregationError(
                f"{self._p} rank {r}'s state in round {rid} disagrees with the leader's lane"
                f" mapping: {'; '.join(problems)}. Every rank must build its pipeline with the"
                " same canonical_replicas, world_size and dp_size."
            )

    def _missing_message(self, rid: str, missing: list[int], not_counted: dict[int, str]) -> str:
        parts = []
        for r in missing:
            part = f"rank {r} (lanes {sorted(self._expected_lanes(r))})"
            if r in not_counted:
                part += f": {not_counted[r]}"
            parts.append(part)
        return (
            f"{self._p} checkpoint round {rid} timed out after {self.timeout_s:g} s waiting for"
            f" {len(missing)} of {self.world_size} ranks in {self.store.describe()}:"
            f" {'; '.join(parts)}. Every rank must call checkpoint() at the same step"
            " (raise aggregate_timeout_s if some ranks are just slow)."
        )

    def _wait_acks(self, rid: str, deadline: _Deadline) -> list[int]:
        n = self.world_size
        missing = [r for r in range(n) if r != self.rank]
        want = rid.encode()
        poller = _Poller(self.store, deadline)
        while missing:
            acks = get_many(self.store, [ack_key(r, n) for r in missing])
            missing = [r for r, ack in zip(missing, acks, strict=True) if ack != want]
            if missing and not poller.sleep():
                break
        return missing

    def _fail(self, rid: str, error: BaseException) -> None:
        """Publish a failure notice (so followers fail at once) and clean up; never raises."""
        message = str(error) or type(error).__name__
        if not isinstance(error, AggregationError):
            message = f"{type(error).__name__}: {message}"
        self._log.error("%s round %s failed: %s", self._p, rid, message)
        self._failed = failed_key(rid)
        try:
            self.store.put(failed_key(rid), dumps({"round_id": rid, "error": message}))
            self._kept.append(failed_key(rid))
        except BaseException as e:  # the original error matters more
            self._log.error("%s could not publish the failure notice: %s", self._p, e)
        # The announcement stays (until the next round replaces it, or close()): a follower
        # that had not read it yet still joins this round and then finds the notice.
        self._delete_quietly(state_key(self.rank, self.world_size))

    # ------------------------------------------------------------------------- follower

    def _follow(self, state: dict[str, Any]) -> dict[str, Any]:
        deadline = _Deadline(self.timeout_s)
        n = self.world_size
        joined = _Joined()
        try:
            self._await_announcement(deadline, joined)
            self._write_own_state(joined.ann.round_id, state)
            merged = self._await_merged(joined, state, deadline)
        except BaseException as e:
            if joined.ann is not None:
                self._last_round = (joined.ann.session, joined.ann.counter)
            if not isinstance(e, _StateNotSerialisable):  # that record tells the leader why
                self._delete_quietly(state_key(self.rank, n))
            raise
        rid = joined.ann.round_id
        self._last_round = (joined.ann.session, joined.ann.counter)
        try:
            self.store.delete(state_key(self.rank, n))
            self.store.put(ack_key(self.rank, n), rid.encode())
        except Exception as e:  # this rank has the result; the leader just keeps it around
            self._log.warning(
                "%s round %s: could not acknowledge the merged result: %s", self._p, rid, e
            )
        self._log.debug("%s round %s done in %.1f ms", self._p, rid, deadline.elapsed_ms())
        return merged

    def _read_announcement(self, blob: Any = _UNREAD) -> tuple[_Announcement | None, str | None]:
        """The current announcement if this rank may join it; else (None, why not)."""
        if blob is _UNREAD:
            blob = self.store.get(ANNOUNCE_KEY)
        if blob is None:
            return None, None
        if self._ann_cache is not None and self._ann_cache[0] == blob:
            ann = self._ann_cache[1]
        else:
            ann = _Announcement.decode(blob)
            self._ann_cache = (blob, ann)
        if ann is None:
            return None, f"an unreadable announcement in {ANNOUNCE_KEY!r}"
        if ann.world_size != self.world_size:
            return None, (
                f"an announcement of round {ann.round_id} for world_size {ann.world_size}"
                f" (this rank has {self.world_size}; left by another job?)"
            )
        last = self._last_round
        if last is not None and ann.session == last[0] and ann.counter <= last[1]:
            return None, f"the announcement of round {ann.round_id}, which this rank already left"
        return ann, None

    def _await_announcement(self, deadline: _Deadline, joined: _Joined) -> None:
        poller = _Poller(self.store, deadline)
        ignored = None
        fresh = False  # saw the key absent or unusable first: what follows is this job's
        while True:
            ann, why = self._read_announcement()
            if ann is not None:
                # A later round of the leader this rank already worked with is this job's too.
                known = self._last_round is not None and ann.session == self._last_round[0]
                joined.join(ann, fresh or known)
                return
            fresh = True
            ignored = why or ignored
            if not poller.sleep():
                extra = f"; ignored {ignored}" if ignored else ""
                raise AggregationError(
                    f"{self._p} checkpoint round timed out after {self.timeout_s:g} s waiting"
                    f" for the leader (rank {LEADER_RANK}) to announce a round in"
                    f" {self.store.describe()}{extra}. Has rank {LEADER_RANK} called"
                    " checkpoint() at this step?"
                )

    def _write_own_state(self, rid: str, state: dict[str, Any]) -> None:
        n = self.world_size
        try:
            record = _state_record(rid, self.rank, n, state)
        except CheckpointError as e:
            # Tell the leader, so the whole round fails now rather than at the deadline.
            notice = dumps({"round_id": rid, "rank": self.rank, "error": str(e)})
            self.store.put(state_key(self.rank, n), notice)
            raise _StateNotSerialisable(f"{self._p} cannot serialise this rank's state: {e}") from e
        self.store.put(state_key(self.rank, n), record)

    def _await_merged(
        self, joined: _Joined, state: dict[str, Any], deadline: _Deadline
    ) -> dict[str, Any]:
        """Wait for the merged result of the joined round; switch rounds when the joined
        one turns out to be a leftover; fail on the leader's notice or death."""
        poller = _Poller(self.store, deadline)
        grace_s = self.lease_ttl_s / 4
        absent_reads = 0
        while True:
            ann = joined.ann
            rid = ann.round_id
            # One read of the liveness key, the result, the notice and the announcement.
            # The leader writes its notice before releasing the key, so a leader seen alive
            # here has its notice (if any) in the same read.
            leader, merged_blob, failed_blob, ann_blob = get_many(
                self.store, [LEADER_KEY, merged_key(rid), failed_key(rid), ANNOUNCE_KEY]
            )
            alive = leader is not None and leader.split(b" ", 1)[0] == ann.session.encode()
            if alive:
                joined.leader_seen, joined.gone_since = True, None
                joined.fresh = True  # its leader is alive: not a leftover
            merged = self._merged_or_notice(joined, merged_blob, failed_blob)
            if merged is not None:
                return merged
            cur, _ = self._read_announcement(ann_blob)
            absent_reads = absent_reads + 1 if cur is None else 0
            if absent_reads >= 2:
                joined.fresh = True  # closed by its leader: the joined round is live
            if cur is not None and cur.round_id != rid:
                if cur.session != ann.session:
                    self._log.info(
                        "%s round %s was left by an earlier leader; joining round %s",
                        self._p,
                        rid,
                        cur.round_id,
                    )
                    joined.join(cur, fresh=True)
                    self._write_own_state(cur.round_id, state)
                    continue
                if cur.counter > ann.counter:
                    raise AggregationError(
                        f"{self._p} the leader (rank {LEADER_RANK}) abandoned round {rid} and"
                        f" announced round {cur.round_id} in {self.store.describe()}"
                        f"{joined.problem_suffix()}; this rank's checkpoint() was not part of it"
                    )
            if not alive and joined.leader_seen:
                now = time.monotonic()
                joined.gone_since = now if joined.gone_since is None else joined.gone_since
                if now - joined.gone_since >= grace_s:
                    merged = self._merged_or_notice(joined)  # it may have finished just now
                    if merged is not None:
                        return merged
                    raise AggregationError(
                        f"{self._p} the leader (rank {LEADER_RANK}) of round {rid} is gone: its"
                        f" liveness key {LEADER_KEY!r} in {self.store.describe()} expired or"
                        " was removed and it published neither a merged result nor a failure"
                        f" notice (lease_ttl_s={self.lease_ttl_s:g}); did rank"
                        f" {LEADER_RANK} die?"
                    )
            if not poller.sleep():
                if not joined.leader_seen:
                    leader_state = "has not been seen alive in this round"
                elif joined.gone_since is None:
                    leader_state = "was alive when last seen"
                else:
                    leader_state = "has vanished"
                raise AggregationError(
                    f"{self._p} checkpoint round {rid} timed out after {self.timeout_s:g} s"
                    f" waiting for the merged result from the leader (rank {LEADER_RANK}) in"
                    f" {self.store.describe()}; the leader {leader_state}"
                    f"{joined.problem_suffix()}. It waits for every rank's state: is some rank"
                    " missing, or the leader stuck?"
                )

    def _merged_or_notice(
        self, joined: _Joined, blob: Any = _UNREAD, failed_blob: Any = _UNREAD
    ) -> dict[str, Any] | None:
        """The merged result of the joined round, or None; raises on its failure notice.

        A round joined from the first read of the announcement may be a leftover of a dead
        job, so its (unreadable result or) failure notice only fails this rank if the round
        proves live; until then it is kept for the timeout message.
        """
        rid = joined.ann.round_id
        if blob is _UNREAD:
            blob = self.store.get(merged_key(rid))
        if blob is not None:
            try:
                rec = loads(blob)
            except CheckpointError as e:
                problem = f"the merged result of round {rid} is unreadable: {e}"
            else:
                if rec.get("round_id") == rid and isinstance(rec.get("merged"), dict):
                    return rec["merged"]
                problem = f"{merged_key(rid)!r} holds no merged result of round {rid}"
            if joined.fresh:
                raise AggregationError(f"{self._p} {problem} (in {self.store.describe()})")
            joined.problem = problem
        blob = self.store.get(failed_key(rid)) if failed_blob is _UNREAD else failed_blob
        if blob is not None:
            try:
                why = loads(blob).get("error", "no reason given")
            except CheckpointError as e:
                why = f"(the notice is unreadable: {e})"
            problem = f"the leader (rank {LEADER_RANK}) failed checkpoint round {rid}: {why}"
            if joined.fresh:
                raise AggregationError(f"{self._p} {problem}")
            joined.problem = problem
        return None

    # ------------------------------------------------------------------------- helpers

    def _delete_quietly(self, key: str) -> None:
        try:
            self.store.delete(key)
        except Exception as e:  # cleanup must not mask the round's outcome
            self._log.warning("%s could not delete %r: %s", self._p, key, e)


def _state_record(rid: str, rank: int, world_size: int, state: dict[str, Any]) -> bytes:
    return dumps({"round_id": rid, "rank": rank, "world_size": world_size, "state": state})


# ----------------------------------------------------------------------------- stores


def open_store(
    aggregate_dir: str | os.PathLike[str] | None = None,
    aggregate_store: str | None = None,
    *,
    namespace: str = "zephon",
) -> Store:
    """The store behind ``Pipeline(aggregate_dir=...)`` or ``Pipeline(aggregate_store=...)``.

    Args:
        aggregate_dir: a local or shared directory, or an fsspec URL (``s3://b/dir``).
        aggregate_store: ``"etcd://host:port[,host:port...]"``, ``"jax://"`` (the running
            ``jax.distributed`` service) or ``"torch://"`` (torchrun's TCPStore).
        namespace: a prefix that separates jobs sharing one location.

    Raises:
        ValueError: neither or both given, or an unknown ``aggregate_store`` scheme.
        ImportError: the backend's module or its client library is not installed.
    """
    if (aggregate_dir is None) == (aggregate_store is None):
        raise ValueError(
            "give exactly one of aggregate_dir (a directory or fsspec URL) and aggregate_store"
            f" ('etcd://host:port', 'jax://', 'torch://'); got aggregate_dir={aggregate_dir!r},"
            f" aggregate_store={aggregate_store!r}"
        )
    if aggregate_dir is not None:
        from zephon.checkpoint.stores.directory import DirectoryStore

        return DirectoryStore(aggregate_dir, namespace)
    assert aggregate_store is not None
    scheme, sep, rest = aggregate_store.partition("://")
    if not sep or scheme not in ("etcd", "jax", "torch"):
        raise ValueError(
            "aggregate_store must be 'etcd://host:port[,host:port]', 'jax://' or 'torch://';"
            f" got {aggregate_store!r} (use aggregate_dir= for a directory or fsspec URL)"
        )
    if scheme == "etcd":
        if not rest.split("/", 1)[0].strip(", "):
            raise ValueError(f"aggregate_store {aggregate_store!r} names no etcd endpoint")
        cls = _backend("etcd", "EtcdStore", aggregate_store, "zephon[etcd]")
        if "/" in rest.strip("/"):  # "etcd://h:p/job7": the URL names the namespace
            return cls.from_url(aggregate_store)
        return cls.from_url(aggregate_store, namespace=namespace)
    if scheme == "jax":
        return _backend("jax_store", "JaxStore", aggregate_store, "zephon[jax]")(
            namespace=namespace
        )
    return _backend("torch_store", "TorchStore", aggregate_store, "torch")(namespace=namespace)


def _backend(module: str, name: str, url: str, extra: str) -> Any:
    import importlib

    try:
        mod = importlib.import_module(f"zephon.checkpoint.stores.{module}")
        return getattr(mod, name)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"aggregate_store={url!r} needs zephon.checkpoint.stores.{module}.{name}, which"
            f" could not be loaded ({type(e).__name__}: {e}); install {extra}"
        ) from e
