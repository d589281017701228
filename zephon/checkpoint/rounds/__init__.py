"""Multi-rank checkpoint rounds: every rank's state merged through a shared store.

The leader/follower round of the seed page ("Multi-rank aggregation"), over any
:class:`~zephon.checkpoint.stores.base.BaseStore`, at any world size. The leader is global
rank 0. The entry point is :class:`zephon.checkpoint.aggregate.Aggregator`; this package
holds its parts: ``keys`` (where everything lives, what the records hold), ``job`` (the job
id), ``holder`` (each rank's liveness key, taken over from a dead holder), ``wait`` (one
budget, backoff, watches), ``leader``, ``follower``, ``context`` (what both share: deciding
a round, probing the store), ``checks`` (the leader's checks of what the ranks sent),
``merged`` (a follower's share, whose whole merged state is read back from the round's
state records), ``stats`` (what a round cost).

**What a round guarantees** (SPEC section 6; ``tests/chaos`` checks it under random
faults): a round is one step of one job. Every rank's state names its step (batches
delivered since the start of the data); the announcement names the leader's, a follower
joins only a round of its own step and the leader merges only states of it. The outcome is
one decision key, written once, and every rank's return value is read from it: all ranks
return the committed state or all raise. Everything a committed round's file needs (every
rank's state record) is in the store before the commit is written. A failed round costs
that round: the next call at a step every rank reaches runs a new one.

Leader::

    keep_alive("c.leader", exclusive)     once, held until close(): followers see it alive;
                                          a dead holder of this host is taken over at once,
                                          another host's waited for (its lease), a live
                                          one is another job: an error naming job_id=
    announce("c.gen") -> fence            the generation every committing write is fenced on
    put("c.round")                        the announcement: round id, step, world size, job
                                          id, pipeline fingerprint (if it fails: the round
                                          announced as failed, or an empty announcement)
    put("s.<id>.0", its own state record) beside the followers' (before the commit)
    wait until every rank r wrote "s.<id>.r", reporting exactly expected_lanes(r) (its DP
        group's lanes) at the round's step; a state that disagrees with the lane mapping or
        the step, or belongs to another job or pipeline, raises at once; a follower's abort
        (the decision key) or a vanished generation ends the wait at once
    delete("c.round")                     the round is closed
    merge; create("c.d.<id>", commit manifest, fence)
                                          the commit: the merged state's header (no lanes)
                                          and one 8-byte digest per rank's state record; if
                                          writing it raises, the decision key is read back
                                          (the store may have taken it): a commit there is
                                          the round's outcome on this rank too
    wait until every "a.<id>.r" is written (a follower's acknowledgement)
    delete the acks, the previous round's commit and its states; compact the store's
        history (etcd)

Follower r::

    keep_alive("m.<r>", exclusive)        once, held until close(): one live process per
                                          rank (taken over and refused as the leader's)
    watch "c." (etcd) or poll it with backoff (directory, TCPStore, JAX)
    read "c.round" -> round id and step. At another step: behind it (the leader passed this
        rank's step), fail at once naming both steps; ahead of it (the leader's round can
        never get this rank's state), end that round with a notice naming both, and wait
        for the leader to reach this step. The leader this rank worked with gone (its key)
        with nothing announced: fail, naming why
    create("s.<id>.r", state record)
    wait for "c.d.<id>": a commit whose digest for rank r is this rank's record -> the
        result; an abort -> fail with its reason; reads the store fails are tried again
        (the state is written: only the decision key says the round failed)
    put("a.<id>.r", its record's digest)  the acknowledgement (its state stays for the
                                          shares until the next round is acknowledged)

**What a rank gets back.** The leader returns the merged state (every lane). A follower
returns its *share*: the merged state's header (format, fingerprint, topology, the
round-robin positions of every DP group: everything but the lanes) with its own lanes,
which the leader checked are the lanes it merged, and a ``"share"`` entry naming the round.
So a follower reads a manifest of O(W) small entries, never the other ranks' lanes: on
the wire a round is the ranks' states going to the leader and one commit manifest coming
back. The share is a :class:`zephon.checkpoint.share.Share` (a ``dict``) that can still
become the whole merged state: every rank's state record (the leader writes its own
after the commit) stays under ``s.<id>.`` until the next round is acknowledged (or
close()), and ``zephon.save`` of a share, or a
``restore`` of it on lanes it does not hold, reads them from there. So a follower's result
saves and restores on any rank and any world size, as before; only a rank that saves it
pays for reading every lane.

**A store that cannot be reached** when a rank must learn the outcome (a restart of etcd
under the round) is waited for, up to one more ``timeout_s`` past the round's budget: a
rank never guesses, since a commit may be there. If it never answers, the rank raises,
saying the round may have committed elsewhere.

**One decision per round.** ``c.d.<id>`` is written with ``create`` (only if absent): by
the leader's commit, or by anyone's abort notice (the leader's failure notice; a follower
that cannot serialise or write its state; a follower that gives up on a dead or stalled
leader, or at its deadline). Whoever writes first decides, and every rank reads that one
value, so the ranks of a round always agree: all succeed or all fail. A leader paused
mid-round (SIGSTOP) whose followers gave up finds their abort when it resumes and fails
too; paused after its commit, its followers already have the result. The commit is also
fenced on the generation (a newer round's announcement makes it fail) and refused when
the leader's liveness lease lapsed.

**When the store refuses writes** (a full disk, etcd over its quota, permissions): a rank
whose write fails publishes an abort with the store's error; if the store refuses even
that, an empty decision (a full disk still takes an empty file), and failing that it
deletes the generation key (etcd over its quota still takes deletes), which ends the round
for everyone waiting on it. A rank that finds its round ended that way, its leader gone, or
no announcement after ``probe_after_s``, tries one small write of its own to name the
store's error. So every rank fails within about a second, naming the store's error, and no
rank is blamed for it.

**Leftovers** of an earlier run of the same job (same job id and pipeline) are ignored:
their states carry other round ids; an old announcement may be joined by a
follower, which then switches (re-writing its state) as soon as a leader of another session
announces, and an old failure notice does not count, because a follower only trusts a
notice once the round is shown to be live: its leader's liveness key (tagged with the
session) was seen, the announcement was absent at some point of this call, or the follower
already worked with that leader. A commit counts only if it lists the digest of the state
this rank wrote. A follower that sees its own leader announce a later round fails: the round
it joined was abandoned.

One ``timeout_s`` budget covers the whole round. The commit stays in the store as the
"round closed" marker until the next round has been acknowledged by every rank (or
:meth:`Aggregator.close`); if acks time out it stays, with the round's states, for the
followers that have not read it.
"""

from zephon.checkpoint.rounds.job import DEFAULT_JOB_ID, resolve_job_id
from zephon.checkpoint.rounds.keys import LEADER_RANK, Announcement, Keys
from zephon.checkpoint.rounds.stats import RoundStats
from zephon.checkpoint.share import SHARE_KEY

__all__ = [
    "DEFAULT_JOB_ID",
    "LEADER_RANK",
    "SHARE_KEY",
    "Announcement",
    "Keys",
    "RoundStats",
    "resolve_job_id",
]
