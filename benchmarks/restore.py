"""Question 2: restore cost and checkpoint size against the step and the lane count.

For Zephon and Grain: time from a fresh loader to its first batch after restoring a
checkpoint taken at step 10, 1,000 and 10,000, against a fresh start; checkpoint bytes
(Zephon: the zstd file ``zp.save`` writes; Grain: its JSON state) and ``checkpoint()``
latency. Then Zephon's checkpoint bytes per lane and latency for canonical_replicas 1, 8, 64.

    python -m benchmarks.restore [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import zephon as zp
from benchmarks.common import print_table, write_results
from benchmarks.workload import SyntheticDocs, pregenerate
from benchmarks.zephon_lm import zephon_lm_pipeline


def zephon_restore(
    docs: list[str], step: int, workers: int, lanes: int = 8, repeats: int = 3
) -> dict[str, Any]:
    with zephon_lm_pipeline(docs, 0, workers, lanes=lanes) as p:
        for _ in range(step):
            next(p)
        t0 = time.perf_counter()
        state = p.checkpoint()
        ckpt_s = time.perf_counter() - t0
        blob = zp.checkpoint.dumps(state)
        expected = next(p)
    fresh, restore, replayed = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        with zephon_lm_pipeline(docs, 0, workers, lanes=lanes) as q:
            next(q)
            fresh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with zephon_lm_pipeline(docs, 0, workers, lanes=lanes) as q:
            q.restore(zp.checkpoint.loads(blob))
            first = next(q)
            restore.append(time.perf_counter() - t0)
            replayed = q.stats()["replayed_chunks"]
    exact = all((first[k] == expected[k]).all() for k in expected)
    return {
        "loader": f"zephon workers={workers}",
        "step": step,
        "fresh ms": round(statistics.median(fresh) * 1e3, 1),
        "restore ms": round(statistics.median(restore) * 1e3, 1),
        "restore/fresh": round(statistics.median(restore) / statistics.median(fresh), 2),
        "replayed chunks": replayed,
        "ckpt bytes": len(blob),
        "bytes/lane": round(len(blob) / lanes),
        "checkpoint() ms": round(ckpt_s * 1e3, 2),
        "exact": exact,
    }


def grain_restore(docs: list[str], step: int) -> dict[str, Any]:
    from benchmarks.grain_baseline import measure_restore

    r = measure_restore(docs, 0, step)
    return {
        "loader": "grain single-process",
        "step": step,
        "fresh ms": round(r["fresh_s"] * 1e3, 1),
        "restore ms": round(r["restore_s"] * 1e3, 1),
        "restore/fresh": round(r["restore_s"] / r["fresh_s"], 2),
        "replayed chunks": None,
        "ckpt bytes": r["state_bytes"],
        "bytes/lane": None,
        "checkpoint() ms": round(r["checkpoint_s"] * 1e3, 2),
        "exact": r["exact"],
    }


def lanes_sweep(docs: list[str], step: int) -> list[dict[str, Any]]:
    rows = []
    for lanes in (1, 8, 64):
        with zephon_lm_pipeline(docs, 0, 0, lanes=lanes) as p:
            for _ in range(step):
                next(p)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                state = p.checkpoint()
                times.append(time.perf_counter() - t0)
            blob = zp.checkpoint.dumps(state)
        rows.append(
            {
                "canonical_replicas": lanes,
                "step": step,
                "ckpt bytes": len(blob),
                "bytes/lane": round(len(blob) / lanes),
                "checkpoint() ms": round(statistics.median(times) * 1e3, 2),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
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
    rows = []
    for step in steps:
        rows.append(zephon_restore(docs, step, 0, repeats=1 if args.quick else 3))
        rows.append(zephon_restore(docs, step, 2, repeats=1 if args.quick else 2))
        if with_grain:
            rows.append(grain_restore(docs, step))
    print_table(rows, list(rows[0]), title="Restore to first batch, against the step")
    sweep = lanes_sweep(docs, steps[-1] if args.quick else 1000)
    print_table(
        sweep, list(sweep[0]), title="Checkpoint size and latency against canonical_replicas"
    )
    write_results("restore", rows, args.results, extra={"lanes_sweep": sweep, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
