"""Question: what does the metrics endpoint cost? LM-workload throughput with
``Pipeline(metrics_port=0)`` and a scraper reading ``/metrics`` every ``--scrape-s``
seconds, against the same pipeline without an endpoint, in process and with 2 workers.

Candidates alternate (off on off on ..., rotated each round) and each reports its median;
the ratio on/off per worker count is the headline (goal: >= 0.98), also as the median
of the rounds' ratios (each round runs both, one after the other). The figures the
endpoint reads are kept by the engine whether or not it serves them (a bucket increment
and a per-component sum a batch), so "off" already carries those; their cost per
``next()`` is printed separately from a micro-benchmark of exactly those lines.

    python -m benchmarks.metrics_overhead [--quick] [--repeats N] [--batches N]
"""

from __future__ import annotations

import argparse
import threading
import time
import urllib.request
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from benchmarks.harness.results import write_results
from benchmarks.harness.stats import summarize
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, measure_throughput
from benchmarks.workload import SyntheticDocs, pregenerate
from benchmarks.zephon_lm import zephon_lm_pipeline


class _Scraped:
    """The pipeline, with a thread scraping its endpoint every ``every_s`` seconds while it
    is iterated (the scrapes count: they run in the parent, beside the consumer)."""

    def __init__(self, pipe: Any, every_s: float) -> None:
        self.pipe = pipe
        self.every_s = every_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            server = self.pipe._metrics  # noqa: SLF001 - started by the first next()
            if server is not None:
                try:
                    urllib.request.urlopen(server.url, timeout=10).read()
                except OSError:
                    return  # closed under the scrape: the run is over
                self.scrapes += 1

    def __iter__(self) -> Iterator[Any]:
        self._thread.start()
        return iter(self.pipe)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pipe.close()


def _hot_path_ns(n: int = 200_000) -> float:
    """What the engine adds to each next() for the metrics: one histogram bucket and the
    batch's tokens per component (two components), in ns."""
    from zephon.pipeline.engine import WAIT_BUCKETS_S

    buckets = [0] * (len(WAIT_BUCKETS_S) + 1)
    tokens: dict[int, int] = {}
    mix = {0: 1500, 1: 500}
    t0 = time.perf_counter()
    for i in range(n):
        buckets[bisect_left(WAIT_BUCKETS_S, i * 1e-7)] += 1
        for comp, k in mix.items():
            tokens[comp] = tokens.get(comp, 0) + k
    return (time.perf_counter() - t0) / n * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.batches, args.docs = 1, 20, 1500
    workers = [int(w) for w in args.workers.split(",")]
    docs = pregenerate(SyntheticDocs(args.docs, seed=0))
    warmup = 5 if args.quick else 20
    cands = {}
    for w in workers:
        cands[f"workers={w} off"] = lambda w=w: measure_throughput(
            lambda: zephon_lm_pipeline(docs, 0, w), args.batches, warmup
        )
        cands[f"workers={w} on"] = lambda w=w: measure_throughput(
            lambda: _Scraped(zephon_lm_pipeline(docs, 0, w, metrics_port=0), args.scrape_s),
            args.batches,
            warmup,
        )
    results = interleaved_repeats(cands, args.repeats, rotate=True)
    rows = []
    for w in workers:
        off = summarize([r["batches_per_s"] for r in results[f"workers={w} off"]])
        on = summarize([r["batches_per_s"] for r in results[f"workers={w} on"]])
        # the two run next to each other in every round: their ratio round by round is
        # less exposed to the machine's drift than the ratio of the medians
        paired = summarize(
            [
                a["batches_per_s"] / b["batches_per_s"]
                for a, b in zip(
                    results[f"workers={w} on"], results[f"workers={w} off"], strict=True
                )
            ]
        )
        rows.append(
            {
                "workers": w,
                "off batches/s": round(off["median"], 1),
                "on batches/s": round(on["median"], 1),
                "on/off": round(on["median"] / off["median"], 3),
                "on/off paired": round(paired["median"], 3),
                "off range": f"{off['min']:.0f}-{off['max']:.0f}",
                "on range": f"{on['min']:.0f}-{on['max']:.0f}",
            }
        )
    hot = _hot_path_ns()
    print_table(
        rows,
        list(rows[0]),
        title=(
            f"Metrics endpoint on (scraped every {args.scrape_s} s) vs off, LM workload "
            f"({args.batches} batches x {args.repeats}, medians)"
        ),
    )
    print(f"engine bookkeeping kept for the metrics, on or off: {hot:.0f} ns per next()")
    write_results(
        "metrics_overhead", rows, args.results, extra={"args": vars(args), "hot_path_ns": hot}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
