"""Question 1: LM-workload throughput, Zephon (workers 0, 1, 2) against Grain 0.2.18.

Grain runs single-process, with ``mp_prefetch(2)`` over its default shared memory, and with
``min_shm_size=1_000_000`` (pickled arrays, its faster mode here). Candidates alternate
(A B C A B C ...) and each reports its median over the repetitions; ratios to Grain are the
headline, because the machines this runs on are noisy.

Parent CPU is also given per batch, and measured once more for Zephon with 2 workers with
the consumer paced at the rate the goal names (1.5x Grain's default ``mp_prefetch``; 1,000
batches/s without Grain), the way a training loop bound by its step time consumes: what the
loader's parent process costs at that rate.

    python -m benchmarks.lm_throughput [--quick] [--repeats N] [--batches N]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.harness.results import write_results
from benchmarks.harness.stats import summarize
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, measure_throughput
from benchmarks.workload import SyntheticDocs, pregenerate
from benchmarks.zephon_lm import zephon_lm_pipeline


def candidates(
    docs: list[str], seed: int, batches: int, warmup: int, with_grain: bool, workers: list[int]
) -> dict[str, Any]:
    cands: dict[str, Any] = {}
    for w in workers:
        cands[f"zephon workers={w}"] = lambda w=w: measure_throughput(
            lambda: zephon_lm_pipeline(docs, seed, w), batches, warmup
        )
    if with_grain:
        from benchmarks.grain_baseline import grain_lm_iter

        cands["grain single-process"] = lambda: measure_throughput(
            lambda: grain_lm_iter(docs, seed), batches, warmup
        )
        if max(workers) > 0:
            cands["grain mp_prefetch(2) shm"] = lambda: measure_throughput(
                lambda: grain_lm_iter(docs, seed, workers=2), batches, warmup
            )
            cands["grain mp_prefetch(2) min_shm_size=1e6"] = lambda: measure_throughput(
                lambda: grain_lm_iter(docs, seed, workers=2, min_shm_size=1_000_000),
                batches,
                warmup,
            )
    return cands


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--no-grain", action="store_true")
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.batches, args.docs = 1, 20, 1500
    workers = [int(w) for w in args.workers.split(",")]
    with_grain = not args.no_grain
    if with_grain:
        try:
            import grain  # noqa: F401
        except ImportError:
            print(
                "grain is not installed (pip install 'zephon[bench]'); measuring Zephon only",
                file=sys.stderr,
            )
            with_grain = False
    docs = pregenerate(SyntheticDocs(args.docs, seed=0))
    warmup = 5 if args.quick else 20
    results = interleaved_repeats(
        candidates(docs, 0, args.batches, warmup, with_grain, workers), args.repeats, rotate=True
    )
    base = (
        summarize([r["batches_per_s"] for r in results["grain single-process"]])["median"]
        if "grain single-process" in results
        else None
    )
    if 2 in workers and not args.quick:
        grain_mp = results.get("grain mp_prefetch(2) shm")
        rate = (
            1.5 * summarize([r["batches_per_s"] for r in grain_mp])["median"]
            if grain_mp
            else 1000.0
        )
        label = f"zephon workers=2 paced at {rate:.0f}/s"
        results[label] = interleaved_repeats(
            {
                label: lambda: measure_throughput(
                    lambda: zephon_lm_pipeline(docs, 0, 2), 2 * args.batches, warmup, rate=rate
                )
            },
            args.repeats,
        )[label]
    rows = []
    for name, runs in results.items():
        bps = summarize([r["batches_per_s"] for r in runs])
        rows.append(
            {
                "loader": name,
                "batches/s": round(bps["median"], 1),
                "range": f"{bps['min']:.0f}-{bps['max']:.0f}",
                "vs grain 1p": round(bps["median"] / base, 2) if base else None,
                "real Mtok/s": round(
                    summarize([r["real_tokens_per_s"] for r in runs])["median"] / 1e6, 2
                ),
                "padded Mtok/s": round(
                    summarize([r["padded_tokens_per_s"] for r in runs])["median"] / 1e6, 2
                ),
                "parent CPU": round(
                    summarize([r["parent_cpu_per_wall"] for r in runs])["median"], 2
                ),
                "parent us/batch": round(
                    summarize([r["parent_cpu_s"] / r["batches"] * 1e6 for r in runs])["median"]
                ),
                "children CPU": round(
                    summarize([r["children_cpu_per_wall"] for r in runs])["median"], 2
                ),
                "startup s": round(summarize([r["startup_s"] for r in runs])["median"], 2),
            }
        )
    print_table(
        rows,
        list(rows[0]),
        title=f"LM workload throughput ({args.batches} batches x {args.repeats}, medians)",
    )
    write_results("lm_throughput", rows, args.results, extra={"args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
