"""A follower's result of a committed round: the merged state's header with the rank's own
lanes, as a :class:`~zephon.checkpoint.share.Share` whose whole merged state is read back
when it is asked for, from the round's state records (kept until the next round is
acknowledged; see :mod:`zephon.checkpoint.rounds.keys`), each checked against the
commit's digests."""

from __future__ import annotations

import time
from typing import Any

from zephon.checkpoint.rounds.context import RoundContext
from zephon.checkpoint.rounds.keys import DIGEST_BYTES, LEADER_RANK, STATE, decode, digest
from zephon.checkpoint.rounds.wait import Deadline
from zephon.checkpoint.share import SHARE_KEY, Share
from zephon.checkpoint.state import ROUND
from zephon.errors import AggregationError, CheckpointError
from zephon.tracking.schema import LANE

__all__ = ["read_merged", "share_of", "with_round"]


def share_of(
    ctx: RoundContext, rec: dict[str, Any], state: dict[str, Any], rid: str
) -> dict[str, Any]:
    """The merged state's header with this rank's own lanes (the merged lanes of this
    rank are its own, as the leader checked) and what they are a share of."""
    header = rec.get("header")
    if not isinstance(header, dict):
        raise AggregationError(f"{ctx.p} the commit of round {rid} has no header")
    out = dict(header)
    out["lanes"] = sorted(state["lanes"], key=lambda ls: ls[LANE])
    lanes_total = int(rec.get("lanes_total", 0))
    out[SHARE_KEY] = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "round_id": rid,
        "job_id": ctx.job_id,
        "lanes_total": lanes_total,
    }
    own = out["lanes"]
    digests = rec.get("digests")

    def fetch() -> dict[str, Any]:
        merged = read_merged(ctx, rid, digests, own)
        if ROUND in header:
            merged[ROUND] = header[ROUND]
        return merged

    return Share(out, fetch)


def with_round(merged: Any, ctx: RoundContext, rid: str, step: int) -> Any:
    """``merged`` (the leader's merge of round ``rid``) naming its round: its id, its step
    and the job (``zephon.save`` says so when saving it fails; ``zephon inspect`` shows
    it)."""
    if isinstance(merged, dict):
        merged[ROUND] = {"round_id": rid, "step": step, "job_id": ctx.job_id}
    return merged


def read_merged(ctx: RoundContext, rid: str, digests: Any, own: list[Any]) -> dict[str, Any]:
    """Round ``rid``'s whole merged state: every rank's state record (waiting, within one
    round budget, for the leader's own, which it writes after its commit), each checked
    against the commit's digests, merged as the leader merged them."""
    keys, n = ctx.keys, ctx.world_size
    what = f"{ctx.p} the merged state of round {rid} (this rank's share of it was asked"
    if not isinstance(digests, bytes) or len(digests) != n * DIGEST_BYTES:
        raise CheckpointError(f"{what} for every lane): the commit of round {rid} lists no digests")
    deadline = Deadline(ctx.timeout_s)
    delay = float(ctx.store.poll_interval_s)
    records: list[bytes | None] = [None] * n
    try:
        while True:
            missing = [r for r in range(n) if records[r] is None]
            got = ctx.store.get_many([keys.state(rid, r) for r in missing])
            for r, blob in zip(missing, got, strict=True):
                records[r] = blob
            if all(blob is not None for blob in records):
                break
            if ctx.store.get(keys.decision(rid)) is None:
                raise CheckpointError(
                    f"{what} for every lane) is no longer in {ctx.where}: a later round"
                    " was acknowledged, or rank 0 closed its pipeline. Save a follower's"
                    " checkpoint() result before the next checkpoint() and before rank 0"
                    " closes, or save rank 0's"
                )
            if deadline.remaining() <= 0:
                absent = [r for r in range(n) if records[r] is None]
                raise CheckpointError(
                    f"{what} for every lane): the state records of ranks {absent[:8]} did"
                    f" not appear in {ctx.where} within {ctx.timeout_s:g} s; the leader"
                    f" (rank {LEADER_RANK}) logs why"
                )
            time.sleep(min(delay, max(deadline.remaining(), 0.0)))
            delay = min(delay * 2, 0.5)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{what} for every lane) could not be read from {ctx.where}: {type(e).__name__}: {e}"
        ) from e
    states = []
    for r, record in enumerate(records):
        st = decode(record, STATE) if isinstance(record, bytes) else None
        if (
            st is None
            or digest(record) != digests[r * DIGEST_BYTES : (r + 1) * DIGEST_BYTES]  # type: ignore[arg-type]
            or (st.get("round_id"), st.get("job_id"), st.get("fingerprint"))
            != (rid, ctx.job_id, ctx.fingerprint)
        ):
            raise CheckpointError(
                f"{what} for every lane): rank {r}'s state record {keys.state(rid, r)}"
                f" in {ctx.where} is not the one the round's commit lists"
            )
        states.append(st["state"])
    merged = ctx.merge(states)
    by_lane = {ls.get(LANE): ls for ls in merged.get("lanes", []) if isinstance(ls, dict)}
    if any(by_lane.get(ls[LANE]) != ls for ls in own):
        raise CheckpointError(
            f"{what} for every lane) merged from {ctx.where} differs from this rank's own lanes"
        )
    return merged
