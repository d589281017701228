"""Question: under random faults across ranks, does a checkpoint round ever commit a wrong
state, split its ranks' outcomes, or refuse a restarted job?

Runs the chaos harness of the suite (:mod:`tests.chaos.harness`: rank processes of real
jobs, SIGKILL and SIGSTOP of the leader and of followers at random moments, a full tmpfs,
etcd killed and restarted, restarts on another rank count, a second job on the same store
with and without its own job id) for ``--minutes`` on each store, then checks every call
and every saved file, and prints: rounds, faults injected, faulted rounds, split outcomes,
files off-step, files mixed across jobs, restarts and the time from each restart to its
first committed round.

Goal (issue 33), over at least 300 faulted rounds on each store: 0 split outcomes, 0
off-step files, 0 mixed files; the first round after a same-host restart succeeds.

    python -m benchmarks.chaos [--minutes M] [--store dir|etcd|both] [--seed S]
        [--results DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _row(report: dict[str, Any]) -> dict[str, Any]:
    restart = report["restart_s"]
    return {
        "store": report["store"],
        "minutes": round(report["duration_s"] / 60, 1),
        "rounds": report["rounds"],
        "committed": report["rounds_ok"],
        "faulted rounds": report["faulted_rounds"],
        "faults": sum(report["faults"].values()),
        "split": len(report["split"]),
        "off-step files": len(report["off_step"]),
        "mixed files": len(report["mixed"]),
        "files checked": report["files"],
        "restarts": report["restarts"],
        "first round failed": len(report["restart_failures"]),
        "restart->round s (median)": restart[len(restart) // 2] if restart else None,
        "restart->round s (max)": max(restart) if restart else None,
        "crashes": len(report["crashes"]),
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.results import write_results
    from benchmarks.harness.tables import print_table
    from tests.chaos.harness import Config, run

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=5.0, help="of faults, per store")
    ap.add_argument("--store", choices=["dir", "etcd", "both"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default="bench_results")
    ap.add_argument("--keep", help="a directory to keep the ranks' logs and files in")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    stores = ["dir", "etcd"] if args.store == "both" else [args.store]
    t0 = time.monotonic()

    def say(line: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t0:7.1f} s] {line}", flush=True)

    reports = []
    for i, store in enumerate(stores):
        workdir = None
        if args.keep:
            import os

            workdir = os.path.join(args.keep, store)
            os.makedirs(workdir, exist_ok=True)
        cfg = Config(
            store=store,
            duration_s=args.minutes * 60,
            seed=args.seed + i,
            workdir=workdir,
            log=say,
        )
        report = run(cfg)
        reports.append(report)
        for key in ("split", "off_step", "mixed", "restart_failures", "crashes"):
            for line in report[key][:5]:
                print(f"  {store} {key}: {line}")
        print(f"  {store} faults: {report['faults']}")
    rows = [_row(r) for r in reports]
    print_table(
        rows, title="chaos: rounds under random faults (goal: 0 split, 0 off-step, 0 mixed)"
    )
    write_results("chaos", rows, args.results, extra={"reports": reports})
    bad = any(
        r["split"] or r["off_step"] or r["mixed"] or r["restart_failures"] or r["crashes"]
        for r in reports
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
