"""Question 10: a large in-memory dataset with worker processes: memory and first batch.

One in-memory float32 array (500 MB; 50 MB with --quick) in an ``ArraySource``, read by
2 worker processes (spawn unless --start-method says otherwise) as batches of 256 rows of
4 KiB. Measured in a fresh
interpreter per run:

- the summed PSS of every process of the job (the parent and all its descendants: the
  workers, multiprocess's resource tracker), from ``/proc/PID/smaps_rollup``, so pages
  several processes share count once in all; after the first batch, and again after the
  workers have read about every row once;
- the same for the same pipeline over as many rows of zeros made on demand (a dataset
  that holds no data): the no-data baseline;
- the seconds from building the pipeline to its first batch, for both.

Goals (issue 14, item 10): summed PSS <= 2.2 x the array + the baseline (the caller's own
array and one shared copy: 2.0 x), first batch <= 1 s. Before datasets travelled by
reference every worker unpickled its own copy: 5.7 x, 5.4 s to the first batch.

    python -m benchmarks.worker_memory [--quick] [--repeats N] [--mb MB] [--start-method M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.cpu import descendant_pids
from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table

ROOT = Path(__file__).resolve().parents[1]
ROW_FLOATS = 1024  # 4 KiB rows: one page each
BATCH_ROWS = 256  # 1 MiB batches
WORKERS = 2
GOAL_PSS_RATIO = 2.2
GOAL_FIRST_BATCH_S = 1.0


def pss_bytes(pid: int) -> int:
    """``Pss`` of one process (``/proc/PID/smaps_rollup``), 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")


def job_pss() -> dict[str, int]:
    """Summed PSS of this process and every descendant, and this process's own."""
    me = pss_bytes(os.getpid())
    return {"total": me + sum(pss_bytes(pid) for pid in descendant_pids()), "parent": me}


def shared_segment_bytes() -> int:
    """The size of the shared datasets segment this process holds (0: none)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:zephon-data"):
                return os.stat(f"/proc/self/fd/{fd}").st_size
        except OSError:
            continue
    return 0


class Zeros:
    """The no-data baseline: rows of zeros made on demand, shaped like the array's."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> np.ndarray:
        return np.zeros(ROW_FLOATS, np.float32)


def run_child(array_mb: float, baseline: bool, start_method: str) -> dict[str, Any]:
    """One measurement, in this (fresh) process: what ``--child`` prints."""
    import zephon as zp

    rows = max(BATCH_ROWS * 4, int(array_mb * 1e6) // (ROW_FLOATS * 4))
    if baseline:
        data, dataset = np.empty((0, ROW_FLOATS), np.float32), Zeros(rows)
    else:
        data = np.arange(rows * ROW_FLOATS, dtype=np.float32).reshape(rows, ROW_FLOATS)
        dataset = zp.ArraySource(data)
    t0 = time.perf_counter()
    src = zp.StaticMixtureWorkSource(
        datasets={"a": dataset}, weights={"a": 1.0}, seed=0, chunk_size=64
    )
    pipe = (
        zp.Pipeline(src, canonical_replicas=4, workers=WORKERS, worker_start_method=start_method)
        .fetch()
        .batch(BATCH_ROWS)
    )
    next(pipe)
    first_batch_s = time.perf_counter() - t0
    after_first = job_pss()
    for _ in range(rows // BATCH_ROWS):  # about every row once, across the workers
        next(pipe)
    after_pass = job_pss()
    result = {
        "array_bytes": int(data.nbytes),
        "rows": rows,
        "first_batch_s": first_batch_s,
        "pss_first_batch": after_first["total"],
        "pss_full_pass": after_pass["total"],
        "parent_pss": after_pass["parent"],
        "shared_segment_bytes": shared_segment_bytes(),
    }
    pipe.close()
    return result


def measure(array_mb: float, baseline: bool, start_method: str) -> dict[str, Any]:
    """Runs one measurement in a fresh interpreter and returns what it printed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    child = ["--child", str(array_mb), "--start-method", start_method]
    if baseline:
        child.append("--baseline")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.worker_memory", *child],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"measurement of {array_mb} MB failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="50 MB, one repetition")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mb", type=float, default=None, help="array size in MB (default 500)")
    ap.add_argument("--start-method", default="spawn", choices=["spawn", "forkserver", "fork"])
    ap.add_argument("--results", default="bench_results")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(run_child(args.child, args.baseline, args.start_method)), flush=True)
        return 0
    array_mb = args.mb if args.mb is not None else (50.0 if args.quick else 500.0)
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[dict[str, Any]]] = {"data": [], "baseline": []}
    for _ in range(repeats):  # interleaved, so machine noise spreads over both
        runs["data"].append(measure(array_mb, False, args.start_method))
        runs["baseline"].append(measure(array_mb, True, args.start_method))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    mb = 1e6
    array_bytes = runs["data"][0]["array_bytes"]
    rows = []
    for moment, key in (("first batch", "pss_first_batch"), ("full pass", "pss_full_pass")):
        data, base = median("data", key), median("baseline", key)
        ratio = (data - base) / array_bytes
        rows.append(
            {
                "after": moment,
                "array MB": round(array_bytes / mb, 1),
                "summed PSS MB": round(data / mb, 1),
                "baseline PSS MB": round(base / mb, 1),
                "(PSS - baseline) / array": round(ratio, 2),
                "goal": f"<= {GOAL_PSS_RATIO}",
                "met": ratio <= GOAL_PSS_RATIO,
            }
        )
    title = f"Summed PSS, {WORKERS} workers ({args.start_method}; medians of {repeats})"
    print_table(rows, list(rows[0]), title=title)
    first = median("data", "first_batch_s")
    timing = [
        {
            "dataset": f"{array_bytes / mb:.0f} MB array",
            "first batch s": round(first, 3),
            "range": _range(runs["data"], "first_batch_s"),
            "goal": f"<= {GOAL_FIRST_BATCH_S}",
            "met": first <= GOAL_FIRST_BATCH_S,
            "shared segment MB": round(median("data", "shared_segment_bytes") / mb, 1),
        },
        {
            "dataset": "rows made on demand (baseline)",
            "first batch s": round(median("baseline", "first_batch_s"), 3),
            "range": _range(runs["baseline"], "first_batch_s"),
            "goal": None,
            "met": None,
            "shared segment MB": round(median("baseline", "shared_segment_bytes") / mb, 1),
        },
    ]
    print_table(timing, list(timing[0]), title="Building the pipeline to its first batch")
    write_results(
        "worker_memory", rows + timing, args.results, extra={"args": vars(args), "runs": runs}
    )
    return 0


def _range(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{min(values):.3f}–{max(values):.3f}"


if __name__ == "__main__":
    sys.exit(main())
