"""Question 5: elastic resume - restore a checkpoint into a different number of worker
processes or ranks, and check that every lane continues exactly.

Zephon (the LM workload with ``.shuffle(64)``, 8 lanes, ``flush_every_k_chunks=4``):

* a 2-worker pipeline runs S batches and is checkpointed; the state is restored into fresh
  pipelines with 1 and 3 workers, which run T more batches;
* 4 ranks (simulated in this process one after another, as ``tests/integration/
  test_elastic.py`` does) run an uneven number of batches each, their checkpoints are merged
  with ``zephon.pipeline.merge_states``, and the merged state is restored into 2 ranks - in
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

    python -m benchmarks.elastic [--quick] [--no-grain] [--results DIR]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common import print_table, write_results
from benchmarks.flush_tradeoff import doc_tags, lm_shuffle_pipeline, tagged_docs
from zephon.pipeline import merge_states

LANES = 8


def digest(batch: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:16]


class Tape:
    """What a run delivered: per-lane digests, the global sequence, document tags."""

    def __init__(self) -> None:
        self.lanes: dict[int, list[str]] = {}
        self.stream: list[str] = []
        self.docs: list[int] = []

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


def repeats(before: Tape, after: Tape) -> int:
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
    ) -> tuple[Tape, float]:
        """Build, restore ``state`` (if any), take ``steps`` batches; time to the first."""
        t0 = time.perf_counter()
        with self.build(**kw) as p:
            if state is not None:
                p.restore(state)
            tape = take(p, 1)
            first_s = time.perf_counter() - t0
            take(p, steps - 1, tape)
        return tape, first_s

    def workers_case(self, before_workers: int, after: Sequence[int], s: int, t: int) -> list[dict]:
        with self.build(workers=before_workers) as p:
            before = take(p, s)
            state = p.checkpoint()
        rows = []
        for w in after:
            tape, first_s = self.first_batch(state, t, workers=w)
            _, fresh_s = self.first_batch(None, 1, workers=w)
            # Same world size: the round-robin position is restored too, so the whole stream
            # (not only each lane) must equal the uninterrupted one.
            full = before.stream + tape.stream
            ref = self.reference(_need(before, tape), len(full))
            uninterrupted = ref.stream[: len(full)]
            ok, n = lanes_exact(ref.lanes, before, tape)
            rows.append(
                {
                    "loader": "zephon",
                    "checkpoint from": f"1 rank, {before_workers} workers",
                    "restored into": f"1 rank, {w} worker{'s' if w != 1 else ''}",
                    "first batch ms": round(first_s * 1e3, 1),
                    "fresh start ms": round(fresh_s * 1e3, 1),
                    "lanes exact": f"{ok}/{n}",
                    "stream exact": full == uninterrupted,
                    "docs repeated": repeats(before, tape),
                    "outcome": "continues exactly"
                    if ok == n and full == uninterrupted
                    else "DIVERGED",
                }
            )
        return rows

    def ranks_case(self, before_steps: Sequence[int], after_world: int, t: int) -> dict:
        """Interleave output: 4 ranks -> merged -> ``after_world`` ranks."""
        world = len(before_steps)
        before = Tape()
        states = []
        for rank, steps in enumerate(before_steps):
            with self.build(rank=rank, world_size=world) as p:
                take(p, steps, before)
                states.append(p.checkpoint())
        merged = merge_states(states)
        after = Tape()
        first, fresh = [], []
        for rank in range(after_world):
            tape, first_s = self.first_batch(merged, t, rank=rank, world_size=after_world)
            after.extend(tape)
            first.append(first_s)
            fresh.append(self.first_batch(None, 1, rank=rank, world_size=after_world)[1])
        ok, n = lanes_exact(self.reference(_need(before, after)).lanes, before, after)
        return {
            "loader": "zephon",
            "checkpoint from": f"{world} ranks (interleave)",
            "restored into": f"{after_world} ranks",
            "first batch ms": round(max(first) * 1e3, 1),
            "fresh start ms": round(max(fresh) * 1e3, 1),
            "lanes exact": f"{ok}/{n}",
            "stream exact": None,
            "docs repeated": repeats(before, after),
            "outcome": "continues exactly" if ok == n else "DIVERGED",
        }

    def lockstep_case(self, world: int, after_world: int, s: int, t: int) -> dict:
        """Lockstep output: global batch at step i = concatenation of the ranks' batches;
        it must be the same for any world size."""

        def global_batches(
            w: int, steps: int, state: dict | None = None
        ) -> tuple[list[str], dict, float, list]:
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
                return out, merge_states([p.checkpoint() for p in pipes]), first_s, docs
            finally:
                for p in pipes:
                    p.close()

        ref, _, _, _ = global_batches(1, s + t)
        head, merged, _, docs_before = global_batches(world, s)
        tail, _, first_s, docs_after = global_batches(after_world, t, merged)
        _, _, fresh_s, _ = global_batches(after_world, 1)
        exact = head + tail == ref
        return {
            "loader": "zephon",
            "checkpoint from": f"{world} ranks (lockstep)",
            "restored into": f"{after_world} ranks",
            "first batch ms": round(first_s * 1e3, 1),
            "fresh start ms": round(fresh_s * 1e3, 1),
            "lanes exact": f"{LANES}/{LANES}" if exact else "-",
            "stream exact": exact,
            "docs repeated": len(set(docs_before) & set(docs_after)),
            "outcome": "same global batches" if exact else "DIVERGED",
        }


def _plain(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """Copy out of Grain's shared memory so the segment can go."""
    return {k: np.array(v, copy=True) for k, v in batch.items()}


def grain_case(docs: list[str], s: int, t: int, targets: Sequence[int]) -> list[dict]:
    from benchmarks.grain_baseline import grain_lm_iter

    it = grain_lm_iter(docs, 0, workers=2)
    try:
        before = Tape()
        for _ in range(s):
            b = _plain(next(it))
            before.record(b, ())
        state = it.get_state()
        expected = [digest(_plain(next(it))) for _ in range(t)]
    finally:
        it.close()
        del it
        gc.collect()
    rows = []
    for w in targets:
        row: dict[str, Any] = {
            "loader": "grain 0.2.18",
            "checkpoint from": "mp_prefetch(2)",
            "restored into": f"mp_prefetch({w})",
            "fresh start ms": None,
            "lanes exact": None,
            "stream exact": None,
            "docs repeated": None,
        }
        t0 = time.perf_counter()
        it = grain_lm_iter(docs, 0, workers=w)
        stage = "set_state"
        try:
            it.set_state(state)
            stage = "the first next()"
            after = Tape()
            b = _plain(next(it))
            stage = "next()"
            row["first batch ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            after.record(b, ())
            for _ in range(t - 1):
                after.record(_plain(next(it)), ())
            same = sum(a == e for a, e in zip(after.stream, expected, strict=True))
            row["stream exact"] = same == t
            row["docs repeated"] = repeats(before, after)
            row["outcome"] = (
                "continues exactly"
                if same == t
                else f"runs, different data: {same}/{t} batches equal the continuation"
            )
        except Exception as e:  # noqa: BLE001 - recording what Grain does is the point
            row["first batch ms"] = None
            got = after.stream if stage == "next()" else []
            if got:
                row["stream exact"] = False
                row["docs repeated"] = repeats(before, after)
            same = sum(a == x for a, x in zip(got, expected, strict=False))
            prefix = (
                f"{len(got)} batch(es) delivered ({same} equal to the continuation), then "
                if got
                else ""
            )
            row["outcome"] = f"{prefix}{stage} raises {type(e).__name__}: {e}"
        finally:
            it.close()
            del it
            gc.collect()
        if row["first batch ms"] is not None:
            row["fresh start ms"] = round(_grain_fresh_s(docs, w) * 1e3, 1)
        rows.append(row)
    return rows


def _grain_fresh_s(docs: list[str], workers: int) -> float:
    from benchmarks.grain_baseline import grain_lm_iter

    t0 = time.perf_counter()
    it = grain_lm_iter(docs, 0, workers=workers)
    try:
        _plain(next(it))
        return time.perf_counter() - t0
    finally:
        it.close()
        del it
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--no-grain", action="store_true")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        n_docs, chunk_size, s, t, rank_steps = 6000, 16, 20, 16, (5, 9, 2, 7)
    else:
        n_docs, chunk_size, s, t, rank_steps = 20000, 64, 300, 200, (50, 90, 20, 70)
    with_grain = not args.no_grain
    if with_grain:
        try:
            import grain  # noqa: F401
        except ImportError:
            print("grain is not installed: Zephon rows only", file=sys.stderr)
            with_grain = False
    docs = tagged_docs(n_docs)
    z = Zephon(docs, chunk_size)
    rows = z.workers_case(2, (1, 3), s, t)
    rows.append(z.ranks_case(rank_steps, 2, t))
    rows.append(z.lockstep_case(4, 2, max(2, s // LANES), max(2, t // LANES)))
    if with_grain:
        rows.extend(grain_case(docs, s, t, (1, 3, 2)))
    print_table(
        rows,
        [
            "loader",
            "checkpoint from",
            "restored into",
            "first batch ms",
            "fresh start ms",
            "lanes exact",
            "stream exact",
            "docs repeated",
            "outcome",
        ],
        title=f"Elastic resume ({LANES} lanes; {s} batches before, {t} after)",
    )
    path = write_results(
        "elastic",
        rows,
        args.results,
        extra={
            "args": vars(args),
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
