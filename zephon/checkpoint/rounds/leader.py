"""The leader's side of a round (global rank 0); see :mod:`zephon.checkpoint.rounds`."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import uuid
from typing import Any

from zephon.checkpoint.rounds.checks import (
    Decided,
    check_not_ended,
    checked_state,
    leader_topology,
    merged_header,
    missing_message,
)
from zephon.checkpoint.rounds.context import RoundContext, read_decision
from zephon.checkpoint.rounds.holder import PlaceTakenError, holder_value, take_place
from zephon.checkpoint.rounds.keys import (
    COMMIT,
    DIGEST_BYTES,
    LEADER_RANK,
    STATE,
    Announcement,
    Keys,
    digest,
)
from zephon.checkpoint.rounds.merged import with_round
from zephon.checkpoint.rounds.stats import RoundStats, round_stats
from zephon.checkpoint.rounds.wait import (
    LEADER_POLL_PER_RANK_S,
    ControlView,
    Deadline,
    PrefixFeed,
    await_written,
)
from zephon.checkpoint.stores.base import KeepAlive, StaleRoundError
from zephon.errors import AggregationError, CheckpointError

__all__ = ["Leader"]

_RID = re.compile(r"[0-9a-f]{12}-[0-9]{1,12}")  # <session>-<counter>
#: How many void rounds (see Leader.void) an announcement names.
_VOID_KEPT = 8


class Leader:
    """Runs rank 0's rounds and keeps what must outlive one: the liveness lease, the
    decisions not yet safe to delete, the round whose states the shares read, the rounds
    whose states are left over."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.session = uuid.uuid4().hex[:12]
        self.counter = 0
        self.kept: list[str] = []  # decision keys (commits, notices) not yet safe to delete
        self.lease: KeepAlive | None = None  # the liveness key, held until close()
        self.failed: str | None = None  # the decision key of the last round, if it failed
        self.leftovers: set[str] = set()  # round ids whose states may still be stored
        self.replaced: set[tuple[str, int]] = set()  # earlier runs' rounds this one replaced
        self.announced: str | None = None  # the last round this leader announced
        #: Rounds whose announcement failed or timed out (the store may apply it late):
        #: named in the next announcements (see Announcement.void), the last few kept.
        self.void: list[str] = []
        self.deferred: list[str] = []  # commits to delete with the next announcement
        #: The last round every rank acknowledged: its states stay for the followers'
        #: shares until the next one is (see zephon.checkpoint.rounds.keys).
        self.shared: str | None = None
        #: (round id, merged state, commit record) while the commit is being written: if
        #: writing it fails, the decision key says whether it went through after all.
        self._committing: tuple[str, dict[str, Any], bytes] | None = None
        self._ann: Announcement | None = None  # the round being run's
        self.last: RoundStats | None = None
        #: Deleting an acknowledged round's acks (see _drop_acks_later) after round() has
        #: returned; joined before the next round and in close().
        self._cleaner: threading.Thread | None = None

    # ------------------------------------------------------------------------- round

    def round(self, state: dict[str, Any], step: int, call: int) -> dict[str, Any]:
        self._join_cleaner()
        ctx, n = self.ctx, self.ctx.world_size
        deadline = Deadline(ctx.timeout_s)
        before = ctx.counters()
        self.counter += 1
        rid = f"{self.session}-{self.counter}"
        ann = Announcement(
            rid,
            self.session,
            self.counter,
            n,
            ctx.job_id,
            ctx.fingerprint,
            step=step,
            call=call,
            void=tuple(self.void),
        )
        self.failed = None
        self._ann = ann
        ok = False
        try:
            try:
                merged = self._run(rid, ann, state, deadline)
                ok = True
            except BaseException as e:
                after_all = self._fail(rid, e, deadline)
                if after_all is not None:
                    # The commit reached the store though this leader saw an error (a store
                    # restarting under it): the round committed, as every rank reads it.
                    ctx.log.warning(
                        "%s round %s committed though writing its commit raised %s: %s",
                        ctx.p,
                        rid,
                        type(e).__name__,
                        e,
                    )
                    self.kept.append(ctx.keys.decision(rid))
                    self._after_commit(rid, deadline)
                    ok = True
                    return after_all
                if isinstance(e, AggregationError) and not str(e).startswith(ctx.p):
                    raise AggregationError(f"{ctx.p} round {rid} failed: {e}") from e
                if isinstance(e, AggregationError | KeyboardInterrupt | SystemExit):
                    raise
                if isinstance(e, CheckpointError):
                    raise AggregationError(f"{ctx.p} round {rid}: {e}") from e
                if isinstance(e, Exception):
                    raise AggregationError(
                        f"{ctx.p} round {rid} failed in {ctx.where}: {type(e).__name__}: {e}"
                    ) from e
                raise
            self._after_commit(rid, deadline)
            return merged
        finally:
            self.last = round_stats(ctx, rid, "leader", ok, deadline, before)

    def _run(
        self, rid: str, ann: Announcement, state: dict[str, Any], deadline: Deadline
    ) -> dict[str, Any]:
        ctx, keys, n = self.ctx, self.ctx.keys, self.ctx.world_size
        own = ctx.record(STATE, rid, rank=LEADER_RANK, world_size=n, state=state)
        self._hold_liveness(deadline)
        watch = ctx.watch(keys.prefix)
        self._clear_leftover_announcement(watch)
        self.announced = rid  # from here on the keys are this leader's to publish and remove
        self.leftovers.add(rid)
        if n > 1:
            ctx.store.make_room([keys.states(rid), keys.acks(rid)])
        try:
            # The generation, the announcement and the removal of commits that no rank
            # needs any more (see _after_commit): one request where the store has
            # transactions (etcd)
            fence = ctx.store.announce_with(
                keys.gen, rid.encode(), {keys.round: ann.encode()}, delete=self.deferred
            )
            self.deferred = []
        except BaseException:
            self.void = [*self.void, rid][-_VOID_KEPT:]
            self.leftovers.add(rid)  # a follower may still join it late and write there
            raise
        ctx.log.debug(
            "%s round %s announced (step %d, %d ranks, %s)", ctx.p, rid, ann.step, n, ctx.who()
        )
        # The leader's own state record goes beside the followers' before anything is
        # decided: a committed round is one every rank's share can be saved from, even if
        # the leader dies right after its commit.
        ctx.store.put(keys.state(rid, LEADER_RANK), own)
        states, digests = self._collect(rid, ann.step, state, own, deadline, watch)
        t_collect = deadline.elapsed_ms()
        try:
            merged = ctx.merge(states)
        except Exception as e:
            raise AggregationError(
                f"{ctx.p} merging the states of round {rid} failed: {type(e).__name__}: {e}"
            ) from e
        merged = with_round(merged, ctx, rid, ann.step)
        header, lanes_total = merged_header(ctx, rid, merged, states)
        commit = ctx.record(
            COMMIT,
            rid,
            world_size=n,
            digests=b"".join(digests),
            header=header,
            lanes_total=lanes_total,
        )
        self._committing = (rid, merged, commit)
        if self.lease is not None and self.lease.lost:
            # Followers may have declared this leader dead and given up.
            raise AggregationError(
                f"{ctx.p} this leader's liveness key 'leader' ({keys.leader}) in {ctx.where}"
                f" lapsed during round {rid} (was the process paused longer than"
                f" lease_ttl_s={ctx.lease_ttl_s:g}?); not committing"
            )
        try:
            # The round is closed (its announcement deleted) and committed: in one
            # transaction where the store has them (etcd), else the deletion first
            existing = ctx.store.create_and_delete(
                keys.decision(rid), commit, fence=fence, delete=[keys.round]
            )
        except StaleRoundError as e:
            raise AggregationError(
                f"{ctx.p} round {rid} cannot publish its merged result: a newer round was"
                f" announced in {ctx.where} meanwhile, so this leader is stale ({e})"
            ) from e
        if existing is not None and existing != commit:
            d = read_decision(existing)
            raise Decided(
                f"{ctx.p} round {rid} was ended before this leader could commit it:"
                f" {_by(d.record)}{ctx.why(rid, d)}"
            )
        self._committing = None
        self.kept.append(keys.decision(rid))
        ctx.log.debug(
            "%s round %s committed at %.1f ms (states collected at %.1f ms)",
            ctx.p,
            rid,
            deadline.elapsed_ms(),
            t_collect,
        )
        return merged

    def _drop_round(self, rid: str, world_size: int) -> None:
        """Delete round ``rid``'s state records and acknowledgements."""
        ctx, keys = self.ctx, self.ctx.keys
        ctx.delete_prefix_quietly(keys.states(rid), [keys.state(rid, r) for r in range(world_size)])
        self._drop_acks(rid, world_size)

    def _drop_acks(self, rid: str, world_size: int) -> None:
        """Delete round ``rid``'s acknowledgements."""
        ctx, keys = self.ctx, self.ctx.keys
        followers = [r for r in range(world_size) if r != LEADER_RANK]
        ctx.delete_prefix_quietly(keys.acks(rid), [keys.ack(rid, r) for r in followers])

    def _drop_acks_later(self, rid: str) -> None:
        """:meth:`_drop_acks` on a thread: the acks are counted and nobody reads them again,
        and over a directory they are a file each, a thousand at 1,024 ranks, which the
        round need not wait for. Their requests are counted in no round's figures."""
        self._cleaner = threading.Thread(
            target=self._drop_acks,
            args=(rid, self.ctx.world_size),
            name=f"zephon-acks-{rid}",
            daemon=True,
        )
        self._cleaner.start()

    def _join_cleaner(self) -> None:
        if self._cleaner is not None:
            self._cleaner.join()
            self._cleaner = None

    def _after_commit(self, rid: str, deadline: Deadline) -> None:
        """Wait for the acks; then clean up. Nothing here fails the round: store errors
        only leave keys behind for close() or the next round."""
        ctx, n = self.ctx, self.ctx.world_size
        try:
            missing = self._wait_acks(rid, deadline)
        except Exception as e:  # noqa: BLE001
            ctx.log.warning("%s round %s: waiting for acks failed: %s", ctx.p, rid, e)
            missing = [r for r in range(n) if r != LEADER_RANK]
        if missing:
            ctx.log.warning(
                "%s round %s: ranks %s did not acknowledge the merged result within the"
                " round's %g s budget; its commit stays in %s for them",
                ctx.p,
                rid,
                missing,
                ctx.timeout_s,
                ctx.where,
            )
            return
        # Every rank has read this round's commit, so none still needs an earlier one (nor
        # an earlier round's states: a share of an earlier round cannot be saved any more).
        # This round's states stay for its shares; its acknowledgements are counted.
        old_decisions = self.kept[:-1]
        self.kept = self.kept[-1:]
        if self.shared is not None and self.shared != rid:
            self._drop_round(self.shared, n)  # (now: a share of it says it can't be saved)
        self.shared = rid
        self._drop_acks_later(rid)
        if ctx.store.announce_batches:
            # Deleted with the next announcement (or at close()): a write, and a pushed
            # event to every watching follower, fewer per round.
            self.deferred.extend(old_decisions)
        else:
            for key in old_decisions:
                ctx.delete_quietly(key)
        self.leftovers.discard(rid)
        if self.replaced:
            self._sweep_replaced()
            self.replaced.clear()
        try:
            ctx.store.compact()
        except Exception as e:  # noqa: BLE001
            ctx.log.warning("%s could not compact %s: %s", ctx.p, ctx.where, e)
        ctx.log.debug("%s round %s done in %.1f ms", ctx.p, rid, deadline.elapsed_ms())

    # ------------------------------------------------------------------------- steps

    def _hold_liveness(self, deadline: Deadline) -> None:
        """Hold the leader's liveness key from the first round until close().

        Held across rounds, not per round: a follower that reaches a round the leader has
        already failed still sees the leader alive, so it trusts the failure notice it finds
        (where the announcement of a dead job's leader, whose key has expired, is ignored).
        Taken exclusively (see :func:`~zephon.checkpoint.rounds.holder.take_place`): the key
        of a leader of this host that is gone is taken over at once, another host's is
        waited for until its lease lapses, and a live one is another job on this location.
        """
        ctx = self.ctx
        if self.lease is not None and not self.lease.lost:
            return
        if self.lease is not None:
            ctx.log.warning("%s liveness lease was lost; taking a new one", ctx.p)
            with contextlib.suppress(Exception):
                self.lease.stop()
            self.lease = None
        self.lease = take_place(
            ctx.store,
            ctx.keys.leader,
            holder_value(self.session, ctx.rank),
            ctx.lease_ttl_s,
            deadline,
            session=self.session,
            conflict=ctx.conflict_message("the leader's liveness key"),
            log=ctx.log,
            p=ctx.p,
        )

    def _clear_leftover_announcement(self, watch: Any) -> None:
        """An announcement of another session is an earlier run's failed round (a job
        restarted under the same id): its notice and states can go with it."""
        ctx, keys = self.ctx, self.ctx.keys
        view = ControlView(ctx.store, watch, Deadline(ctx.timeout_s), 1)
        blob, gen = view.get_many([keys.round, keys.gen])
        old = Announcement.decode(blob) if blob is not None else None
        found: dict[str, int] = {}
        if old is not None and old.session != self.session and _RID.fullmatch(old.round_id):
            found[old.round_id] = old.world_size
        # A run that died after closing its round left no announcement, but its
        # generation key still names that round.
        old_gen = gen.decode(errors="replace") if gen is not None else ""
        if _RID.fullmatch(old_gen) and not old_gen.startswith(f"{self.session}-"):
            found[old_gen] = ctx.world_size
        for rid, world_size in found.items():
            ctx.log.debug("%s replacing round %s left by an earlier run", ctx.p, rid)
            ctx.delete_quietly(keys.decision(rid))
            # Its states go now and again after this round: followers that had
            # joined it may still write there until they see the new announcement.
            self.replaced.add((rid, world_size))
        if found:
            self._sweep_replaced()

    def _sweep_replaced(self) -> None:
        for rid, world_size in sorted(self.replaced):
            self._drop_round(rid, world_size)

    def _collect(
        self,
        rid: str,
        step: int,
        own: dict[str, Any],
        own_blob: bytes,
        deadline: Deadline,
        watch: Any,
    ) -> tuple[list[dict[str, Any]], list[bytes]]:
        ctx, keys, n = self.ctx, self.ctx.keys, self.ctx.world_size
        ref = leader_topology(ctx, rid, own)
        states: list[Any] = [None] * n
        digests = [b"\x00" * DIGEST_BYTES] * n
        states[LEADER_RANK] = own
        digests[LEADER_RANK] = digest(own_blob)
        missing = {r for r in range(n) if r != LEADER_RANK}
        feed = PrefixFeed(
            ctx.store,
            watch,
            keys.states(rid),
            [keys.state(rid, r) for r in missing],
            known=(keys.state(rid, LEADER_RANK),),
        )
        view = ControlView(ctx.store, watch, deadline, n, LEADER_POLL_PER_RANK_S)
        gen_seen = False  # this round's generation was read back at least once
        while True:
            changes = view.changes()
            for key, blob in feed.poll(changes).items():
                r = Keys.rank_of(key)
                if r is None or r not in missing:
                    continue
                states[r] = checked_state(ctx, rid, r, key, blob, ref, step)
                digests[r] = digest(blob)
                missing.discard(r)
            if not missing:
                return states, digests
            gen_seen = check_not_ended(ctx, rid, view, gen_seen)
            if not view.sleep():
                raise AggregationError(missing_message(ctx, rid, sorted(missing)))

    def _wait_acks(self, rid: str, deadline: Deadline) -> list[int]:
        """The followers whose acknowledgement has not come at the deadline."""
        ctx, keys, n = self.ctx, self.ctx.keys, self.ctx.world_size
        pending = {keys.ack(rid, r): r for r in range(n) if r != LEADER_RANK}
        if not pending:
            return []
        view = ControlView(ctx.store, ctx.watch(keys.prefix), deadline, n, LEADER_POLL_PER_RANK_S)
        return await_written(view, keys.acks(rid), pending)

    def _fail(self, rid: str, error: BaseException, deadline: Deadline) -> dict[str, Any] | None:
        """Publish the failure notice (the round's decision: an abort), so followers fail
        at once; never raises. Returns the merged state if the round turns out to be
        committed after all: this leader's commit reached the store though writing it
        raised (the decision key is read back, waiting for a store that cannot be reached,
        within one more ``timeout_s``)."""
        ctx, keys = self.ctx, self.ctx.keys
        committing, self._committing = self._committing, None
        message = str(error) or type(error).__name__
        if not isinstance(error, AggregationError):
            message = f"{type(error).__name__}: {message}"
        if self.announced != rid:
            # Never announced (its first write failed, or another leader holds the
            # location): there is no round to end. Followers waiting for it learn why from
            # an announcement of the round as failed, if the store takes that (one that
            # refuses every write: from this leader's liveness key vanishing, and a probe).
            ctx.log.error("%s round %s failed: %s", ctx.p, rid, message)
            if not isinstance(error, PlaceTakenError):
                self._announce_failed(rid, message)
            self._drop_lease_if_refused()
            return None
        self.failed = keys.decision(rid)
        if isinstance(error, Decided):
            ctx.log.error("%s round %s failed: %s", ctx.p, rid, message)
            if keys.decision(rid) not in self.kept:
                self.kept.append(keys.decision(rid))
            return None  # the decision is there already
        void = {"void": True} if rid in self.void else {}  # (see Announcement.void)
        settle = None if committing is None else deadline.end + ctx.timeout_s
        d = ctx.abort(rid, message, settle_until=settle, **void)
        if void:  # its announcement failed: followers waiting for one learn of it this way
            self._announce_failed(rid, message)
        if (
            committing is not None
            and committing[0] == rid
            and d is not None
            and d.kind == "commit"
            and d.record == read_decision(committing[2]).record
        ):
            self.failed = None
            return committing[1]
        ctx.log.error("%s round %s failed: %s", ctx.p, rid, message)
        if keys.decision(rid) not in self.kept:
            self.kept.append(keys.decision(rid))
        # The store refuses writes? Followers that have not seen this round learn it from
        # the leader's liveness key vanishing (deletes still work) and a probe.
        self._drop_lease_if_refused()
        # The announcement stays (until the next round replaces it, or close()): a follower
        # that had not read it yet still joins this round and then finds the notice.
        return None

    def _announce_failed(self, rid: str, message: str) -> None:
        """Announce round ``rid`` as failed (``Announcement.error``), for followers that
        wait for an announcement its leader could not write; where the store takes not even
        that, an empty announcement (a full disk still takes one). Never raises."""
        ctx = self.ctx
        if self._ann is None or self._ann.round_id != rid:
            return
        failed = dataclasses.replace(self._ann, error=message[:2000])
        for value in (failed.encode(), b""):
            try:
                ctx.store.put(ctx.keys.round, value)
                self.announced = rid  # (its announcement is this leader's to remove)
                return
            except Exception as e:  # noqa: BLE001
                ctx.log.debug("%s could not announce round %s failed: %s", ctx.p, rid, e)

    def _drop_lease_if_refused(self) -> None:
        """Give the liveness key up if the store refuses this rank's writes."""
        if self.ctx.probe() is not None and self.lease is not None:
            with contextlib.suppress(Exception):
                self.lease.stop()
            self.lease = None

    # ------------------------------------------------------------------------- close

    def close(self) -> None:
        """Release the liveness key; delete the kept commit (the last round's marker) and
        whatever else of this leader's rounds is left (the fence, acks that timed out). A
        failed last round keeps its announcement and notice: followers that have not looked
        yet must still find out (a later run ignores them)."""
        ctx, keys, n = self.ctx, self.ctx.keys, self.ctx.world_size
        self._join_cleaner()
        if self.lease is not None:
            try:
                self.lease.stop()
            except Exception as e:  # noqa: BLE001
                ctx.log.warning("%s could not release the liveness key: %s", ctx.p, e)
            self.lease = None
        keep = set() if self.failed is None else {self.failed, keys.round}
        mine = [keys.gen, keys.round] if self.announced is not None else []
        for key in [*self.deferred, *self.kept, *mine]:
            if key not in keep:
                ctx.delete_quietly(key)
        for rid in sorted(self.leftovers | ({self.shared} if self.shared else set())):
            self._drop_round(rid, n)
        self.shared = None
        self._sweep_replaced()
        self.replaced.clear()
        if self.announced is not None:
            ctx.delete_prefix_quietly(keys.probes, [keys.probe(r) for r in range(n)])
        self.kept = [k for k in self.kept if k in keep]
        self.deferred = []
        self.leftovers.clear()
        ctx.close_watch()


def _by(record: dict[str, Any]) -> str:
    rank = record.get("rank")
    return f"rank {rank}: " if isinstance(rank, int) else ""
