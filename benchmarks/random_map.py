"""What ``random_map`` costs over ``map`` with the same function.

A record's generator is keyed by the record's identity, so every record gets its own
numbers whatever the worker count or restore point; the question is what that costs.
The same function runs three ways over pre-tokenized documents: ``map`` with one shared
generator (fast, but its numbers depend on processing order), ``random_map`` (numbers of
the record), and ``map`` making a new ``numpy.random.default_rng(identity)`` per record
(the obvious way to get per-record numbers). The work per record is a BERT-style 15%
token mask over a 512-token document. CPU seconds per record, the minimum of
``--repeats`` interleaved runs; the ratio is against ``map``.

    python -m benchmarks.random_map [--quick] [--repeats N] [--records N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import zephon as zp
from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats

MASK_ID = 3
DOC_LEN = 512


def mask_tokens(data: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    tokens = data["tokens"].copy()
    tokens[rng.random(len(tokens)) < 0.15] = MASK_ID
    return {"tokens": tokens}


def _source(records: int) -> zp.StaticMixtureWorkSource:
    rng = np.random.default_rng(0)
    docs = [{"tokens": rng.integers(5, 30000, DOC_LEN).astype(np.int32)} for _ in range(512)]
    return zp.StaticMixtureWorkSource(
        [zp.ArraySource(docs)], seed=0, chunk_size=64, num_epochs=max(1, records // 512)
    )


def _pipeline(kind: str, records: int) -> zp.Pipeline:
    pipe = zp.Pipeline(_source(records), canonical_replicas=8, prefetch=0).fetch()
    if kind == "map":
        shared = np.random.default_rng(0)
        pipe = pipe.map(lambda d: mask_tokens(d, shared))
    elif kind == "random_map":
        pipe = pipe.random_map(mask_tokens)
    else:  # a new default_rng per record, from the record's content (what users write)

        def fresh(d: dict[str, Any]) -> dict[str, Any]:
            return mask_tokens(d, np.random.default_rng(int(d["tokens"][0])))

        pipe = pipe.map(fresh)
    return pipe.batch(32)


def _run(kind: str, records: int) -> Callable[[], float]:
    def once() -> float:
        with _pipeline(kind, records) as pipe:
            next(pipe)  # start-up out of the window
            n = 1
            t0 = time.process_time()
            for _ in pipe:
                n += 1
            dt = time.process_time() - t0
        return dt / ((n - 1) * 32)

    return once


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 7)
    records = args.records or (2048 if args.quick else 16384)
    kinds = ["map", "random_map", "map + default_rng per record"]
    runs = interleaved_repeats({k: _run(k, records) for k in kinds}, repeats, rotate=True)
    best = {k: min(v) for k, v in runs.items()}
    rows = [
        {
            "operator": k,
            "us_per_record": round(best[k] * 1e6, 2),
            "vs_map": round(best[k] / best["map"], 3),
        }
        for k in kinds
    ]
    print_table(rows, ["operator", "us_per_record", "vs_map"])
    overhead = best["random_map"] / best["map"] - 1
    print(f"random_map adds {overhead * 100:.1f}% over map (goal <= 10%)")
    write_results("random_map", rows, args.results, extra={"repeats": repeats, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
