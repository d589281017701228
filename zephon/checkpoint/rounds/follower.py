"""A follower's side of a round (every rank but 0); see :mod:`zephon.checkpoint.rounds`."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from zephon.checkpoint.rounds.context import Decision, RoundContext, read_decision
from zephon.checkpoint.rounds.holder import Holder, PlaceTakenError, holder_value, take_place
from zephon.checkpoint.rounds.keys import (
    DIGEST_BYTES,
    LEADER_RANK,
    STATE,
    Announcement,
    digest,
)
from zephon.checkpoint.rounds.merged import share_of
from zephon.checkpoint.rounds.stats import RoundStats, round_stats
from zephon.checkpoint.rounds.wait import ControlView, Deadline
from zephon.checkpoint.share import SHARE_KEY
from zephon.checkpoint.stores.base import KeepAlive
from zephon.errors import AggregationError, CheckpointError

__all__ = ["Follower", "SHARE_KEY"]
#: without pushes, how often (at least; four poll intervals at large world sizes, at most a
#: quarter of the lease TTL) a waiting follower also reads the generation and the leader's
#: liveness key, and the announcement when the generation moved on (the decision key it
#: reads every poll)
SLOW_CHECK_S = 0.1
#: How long a follower whose round lost its generation waits for an announcement that
#: names the round void (see Follower._voiding_announcement).
VOID_WAIT_S = 0.25
_NEVER_LIVE = "was never live (its leader's announcement of it failed)"


class _Joined:
    """The round a follower joined and what it has learnt about it."""

    def __init__(self) -> None:
        self.ann: Any = None
        self.fresh = False  # proven to be this job's live round (not a leftover)
        self.leader_seen = False  # its leader's liveness key seen: only then is absence death
        self.gen_seen = False  # the generation key named this round at some point
        self.gone_since: float | None = None
        self.problem: str | None = None  # a notice that did not count yet (maybe a leftover)
        self.digest = b""  # of the state record this rank wrote for the round

    def join(self, ann: Announcement | None, fresh: bool) -> None:
        self.ann, self.fresh = ann, fresh
        self.leader_seen, self.gen_seen, self.gone_since, self.problem = False, False, None, None
        self.digest = b""

    def problem_suffix(self) -> str:
        return f"; found: {self.problem}" if self.problem else ""


class _StateNotSerialisable(AggregationError):
    pass


class _StoreHiccup(Exception):
    """A read of the store failed while this rank waited for its round's decision."""


class _Reads:
    """A :class:`ControlView` whose reads raise :class:`_StoreHiccup` when the store
    fails them (so waiting tells a store that hiccuped from a round that failed)."""

    def __init__(self, view: ControlView) -> None:
        self.view = view

    def get(self, key: str) -> bytes | None:
        try:
            return self.view.get(key)
        except Exception as e:  # noqa: BLE001 - any store error
            raise _StoreHiccup(f"{type(e).__name__}: {e}") from e

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        try:
            return self.view.get_many(keys)
        except Exception as e:  # noqa: BLE001
            raise _StoreHiccup(f"{type(e).__name__}: {e}") from e

    @property
    def deadline(self) -> Deadline:
        return self.view.deadline

    @property
    def pushed(self) -> bool:
        return self.view.pushed

    @property
    def interval_s(self) -> float:
        return self.view.interval_s

    def sleep(self) -> bool:
        return self.view.sleep()


class _Polling:
    """What :meth:`Follower._await_decision` keeps between looks."""

    def __init__(self) -> None:
        self.next_slow = 0.0
        self.absent_reads = 0
        self.store_error: str | None = None


_AGAIN = object()


class _Rejoin(Exception):
    """The joined round turned out not to be this rank's (a leftover) and the current one
    is at another step: wait for an announcement again."""


class Follower:
    """Runs one follower rank's rounds; remembers the last round it took part in, so a
    leftover announcement is not joined twice."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.session = uuid.uuid4().hex[:12]
        self.lease: KeepAlive | None = None  # this rank's place (its key m.<rank>), until close()
        self.last_round: tuple[str, int] | None = None
        self._ann_cache: tuple[bytes, Announcement | None] | None = None
        self.last: RoundStats | None = None
        #: rounds of another step this rank ended (their leader was behind it)
        self._ended: dict[str, None] = {}
        self._step = 0
        self._call = 0
        self._other_world: Announcement | None = None  # (see _read_announcement)

    def round(self, state: dict[str, Any], step: int, call: int) -> dict[str, Any]:
        ctx, keys, n = self.ctx, self.ctx.keys, self.ctx.world_size
        deadline = Deadline(ctx.timeout_s)
        before = ctx.counters()
        joined = _Joined()
        self._step, self._call = step, call
        ok = False
        try:
            try:
                place_error = self._hold_place(deadline)
                view = ControlView(ctx.store, ctx.watch(keys.control), deadline, n)
                while True:
                    self._await_announcement(view, joined)
                    t_joined = deadline.elapsed_ms()
                    if place_error is not None:
                        self._cannot_write(joined, place_error, "its liveness key")
                    self._write_state(joined, state)
                    ctx.log.debug(
                        "%s joined round %s at %.1f ms, state written at %.1f ms",
                        ctx.p,
                        joined.ann.round_id,
                        t_joined,
                        deadline.elapsed_ms(),
                    )
                    try:
                        result = self._await_decision(view, joined, state)
                        break
                    except _Rejoin:
                        continue
            except AggregationError as e:
                if str(e).startswith(ctx.p):
                    raise
                what = f"round {joined.ann.round_id}" if joined.ann is not None else "round"
                raise AggregationError(f"{ctx.p} checkpoint {what} failed: {e}") from e
            finally:
                if joined.ann is not None:
                    self.last_round = (joined.ann.session, joined.ann.counter)
            rid = joined.ann.round_id
            try:
                # The acknowledgement: the digest of the state the commit listed (the
                # state stays, for the shares, until the next round is acknowledged).
                ctx.store.put(keys.ack(rid, ctx.rank), joined.digest)
            except Exception as e:  # noqa: BLE001 - this rank has the result
                ctx.log.warning(
                    "%s round %s: could not acknowledge the merged result: %s", ctx.p, rid, e
                )
            ok = True
            ctx.log.debug("%s round %s done in %.1f ms", ctx.p, rid, deadline.elapsed_ms())
            return result
        finally:
            rid_or_none = joined.ann.round_id if joined.ann is not None else None
            self.last = round_stats(ctx, rid_or_none or "", "follower", ok, deadline, before)

    # ------------------------------------------------------------------------ joining

    def _hold_place(self, deadline: Deadline) -> Exception | None:
        """Hold this rank's place (its liveness key) from its first round until close():
        one live process per rank of a job on this location, so the followers of a second
        job with the same id never join this job's rounds (see
        :mod:`~zephon.checkpoint.rounds.holder`). Returns the store's error if it refuses
        the write (the round this rank joins then fails at once, as for its state);
        raises :class:`PlaceTakenError` for a place another live process holds."""
        ctx = self.ctx
        if self.lease is not None and not self.lease.lost:
            return None
        if self.lease is not None:
            ctx.log.warning("%s this rank's liveness lease was lost; taking a new one", ctx.p)
            with contextlib.suppress(Exception):
                self.lease.stop()
            self.lease = None
        try:
            self.lease = take_place(
                ctx.store,
                ctx.keys.member(ctx.rank),
                holder_value(self.session, ctx.rank),
                ctx.lease_ttl_s,
                deadline,
                session=self.session,
                conflict=ctx.conflict_message(f"rank {ctx.rank}'s place"),
                log=ctx.log,
                p=ctx.p,
            )
        except PlaceTakenError:
            raise
        except Exception as e:  # noqa: BLE001 - the store's error, for the round's notice
            return e
        return None

    def close(self) -> None:
        """Give this rank's place up (its liveness key goes at once)."""
        if self.lease is not None:
            try:
                self.lease.stop()
            except Exception as e:  # noqa: BLE001
                self.ctx.log.warning("%s could not release this rank's place: %s", self.ctx.p, e)
            self.lease = None
        self.ctx.close_watch()

    def _leader_alive(self, view: ControlView, session: str) -> bool:
        """Whether the leader of ``session`` holds its liveness key, as far as this rank can
        tell (a holder of this host that is gone is not alive)."""
        blob = view.get(self.ctx.keys.leader)
        if blob is None:
            return False
        holder = Holder(blob)
        return holder.session == session and holder.gone() is not True

    def _other_step(self, view: ControlView, ann: Announcement) -> str:
        """A round announced at another step than this rank's: this rank is behind it (the
        leader passed this step, so no round of it can follow: fail now) or ahead of it
        (the leader's round can never get this rank's state: end it, and wait for the
        leader to reach this step). Returns why the announcement is not joined."""
        ctx, step, call = self.ctx, self._step, self._call
        rid = ann.round_id
        mine = f"rank {ctx.rank} is at step {step} (its checkpoint() call {call} since it started)"
        theirs = f"round {rid} of the leader (rank {LEADER_RANK}) is at step {ann.step} (its call {ann.call})"
        if ann.step < step:
            if rid not in self._ended:
                self._ended[rid] = None
                while len(self._ended) > 64:
                    del self._ended[next(iter(self._ended))]
                ctx.log.warning("%s %s but %s: ending that round", ctx.p, mine, theirs)
                ctx.abort(
                    rid,
                    f"{mine}, past the round's step {ann.step}: the ranks called checkpoint()"
                    " at different steps, so this round cannot merge one step. Nothing was"
                    " saved; call checkpoint() again at a step every rank reaches",
                )
            return f"{theirs}, behind this rank's step {step} (ended it)"
        known = self.last_round is not None and ann.session == self.last_round[0]
        if known or self._leader_alive(view, ann.session):
            raise AggregationError(
                f"{ctx.p} checkpoint() at step {step} is in no round: {mine} but {theirs}"
                f" in {ctx.where}: the leader has passed this step (the ranks called"
                " checkpoint() at different steps, or this rank was paused past a round)."
                " Nothing was saved and no round was changed; call checkpoint() again at the"
                " step the other ranks checkpoint next"
            )
        return f"{theirs} (not shown live: left by an earlier run?)"

    def _read_announcement(self, blob: bytes | None) -> tuple[Announcement | None, str | None]:
        """The current announcement if this rank may join it; else (None, why not)."""
        ctx = self.ctx
        if blob is None:
            return None, None
        if self._ann_cache is not None and self._ann_cache[0] == blob:
            ann = self._ann_cache[1]
        else:
            ann = Announcement.decode(blob)
            self._ann_cache = (blob, ann)
        if ann is None and not blob:
            return None, (
                f"an empty announcement in {ctx.keys.round!r} (its leader could not write one:"
                " does the store refuse writes? is it full?)"
            )
        if ann is None:
            return None, f"an unreadable announcement in {ctx.keys.round!r}"
        if (ann.job_id, ann.fingerprint) != (ctx.job_id, ctx.fingerprint):
            raise AggregationError(
                f"{ctx.p} the announcement in {ctx.where} ({ctx.keys.round}) is for job"
                f" {ann.job_id!r}, pipeline {ann.fingerprint[:12]}…, but this rank runs"
                f" {ctx.who()}: it never joins another job's or pipeline's round. Every"
                " rank of a job must get the same job id (ZEPHON_JOB_ID or the launcher's)"
                " and build the same pipeline"
            )
        if ann.world_size != ctx.world_size:
            self._other_world = ann
            return None, (
                f"an announcement of round {ann.round_id} for world_size {ann.world_size}"
                f" (this rank has {ctx.world_size}; left by an earlier run?)"
            )
        last = self.last_round
        if last is not None and ann.session == last[0] and ann.counter <= last[1]:
            return None, f"the announcement of round {ann.round_id}, which this rank already left"
        return ann, None

    def _await_announcement(self, view: ControlView, joined: _Joined) -> None:
        ctx = self.ctx
        ignored = None
        fresh = False  # saw the key absent or unusable first: what follows is this job's
        probed = False
        next_probe_s = ctx.probe_after_s
        next_slow = 0.0
        gone_since: float | None = None  # the leader this rank worked with: its key gone
        while True:
            self._other_world = None
            ann, why = self._read_announcement(view.get(ctx.keys.round))
            other = self._other_world
            if other is not None and self._leader_alive(view, other.session):
                raise AggregationError(
                    f"{ctx.conflict_message(f'rank {ctx.rank}')}: a live leader runs round"
                    f" {other.round_id} for world_size {other.world_size}, and this rank has"
                    f" world_size {ctx.world_size} (or was this rank started with another"
                    " world_size than the others?)"
                )
            if ann is not None and ann.step != self._step:
                why = self._other_step(view, ann)
                ann = None
            if ann is not None and ann.error:
                known = self.last_round is not None and ann.session == self.last_round[0]
                if known or self._leader_alive(view, ann.session):
                    raise AggregationError(
                        f"{ctx.p} the leader (rank {LEADER_RANK}) could not run checkpoint"
                        f" round {ann.round_id} at step {ann.step} in {ctx.where}: {ann.error}"
                    )
                why = f"round {ann.round_id}, which its leader could not run"
                ann = None
            if ann is not None:
                # A later round of the leader this rank already worked with is this job's too.
                known = self.last_round is not None and ann.session == self.last_round[0]
                joined.join(ann, fresh or known)
                return
            fresh = True
            ignored = why or ignored
            now = time.monotonic()
            if self.last_round is not None and now >= next_slow:
                # The leader this rank worked with holds its key until it closes: with the
                # key gone (beyond a lease's grace) and no round announced, it closed,
                # died, or gave the key up because the store refuses its writes.
                next_slow = now + SLOW_CHECK_S
                if view.get(ctx.keys.leader) is not None:
                    gone_since = None
                elif gone_since is None:
                    gone_since = now
                elif now - gone_since >= ctx.lease_ttl_s:
                    refused = ctx.probe()
                    if refused is not None:
                        raise AggregationError(ctx.refused_message(None, refused))
                    extra = f"; found {ignored}" if ignored else ""
                    raise AggregationError(
                        f"{ctx.p} the leader (rank {LEADER_RANK}) is gone: its liveness key"
                        f" {ctx.keys.leader!r} in {ctx.where} vanished and it announced no"
                        f" round{extra}. It closed its pipeline, died, or gave its key up"
                        " because the store refuses its writes (is it full?)"
                    )
            if not probed and view.deadline.elapsed_s() >= next_probe_s:
                next_probe_s = view.deadline.elapsed_s() + max(ctx.probe_after_s, view.interval_s)
                # Still no round and no live leader: make sure it is not the store refusing
                # the leader's writes (it would refuse this rank's too), which nothing else
                # would tell us. (A leader whose key is there is only late; a leader that
                # cannot write gives its key up.)
                if view.get(ctx.keys.leader) is None:
                    probed = True
                    refused = ctx.probe()
                    if refused is not None:
                        raise AggregationError(ctx.refused_message(None, refused))
            if not view.sleep():
                extra = f"; ignored {ignored}" if ignored else ""
                raise AggregationError(
                    f"{ctx.p} checkpoint round timed out after {ctx.timeout_s:g} s waiting"
                    f" for the leader (rank {LEADER_RANK}) to announce a round in"
                    f" {ctx.where}{extra}. Has rank {LEADER_RANK} called checkpoint() at this"
                    " step?"
                )

    def _cannot_write(self, joined: _Joined, e: Exception, what: str) -> None:
        """This rank could not write ``what`` to the store: end the joined round, naming
        the store's error."""
        ctx = self.ctx
        rid = joined.ann.round_id
        error = f"{type(e).__name__}: {e}"
        ctx.abort(rid, f"rank {ctx.rank} could not write {what} to {ctx.where}: {error}")
        raise AggregationError(
            f"{ctx.p} checkpoint round {rid} failed: this rank could not write {what} to"
            f" {ctx.where}: {error}"
        ) from e

    def _write_state(self, joined: _Joined, state: dict[str, Any]) -> None:
        ctx, keys = self.ctx, self.ctx.keys
        rid = joined.ann.round_id
        try:
            record = ctx.record(STATE, rid, rank=ctx.rank, world_size=ctx.world_size, state=state)
        except CheckpointError as e:
            # Tell everyone, so the whole round fails now rather than at the deadline.
            ctx.abort(rid, f"rank {ctx.rank} cannot serialise its state: {e}")
            raise _StateNotSerialisable(f"{ctx.p} cannot serialise this rank's state: {e}") from e
        try:
            existing = ctx.store.create(keys.state(rid, ctx.rank), record)
        except Exception as e:  # noqa: BLE001 - the store's error is the message
            self._cannot_write(joined, e, "its state")
        if existing is not None and existing != record:
            if not joined.fresh:
                # Most likely a leftover round of an earlier run whose states are still
                # there; its leader is not seen alive, so wait for a live round.
                joined.problem = f"rank {ctx.rank}'s state of round {rid} was already written"
                return
            message = (
                f"two processes wrote rank {ctx.rank}'s state in round {rid} in {ctx.where}"
                f" ({ctx.who()}): two jobs with the same job id and pipeline share this"
                " location; give each job its own ZEPHON_JOB_ID"
            )
            ctx.abort(rid, message)
            raise AggregationError(f"{ctx.p} {message}")
        joined.digest = digest(record)

    # ------------------------------------------------------------------------ waiting

    def _await_decision(
        self, view: ControlView, joined: _Joined, state: dict[str, Any]
    ) -> dict[str, Any]:
        """Wait for the joined round's decision; switch rounds when the joined one turns
        out to be a leftover; give up (deciding the round as failed) on the leader's death
        or at the deadline. A read the store fails (a restart, a timeout) is tried again:
        this rank's state is written, so the round may still commit, and only the decision
        key may say it did not."""
        ctx = self.ctx
        poll = _Polling()
        reads = _Reads(view)
        while True:
            try:
                result = self._decision_once(reads, joined, state, poll)
            except _StoreHiccup as e:
                if poll.store_error is None:
                    ctx.log.warning(
                        "%s round %s: reading %s failed (%s); trying again",
                        ctx.p,
                        joined.ann.round_id,
                        ctx.where,
                        e,
                    )
                poll.store_error = str(e)
                result = None
            else:
                poll.store_error = None
            if result is _AGAIN:
                continue
            if result is not None:
                return result  # type: ignore[return-value]
            if view.sleep():
                continue
            rid = joined.ann.round_id
            if poll.store_error is not None:
                return self._give_up(
                    joined,
                    state,
                    f"{ctx.p} checkpoint round {rid} timed out after {ctx.timeout_s:g} s:"
                    f" {ctx.where} could not be read ({poll.store_error})",
                )
            if not joined.leader_seen:
                leader_state = "has not been seen alive in this round"
            elif joined.gone_since is None:
                leader_state = "was alive when last seen"
            else:
                leader_state = "has vanished"
            return self._give_up(
                joined,
                state,
                f"{ctx.p} checkpoint round {rid} timed out after {ctx.timeout_s:g} s"
                f" waiting for the merged result from the leader (rank {LEADER_RANK}) in"
                f" {ctx.where}; the leader {leader_state}{joined.problem_suffix()}. It"
                " waits for every rank's state: is some rank missing, or the leader stuck?",
            )

    def _decision_once(
        self, reads: Any, joined: _Joined, state: dict[str, Any], poll: _Polling
    ) -> Any:
        """One look at the joined round: the result, None (nothing yet) or ``_AGAIN``
        (moved to another round: look again at once)."""
        ctx, keys = self.ctx, self.ctx.keys
        grace_s = ctx.lease_ttl_s / 4
        slow_cap_s = max(SLOW_CHECK_S, grace_s)
        ann = joined.ann
        rid = ann.round_id
        blob = reads.get(keys.decision(rid))
        if blob is not None:
            decision = read_decision(blob)
            if decision.kind == "abort" and (decision.empty or decision.record.get("void")):
                # The leader's notice of a round it could not announce (written, like
                # the announcement, late), or a notice the store took only empty?
                voiding = self._voiding_announcement(reads, rid)
                if voiding is not None:
                    self._move_to(reads, joined, voiding, state, _NEVER_LIVE)
                    return _AGAIN
            result = self._judge(joined, decision, state)
            if result is not None:
                ctx.log.debug(
                    "%s round %s decided; seen at %.1f ms",
                    ctx.p,
                    rid,
                    reads.deadline.elapsed_ms(),
                )
                return result
        now = time.monotonic()
        if reads.pushed or now >= poll.next_slow:
            poll.next_slow = now + min(max(SLOW_CHECK_S, 4 * reads.interval_s), slow_cap_s)
            leader, gen = reads.get_many([keys.leader, keys.gen])
            holder = Holder(leader) if leader is not None else None
            alive = holder is not None and holder.session == ann.session and not holder.gone()
            if alive:
                joined.leader_seen, joined.gone_since = True, None
                joined.fresh = True  # its leader is alive: not a leftover
            if gen == rid.encode():
                joined.gen_seen = True
            elif gen is None and joined.gen_seen:
                voiding = self._voiding_announcement(reads, rid)
                if voiding is None:
                    return self._ended_without_decision(joined, state)
                self._move_to(reads, joined, voiding, state, _NEVER_LIVE)
                return _AGAIN
            # While the generation names this round no newer one was announced: the
            # announcement is only read when it does not.
            cur = None
            if gen != rid.encode():
                cur, _ = self._read_announcement(reads.get(keys.round))
                poll.absent_reads = poll.absent_reads + 1 if cur is None else 0
                if poll.absent_reads >= 2:
                    joined.fresh = True  # closed by its leader: the joined round is live
            if cur is not None and cur.round_id != rid:
                if cur.session != ann.session:
                    self._move_to(reads, joined, cur, state, "was left by an earlier run")
                    return _AGAIN
                if rid in cur.void:
                    self._move_to(reads, joined, cur, state, _NEVER_LIVE)
                    return _AGAIN
                if cur.counter > ann.counter:
                    raise AggregationError(
                        f"{ctx.p} the leader (rank {LEADER_RANK}) abandoned round {rid} and"
                        f" announced round {cur.round_id} in {ctx.where}"
                        f"{joined.problem_suffix()}; this rank's checkpoint() was not part"
                        " of it"
                    )
            if not alive and joined.leader_seen:
                now = time.monotonic()
                if joined.gone_since is None:
                    joined.gone_since = now
                    refused = ctx.probe()  # gone because the store refuses its writes?
                    if refused is not None:
                        return self._give_up(joined, state, ctx.refused_message(rid, refused))
                if now - joined.gone_since >= grace_s:
                    return self._give_up(
                        joined,
                        state,
                        f"{ctx.p} the leader (rank {LEADER_RANK}) of round {rid} is gone:"
                        f" its liveness key 'leader' ({keys.leader}) in {ctx.where} expired"
                        " or was removed and it decided nothing (lease_ttl_s="
                        f"{ctx.lease_ttl_s:g}); did rank {LEADER_RANK} die?",
                    )
        return None

    def _judge(self, joined: _Joined, d: Decision, state: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's result if ``d`` decides the joined round for it; raises on an abort
        that counts; None for a decision that may be a leftover's (kept for the message)."""
        ctx = self.ctx
        rid = joined.ann.round_id
        if d.kind == "commit":
            rec = d.record
            theirs = (rec.get("job_id"), rec.get("fingerprint"))
            if theirs != (ctx.job_id, ctx.fingerprint):
                raise AggregationError(
                    f"{ctx.p} the commit of round {rid} in {ctx.where} is for job"
                    f" {theirs[0]!r}, pipeline {str(theirs[1])[:12]}…, but this rank runs"
                    f" {ctx.who()}; it is never taken"
                )
            digests = rec.get("digests")
            start = ctx.rank * DIGEST_BYTES
            mine = digests[start : start + DIGEST_BYTES] if isinstance(digests, bytes) else b""
            if joined.digest and mine == joined.digest:
                return share_of(self.ctx, rec, state, rid)
            problem = f"the commit of round {rid} did not merge this rank's state"
            if joined.fresh:
                raise AggregationError(
                    f"{ctx.p} {problem} (in {ctx.where}): another process wrote this rank's"
                    " state; do two jobs share this job id?"
                )
            joined.problem = problem
            return None
        by = d.record.get("rank")
        why = ctx.why(rid, d)
        if d.empty:
            problem = f"checkpoint round {rid} was ended: {why}"
        elif not isinstance(by, int) or by == LEADER_RANK:
            problem = f"the leader (rank {LEADER_RANK}) failed checkpoint round {rid}: {why}"
        else:
            problem = f"rank {by} ended checkpoint round {rid}: {why}"
        if joined.fresh:
            raise AggregationError(f"{ctx.p} {problem}")
        joined.problem = problem
        return None

    def _voiding_announcement(self, view: ControlView, rid: str) -> Announcement | None:
        """A newer announcement that names ``rid`` void (its leader never saw its
        announcement go through, so the store applied it late: see
        :attr:`Announcement.void`), waited for up to :data:`VOID_WAIT_S`; else None. The
        late write can reach the store with the leader's late attempts to end the round,
        just before the leader's next announcement."""
        until = time.monotonic() + VOID_WAIT_S
        while True:
            cur, _ = self._read_announcement(view.get(self.ctx.keys.round))
            if cur is not None and cur.round_id != rid and rid in cur.void:
                return cur
            if time.monotonic() >= until or not view.sleep():
                return None

    def _move_to(
        self,
        view: ControlView,
        joined: _Joined,
        cur: Announcement,
        state: dict[str, Any],
        why: str,
    ) -> None:
        """Leave the joined round (``why``: what it turned out to be) for ``cur``."""
        ctx = self.ctx
        if cur.step != self._step:
            # (raises if this rank is behind it)
            ctx.log.info(
                "%s round %s %s; round %s is not of this rank's step: %s",
                ctx.p,
                joined.ann.round_id,
                why,
                cur.round_id,
                self._other_step(view, cur),
            )
            joined.join(None, fresh=False)
            raise _Rejoin
        ctx.log.info(
            "%s round %s %s; joining round %s", ctx.p, joined.ann.round_id, why, cur.round_id
        )
        joined.join(cur, fresh=True)
        self._write_state(joined, state)

    def _ended_without_decision(self, joined: _Joined, state: dict[str, Any]) -> dict[str, Any]:
        """The generation key vanished and no decision came: a rank that could not write
        even a notice ended the round (or the store refuses writes)."""
        ctx = self.ctx
        rid = joined.ann.round_id
        refused = ctx.probe()
        message = (
            ctx.refused_message(rid, refused)
            if refused is not None
            else f"{ctx.p} checkpoint round {rid} was ended: its generation key"
            f" {ctx.keys.gen!r} was removed from {ctx.where} without a decision (a rank that"
            " cannot write to the store ends a round that way)"
        )
        return self._give_up(joined, state, message)

    def _give_up(self, joined: _Joined, state: dict[str, Any], message: str) -> dict[str, Any]:
        """Decide the joined round as failed, so a stalled leader cannot commit it later;
        if it committed first, that commit is this rank's result after all."""
        ctx = self.ctx
        rid = joined.ann.round_id
        # The state is written: the round may have committed. A store that cannot be
        # reached now is waited for (one more budget), never guessed.
        first = ctx.abort(
            rid, message.removeprefix(f"{ctx.p} "), settle_until=time.monotonic() + ctx.timeout_s
        )
        if first is not None:
            if first.kind == "commit":
                joined.fresh = True
                result = self._judge(joined, first, state)
                if result is not None:
                    return result
            elif first.kind == "unknown":
                message += f"; {first.why}"
            elif joined.fresh:
                message += f"; the round had already been ended: {first.why}"
        raise AggregationError(message)
