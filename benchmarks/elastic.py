"""Question 5: elastic resume - restore a checkpoint into a different number of worker
processes or ranks, and check that every lane continues exactly.

Zephon (the LM workload with ``.shuffle(64)``, 8 lanes, ``flush_every_k_chunks=4``):

* a 2-worker pipeline runs S batches and is checkpointed; the state is restored into fresh
  pipelines with 1 and 3 workers, which run T more batches;
* 4 ranks (simulated in this process one after another, as ``tests/integration/
  test_elastic.py`` does) run an uneven number of batches each, their checkpoints are merged
  with ``zephon.checkpoint.state.merge_states``, and the merged state is restored into 2 ranks - in
  ``interleave`` output (each rank yields its lanes' batches round-robin) and in ``lockstep``
  output (the global batch of a step is the ranks' batches concatenated; it must equal a
  1-rank run's).

Every batch is attributed to its lane (``pipe.last_batch_lanes``) and hashed; a lane is
*exact* when its batches before the checkpoint followed by its batches after the restore are
the first batches of that lane in an uninterrupted 1-process run. "First batch" is the time
from building the new pipeline to its first batch after ``restore`` (worst rank), next to a
fresh start of the same topology. Documents carry an index tag (see ``flush_tradeoff``), so
the table also counts documents delivered both before and after the restore (repeats; the
corpus is large enough that no lane reaches a second dataset epoch in these runs, so any
repeat would be a resume error).

Grain 0.2.18, the same situation: an ``mp_prefetch(2)`` iterator runs S batches, its
``get_state()`` is passed to ``set_state`` of an ``mp_prefetch(1)`` and an ``mp_prefetch(3)``
iterator (and, as a control, ``mp_prefetch(2)``), and whatever happens is recorded: an
exception, or how many of the next T batches equal the uninterrupted continuation and how
many documents repeat. (Grain's state holds one entry per worker and each worker packs its
own slice ``i::num_workers`` of the data, so its state is tied to the worker count; likewise
a per-process shard of a multi-host job is tied to the process count.)

Each checkpoint is taken once; then, in each of 3 repetitions, every case's restore (with its
T batches) and fresh start run one after another, Zephon's and Grain's alike, in an order
rotated between repetitions, so machine noise lands on all of them. The times are medians
with their min-max range. Every repetition must deliver the same batches as the first (a row
that does not is marked DIVERGED); the exactness columns are the first's. A Grain restore
that raises is tried once and its fresh start is not timed: there is no time to compare.

    python -m benchmarks.elastic [--quick] [--repeats N] [--no-grain] [--results DIR]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.flush_tradeoff import doc_tags, lm_shuffle_pipeline, tagged_docs
from benchmarks.harness.batches import copy_batch
from benchmarks.harness.results import write_results
from benchmarks.harness.stats import median_and_range
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats
from zephon.checkpoint.state import merge_states

LANES = 8


def digest(batch: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:16]


@dataclass
class Tape:
    """What a run delivered: per-lane digests, the global sequence, document tags."""

    lanes: dict[int, list[str]] = field(default_factory=dict)
    stream: list[str] = field(default_factory=list)
    docs: list[int] = field(default_factory=list)

    def record(self, batch: dict[str, Any], lanes: Sequence[int]) -> None:
        d = digest(batch)
        self.stream.append(d)
        if len(lanes) == 1:
            self.lanes.setdefault(lanes[0], []).append(d)
        self.docs.extend(doc_tags(batch["tokens"]).tolist())

    def extend(self, other: Tape) -> None:
        for lane, ds in other.lanes.items():
            self.lanes.setdefault(lane, []).extend(ds)
        self.stream.extend(other.stream)
        self.docs.extend(other.docs)


def take(pipe: Any, steps: int, tape: Tape | None = None) -> Tape:
    tape = tape or Tape()
    for _ in range(steps):
        b = next(pipe)
        tape.record(b, pipe.last_batch_lanes)
    return tape


def repeated_docs(before: Tape, after: Tape) -> int:
    """Documents whose first piece was delivered both before and after the restore."""
    return len(set(before.docs) & set(after.docs))


def _need(before: Tape, after: Tape) -> int:
    """Batches per lane the reference must have to check ``before`` + ``after``."""
    return max(
        len(before.lanes.get(lane, [])) + len(after.lanes.get(lane, [])) for lane in range(LANES)
    )


def lanes_exact(reference: dict[int, list[str]], before: Tape, after: Tape) -> tuple[int, int]:
    """(lanes that continued exactly and produced batches after the restore, lanes)."""
    ok = 0
    for lane in range(LANES):
        got = before.lanes.get(lane, []) + after.lanes.get(lane, [])
        if after.lanes.get(lane) and got == reference[lane][: len(got)]:
            ok += 1
    return ok, LANES


@dataclass
class Case:
    """One restore situation, checkpointed once and resumed as often as wanted.

    ``resume()`` builds the new loader(s), restores the checkpoint and runs them: the seconds
    from building to the first batch (None where it failed) and what they delivered.
    ``fresh()``: seconds from building the same topology to its first batch, without a restore
    (None: not measured). ``verdict(delivered)``: the exactness columns of one resume.
    """

    labels: dict[str, str]
    resume: Callable[[], tuple[float | None, Any]]
    fresh: Callable[[], float | None]
    verdict: Callable[[Any], dict[str, Any]]


class Zephon:
    def __init__(self, docs: list[str], chunk_size: int) -> None:
        self.docs = docs
        self.chunk_size = chunk_size
        self._ref: Tape | None = None

    def build(self, **kw: Any) -> Any:
        return lm_shuffle_pipeline(self.docs, 0, lanes=LANES, chunk_size=self.chunk_size, k=4, **kw)

    def reference(self, per_lane: int, stream: int = 0) -> Tape:
        """The uninterrupted 1-process run: at least ``per_lane`` batches of every lane and
        ``stream`` batches in all (kept and extended as later cases need more)."""
        have = self._ref
        if (
            have is None
            or min(len(v) for v in have.lanes.values()) < per_lane
            or len(have.stream) < stream
        ):
            with self.build() as p:
                self._ref = take(p, max(LANES * (per_lane + 1), stream))
        return self._ref

    def first_batch(
        self, state: dict[str, Any] | None, steps: int, **kw: Any
    ) -> tuple[float, Tape]:
        """Build, restore ``state`` (if any), take ``steps`` batches; time to the first."""
        t0 = time.perf_counter()
        with self.build(**kw) as p:
            if state is not None:
                p.restore(state)
            tape = take(p, 1)
            first_s = time.perf_counter() - t0
            take(p, steps - 1, tape)
        return first_s, tape

    def workers_cases(
        self, before_workers: int, after: Sequence[int], s: int, t: int
    ) -> list[Case]:
        with self.build(workers=before_workers) as p:
            before = take(p, s)
            state = p.checkpoint()

        def verdict(tape: Tape) -> dict[str, Any]:
            # Same world size: the round-robin position is restored too, so the whole stream
            # (not only each lane) must equal the uninterrupted one.
            full = before.stream + tape.stream
            ref = self.reference(_need(before, tape), len(full))
            stream_exact = full == ref.stream[: len(full)]
            ok, n = lanes_exact(ref.lanes, before, tape)
            return {
                "lanes exact": f"{ok}/{n}",
                "stream exact": stream_exact,
                "docs repeated": repeated_docs(before, tape),
                "outcome": "continues exactly" if ok == n and stream_exact else "DIVERGED",
            }

        return [
            Case(
                labels={
                    "loader": "zephon",
                    "checkpoint from": f"1 rank, {before_workers} workers",
                    "restored into": f"1 rank, {w} worker{'s' if w != 1 else ''}",
                },
                resume=lambda w=w: self.first_batch(state, t, workers=w),
                fresh=lambda w=w: self.first_batch(None, 1, workers=w)[0],
                verdict=verdict,
            )
            for w in after
        ]

    def ranks_case(self, before_steps: Sequence[int], after_world: int, t: int) -> Case:
        """Interleave output: 4 ranks -> merged -> ``after_world`` ranks (run one after
        another; the time to the first batch is the worst rank's)."""
        world = len(before_steps)
        before = Tape()
        states = []
        for rank, steps in enumerate(before_steps):
            with self.build(rank=rank, world_size=world) as p:
                take(p, steps, before)
                states.append(p.checkpoint())
        merged = merge_states(states)

        def resume() -> tuple[float, Tape]:
            after = Tape()
            first = []
            for rank in range(after_world):
                first_s, tape = self.first_batch(merged, t, rank=rank, world_size=after_world)
                after.extend(tape)
                first.append(first_s)
            return max(first), after

        def fresh() -> float:
            return max(
                self.first_batch(None, 1, rank=rank, world_size=after_world)[0]
                for rank in range(after_world)
            )

        def verdict(after: Tape) -> dict[str, Any]:
            ok, n = lanes_exact(self.reference(_need(before, after)).lanes, before, after)
            return {
                "lanes exact": f"{ok}/{n}",
                "stream exact": None,
                "docs repeated": repeated_docs(before, after),
                "outcome": "continues exactly" if ok == n else "DIVERGED",
            }

        return Case(
            labels={
                "loader": "zephon",
                "checkpoint from": f"{world} ranks (interleave)",
                "restored into": f"{after_world} ranks",
            },
            resume=resume,
            fresh=fresh,
            verdict=verdict,
        )

    def global_batches(
        self, w: int, steps: int, state: dict | None = None
    ) -> tuple[float, list[str], list[int], dict]:
        """Lockstep run of ``w`` ranks: seconds to the first global batch, the global
        batches' digests, their document tags, and the ranks' merged checkpoint."""
        pipes = [self.build(rank=r, world_size=w, output="lockstep") for r in range(w)]
        try:
            t0 = time.perf_counter()
            if state is not None:
                for p in pipes:
                    p.restore(state)
            out, docs = [], []
            first_s = 0.0
            for i in range(steps):
                parts = [next(p) for p in pipes]
                if i == 0:
                    first_s = time.perf_counter() - t0
                merged_batch = {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}
                out.append(digest(merged_batch))
                docs.extend(doc_tags(merged_batch["tokens"]).tolist())
            return first_s, out, docs, merge_states([p.checkpoint() for p in pipes])
        finally:
            for p in pipes:
                p.close()

    def lockstep_case(self, world: int, after_world: int, s: int, t: int) -> Case:
        """Lockstep output: global batch at step i = concatenation of the ranks' batches;
        it must be the same for any world size."""
        _, ref, _, _ = self.global_batches(1, s + t)
        _, head, docs_before, merged = self.global_batches(world, s)

        def resume() -> tuple[float, tuple[list[str], list[int]]]:
            first_s, tail, docs_after, _ = self.global_batches(after_world, t, merged)
            return first_s, (tail, docs_after)

        def verdict(delivered: tuple[list[str], list[int]]) -> dict[str, Any]:
            tail, docs_after = delivered
            exact = head + tail == ref
            return {
                "lanes exact": f"{LANES}/{LANES}" if exact else "-",
                "stream exact": exact,
                "docs repeated": len(set(docs_before) & set(docs_after)),
                "outcome": "same global batches" if exact else "DIVERGED",
            }

        return Case(
            labels={
                "loader": "zephon",
                "checkpoint from": f"{world} ranks (lockstep)",
                "restored into": f"{after_world} ranks",
            },
            resume=resume,
            fresh=lambda: self.global_batches(after_world, 1)[0],
            verdict=verdict,
        )


class GrainResume:
    """Grain's ``mp_prefetch(2)`` state, as JSON, set into an ``mp_prefetch(workers)``
    iterator. An attempt that raises is recorded and not repeated (nor is its fresh start
    timed): there is no time to the first batch to measure."""

    def __init__(self, docs: list[str], state_json: str, expected: list[str], workers: int) -> None:
        self.docs = docs
        self.state_json = state_json
        self.expected = expected
        self.workers = workers
        self.failure: tuple[Tape, str] | None = None

    def resume(self) -> tuple[float | None, tuple[Tape, str | None]]:
        """Seconds to the first batch (None if anything raised) and (what was delivered,
        the error)."""
        from benchmarks.grain_baseline import grain_lm_iter

        if self.failure is not None:
            return None, self.failure
        state = json.loads(self.state_json)
        after = Tape()
        t0 = time.perf_counter()
        it = grain_lm_iter(self.docs, 0, workers=self.workers)
        stage = "set_state"
        try:
            it.set_state(state)
            stage = "the first next()"
            batch = copy_batch(next(it))
            first_s = time.perf_counter() - t0
            stage = "next()"
            after.record(batch, ())
            for _ in range(len(self.expected) - 1):
                after.record(copy_batch(next(it)), ())
            return first_s, (after, None)
        except Exception as e:  # noqa: BLE001 - recording what Grain does is the point
            self.failure = (after, f"{stage} raises {type(e).__name__}: {e}")
            return None, self.failure
        finally:
            it.close()
            del it
            gc.collect()

    def fresh(self) -> float | None:
        from benchmarks.grain_baseline import grain_lm_iter

        if self.failure is not None:
            return None
        t0 = time.perf_counter()
        it = grain_lm_iter(self.docs, 0, workers=self.workers)
        try:
            copy_batch(next(it))
            return time.perf_counter() - t0
        finally:
            it.close()
            del it
            gc.collect()


def grain_verdict(
    before: Tape, expected: list[str], delivered: tuple[Tape, str | None]
) -> dict[str, Any]:
    after, error = delivered
    t = len(expected)
    same = sum(a == e for a, e in zip(after.stream, expected, strict=False))
    cols: dict[str, Any] = {"lanes exact": None, "stream exact": None, "docs repeated": None}
    if after.stream:
        cols["stream exact"] = error is None and same == t
        cols["docs repeated"] = repeated_docs(before, after)
    if error is None:
        cols["outcome"] = (
            "continues exactly"
            if same == t
            else f"runs, different data: {same}/{t} batches equal the continuation"
        )
    else:
        got = len(after.stream)
        prefix = (
            f"{got} batch(es) delivered ({same} equal to the continuation), then " if got else ""
        )
        cols["outcome"] = prefix + error
    return cols


def grain_cases(docs: list[str], s: int, t: int, targets: Sequence[int]) -> list[Case]:
    from benchmarks.grain_baseline import grain_lm_iter

    it = grain_lm_iter(docs, 0, workers=2)
    try:
        before = Tape()
        for _ in range(s):
            before.record(copy_batch(next(it)), ())
        state_json = json.dumps(it.get_state())
        expected = [digest(copy_batch(next(it))) for _ in range(t)]
    finally:
        it.close()
        del it
        gc.collect()
    cases = []
    for w in targets:
        g = GrainResume(docs, state_json, expected, w)
        cases.append(
            Case(
                labels={
                    "loader": "grain 0.2.18",
                    "checkpoint from": "mp_prefetch(2)",
                    "restored into": f"mp_prefetch({w})",
                },
                resume=g.resume,
                fresh=g.fresh,
                verdict=lambda delivered: grain_verdict(before, expected, delivered),
            )
        )
    return cases


def consistent(verdict: dict[str, Any], delivered: Sequence[Any]) -> dict[str, Any]:
    """``verdict`` (of the first repetition) when every repetition delivered the same;
    otherwise marked as diverged."""
    differ = [r for r, d in enumerate(delivered) if d != delivered[0]]
    if not differ:
        return verdict
    return {
        **verdict,
        "stream exact": False,
        "outcome": f"DIVERGED: repetition(s) {differ} delivered other batches than the first",
    }


def measure(cases: Sequence[Case], repeats: int) -> list[dict[str, Any]]:
    """Every case's resume and fresh start, interleaved and rotated; one row per case."""
    cands: dict[str, Callable[[], Any]] = {}
    for i, case in enumerate(cases):
        cands[f"{i} resume"] = case.resume
        cands[f"{i} fresh"] = case.fresh
    runs = interleaved_repeats(cands, repeats, rotate=True)
    rows = []
    for i, case in enumerate(cases):
        resumes = runs[f"{i} resume"]
        delivered = [d for _, d in resumes]
        first = [f for f, _ in resumes if f is not None]
        fresh = [f for f in runs[f"{i} fresh"] if f is not None]
        rows.append(
            {
                **case.labels,
                **median_and_range("first batch ms", first, scale=1e3),
                **median_and_range("fresh start ms", fresh, scale=1e3),
                **consistent(case.verdict(delivered[0]), delivered),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="repetitions (default 3; 1 with --quick)"
    )
    ap.add_argument("--no-grain", action="store_true")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        n_docs, chunk_size, s, t, rank_steps = 6000, 16, 20, 16, (5, 9, 2, 7)
    else:
        n_docs, chunk_size, s, t, rank_steps = 20000, 64, 300, 200, (50, 90, 20, 70)
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    with_grain = not args.no_grain
    if with_grain:
        try:
            import grain  # noqa: F401
        except ImportError:
            print("grain is not installed: Zephon rows only", file=sys.stderr)
            with_grain = False
    docs = tagged_docs(n_docs)
    z = Zephon(docs, chunk_size)
    cases = z.workers_cases(2, (1, 3), s, t)
    cases.append(z.ranks_case(rank_steps, 2, t))
    cases.append(z.lockstep_case(4, 2, max(2, s // LANES), max(2, t // LANES)))
    if with_grain:
        cases.extend(grain_cases(docs, s, t, (1, 3, 2)))
    rows = measure(cases, repeats)
    print_table(
        rows,
        [
            "loader",
            "checkpoint from",
            "restored into",
            "first batch ms",
            "first batch ms range",
            "fresh start ms",
            "fresh start ms range",
            "lanes exact",
            "stream exact",
            "docs repeated",
            "outcome",
        ],
        title=(
            f"Elastic resume ({LANES} lanes; {s} batches before, {t} after; times: median and "
            f"min–max of {repeats} repetition{'s' if repeats != 1 else ''})"
        ),
    )
    path = write_results(
        "elastic",
        rows,
        args.results,
        extra={
            "args": vars(args),
            "repeats": repeats,
            "lanes": LANES,
            "before": s,
            "after": t,
            "rank_steps": list(rank_steps),
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
