"""Question 12: packing strategies on the LM workload, Zephon against Grain 0.2.18.

For first fit, best fit and concat-then-split, in process (Zephon ``workers=0``, Grain
without ``mp_prefetch``): batches/s and the padding fraction (padded positions over all
positions of the measured batches), side by side in one run. Candidates alternate
(A B C ... A B C ...) and each reports its best (the least disturbed) and median repetition.

The pipelines, over the same pregenerated documents (``benchmarks.workload``):

* Zephon: ``fetch -> tokenize -> split(SEQ_LEN) -> pack(SEQ_LEN, NUM_BINS, strategy) ->
  batch`` (concat-then-split without ``split``: it cuts documents itself), 8 lanes, a flush
  every 4 chunks: each lane's open rows are emitted, partly empty, at every flush.
* Grain: ``MapDataset.source(docs).shuffle().repeat().map(tokenize) -> to_iter_dataset ->
  [FlatMapIterDataset(split)] -> FirstFitPackIterDataset | BestFitPackIterDataset |
  ConcatThenSplitIterDataset -> batch`` (``grain_baseline`` for the parts they share).

Goals (issue 17): best fit pads less than first fit and costs at most 1.3x its time; each
Zephon packer at least 2x the matching Grain packer's batches/s.

    python -m benchmarks.packing [--quick] [--repeats N] [--batches N] [--no-grain]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, measure_throughput
from benchmarks.workload import BATCH_SIZE, NUM_BINS, SEQ_LEN, SyntheticDocs, pregenerate
from benchmarks.zephon_lm import zephon_lm_pipeline

STRATEGIES = ("first_fit", "best_fit", "concat_then_split")


def grain_packing_iter(
    docs: Sequence[str],
    seed: int,
    strategy: str,
    *,
    seq_len: int = SEQ_LEN,
    num_bins: int = NUM_BINS,
    batch_size: int = BATCH_SIZE,
) -> Iterator[dict[str, np.ndarray]]:
    """Grain's matching packer over the same documents, single process."""
    from benchmarks.grain_baseline import SplitToMaxLen, _grain, tokenize_to_dict

    grain = _grain()
    ds = grain.MapDataset.source(docs).shuffle(seed=seed).repeat().map(tokenize_to_dict)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    length = {"tokens": seq_len}
    if strategy == "concat_then_split":
        ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=length)
    else:
        grain.experimental.FlatMapTransform.register(SplitToMaxLen)
        ds = grain.experimental.FlatMapIterDataset(ds, SplitToMaxLen(seq_len))
        packer = {
            "first_fit": grain.experimental.FirstFitPackIterDataset,
            "best_fit": grain.experimental.BestFitPackIterDataset,
        }[strategy]
        ds = packer(ds, length_struct=length, num_packing_bins=num_bins, seed=seed)
    return iter(ds.batch(batch_size, drop_remainder=True))


def candidates(
    docs: Sequence[str], seed: int, batches: int, warmup: int, with_grain: bool
) -> dict[str, Any]:
    cands: dict[str, Any] = {}
    for strategy in STRATEGIES:
        cands[f"zephon {strategy}"] = lambda s=strategy: measure_throughput(
            lambda: zephon_lm_pipeline(docs, seed, prefetch=0, pack_kw={"strategy": s}),
            batches,
            warmup,
        )
        if with_grain:
            cands[f"grain {strategy}"] = lambda s=strategy: measure_throughput(
                lambda: grain_packing_iter(docs, seed, s), batches, warmup
            )
    return cands


def rows_of(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per candidate: best and median batches/s, padding fraction, and the
    ratios the goals name."""
    best = {name: max(r["batches_per_s"] for r in runs) for name, runs in results.items()}
    rows = []
    for name, runs in results.items():
        loader, strategy = name.split(" ", 1)
        rates = sorted(r["batches_per_s"] for r in runs)
        row: dict[str, Any] = {
            "loader": loader,
            "strategy": strategy,
            "batches/s best": round(best[name], 1),
            "batches/s median": round(float(np.median(rates)), 1),
            "padding fraction": round(float(np.mean([r["padding_fraction"] for r in runs])), 4),
            "repeats": len(runs),
        }
        grain = best.get(f"grain {strategy}")
        row["x grain"] = round(best[name] / grain, 2) if loader == "zephon" and grain else None
        first = best.get(f"{loader} first_fit")
        row["time / first_fit"] = round(first / best[name], 2) if first else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-grain", action="store_true")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.batches, args.warmup, args.docs = 1, 10, 2, 1500
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
    docs = pregenerate(SyntheticDocs(args.docs, seed=args.seed))
    cands = candidates(docs, args.seed, args.batches, args.warmup, with_grain)
    results = interleaved_repeats(cands, args.repeats, rotate=True)
    rows = rows_of(results)
    columns = [
        "loader",
        "strategy",
        "batches/s best",
        "batches/s median",
        "padding fraction",
        "x grain",
        "time / first_fit",
        "repeats",
    ]
    print_table(
        rows,
        columns,
        title=f"Packing on the LM workload ({args.batches} batches of {BATCH_SIZE}x{SEQ_LEN}, "
        "in process)",
    )
    by = {(r["loader"], r["strategy"]): r for r in rows}
    ff, bf = by[("zephon", "first_fit")], by[("zephon", "best_fit")]
    goals = {
        "best_fit pads less than first_fit": bf["padding fraction"] < ff["padding fraction"],
        "best_fit time <= 1.3x first_fit": bf["time / first_fit"] <= 1.3,
    }
    if with_grain:
        for s in STRATEGIES:
            goals[f"zephon {s} >= 2x grain"] = by[("zephon", s)]["x grain"] >= 2.0
    for goal, met in goals.items():
        print(f"{'met' if met else 'NOT met'}: {goal}")
    write_results("packing", rows, args.results, extra={"args": vars(args), "goals": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
