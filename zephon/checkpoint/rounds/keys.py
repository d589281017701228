"""Where a round's keys live and what its records hold.

Every key of a round sits under one prefix per (job, pipeline)::

    j<job hash>.p<fingerprint>.            P: the job id hashed (12 hex), the pipeline
                                           fingerprint's first 16 hex
    P c.leader                             the leader's liveness key (a lease), held
                                           from its first round until close()
    P m.<rank>                             a follower's liveness key, likewise: one live
                                           process per rank (see rounds.holder)
    P c.gen                                the generation: the current round id; the
                                           fence every committing write is checked against
    P c.round                              the announcement (deleted when the round closes)
    P c.d.<round id>                       the decision: the commit manifest, or an abort
                                           notice; written once (create), so exactly one
                                           outcome exists and every rank reads the same one
    P s.<round id>.<rank>                  a rank's state record (the leader's own is
                                           written after its commit); kept until the next
                                           round is acknowledged by every rank: what a
                                           follower's share reads and merges when it is
                                           saved or restored elsewhere
    P a.<round id>.<rank>                  a follower's acknowledgement (the digest of its
                                           state record), written once it has read the
                                           commit; deleted when every rank's has come
    P x.<rank>                             a probe: "can this rank write at all?"

Followers watch (or poll) only ``P c.``: the control keys are small, and the one large
value among them, the commit manifest, holds O(W) small entries (an 8-byte digest per
rank and the merged state's header), never the lane states. Two jobs (different job ids)
or two pipelines of one job (different fingerprints) on one location have disjoint
prefixes, so their rounds never meet; the records carry both ids anyway, and a record
with another job's or pipeline's id under this prefix is an error naming both.

Records are :func:`zephon.checkpoint.io.dumps` bytes (msgpack + zstd with a checksummed
header; never pickle). A state record's digest (blake2b, 8 bytes, of the record's bytes)
is what the commit manifest lists per rank: a follower accepts a commit only if the entry
for its rank is the digest of the record it wrote.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from zephon.checkpoint.io import dumps, loads
from zephon.errors import CheckpointError

__all__ = [
    "ABORT",
    "ANNOUNCE",
    "COMMIT",
    "DIGEST_BYTES",
    "LEADER_RANK",
    "STATE",
    "Announcement",
    "Keys",
    "decode",
    "digest",
    "encode",
]

LEADER_RANK = 0
DIGEST_BYTES = 8  # (not a defence against forgery: it tells this rank's record from another's)
_KIND = "zephon.round"
ANNOUNCE = f"{_KIND}/announce"
STATE = f"{_KIND}/state"
COMMIT = f"{_KIND}/commit"
ABORT = f"{_KIND}/abort"


def job_hash(job_id: str) -> str:
    """The job id as a short key-safe name (12 hex of its blake2b)."""
    return hashlib.blake2b(job_id.encode(), digest_size=6).hexdigest()


class Keys:
    """The key names of one job's rounds of one pipeline (see the module docstring)."""

    def __init__(self, job_id: str, fingerprint: str) -> None:
        fp = "".join(c for c in fingerprint.lower() if c in "0123456789abcdef")[:16] or "0"
        self.prefix = f"j{job_hash(job_id)}.p{fp}."
        self.control = self.prefix + "c."
        self.leader = self.control + "leader"
        self.gen = self.control + "gen"
        self.round = self.control + "round"
        self.decisions = self.control + "d."
        self.probes = self.prefix + "x."
        self.members = self.prefix + "m."

    def member(self, rank: int) -> str:
        return f"{self.members}{rank}"

    def decision(self, rid: str) -> str:
        return f"{self.decisions}{rid}"

    def states(self, rid: str) -> str:
        return f"{self.prefix}s.{rid}."

    def state(self, rid: str, rank: int) -> str:
        return f"{self.prefix}s.{rid}.{rank}"

    def acks(self, rid: str) -> str:
        return f"{self.prefix}a.{rid}."

    def ack(self, rid: str, rank: int) -> str:
        return f"{self.prefix}a.{rid}.{rank}"

    def probe(self, rank: int) -> str:
        return f"{self.probes}{rank}"

    @staticmethod
    def rank_of(key: str) -> int | None:
        """The rank at the end of a state key (None if it is not one)."""
        tail = key.rsplit(".", 1)[-1]
        return int(tail) if tail.isdigit() else None


@dataclass(frozen=True)
class Announcement:
    """What ``c.round`` holds: the round id and who it belongs to; ``step``, the step of the
    leader's state (batches delivered since the start of the data), which every rank's
    state must be at; ``call``, the leader's count of checkpoint() calls (for messages);
    and ``void``: this
    leader's earlier rounds whose announcement it never saw go through (the store timed
    out or failed it). The store may still apply such a write late, after the leader gave
    the round up; a follower that joined one of them joined no round of the leader's, and
    takes this round instead of failing."""

    round_id: str
    session: str
    counter: int
    world_size: int
    job_id: str
    fingerprint: str
    step: int
    call: int = 0
    void: tuple[str, ...] = ()
    #: Set when the leader could not run the round (its announcement failed, say): why.
    error: str = ""

    def encode(self) -> bytes:
        return encode(
            ANNOUNCE,
            round_id=self.round_id,
            session=self.session,
            counter=self.counter,
            world_size=self.world_size,
            leader_rank=LEADER_RANK,
            job_id=self.job_id,
            fingerprint=self.fingerprint,
            step=self.step,
            call=self.call,
            void=list(self.void),
            error=self.error,
        )

    @classmethod
    def decode(cls, blob: bytes) -> Announcement | None:
        """None for bytes this version did not write as an announcement."""
        rec = decode(blob, ANNOUNCE)
        if rec is None:
            return None
        try:
            return cls(
                str(rec["round_id"]),
                str(rec["session"]),
                int(rec["counter"]),
                int(rec["world_size"]),
                str(rec["job_id"]),
                str(rec["fingerprint"]),
                int(rec["step"]),
                int(rec.get("call", 0)),
                tuple(str(r) for r in rec.get("void", ())),
                str(rec.get("error", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None


def encode(kind: str, **fields: Any) -> bytes:
    """A record: ``{"kind": kind, **fields}`` as checkpoint-format bytes (fast zstd)."""
    return dumps({"kind": kind, **fields}, level=1)


def decode(blob: bytes, kind: str | None = None) -> dict[str, Any] | None:
    """The record in ``blob`` (of ``kind``, when given), or None if it is not one."""
    try:
        rec = loads(blob)
    except CheckpointError:
        return None
    if kind is not None and rec.get("kind") != kind:
        return None
    return rec


def digest(blob: bytes) -> bytes:
    """The digest (``DIGEST_BYTES``) a commit manifest lists for a state record."""
    return hashlib.blake2b(blob, digest_size=DIGEST_BYTES).digest()
