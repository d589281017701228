"""What the leader and the followers of a round share: the rank's settings, its store and
keys, its watch, and the steps both sides take (deciding a round, probing the store)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zephon.checkpoint.rounds.keys import ABORT, COMMIT, Keys, decode, encode
from zephon.checkpoint.rounds.wait import open_watch
from zephon.checkpoint.stores.base import BaseStore, PrefixWatch

__all__ = ["Decision", "RoundContext"]


@dataclass(frozen=True)
class Decision:
    """A round's decision as read back: ``kind`` is ``"commit"`` or ``"abort"`` (or
    ``"unknown"``: the store could not be reached to read it; see
    :meth:`RoundContext.abort`)."""

    kind: str
    record: dict[str, Any]
    empty: bool = False  # an abort whose notice the store refused (see read_decision)

    @property
    def why(self) -> str:
        return str(self.record.get("error") or "no reason recorded")


def read_decision(blob: bytes) -> Decision:
    """The decision in ``blob``. An empty value is an abort whose notice could not be
    stored (the store refused everything but an empty key); anything unreadable too."""
    if not blob:
        return Decision(
            "abort",
            {"error": "a rank aborted the round but the store refused its notice (is it full?)"},
            empty=True,
        )
    rec = decode(blob)
    if rec is not None and rec.get("kind") == COMMIT:
        return Decision("commit", rec)
    if rec is not None and rec.get("kind") == ABORT:
        return Decision("abort", rec)
    return Decision("abort", {"error": "the round's decision key holds an unreadable value"})


class RoundContext:
    """One rank's side of every round: settings, store, keys, logger and watch."""

    def __init__(
        self,
        store: BaseStore,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        lease_ttl_s: float,
        expected_lanes: Callable[[int], list[int]],
        merge: Callable[[list[dict[str, Any]]], dict[str, Any]],
        job_id: str,
        job_source: str,
        fingerprint: str,
        log: logging.Logger,
        probe_after_s: float,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.expected_lanes = expected_lanes
        self.merge = merge
        self.job_id = job_id
        self.job_source = job_source
        self.fingerprint = fingerprint
        self.log = log
        self.probe_after_s = probe_after_s
        self.p = f"[rank={rank}]"
        self.keys = Keys(job_id, fingerprint)
        self._watch: PrefixWatch | None = None
        self._watch_prefix: str | None = None
        store.log_prefix = f"{self.p} "

    @property
    def where(self) -> str:
        return str(self.store.describe())

    def conflict_message(self, what: str) -> str:
        """The start of the error for a rank whose place (``what``) another live process
        holds: two jobs that this location cannot tell apart."""
        return (
            f"{self.p} {what} of {self.who()} in {self.where} is another process's: two jobs"
            " with the same job id and pipeline share this location, and their rounds would"
            " mix. Give each job its own id: Pipeline(job_id=...) or ZEPHON_JOB_ID"
        )

    def who(self) -> str:
        """``job 'slurm:1' pipeline 3f9a…`` for messages about identity."""
        fp = self.fingerprint[:12] + "…" if len(self.fingerprint) > 12 else self.fingerprint
        return f"job {self.job_id!r} (from {self.job_source}), pipeline {fp or '(none)'}"

    def watch(self, prefix: str) -> PrefixWatch | None:
        """This rank's watch of ``prefix`` (opened once, kept until close), or None."""
        if self._watch is None or self._watch_prefix != prefix:
            if self._watch is not None:
                with contextlib.suppress(Exception):
                    self._watch.close()
            self._watch = open_watch(self.store, prefix)
            self._watch_prefix = prefix
        return self._watch

    def close_watch(self) -> None:
        if self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.close()
            self._watch = None

    def counters(self) -> dict[str, int]:
        return self.store.counters.snapshot()

    def record(self, kind: str, rid: str, **fields: Any) -> bytes:
        """A record of round ``rid`` of this job and pipeline: the ids, then ``fields``."""
        return encode(
            kind, round_id=rid, job_id=self.job_id, fingerprint=self.fingerprint, **fields
        )

    # -------------------------------------------------------------------- deciding

    def abort(
        self, rid: str, error: str, *, settle_until: float | None = None, **fields: Any
    ) -> Decision | None:
        """Decide round ``rid`` as failed, with ``error`` as the notice; never raises.

        Returns None when this abort decided the round, else the decision that stands (the
        leader's commit, someone's notice). The decision key is created, so if someone
        decided first that decision is returned and stands. When the store refuses the
        notice, an empty decision is tried (a full disk still takes an empty file), then
        the generation key is deleted (etcd over its quota still takes deletes): either
        way no commit of ``rid`` can follow, and waiting ranks see the round end.

        With ``settle_until`` (a ``time.monotonic()`` time), a store that cannot be reached
        at all (not even read) is tried again until then, because the round's outcome is
        what its decision key holds and a rank must not guess it (a commit may be there):
        a store restarting under the round is waited for. If it never answers, the
        decision returned is ``"unknown"``.
        """
        while True:
            decision, reached = self._abort_once(rid, error, fields)
            if reached:
                return decision
            if settle_until is None or time.monotonic() >= settle_until:
                return Decision(
                    "unknown",
                    {
                        "error": f"{self.where} could not be reached to learn the outcome of"
                        f" round {rid}: it may have committed on other ranks"
                    },
                )
            time.sleep(min(0.2, max(settle_until - time.monotonic(), 0.0)))

    def _abort_once(
        self, rid: str, error: str, fields: dict[str, Any]
    ) -> tuple[Decision | None, bool]:
        """One try of :meth:`abort`: its result, and whether the store answered at all."""
        notice = encode(ABORT, round_id=rid, rank=self.rank, error=error, **fields)
        key = self.keys.decision(rid)
        failures = []
        for value in (notice, b""):
            try:
                existing = self.store.create(key, value)
            except Exception as e:  # noqa: BLE001 - try the next, smaller signal
                failures.append(f"{type(e).__name__}: {e}")
                continue
            return (None if existing is None else read_decision(existing)), True
        try:
            self.store.delete(self.keys.gen)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{type(e).__name__}: {e}")
            try:
                blob = self.store.get(key)
            except Exception:  # noqa: BLE001 - not even a read: the store is unreachable
                self.log.warning(
                    "%s could not reach %s to end round %s: %s",
                    self.p,
                    self.where,
                    rid,
                    "; ".join(failures),
                )
                return None, False
            self.log.error(
                "%s could not publish the failure notice of round %s in %s, nor end the"
                " round by deleting its generation key: %s",
                self.p,
                rid,
                self.where,
                "; ".join(failures),
            )
            return (None if blob is None else read_decision(blob)), True
        self.log.error(
            "%s the store refused the failure notice of round %s (%s); ended the round by"
            " deleting its generation key instead",
            self.p,
            rid,
            failures[0],
        )
        # The leader may have committed just before the delete: then that stands.
        with contextlib.suppress(Exception):
            blob = self.store.get(key)
            if blob is not None:
                return read_decision(blob), True
        return None, True

    def probe(self) -> str | None:
        """Whether this rank can write to the store at all: None, or the store's error."""
        key = self.keys.probe(self.rank)
        try:
            self.store.put(key, b"probe %.3f" % time.time())
        except Exception as e:  # noqa: BLE001 - the error is the answer
            return f"{type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            self.store.delete(key)
        return None

    def why(self, rid: str, d: Decision) -> str:
        """``d``'s reason; for an empty notice, this rank's own probe of the store names
        the error the store gives (the rank that aborted could not store it)."""
        if d.empty:
            refused = self.probe()
            if refused is not None:
                return f"the store {self.where} refuses writes ({refused})"
        return d.why

    def refused_message(self, rid: str | None, error: str) -> str:
        what = f"checkpoint round {rid}" if rid else "the checkpoint round"
        return (
            f"{self.p} {what} cannot run: the store {self.where} refuses writes ({error})."
            " Free space or raise its quota (etcd: --quota-backend-bytes, then"
            " 'etcdctl alarm disarm'), or fix its permissions"
        )

    def delete_quietly(self, key: str) -> None:
        try:
            self.store.delete(key)
        except Exception as e:  # noqa: BLE001 - cleanup must not mask the round's outcome
            self.log.warning("%s could not delete %r in %s: %s", self.p, key, self.where, e)

    def delete_prefix_quietly(self, prefix: str, keys: list[str]) -> None:
        """Remove ``prefix`` (in one request where the store can; ``keys`` are those a store
        that cannot list deletes)."""
        try:
            self.store.delete_prefix(prefix, keys)
        except Exception as e:  # noqa: BLE001 - cleanup must not mask the round's outcome
            self.log.warning("%s could not delete %r* in %s: %s", self.p, prefix, self.where, e)
