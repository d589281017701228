"""Question 2: restore cost and checkpoint size against the step and the lane count.

For Zephon (workers 0 and 2) and Grain: time from a fresh loader to its first batch after
restoring a checkpoint taken at step 10, 1,000 and 10,000 (decoding the checkpoint bytes
included), against a fresh start to its first batch; checkpoint bytes (Zephon: the zstd file
``zp.save`` writes; Grain: its JSON state) and ``checkpoint()`` latency (median of 5 calls in a
row). Then Zephon's checkpoint bytes per lane and latency for canonical_replicas 1, 8, 64.

Each loader is checkpointed once per step; then, in every repetition, the fresh starts and
restores of all loaders at all steps run one after another, in an order rotated between
repetitions, so machine noise lands on all of them alike. Times are medians with their
min-max range (41 repetitions for Zephon in process, 15 for Grain, 3 for workers=2, which
starts processes); restore/fresh is the ratio of the medians, ``vs step 10`` that of a
restore to the same loader's restore at step 10. ``exact``: in every repetition, the first batch after the restore equals the batch
the checkpointed loader produced next.

    python -m benchmarks.restore [--quick] [--repeats N] [--no-grain] [--results DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zephon as zp
from benchmarks.harness.batches import batches_equal, copy_batch
from benchmarks.harness.results import write_results
from benchmarks.harness.stats import median_and_range, summarize
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, time_calls
from benchmarks.workload import SyntheticDocs, pregenerate
from benchmarks.zephon_lm import zephon_lm_pipeline

CHECKPOINT_CALLS = 5


class Restorable(Protocol):
    """A loader checkpointed once, to time fresh starts and restores against."""

    checkpoint_s: list[float]
    state_bytes: int

    def time_fresh(self) -> float: ...

    def time_restore(self) -> dict[str, Any]: ...


class ZephonRestore:
    """The Zephon LM pipeline checkpointed once after ``step`` batches (the counterpart of
    ``grain_baseline.GrainRestore``)."""

    def __init__(self, docs: Sequence[str], step: int, workers: int, lanes: int = 8) -> None:
        self.docs, self.workers, self.lanes = docs, workers, lanes
        with self._build() as p:
            for _ in range(step):
                next(p)
            self.checkpoint_s, state = time_calls(p.checkpoint, CHECKPOINT_CALLS)
            self.blob = zp.checkpoint.dumps(state)
            self.expected = copy_batch(next(p))
        self.state_bytes = len(self.blob)

    def _build(self) -> zp.Pipeline:
        return zephon_lm_pipeline(self.docs, 0, self.workers, lanes=self.lanes)

    def time_fresh(self) -> float:
        """Seconds from a new pipeline to its first batch."""
        t0 = time.perf_counter()
        with self._build() as q:
            next(q)
            return time.perf_counter() - t0

    def time_restore(self) -> dict[str, Any]:
        """``restore_s`` (new pipeline, decode, ``restore``, first batch), ``exact`` and
        ``replayed_chunks``."""
        t0 = time.perf_counter()
        with self._build() as q:
            q.restore(zp.checkpoint.loads(self.blob))
            first = next(q)
            restore_s = time.perf_counter() - t0
            return {
                "restore_s": restore_s,
                "exact": batches_equal(first, self.expected),
                "replayed_chunks": q.stats()["replayed_chunks"],
            }


def loaders(docs: Sequence[str], step: int, with_grain: bool) -> dict[str, Restorable]:
    out: dict[str, Restorable] = {
        "zephon workers=0": ZephonRestore(docs, step, 0),
        "zephon workers=2": ZephonRestore(docs, step, 2),
    }
    if with_grain:
        from benchmarks.grain_baseline import GrainRestore

        out["grain single-process"] = GrainRestore(docs, 0, step, checkpoint_calls=CHECKPOINT_CALLS)
    return out


def timed_runs(
    subjects: dict[str, Restorable], repeats: dict[str, int]
) -> dict[str, tuple[list[float], list[dict[str, Any]]]]:
    """Every loader's fresh-start seconds and restore results, interleaved and rotated."""
    cands: dict[str, Callable[[], Any]] = {}
    counts: dict[str, int] = {}
    for name, subject in subjects.items():
        for kind, fn in (("fresh", subject.time_fresh), ("restore", subject.time_restore)):
            cands[f"{name} {kind}"] = fn
            counts[f"{name} {kind}"] = repeats[name]
    runs = interleaved_repeats(cands, counts, rotate=True)
    return {name: (runs[f"{name} fresh"], runs[f"{name} restore"]) for name in subjects}


def restore_row(
    name: str,
    step: int,
    subject: Restorable,
    fresh: list[float],
    restores: list[dict[str, Any]],
    lanes: int | None,
) -> dict[str, Any]:
    restore_s = [r["restore_s"] for r in restores]
    replayed = [r["replayed_chunks"] for r in restores if "replayed_chunks" in r]
    return {
        "loader": name,
        "step": step,
        **median_and_range("fresh ms", fresh, scale=1e3),
        **median_and_range("restore ms", restore_s, scale=1e3),
        "restore/fresh": round(summarize(restore_s)["median"] / summarize(fresh)["median"], 2),
        "reps": len(restores),
        "replayed chunks": max(replayed) if replayed else None,
        "ckpt bytes": subject.state_bytes,
        "bytes/lane": round(subject.state_bytes / lanes) if lanes else None,
        "checkpoint() ms": round(statistics.median(subject.checkpoint_s) * 1e3, 3),
        "exact": all(r["exact"] for r in restores),
    }


def repetitions(subject: Restorable, repeats: int | None, quick: bool) -> int:
    """``repeats`` if given, else 1 with ``quick``, else 41 for Zephon in process and 15 for
    Grain (milliseconds each, on a noisy machine), 3 where each run starts worker
    processes."""
    if repeats is not None:
        return repeats
    if quick:
        return 1
    if isinstance(subject, ZephonRestore):
        return 3 if subject.workers > 0 else 41
    return 15


def all_rows(
    docs: Sequence[str], steps: Sequence[int], with_grain: bool, repeats: int | None, quick: bool
) -> list[dict[str, Any]]:
    """One row per loader and step. The loaders of every step run interleaved in one set of
    rounds, so the ratio of a restore at a late step to one at ``steps[0]`` (``vs step``)
    compares times taken side by side, not minutes apart."""
    subjects = {
        f"{name} @ {step}": (name, step, subject)
        for step in steps
        for name, subject in loaders(docs, step, with_grain).items()
    }
    counts = {key: repetitions(s, repeats, quick) for key, (_, _, s) in subjects.items()}
    runs = timed_runs({key: s for key, (_, _, s) in subjects.items()}, counts)
    rows = []
    first: dict[str, float] = {}  # each loader's median restore at steps[0]
    for key, (name, step, subject) in subjects.items():
        fresh, restores = runs[key]
        lanes = subject.lanes if isinstance(subject, ZephonRestore) else None
        row = restore_row(name, step, subject, fresh, restores, lanes)
        median = summarize([r["restore_s"] for r in restores])["median"]
        first.setdefault(name, median)
        row[f"vs step {steps[0]}"] = round(median / first[name], 2)
        rows.append(row)
    return rows


def lanes_sweep(docs: Sequence[str], step: int) -> list[dict[str, Any]]:
    rows = []
    for lanes in (1, 8, 64):
        with zephon_lm_pipeline(docs, 0, 0, lanes=lanes) as p:
            for _ in range(step):
                next(p)
            times, state = time_calls(p.checkpoint, CHECKPOINT_CALLS)
            blob = zp.checkpoint.dumps(state)
        rows.append(
            {
                "canonical_replicas": lanes,
                "step": step,
                "ckpt bytes": len(blob),
                "bytes/lane": round(len(blob) / lanes),
                "checkpoint() ms": round(statistics.median(times) * 1e3, 3),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repetitions for every loader (default 5, 3 for workers=2; 1 with --quick)",
    )
    ap.add_argument("--no-grain", action="store_true")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    steps = (10, 100) if args.quick else (10, 1000, 10000)
    docs = pregenerate(SyntheticDocs(1500 if args.quick else 20000, seed=0))
    with_grain = not args.no_grain
    if with_grain:
        try:
            import grain  # noqa: F401
        except ImportError:
            with_grain = False
    rows = all_rows(docs, steps, with_grain, args.repeats, args.quick)
    print_table(
        rows,
        list(rows[0]),
        title="Restore to first batch, against the step (medians and min–max over reps)",
    )
    sweep = lanes_sweep(docs, steps[-1] if args.quick else 1000)
    print_table(
        sweep, list(sweep[0]), title="Checkpoint size and latency against canonical_replicas"
    )
    write_results("restore", rows, args.results, extra={"lanes_sweep": sweep, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
