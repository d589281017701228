"""A parent process for the fault tests in ``test_workers_faults.py`` (not collected).

Usage: ``python _fault_parent.py MODE [ARGS]``; prints JSON lines on stdout, the first once
it is ready.

- ``idle``: a ``workers=2`` pipeline reads 3 batches, reports its workers and rings, then
  sleeps (its pump fills the prefetch queue and the rings, so the workers block on a full
  ring: only the parent-death signal can stop them).
- ``slow``: the same report after the first batch, then it keeps iterating a pipeline whose
  ``map`` sleeps (a function of ``__main__``, so the workers get it from dill by value).
- ``churn METHOD``: reports ready, then starts a ``workers=2`` pipeline with that start
  method (its dataset large enough to go through the shared data segment), reports its
  workers after the first batch, reads more for 0.6 s, closes it, and again, forever: a
  kill at a random moment lands in any phase.
- ``preempted PATH STOP_AT HOW``: a training loop that reports each batch's digest and
  "trains" on batch STOP_AT until SIGTERM comes. Its own SIGTERM handler (``HOW=handler``)
  checkpoints, saves to PATH with ``zp.save`` and exits; with ``HOW=flag`` the handler only
  sets a flag, and the loop reads 3 more batches before it checkpoints, saves and exits.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import signal
import sys
import time
from typing import Any

import numpy as np

import zephon as zp
from tests.integration.corpus import lm_pipeline

PREEMPTED_SEED = 7
EXTRA_AFTER_FLAG = 3


def _report(pipe: zp.Pipeline) -> None:
    workers = pipe.stats()["workers"]
    info = {"pids": [w["pid"] for w in workers], "rings": [w["ring"] for w in workers]}
    print(json.dumps(info), flush=True)


def slow_rows(x: int) -> dict[str, np.ndarray]:
    time.sleep(0.05)
    return {"x": np.full(16, x, dtype=np.int64)}


def idle() -> None:
    pipe = lm_pipeline(seed=5, workers=2, num_epochs=None)
    for _ in range(3):
        next(pipe)
    _report(pipe)
    time.sleep(120)


def slow() -> None:
    src = zp.StaticMixtureWorkSource(
        datasets={"a": zp.ArraySource(np.arange(1000, dtype=np.int64))},
        weights={"a": 1.0},
        seed=0,
        chunk_size=8,
        num_epochs=None,
    )
    pipe = (
        zp.Pipeline(src, canonical_replicas=4, workers=2, prefetch=2)
        .fetch()
        .map(slow_rows)
        .batch(2)
    )
    # No try/finally and no close(): Ctrl-C must clean up after a plain loop.
    for i, _ in enumerate(pipe):
        if i == 0:
            _report(pipe)


def churn(method: str) -> None:
    rows = np.arange(1 << 16, dtype=np.int64)  # 512 KiB: shared with the workers, not pickled
    print(json.dumps({"ready": True}), flush=True)
    while True:
        src = zp.StaticMixtureWorkSource(
            datasets={"a": zp.ArraySource(rows)}, weights={"a": 1.0}, seed=0, num_epochs=None
        )
        pipe = (
            zp.Pipeline(src, canonical_replicas=4, workers=2, worker_start_method=method)
            .fetch()
            .batch(8)
        )
        next(pipe)
        print(json.dumps({"running": [w["pid"] for w in pipe.stats()["workers"]]}), flush=True)
        until = time.monotonic() + 0.6
        while time.monotonic() < until:
            next(pipe)
        pipe.close()


def digest(batch: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in sorted(batch):
        h.update(key.encode())
        h.update(np.ascontiguousarray(batch[key]).tobytes())
    return h.hexdigest()[:16]


def preempted_pipeline(workers: int) -> zp.Pipeline:
    return lm_pipeline(seed=PREEMPTED_SEED, workers=workers, num_epochs=None)


def preempted(path: str, stop_at: int, how: str) -> None:
    pipe = preempted_pipeline(workers=2)
    flagged: list[int] = []

    def save_and_exit() -> None:
        zp.save(path, pipe.checkpoint())
        print(json.dumps({"saved": step}), flush=True)
        sys.exit(0)

    def on_sigterm(signum: int, frame: Any) -> None:
        if how == "flag":
            flagged.append(signum)
        else:
            save_and_exit()

    signal.signal(signal.SIGTERM, on_sigterm)
    for step, batch in enumerate(pipe):
        mine = signal.getsignal(signal.SIGTERM) is on_sigterm
        print(json.dumps({"step": step, "digest": digest(batch), "handler_kept": mine}), flush=True)
        if step == stop_at:
            print(json.dumps({"training": step}), flush=True)
            deadline = time.monotonic() + 60
            while not flagged and time.monotonic() < deadline:
                time.sleep(0.01)  # the training step that the preemption interrupts
        if flagged and step == stop_at + EXTRA_AFTER_FLAG:
            save_and_exit()


if __name__ == "__main__":
    # SIGUSR1 writes every thread's stack to stderr (a C handler: also when the main thread
    # cannot run Python), for the test to show where a parent that should have ended is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C as a terminal's foreground job gets it, whatever the test process had: a
    # process inherits SIGINT ignored or blocked (a background job's), and Python then
    # raises no KeyboardInterrupt (CI's Ctrl-C test parent twice never saw the signal).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "churn":
        churn(args[0])
    elif mode == "preempted":
        preempted(args[0], int(args[1]), args[2])
    else:
        {"idle": idle, "slow": slow}[mode]()
