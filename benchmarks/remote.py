"""Issue 35: lanes on Ray actors (``workers=zp.RayWorkers(n)``), on a local Ray (127.0.0.1).

Three questions, each answered as ratios measured in one run (the machines this runs on are
noisy; candidates alternate, A B A B ..., and each reports its median):

* **overhead**: the LM workload (:mod:`benchmarks.zephon_lm`) with 2 Ray actors against 2
  local worker processes; goal >= 0.7x.
* **scaling, simulated**: a pipeline whose ``map`` waits a fixed time per sample
  (``time.sleep``: standing in for CPU on other machines, so many actors fit 2 cores: the
  waits overlap), the same pipeline at 2, 4, 8 and 16 actors; efficiency is samples/s per
  actor against 2 actors' (1.0 is linear); goal >= 0.8 up to 16.
* **recovery**: an actor killed mid-run (``ray.kill``), between two ``next()`` calls, the
  consumer draining the pipeline at full speed. The actor's lanes had made batches
  already; the pipeline learns of the death (its watch of the actors, every 20 ms, or a
  wait for one of the dead lanes) and moves them: each replays its in-flight chunks on
  the other actor while the consumer takes what was made. What the death costs the
  consumer is its longest ``next()`` from the kill until every lane has delivered a batch
  after the move; against restoring the state of just before that call into
  ``workers=0`` and taking one batch (the same lanes' restore); goal <= 2x. ``noticed
  ms``: from the kill to the ``next()`` that moved the lanes, ``batches`` taken in
  between. Shown too: the same without the watch (``_WATCH_S`` infinite), where the death
  is found by the wait for a dead lane's next output, which then waits for its replay:
  that ``next()`` against the same restore. The batches across the death are checked
  equal to ``workers=0``'s.

* **stragglers**: the scaling pipeline on 8 actors with actor 0's waits 10x longer,
  with speculation, against the same without a straggler; goal >= 0.8x.

    python -m benchmarks.remote [--quick] [--repeats N] [--batches N] [--actors 2,4,8,16]
                                [--only overhead,scaling,stragglers,recovery]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import numpy as np

import zephon as zp
from benchmarks.harness.results import write_results
from benchmarks.harness.stats import summarize
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, measure_throughput
from benchmarks.workload import SyntheticDocs, pregenerate
from benchmarks.zephon_lm import zephon_lm_pipeline
from zephon.runners.ray_actor import ACTOR_ENV
from zephon.testing import assert_same_batches, take

#: Tokens per sample of the scaling pipeline (one row of the batch).
_ROW = 32
#: How long the recovery question lets the machine settle (see _recover_once).
_SETTLE_S = 0.5


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return summarize([r[key] for r in runs])["median"]


# -------------------------------------------------------------------------------- overhead
def overhead(docs: list[str], batches: int, warmup: int, repeats: int) -> list[dict[str, Any]]:
    cands = {
        "local workers=2": lambda: measure_throughput(
            lambda: zephon_lm_pipeline(docs, 0, 2), batches, warmup
        ),
        "ray actors=2": lambda: measure_throughput(
            lambda: zephon_lm_pipeline(docs, 0, zp.RayWorkers(2)), batches, warmup
        ),
        "ray actors=2, zero_copy": lambda: measure_throughput(
            lambda: zephon_lm_pipeline(docs, 0, zp.RayWorkers(2), zero_copy=True),
            batches,
            warmup,
        ),
    }
    results = interleaved_repeats(cands, repeats, rotate=True)
    base = _median(results["local workers=2"], "batches_per_s")
    rows = []
    for name, runs in results.items():
        bps = summarize([r["batches_per_s"] for r in runs])
        rows.append(
            {
                "question": "overhead (LM workload)",
                "candidate": name,
                "batches/s": round(bps["median"], 1),
                "range": f"{bps['min']:.0f}-{bps['max']:.0f}",
                "ratio": round(bps["median"] / base, 2),
                "goal": ">= 0.7" if name.startswith("ray") else "",
                "parent us/batch": round(
                    summarize([r["parent_cpu_s"] / r["batches"] * 1e6 for r in runs])["median"]
                ),
            }
        )
    return rows


# --------------------------------------------------------------------------------- scaling
def _waiting_pipeline(
    workers: Any, wait_s: float, lanes: int, chunk_size: int, slow: str | None = None
) -> zp.Pipeline:
    """Samples that cost ``wait_s`` each in ``map`` (a sleep), 8 to a batch, forever; 10x
    that on the Ray actor whose index is ``slow``."""
    src = zp.StaticMixtureWorkSource(
        datasets={"a": zp.ArraySource([f"sample {i:06d} " for i in range(4096)])},
        weights={"a": 1.0},
        seed=3,
        chunk_size=chunk_size,
        num_epochs=None,
    )

    def wait(d: dict[str, Any]) -> dict[str, Any]:
        time.sleep(wait_s * (10 if slow is not None and os.environ.get(ACTOR_ENV) == slow else 1))
        return {"tokens": np.resize(d["tokens"], _ROW)}

    pipe = zp.Pipeline(src, canonical_replicas=lanes, workers=workers)
    return pipe.fetch().tokenize(zp.ByteTokenizer()).map(wait).batch(8)


def scaling(
    actors: list[int], wait_s: float, batches: int, warmup: int, repeats: int
) -> list[dict[str, Any]]:
    lanes = max(actors)
    cands = {
        f"ray actors={n}": lambda n=n: measure_throughput(
            lambda: _waiting_pipeline(
                zp.RayWorkers(n, resources={"CPU": 0.0}), wait_s, lanes, chunk_size=1
            ),
            batches * n // 2,
            warmup * n // 2,
        )
        for n in actors
    }
    results = interleaved_repeats(cands, repeats, rotate=True)
    first = actors[0]
    per_actor0 = _median(results[f"ray actors={first}"], "batches_per_s") / first
    rows = []
    for n in actors:
        runs = results[f"ray actors={n}"]
        bps = summarize([r["batches_per_s"] for r in runs])
        rows.append(
            {
                "question": f"scaling ({wait_s * 1e3:g} ms a sample, {lanes} lanes)",
                "candidate": f"ray actors={n}",
                "batches/s": round(bps["median"], 1),
                "range": f"{bps['min']:.0f}-{bps['max']:.0f}",
                "ratio": round(bps["median"] / n / per_actor0, 2),
                "goal": ">= 0.8" if n > first else "",
                "ideal batches/s": round(n / (8 * wait_s), 1),
                "vs ideal": round(bps["median"] / (n / (8 * wait_s)), 2),
                "parent us/batch": round(
                    summarize([r["parent_cpu_s"] / r["batches"] * 1e6 for r in runs])["median"]
                ),
            }
        )
    return rows


# ------------------------------------------------------------------------------ stragglers
def stragglers(
    n: int, wait_s: float, batches: int, warmup: int, repeats: int
) -> list[dict[str, Any]]:
    """The scaling pipeline on ``n`` actors, then with actor 0 slowed 10x: with
    speculation, and without (over a tenth of the batches: it is that slow)."""

    def run(slow: str | None, speculate: bool, share: int = 1) -> dict[str, Any]:
        spec = zp.RayWorkers(n, resources={"CPU": 0.0}, speculate=speculate)
        return measure_throughput(
            lambda: _waiting_pipeline(spec, wait_s, n, chunk_size=1, slow=slow),
            max(1, batches // share),
            max(1, warmup // share),
        )

    cands = {
        "no straggler": lambda: run(None, True),
        "actor 0 slowed 10x, speculate": lambda: run("0", True),
        "actor 0 slowed 10x, speculate=False": lambda: run("0", False, 10),
    }
    results = interleaved_repeats(cands, repeats, rotate=True)
    base = _median(results["no straggler"], "batches_per_s")
    rows = []
    for name, runs in results.items():
        bps = summarize([r["batches_per_s"] for r in runs])
        rows.append(
            {
                "question": f"stragglers ({n} actors, {wait_s * 1e3:g} ms a sample)",
                "candidate": name,
                "batches/s": round(bps["median"], 1),
                "range": f"{bps['min']:.0f}-{bps['max']:.0f}",
                "ratio": round(bps["median"] / base, 2),
                "goal": ">= 0.8" if name.endswith("speculate") else "",
            }
        )
    return rows


# -------------------------------------------------------------------------------- recovery
def _recover_once(docs: list[str], cut: int, watch: bool) -> dict[str, Any]:
    """One kill (see the module's docstring): the consumer's longest ``next()`` across
    it, against restoring the state of just before that call into ``workers=0`` and
    taking one batch.

    Both run on a settled machine: the kill comes once the actors' start (their
    processes, Ray's agents) is over, and the restore once the Ray pipeline's actors,
    killed when it closed, are gone; neither pays for the other's processes."""
    import ray

    from zephon.runners import ray as zray
    from zephon.testing import roundtrip

    watch_s = zray._WATCH_S
    if not watch:
        zray._WATCH_S = math.inf
    try:
        with zephon_lm_pipeline(docs, 0, zp.RayWorkers(2)) as p:
            got = take(p, cut)
            time.sleep(_SETTLE_S)
            got += take(p, cut)
            at_kill = len(got)
            lanes = len(p._engine.lanes)
            ray.kill(p._engine.executor.actors[0].handle, no_restart=True)
            killed = time.perf_counter()
            calls: list[tuple[float, Any, int]] = []  # (seconds, state before, batch)
            moved = -1  # the batch whose next() moved the lanes
            while moved < 0 or len(got) <= moved + lanes:
                state = p.checkpoint()
                t0 = time.perf_counter()
                got += take(p, 1)
                calls.append((time.perf_counter() - t0, state, len(got) - 1))
                if moved < 0 and p.stats()["ray"]["lane_moves"]:
                    moved, noticed_s = len(got) - 1, t0 - killed
    finally:
        zray._WATCH_S = watch_s
    # with the watch: the longest next(); without: the one that moved the lanes (the
    # longest is then most often a wait on Ray's own notice of the death)
    stall_s, state, at = max(calls, key=lambda c: c[0]) if watch else calls[moved - at_kill]
    state = roundtrip(state)
    time.sleep(_SETTLE_S)
    with zephon_lm_pipeline(docs, 0) as q:
        t0 = time.perf_counter()
        q.restore(state)
        restored = take(q, 1)
        restore_s = time.perf_counter() - t0
    with zephon_lm_pipeline(docs, 0) as r:
        ref = take(r, len(got))
    assert_same_batches(ref, got, "batches across the actor's death")
    assert_same_batches(ref[at : at + 1], restored, "restored")
    return {
        "stall_s": stall_s,
        "restore_s": restore_s,
        "noticed_s": noticed_s,
        "batches": moved - at_kill,
    }


def recovery(docs: list[str], cut: int, repeats: int) -> list[dict[str, Any]]:
    question = "recovery (LM workload, 2 actors, one killed)"
    rows = []
    cands = ((True, "longest next() across the death"), (False, "no watch: next() that moves"))
    for watch, name in cands:
        runs = [_recover_once(docs, cut, watch) for _ in range(repeats)]
        stall = summarize([r["stall_s"] for r in runs])
        res = summarize([r["restore_s"] for r in runs])
        ratio = summarize([r["stall_s"] / r["restore_s"] for r in runs])
        rows += [
            {
                "question": question,
                "candidate": name,
                "ms": round(stall["median"] * 1e3, 1),
                "range": f"{stall['min'] * 1e3:.0f}-{stall['max'] * 1e3:.0f}",
                "ratio": round(ratio["median"], 2),
                "ratio range": f"{ratio['min']:.2f}-{ratio['max']:.2f}",
                "goal": "<= 2" if watch else "",
                "batches": int(summarize([r["batches"] for r in runs])["median"]),
                "noticed ms": round(summarize([r["noticed_s"] for r in runs])["median"] * 1e3),
                "identical": "yes",
            },
            {
                "question": question,
                "candidate": "  restore into workers=0 + next()",
                "ms": round(res["median"] * 1e3, 1),
                "range": f"{res['min'] * 1e3:.0f}-{res['max'] * 1e3:.0f}",
                "ratio": 1.0,
                "goal": "",
                "identical": "yes",
            },
        ]
    return rows


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4000, help="LM batches per run")
    ap.add_argument("--docs", type=int, default=80000)
    ap.add_argument("--actors", default="2,4,8,16", help="actor counts of the scaling runs")
    ap.add_argument("--wait-ms", type=float, default=10.0, help="the scaling map's wait")
    ap.add_argument("--scaling-batches", type=int, default=100, help="per 2 actors")
    ap.add_argument("--straggler-actors", type=int, default=8)
    ap.add_argument("--only", default="overhead,scaling,stragglers,recovery")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.batches, args.docs = 1, 20, 1500
        args.actors, args.scaling_batches, args.straggler_actors = "2,4", 10, 4
    actors = [int(n) for n in args.actors.split(",")]
    only = set(args.only.split(","))
    warmup = 5 if args.quick else 300

    import ray

    from zephon.runners.ray_options import start_local_ray

    owned = not ray.is_initialized()  # else: the Ray this process has (a test's)
    if owned:
        start_local_ray(num_cpus=2, object_store_memory=200 << 20)
    try:
        docs = pregenerate(SyntheticDocs(args.docs, seed=0))
        rows: list[dict[str, Any]] = []
        if "overhead" in only:
            rows += overhead(docs, args.batches, warmup, args.repeats)
        if "scaling" in only:
            rows += scaling(
                actors,
                args.wait_ms / 1e3,
                args.scaling_batches,
                2 if args.quick else args.scaling_batches // 2,
                args.repeats,
            )
        if "stragglers" in only:
            n = args.straggler_actors
            rows += stragglers(
                n,
                args.wait_ms / 1e3,
                args.scaling_batches * n // 2,
                2 if args.quick else args.scaling_batches * n // 4,
                args.repeats,
            )
        if "recovery" in only:
            rows += recovery(docs, 5 if args.quick else 20, args.repeats)
    finally:
        if owned:
            ray.shutdown()
    columns = ["question", "candidate", "batches/s", "ms", "range", "ratio", "ratio range"]
    columns += ["goal"]
    columns += [
        "ideal batches/s",
        "vs ideal",
        "parent us/batch",
        "batches",
        "noticed ms",
        "identical",
    ]
    print_table(
        [{c: r.get(c, "") for c in columns} for r in rows],
        columns,
        title=f"Lanes on Ray actors ({args.repeats} repetitions, medians; ratios in one run)",
    )
    write_results("remote", rows, args.results, extra={"args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
