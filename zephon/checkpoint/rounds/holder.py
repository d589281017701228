"""Who holds a rank's place in a job's rounds, and taking it over from a holder that died.

Every rank of a round holds one liveness key while its pipeline lives: the leader
``c.leader``, each follower ``m.<rank>`` (see :mod:`zephon.checkpoint.rounds.keys`). The
value names the holder: ``<session> rank=<r> pid=<pid> host=<host> start=<ticks>`` (the
session is the Aggregator's own random id; ``start`` the process's start time in clock
ticks, so a pid reused by another process is not taken for the holder).

Taking the key (:func:`take_place`) is exclusive. A key held by someone else is:

* this Aggregator's own (its lease lapsed while it was paused): taken back;
* a process of this host that is gone (killed, exited while the store was down): taken
  over at once, so a job restarted right after a crash runs its first round;
* a live process of this host: another job with the same job id and pipeline on this
  location. That is an error at once, naming ``job_id=``;
* a process of another host: it cannot be asked, so the key is waited for until its lease
  lapses (a dead holder's lapses within the lease time), within the round's budget; if it
  never does, the same error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time

from zephon.checkpoint.rounds.wait import Deadline
from zephon.checkpoint.stores.base import BaseStore, KeepAlive, KeyHeldError
from zephon.errors import AggregationError

__all__ = ["Holder", "PlaceTakenError", "holder_value", "take_place"]

_HOST = socket.gethostname()


class PlaceTakenError(AggregationError):
    """Another live process holds this rank's place: two jobs on one location that their
    job ids do not tell apart."""


def _start_ticks(pid: int) -> str | None:
    """The process's start time (``/proc/<pid>/stat`` field 22), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rsplit(b")", 1)[-1].split()
    return fields[19].decode() if len(fields) > 19 else None


_START = _start_ticks(os.getpid()) or "?"


def holder_value(session: str, rank: int) -> bytes:
    """What this process writes into a place it holds."""
    return f"{session} rank={rank} pid={os.getpid()} host={_HOST} start={_START}".encode()


class Holder:
    """A place key's value, read back: its session and, where written, its process."""

    def __init__(self, value: bytes) -> None:
        text = value.decode(errors="replace")
        words = text.split()
        self.text = text
        self.session = words[0] if words else ""
        fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        self.host = fields.get("host")
        self.start = fields.get("start")
        try:
            self.pid: int | None = int(fields["pid"])
        except (KeyError, ValueError):
            self.pid = None

    def gone(self) -> bool | None:
        """True: a process of this host that no longer runs; False: one that does (or this
        process); None: another host's (or a value that names no process)."""
        if self.pid is None or self.host != _HOST:
            return None
        if self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it runs, under another user
        start = _start_ticks(self.pid)
        if start is not None and self.start not in (None, "?") and start != self.start:
            return True  # the pid now belongs to another process
        return False


def take_place(
    store: BaseStore,
    key: str,
    value: bytes,
    ttl_s: float,
    deadline: Deadline,
    *,
    session: str,
    conflict: str,
    log: logging.Logger | None = None,
    p: str = "",
) -> KeepAlive:
    """Hold ``key`` (a liveness lease of ``ttl_s``) for this rank; returns the lease.

    ``conflict`` is the message for a key that another live process holds (it is followed
    by what the key says). See the module docstring for who is taken over and who waited
    for; the wait ends at ``deadline`` (a ``Deadline``).

    Raises:
        PlaceTakenError: another live process holds the key.
    """
    poll_s = min(0.25, max(ttl_s / 8, 0.02))
    waited = False
    while True:
        try:
            return store.keep_alive(key, value, ttl_s, exclusive=True)
        except KeyHeldError as e:
            error = e
            held = Holder(e.value)
        if held.session == session:
            # This Aggregator's own key, from a lease that lapsed and is not revoked yet.
            return store.keep_alive(key, value, ttl_s)
        gone = held.gone()
        if gone:
            if log is not None:
                log.info(
                    "%s %r was held by pid %s of this host, which is gone; taking it over",
                    p,
                    key,
                    held.pid,
                )
            with contextlib.suppress(Exception):
                store.delete(key)
            continue
        if gone is None and deadline.remaining() > poll_s:
            # Another host's holder: its lease lapses within ttl_s if it is dead.
            if not waited and log is not None:
                log.info(
                    "%s %r is held by %r; waiting up to its lease (%g s) for it to lapse",
                    p,
                    key,
                    held.text,
                    ttl_s,
                )
            waited = True
            time.sleep(poll_s)
            continue
        alive = "a live process of this host" if gone is False else "a process of another host"
        waited_for = f" (waited {ttl_s:g} s for its lease to lapse)" if waited else ""
        raise PlaceTakenError(
            f"{conflict}: {key!r} is held by {alive}{waited_for}: {held.text!r}"
        ) from error
