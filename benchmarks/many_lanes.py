"""One rank owning many lanes (an elastic shrink onto few hosts), against 8 lanes.

The LM workload in process, one rank owning L lanes. A lane's first batch costs more (its
work source and bins start), and a rank of L lanes reaches every lane once per L batches,
so this reports both: the time for the first L batches (every lane's first), and the
steady state after it (batches/s and CPU per batch, over ``--batches`` more). Then the
resident memory and the objects CPython's cyclic collector tracks (what each full
collection scans), and ``checkpoint()``: the first (every lane's state built), then
:data:`CHECKPOINTS` more, each after a round in which every lane moved (the median and
the worst), and one after 100 more batches (100 lanes moved; a lane's state is rebuilt
only when it moved). With each, the time the collector ran inside it and in the 10
batches after it (see :mod:`zephon.pipeline.collector`: the checkpoint builds its state with the
collector paused; a collection the process owes still runs once the collector is back,
inside the call), and those 10 batches' time.
Each L runs in its own process, so memory figures are its own.

    python -m benchmarks.many_lanes [--quick] [--lanes 8,4096] [--batches N]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from typing import Any

from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


#: Checkpoints timed after a round in which every lane moved (the median and the worst).
CHECKPOINTS = 5


def measure(lanes: int, batches: int, docs: int) -> dict[str, Any]:
    """One configuration, in this process."""
    from benchmarks.workload import SyntheticDocs, pregenerate
    from benchmarks.zephon_lm import zephon_lm_pipeline

    corpus = pregenerate(SyntheticDocs(docs, seed=0))
    base_mb = _rss_mb()
    pipe = zephon_lm_pipeline(corpus, 0, 0, lanes=lanes, prefetch=0)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(lanes):
        next(pipe)
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(pipe)
    t2, c2 = time.perf_counter(), time.process_time()
    gc_s = [0.0]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)

    def timed_checkpoint() -> tuple[float, float, float, float]:
        """(checkpoint ms, collector ms in it, next 10 batches ms, collector ms in them)"""
        gc_s[0], a = 0.0, time.perf_counter()
        pipe.checkpoint()
        b, in_ckpt = time.perf_counter(), gc_s[0]
        gc_s[0] = 0.0
        for _ in range(10):
            next(pipe)
        c = time.perf_counter()
        return (b - a) * 1e3, in_ckpt * 1e3, (c - b) * 1e3, gc_s[0] * 1e3

    first = timed_checkpoint()  # every lane's state built for the first time
    rounds = []
    for _ in range(CHECKPOINTS):  # each after a round in which every lane moved
        for _ in range(lanes):
            next(pipe)
        rounds.append(timed_checkpoint())
    for _ in range(100):
        next(pipe)
    after_100 = timed_checkpoint()
    gc.callbacks.remove(on_gc)
    by_ms = sorted(rounds)
    median, worst = by_ms[len(by_ms) // 2], by_ms[-1]
    row = {
        "lanes": lanes,
        "first round s": round(t1 - t0, 2),
        "first round ms/batch": round((t1 - t0) / lanes * 1e3, 2),
        "steady batches/s": round(batches / (t2 - t1), 1),
        "steady CPU us/batch": round((c2 - c1) / batches * 1e6),
        "RSS MB": round(_rss_mb()),
        "RSS over corpus MB": round(_rss_mb() - base_mb),
        "peak RSS MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "tracked objects": len(gc.get_objects()),
        "first checkpoint ms": round(first[0], 1),
        "checkpoint ms (every lane moved), median": round(median[0], 1),
        "collector ms in it": round(median[1], 1),
        "checkpoint ms (every lane moved), worst": round(worst[0], 1),
        "collector ms in the worst": round(worst[1], 1),
        "next 10 batches ms": round(median[2], 1),
        "collector ms in them": round(median[3], 1),
        "checkpoint ms (100 lanes moved)": round(after_100[0], 1),
        "first-round CPU us/batch": round((c1 - c0) / lanes * 1e6),
    }
    pipe.close()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--lanes", default="8,4096")
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--results", default="bench_results")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one L, JSON out
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.batches, args.docs)))
        return 0
    if args.quick:
        args.lanes, args.batches, args.docs = "8,128", 50, 1500
    rows = []
    for lanes in (int(x) for x in args.lanes.split(",")):
        cmd = [sys.executable, "-m", "benchmarks.many_lanes", "--one", str(lanes)]
        cmd += ["--batches", str(args.batches), "--docs", str(args.docs)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]["steady CPU us/batch"]
    for row in rows:
        row["steady CPU vs first row"] = round(row["steady CPU us/batch"] / base, 2)
    print_table(rows, list(rows[0]), title="One rank owning many lanes (LM workload, in process)")
    write_results("many_lanes", rows, args.results, extra={"args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
