"""The leader's checks of what the ranks sent it and of what its merge made of that.

Each raises an :class:`~zephon.errors.AggregationError` naming the rank, the round and the
fix: a state record that is unreadable, of another job or pipeline, or not at its key; a
rank's own error; a state that disagrees with the leader's lane mapping; a merge that
changed a lane's state; a round a follower ended (its failure notice, or the generation
key gone) while the leader collected. :func:`missing_message` says who never sent a state.
"""

from __future__ import annotations

from typing import Any

from zephon.checkpoint.rounds.context import RoundContext, read_decision
from zephon.checkpoint.rounds.keys import LEADER_RANK, STATE, decode
from zephon.checkpoint.rounds.wait import ControlView
from zephon.checkpoint.state import STEP
from zephon.errors import AggregationError
from zephon.tracking.schema import LANE

__all__ = [
    "Decided",
    "check_not_ended",
    "checked_state",
    "leader_topology",
    "merged_header",
    "missing_message",
]

#: How many missing ranks the timeout message names one by one.
_MISSING_NAMED = 32


class Decided(AggregationError):
    """The round's decision key already holds an abort (a follower's notice): the leader
    fails with it and publishes nothing more."""


def leader_topology(ctx: RoundContext, rid: str, own: Any) -> dict[str, Any]:
    """The leader's own topology (what every rank's state is checked against), after
    checking the leader's own state like the others."""
    ref = own.get("topology") if isinstance(own, dict) else None
    if not isinstance(ref, dict):
        raise AggregationError(
            f"{ctx.p} the leader's own state has no 'topology' dict; got {type(ref).__name__}"
        )
    check_state(ctx, rid, LEADER_RANK, own, ref)
    return ref


def checked_state(
    ctx: RoundContext, rid: str, r: int, key: str, blob: bytes, ref: dict[str, Any], step: int
) -> Any:
    """Rank ``r``'s state from its state record ``blob`` (found at ``key``), checked: of
    this round, job and pipeline, at the round's ``step``, and by the lane mapping."""
    rec = decode(blob, STATE)
    if rec is None:
        raise AggregationError(
            f"{ctx.p} rank {r}'s state record in round {rid} ({key} in"
            f" {ctx.where}) is unreadable; is another program writing there?"
        )
    check_identity(ctx, rid, r, rec)
    if "error" in rec:
        raise AggregationError(
            f"{ctx.p} rank {r} could not take part in round {rid}: {rec['error']}"
        )
    check_state(ctx, rid, r, rec.get("state"), ref)
    theirs = rec["state"].get(STEP)
    if theirs != step:
        # A follower joins only a round of its own step: this is no rank of this job.
        raise AggregationError(
            f"{ctx.p} rank {r}'s state in round {rid} is at step {theirs!r}, the round's"
            f" is {step}: a round merges only states of one step; is another program"
            f" writing to {ctx.where}?"
        )
    return rec["state"]


def check_identity(ctx: RoundContext, rid: str, r: int, rec: dict[str, Any]) -> None:
    """Raise unless ``rec`` is rank ``r``'s state record of round ``rid`` of this job and
    pipeline."""
    n = ctx.world_size
    theirs = (rec.get("job_id"), rec.get("fingerprint"))
    if theirs != (ctx.job_id, ctx.fingerprint):
        fp = str(theirs[1])
        raise AggregationError(
            f"{ctx.p} rank {r}'s state in round {rid} belongs to job {theirs[0]!r},"
            f" pipeline {fp[:12]}…, but this leader runs {ctx.who()}: a state of another"
            " job or pipeline is never merged. Every rank of a job must get the same job"
            " id (ZEPHON_JOB_ID or the launcher's) and build the same pipeline"
        )
    if rec.get("round_id") != rid or rec.get("rank") != r or rec.get("world_size") != n:
        raise AggregationError(
            f"{ctx.p} the state record under rank {r}'s key of round {rid} says round"
            f" {rec.get('round_id')!r}, rank {rec.get('rank')!r}, world_size"
            f" {rec.get('world_size')!r}; is another program writing to {ctx.where}?"
        )


def check_state(ctx: RoundContext, rid: str, r: int, st: Any, ref: dict[str, Any]) -> None:
    """Raise at once if rank ``r``'s state disagrees with the leader's lane mapping."""
    problems: list[str] = []
    topo = st.get("topology") if isinstance(st, dict) else None
    if not isinstance(topo, dict):
        problems.append("it has no 'topology' dict")
    else:
        wanted = {
            "rank": r,
            "world_size": ctx.world_size,
            "dp_size": ref.get("dp_size"),
            "canonical_replicas": ref.get("canonical_replicas"),
        }
        for field, want in wanted.items():
            if topo.get(field) != want:
                problems.append(f"{field}={topo.get(field)!r} (the leader has {want!r})")
    expected = sorted(int(x) for x in ctx.expected_lanes(r))
    lanes = st.get("lanes") if isinstance(st, dict) else None
    if not isinstance(lanes, list) or not all(isinstance(x, dict) for x in lanes):
        problems.append("its 'lanes' is not a list of {'lane': int, ...} dicts")
    else:
        raw = [x.get(LANE) for x in lanes]
        ids = [x for x in raw if isinstance(x, int) and not isinstance(x, bool)]
        if len(ids) != len(raw):
            problems.append(f"its lane ids {raw!r} are not all ints")
        elif sorted(ids) != expected:
            problems.append(f"it reports lanes {sorted(ids)}, the leader expects {expected}")
    if problems:
        raise AggregationError(
            f"{ctx.p} rank {r}'s state in round {rid} disagrees with the leader's lane"
            f" mapping: {'; '.join(problems)}. Every rank must build its pipeline with the"
            " same canonical_replicas, world_size and dp_size."
        )


def check_not_ended(ctx: RoundContext, rid: str, view: ControlView, gen_seen: bool) -> bool:
    """A follower's failure notice (the decision key) or the generation key gone (a
    rank that could not write even a notice) ends the collection at once. ``gen_seen``:
    whether the generation key named round ``rid`` at an earlier look; returned for the
    next."""
    keys = ctx.keys
    decision, gen = view.get_many([keys.decision(rid), keys.gen])
    if decision is not None:
        d = read_decision(decision)
        rank = d.record.get("rank")
        who = f"rank {rank}" if isinstance(rank, int) else "a rank"
        raise Decided(f"{ctx.p} {who} could not take part in round {rid}: {ctx.why(rid, d)}")
    if gen == rid.encode():
        return True
    if gen_seen:  # (a watch may not show this leader's own announce yet)
        if gen is None:
            refused = ctx.probe()
            if refused is not None:
                raise AggregationError(ctx.refused_message(rid, refused))
            raise AggregationError(
                f"{ctx.p} round {rid} was ended: its generation key {keys.gen!r} was"
                f" removed from {ctx.where} (a rank that could not write to the store"
                " ends a round that way)"
            )
        raise AggregationError(
            f"{ctx.p} round {rid} cannot publish its merged result: a newer round was"
            f" announced in {ctx.where} meanwhile, so this leader is stale"
            f" (generation is now {gen.decode(errors='replace')!r})"
        )
    return gen_seen


def merged_header(
    ctx: RoundContext, rid: str, merged: Any, states: list[dict[str, Any]]
) -> tuple[dict[str, Any], int]:
    """The merged state without its lanes (what the commit carries) and its lane count,
    after checking that the merged lanes are the ranks' own lane states, which followers
    keep."""
    lanes = merged.get("lanes") if isinstance(merged, dict) else None
    if not isinstance(lanes, list):
        raise AggregationError(
            f"{ctx.p} merging round {rid} returned no 'lanes' list; got {type(merged).__name__}"
        )
    reported: dict[Any, list[Any]] = {}
    for st in states:
        for ls in st["lanes"]:
            reported.setdefault(ls.get(LANE), []).append(ls)
    for ls in lanes:
        lane = ls.get(LANE) if isinstance(ls, dict) else None
        got = reported.get(lane, [])
        if not any(x is ls for x in got) and not any(x == ls for x in got):
            raise AggregationError(
                f"{ctx.p} merging round {rid} changed the state of lane {lane!r}: a"
                " round's merge must keep each lane's state as a rank reported it"
                " (followers keep their own copy and never read the merged lanes)"
            )
    return {k: v for k, v in merged.items() if k != "lanes"}, len(lanes)


def missing_message(ctx: RoundContext, rid: str, missing: list[int]) -> str:
    """The timeout message of a round whose ranks ``missing`` never sent a state."""
    parts = [f"rank {r} (lanes {sorted(ctx.expected_lanes(r))})" for r in missing[:_MISSING_NAMED]]
    if len(missing) > _MISSING_NAMED:
        parts.append(f"and {len(missing) - _MISSING_NAMED} more")
    return (
        f"{ctx.p} checkpoint round {rid} timed out after {ctx.timeout_s:g} s waiting for"
        f" {len(missing)} of {ctx.world_size} ranks in {ctx.where}: {'; '.join(parts)}."
        " Every rank must call checkpoint() at the same step (raise aggregate_timeout_s"
        " if some ranks are just slow)."
    )
