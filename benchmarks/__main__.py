"""Run the whole benchmark suite: ``python -m benchmarks [--quick] [--only q1,q3] [--results DIR]``
(also ``zephon bench ...`` from a source checkout).

Questions (one script each, also runnable alone as ``python -m benchmarks.<module>``):

    q1  lm_throughput     LM-workload throughput, Zephon workers 0/1/2 vs Grain
    q2  restore           restore-to-first-batch and checkpoint size against the step
    q3  flush_tradeoff    flush_every_k_chunks: padding, shuffle quality, replay, bytes
    q4  mixture_fidelity  per-component token share vs targets (ensure_mixture, Grain mix)
    q5  elastic           restore into other worker / rank counts; what Grain does
    q6  transport         worker -> parent transport: ring vs Queue vs segment per array
    q7  round_latency     multi-rank checkpoint round latency, directory and etcd
    q8  ring_depth        worker ring depth x consumer prefetch: the defaults' share of the best
    q9  many_lanes        one rank owning thousands of lanes (elastic shrink) against 8
    q10 worker_memory     a 500 MB in-memory dataset with 2 workers: summed PSS, first batch
    q11 many_components   mixtures of 2 to 1,000 components: next_chunk, memory, throughput
    q12 packing           first fit, best fit, concat-then-split: padding and batches/s vs Grain
    q13 data_at_scale     index scan vs cache, first batch at 10,000 files, fetch over S3 + latency
    q14 random_map        random_map's per-record generators against map with one generator
    q15 pretokenized      token file -> split -> pack -> batch in process, vs Grain first fit
    q16 media             JPEG decode + random crop + batch 64, 2 workers: bound, Grain, torch

Each writes ``<results>/<module>.json`` (rows plus the machine, package versions and date)
and, where it has one, ``<results>/<module>.png``; this runner also writes
``<results>/suite.json`` with what ran, how long it took and whether it failed. A question
that fails is reported and the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any

QUESTIONS: dict[str, tuple[str, str]] = {
    "q1": ("lm_throughput", "LM-workload throughput vs Grain"),
    "q2": ("restore", "restore cost and checkpoint size"),
    "q3": ("flush_tradeoff", "flush_every_k_chunks trade-off"),
    "q4": ("mixture_fidelity", "mixture fidelity"),
    "q5": ("elastic", "elastic resume"),
    "q6": ("transport", "worker transport"),
    "q7": ("round_latency", "checkpoint round latency"),
    "q8": ("ring_depth", "worker ring depth and prefetch"),
    "q9": ("many_lanes", "one rank owning many lanes"),
    "q10": ("worker_memory", "in-memory dataset with workers: memory, first batch"),
    "q11": ("many_components", "mixtures of many components"),
    "q12": ("packing", "packing strategies vs Grain's packers"),
    "q13": ("data_at_scale", "sharded files, index caches, object storage"),
    "q14": ("random_map", "random_map against map"),
    "q15": ("pretokenized", "pre-tokenized split -> pack -> batch vs Grain"),
    "q16": ("media", "JPEG decode + crop + batch vs the bound, Grain, torch"),
}
# Scripts that compare with Grain and accept --no-grain.
_GRAIN = {"q1", "q2", "q4", "q5", "q12", "q15", "q16"}


def _parse_only(text: str | None) -> list[str]:
    if not text:
        return list(QUESTIONS)
    by_module = {mod: q for q, (mod, _) in QUESTIONS.items()}
    picked = []
    for raw in text.split(","):
        key = raw.strip().lower()
        if not key:
            continue
        q = key if key in QUESTIONS else by_module.get(key)
        if q is None and key.isdigit():
            q = f"q{key}" if f"q{key}" in QUESTIONS else None
        if q is None:
            raise SystemExit(
                f"--only: unknown question {raw!r}; choose from "
                + ", ".join(f"{q} ({m})" for q, (m, _) in QUESTIONS.items())
            )
        if q not in picked:
            picked.append(q)
    return picked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--only", default=None, help="comma-separated: q1,q3 or module names")
    ap.add_argument("--results", default="bench_results", help="directory for JSON and PNG")
    ap.add_argument("--no-grain", action="store_true", help="skip the Grain baselines")
    ap.add_argument("--no-etcd", action="store_true", help="skip the etcd rows of q7")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # ``zephon bench -- --quick``
        argv = argv[1:]
    args = ap.parse_args(argv)
    picked = _parse_only(args.only)
    results = Path(args.results)

    from benchmarks.harness.machine import machine_info
    from benchmarks.harness.results import write_results
    from benchmarks.harness.tables import print_table

    info = machine_info()
    print(
        f"Zephon benchmark suite{' (quick)' if args.quick else ''}: {info['cpu_model']}, "
        f"{info['nproc']} CPUs, Python {info['python']}, {info['date']}",
        flush=True,
    )
    summary: list[dict[str, Any]] = []
    t_suite = time.perf_counter()
    for q in picked:
        module, what = QUESTIONS[q]
        print(f"\n=== {q.upper()} {what} (benchmarks.{module}) ===", flush=True)
        sub = ["--results", str(results)]
        if args.quick:
            sub.append("--quick")
        if args.no_grain and q in _GRAIN:
            sub.append("--no-grain")
        if args.no_etcd and q == "q7":
            sub.append("--no-etcd")
        row: dict[str, Any] = {"question": q, "module": module}
        t0 = time.perf_counter()
        started = time.time() - 1.0
        try:
            mod = importlib.import_module(f"benchmarks.{module}")
        except ImportError as e:
            row.update(status=f"not available ({e})", seconds=0.0)
            print(f"benchmarks.{module} is not available: {e}", file=sys.stderr)
            summary.append(row)
            continue
        try:
            rc = int(mod.main(sub) or 0)
            row["status"] = "ok" if rc == 0 else f"exit {rc}"
        except SystemExit as e:  # argparse errors and explicit exits
            row["status"] = "ok" if e.code in (0, None) else f"exit {e.code}"
        except Exception as e:  # noqa: BLE001 - one failing question must not stop the suite
            traceback.print_exc()
            row["status"] = f"failed: {type(e).__name__}: {e}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        for ext in ("json", "png"):
            path = results / f"{module}.{ext}"
            # Only what this run wrote (not a file left by an earlier run).
            row[ext] = str(path) if path.exists() and path.stat().st_mtime >= started else None
        summary.append(row)
    total = time.perf_counter() - t_suite
    print()
    print_table(
        summary,
        ["question", "module", "status", "seconds", "json", "png"],
        title=f"Benchmark suite: {len(summary)} question(s) in {total:.0f} s",
    )
    path = write_results(
        "suite", summary, results, extra={"args": vars(args), "total_s": round(total, 1)}
    )
    plots = [r["png"] for r in summary if r.get("png")]
    print(f"\nresults: {results.resolve()}/ (summary {path.name})")
    if plots:
        print("plots:   " + ", ".join(plots))
    return 0 if all(r["status"] == "ok" for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
