"""Question 12: what does data at scale cost to open and to read?

Three parts (``--parts index,start,remote``):

* ``index``: building JSONL offset indexes by the vectorised newline scan (GB/s from the
  page cache, first open with no cache) against the second open (the caches mapped), for
  ``--index-mb`` of JSONL in 8 files;
* ``start``: time to first batch over ``--files`` JSONL shards (a glob), 8 lanes, 2
  workers: the first start (indexes built) and the second start (caches present), each in
  a fresh Python process, measured from before ``import zephon`` to the first batch;
* ``remote``: batches/s of ``fetch().batch(8)`` at 8 lanes and 2 workers over the same
  shards on local disk, and on a moto S3 server on 127.0.0.1 that answers every request
  ``--latency-ms`` late (in a process of its own, off the loader's interpreter:
  ``benchmarks.s3_local.S3ServerProcess``), read the Zephon way (a chunk's samples in
  concurrent, coalesced range requests) and one sample per request (sequential); and the
  same server with no delay, which gives the rate the server itself allows.

    python -m benchmarks.data_at_scale [--quick] [--parts index,start,remote] [--files N]
        [--index-mb MB] [--latency-ms MS] [--batches N] [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table

ROOT = Path(__file__).resolve().parents[1]
LANES = 8
WORKERS = 2
_FIRST_BATCH = r"""
import time, sys
t0 = time.perf_counter()
import zephon as zp
ds = zp.JsonlSource(sys.argv[1], field="text", storage_options=None)
t_open = time.perf_counter()
source = zp.StaticMixtureWorkSource({"d": ds}, None, seed=0, chunk_size=8)
with zp.Pipeline(source, canonical_replicas=8, workers=2).fetch().batch(8) as pipe:
    next(pipe)
    t1 = time.perf_counter()
print(f"{t_open - t0:.4f} {t1 - t0:.4f} {len(ds)}")
"""


def write_shards(folder: Path, files: int, per_file: int, pad: int = 40) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for k in range(files):
        lines = [
            json.dumps({"id": k * per_file + i, "text": f"doc {k}-{i} " + "x" * (pad + i % 50)})
            for i in range(per_file)
        ]
        data = ("\n".join(lines) + "\n").encode()
        (folder / f"shard-{k:05d}.jsonl").write_bytes(data)
        total += len(data)
    return total


def _fresh_cache(root: Path) -> None:
    for p in root.glob(".*.zephon-idx"):
        p.unlink()
    shutil.rmtree(os.environ["ZEPHON_CACHE_DIR"], ignore_errors=True)


def part_index(work: Path, megabytes: int) -> dict[str, Any]:
    import zephon as zp

    folder = work / "index"
    per_file = max(1, megabytes * (1 << 20) // 8 // 400)
    size = write_shards(folder, 8, per_file, pad=330)
    pattern = str(folder / "*.jsonl")
    zp.JsonlSource(pattern)  # page cache warm
    _fresh_cache(folder)
    t0 = time.perf_counter()
    first = zp.JsonlSource(pattern)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = zp.JsonlSource(pattern)
    second_s = time.perf_counter() - t0
    assert len(again) == len(first) and again._index.built == 0
    return {
        "part": "index",
        "bytes": size,
        "records": len(first),
        "first_open_s": first_s,
        "scan_gb_s": size / first_s / 1e9,
        "second_open_s": second_s,
        "second_over_first": second_s / first_s,
    }


def _first_batch_in_subprocess(pattern: str) -> tuple[float, float, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_BATCH, pattern],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), int(out[2])


def part_start(work: Path, files: int) -> list[dict[str, Any]]:
    folder = work / "start"
    write_shards(folder, files, 5)
    pattern = str(folder / "*.jsonl")
    _fresh_cache(folder)
    rows = []
    for label in ("first start (indexes built)", "second start (caches)"):
        open_s, first_batch_s, n = _first_batch_in_subprocess(pattern)
        rows.append(
            {
                "part": "start",
                "files": files,
                "samples": n,
                "run": label,
                "open_s": open_s,
                "first_batch_s": first_batch_s,
            }
        )
    return rows


class OneAtATime:
    """A dataset without ``read``: fetch falls back to one ``ds[i]`` (one request) per
    sample, the sequential baseline."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]

    def content_identity(self) -> dict[str, Any]:
        return dict(self.ds.content_identity())


def _batches_per_s(ds: Any, batches: int) -> float:
    import zephon as zp

    source = zp.StaticMixtureWorkSource({"d": ds}, None, seed=0, chunk_size=8)
    with zp.Pipeline(source, canonical_replicas=LANES, workers=WORKERS).fetch().batch(8) as pipe:
        for _ in range(LANES * 2):  # every lane started, every file's ends checked
            next(pipe)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(pipe)
        return batches / (time.perf_counter() - t0)


def part_remote(work: Path, latency_ms: float, batches: int) -> list[dict[str, Any]]:
    import zephon as zp
    from benchmarks.s3_local import S3ServerProcess

    folder = work / "remote"
    write_shards(folder, 8, 400)
    local = zp.JsonlSource(str(folder / "*.jsonl"), field="text")
    rows = [{"part": "remote", "read": "local disk", "batches_per_s": None, "requests": None}]
    rows[0]["batches_per_s"] = _batches_per_s(local, batches)
    for delay in (latency_ms, 0.0):
        with S3ServerProcess(delay_s=delay / 1000) as s3:
            client = s3.client()
            client.create_bucket(Bucket="bench")
            for path in sorted(folder.glob("*.jsonl")):
                client.put_object(Bucket="bench", Key=f"d/{path.name}", Body=path.read_bytes())
            remote = zp.JsonlSource(
                "s3://bench/d/*.jsonl", field="text", storage_options=s3.storage_options
            )
            cases = [(f"s3 +{delay:g} ms, concurrent", remote)]
            if delay:
                cases.append((f"s3 +{delay:g} ms, sequential", OneAtATime(remote)))
            for label, ds in cases:
                s3.requests(reset=True)
                n = max(4, batches // 8) if "sequential" in label else batches
                rate = _batches_per_s(ds, n)
                rows.append(
                    {
                        "part": "remote",
                        "read": label,
                        "batches_per_s": rate,
                        "requests": s3.requests(),
                    }
                )
    base = {r["read"]: r["batches_per_s"] for r in rows}
    for r in rows:
        r["vs_local"] = r["batches_per_s"] / base["local disk"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--parts", default="index,start,remote")
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--index-mb", type=int, default=400)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--batches", type=int, default=80)
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    files, megabytes, batches = (
        (200, 8, 16) if args.quick else (args.files, args.index_mb, args.batches)
    )
    rows: list[dict[str, Any]] = []
    saved = os.environ.get("ZEPHON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="zephon-bench-scale-") as tmp:
        work = Path(tmp)
        os.environ["ZEPHON_CACHE_DIR"] = str(work / "cache")
        try:
            if "index" in parts:
                rows.append(part_index(work, megabytes))
                print_table(rows[-1:], title="JSONL index: first open (scan) vs second (cache)")
            if "start" in parts:
                start = part_start(work, files)
                rows += start
                print_table(start, title=f"time to first batch, {files} files, 8 lanes, 2 workers")
            if "remote" in parts:
                remote = part_remote(work, args.latency_ms, batches)
                rows += remote
                print_table(remote, title="fetch over S3 with injected latency, 8 lanes, 2 workers")
        finally:
            if saved is None:
                os.environ.pop("ZEPHON_CACHE_DIR", None)
            else:
                os.environ["ZEPHON_CACHE_DIR"] = saved
    write_results("data_at_scale", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
