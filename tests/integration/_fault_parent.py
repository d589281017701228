"""A parent process for the fault tests in ``test_workers_faults.py`` (not collected).

Usage: ``python _fault_parent.py MODE``; prints one JSON line on stdout once it is ready.

- ``idle``: a ``workers=2`` pipeline reads 3 batches, reports its workers and rings, then
  sleeps (its pump fills the prefetch queue and the rings, so the workers block on a full
  ring: only the parent-death signal can stop them).
- ``slow``: the same report after the first batch, then it keeps iterating a pipeline whose
  ``map`` sleeps (a function of ``__main__``, so the workers get it from dill by value).
- ``segment``: creates one shared-memory segment, reports its name and keeps it until stdin
  closes (a live owner that the sweeper must leave alone).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from corpus import lm_pipeline

import zephon as zp


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


def segment() -> None:
    from zephon.shm import create_segment

    seg = create_segment(4096)
    print(json.dumps({"segment": seg.name}), flush=True)
    sys.stdin.read()
    seg.close()
    seg.unlink()


if __name__ == "__main__":
    {"idle": idle, "slow": slow, "segment": segment}[sys.argv[1]]()
