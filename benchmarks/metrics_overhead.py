"""Question: what does the metrics endpoint cost? LM-workload throughput with
``Pipeline(metrics_port=0)`` and a scraper reading ``/metrics`` every ``--scrape-s``
seconds, against the same pipeline without an endpoint, in process and with 2 workers.

Candidates alternate (off on off on ..., rotated each round) and each reports its median;
the ratio on/off per worker count is the headline (goal: >= 0.98), also as the median
of the rounds' ratios (each round runs both, one after the other), and as the ratio of
CPU seconds (parent and workers) per batch, off over on, round by round: on a machine
whose cores other work takes, wall time swings by 2x between rounds, CPU time per batch
much less. The figures the endpoint reads are kept by the engine whether or not it serves
them (a bucket increment, a per-component sum and the documents per component a batch;
the bytes read per source travel with the operators' counters), so "off" already carries
those; their cost per ``next()`` is printed separately from a micro-benchmark of exactly
that code, and so is the cost of one scrape.

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


def _hot_path_ns(n: int = 200_000) -> tuple[float, float]:
    """What the engine adds to each next() for the metrics, in ns: one histogram bucket
    and the batch's tokens per component (two components); then, apart, counting its
    documents per component (what the trackers add to closing the pieces, in C where it
    is built: 18 pieces of 3 chunks, 14 of them a document's last piece, the LM
    workload's batch; the time with the count less the time without)."""
    import numpy as np

    from zephon.chunks import WorkChunk
    from zephon.pipeline.engine import WAIT_BUCKETS_S
    from zephon.records import Contributor
    from zephon.tracking.tracker import ChunkTrack

    buckets = [0] * (len(WAIT_BUCKETS_S) + 1)
    tokens: dict[int, int] = {}
    mix = {0: 1500, 1: 500}
    t0 = time.perf_counter()
    for i in range(n):
        buckets[bisect_left(WAIT_BUCKETS_S, i * 1e-7)] += 1
        for comp, k in mix.items():
            tokens[comp] = tokens.get(comp, 0) + k
    per_next = (time.perf_counter() - t0) / n * 1e9
    rng = np.random.default_rng(0)
    pieces = [Contributor(c, o, 0, o % 4 != 0) for c in range(3) for o in range(6)]
    m = n // 10

    def close_all(docs: dict[int, int] | None) -> float:
        chunks = [
            WorkChunk(0, c, rng.integers(0, 2, 64).astype(np.int32), np.arange(64), 0)
            for c in range(3)
        ]
        best = float("inf")
        for _ in range(3):
            tracks = [ChunkTrack(chunk) for chunk in chunks]
            t0 = time.perf_counter()
            for _ in range(m):
                i = 0
                for track in tracks:
                    track.delivered[:] = [0] * 64
                    i = track.add_run(pieces, i, docs)
            best = min(best, (time.perf_counter() - t0) / m * 1e9)
        return best

    return per_next, max(0.0, close_all({}) - close_all(None))


def _scrape_ms(docs: Any, workers: int, n: int = 20) -> float:
    """Wall time of one scrape of ``/metrics`` (the collector reads the pipeline in the
    parent), in ms, on a pipeline that has delivered 200 batches."""
    pipe = zephon_lm_pipeline(docs, 0, workers, metrics_port=0)
    try:
        for _ in range(200):
            next(pipe)
        url = pipe._metrics.url  # noqa: SLF001 - started by the first next()
        urllib.request.urlopen(url, timeout=10).read()
        t0 = time.perf_counter()
        for _ in range(n):
            urllib.request.urlopen(url, timeout=10).read()
        return (time.perf_counter() - t0) / n * 1e3
    finally:
        pipe.close()


def _cpu_per_batch(r: dict[str, Any]) -> float:
    return (r["parent_cpu_s"] + r["children_cpu_s"]) / r["batches"]


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
        # CPU seconds (parent and workers) per batch, off over on, round by round: what the
        # metrics cost in work, less exposed than wall time to neighbours taking the cores
        cpu = summarize(
            [
                _cpu_per_batch(b) / _cpu_per_batch(a)
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
                "paired range": f"{paired['min']:.2f}-{paired['max']:.2f}",
                "cpu off/on paired": round(cpu["median"], 3),
                "cpu range": f"{cpu['min']:.2f}-{cpu['max']:.2f}",
                "off range": f"{off['min']:.0f}-{off['max']:.0f}",
                "on range": f"{on['min']:.0f}-{on['max']:.0f}",
            }
        )
    hot, docs_ns = _hot_path_ns()
    scrape_ms = {w: _scrape_ms(docs, w) for w in workers}
    print_table(
        rows,
        list(rows[0]),
        title=(
            f"Metrics endpoint on (scraped every {args.scrape_s} s) vs off, LM workload "
            f"({args.batches} batches x {args.repeats}, medians)"
        ),
    )
    print(
        f"engine bookkeeping kept for the metrics, on or off: {hot:.0f} ns per next(), and "
        f"{docs_ns:.0f} ns to count the documents of an LM batch (18 pieces)"
    )
    print(
        "one scrape of /metrics: "
        + ", ".join(f"{ms:.2f} ms (workers={w})" for w, ms in scrape_ms.items())
        + f"; scraped every {args.scrape_s} s"
    )
    write_results(
        "metrics_overhead",
        rows,
        args.results,
        extra={
            "args": vars(args),
            "hot_path_ns": hot,
            "count_docs_ns": docs_ns,
            "scrape_ms": {str(w): ms for w, ms in scrape_ms.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
