"""Question 12: what does data at scale cost to open and to read?

Three parts (``--parts index,start,remote``):

* ``index``: building JSONL offset indexes by the vectorised newline scan (GB/s from the
  page cache, first open with no cache) against the second open (the caches mapped), for
  ``--index-mb`` of JSONL in 8 files;
* ``start``: time to first batch over ``--files`` JSONL shards (a glob), 8 lanes, 2
  workers: the first start (indexes built) and the second start (caches present), each in
  a fresh Python process, measured from before ``import zephon`` to the first batch;
* ``remote``: batches/s of ``fetch().batch(8)`` at 8 lanes and 2 workers over the same
  shards on local disk and on S3 servers on 127.0.0.1 (``--server``): moto's, in a process
  of its own that answers every request ``--latency-ms`` late
  (``benchmarks.s3_local.S3ServerProcess``), and SeaweedFS's compiled gateway (``weed
  server``, ``benchmarks.s3_local.SeaweedServer``) behind a relay in a process of its own
  that holds every request as long (``DelayProxyProcess``); each read the Zephon way (a
  chunk's samples in concurrent, coalesced range requests) and one sample per request; and
  each server with no delay, which gives the rate the server and the client allow. Every
  case runs ``--repeats`` times, interleaved; each row gives the median and the spread, the
  requests per batch, and the CPU cores (CPU seconds over wall seconds) the server, the
  relay, the loader (this process and its workers) and the whole machine used.

    python -m benchmarks.data_at_scale [--quick] [--parts index,start,remote] [--files N]
        [--index-mb MB] [--latency-ms MS] [--batches N] [--server moto|seaweedfs|both]
        [--repeats N] [--results DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table
from benchmarks.s3_local import cpu_seconds

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


def _machine_busy_s() -> float:
    """CPU seconds all cores of this machine spent busy so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Over the timed part of a run: wall seconds, the requests the server saw, and CPU
    cores in use (CPU seconds / wall seconds) by each server process, by the loader (this
    process and its worker processes) and by the whole machine (other load included)."""

    def __init__(self, servers: dict[str, int], count: Callable[[bool], int] | None) -> None:
        self.servers = servers  # role -> pid
        self.count = count
        self.not_loader: set[int] = set()  # every server's pid: idle ones are not the loader

    def _loader_pids(self) -> list[int]:
        try:
            import psutil
        except ImportError:
            return []
        others = self.not_loader | set(self.servers.values())
        return [os.getpid()] + [
            p.pid for p in psutil.Process().children(recursive=True) if p.pid not in others
        ]

    def _cpu(self, pid: int) -> float:
        try:
            return cpu_seconds(pid)
        except OSError:  # a worker that has just exited
            return 0.0

    def start(self) -> None:
        if self.count is not None:
            self.count(True)
        self._pids = self._loader_pids()
        self._loader0 = {p: self._cpu(p) for p in self._pids}
        self._servers0 = {r: self._cpu(p) for r, p in self.servers.items()}
        self._machine0 = _machine_busy_s()
        self._t0 = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self._t0
        out: dict[str, Any] = {
            "requests": self.count(False) if self.count is not None else None,
            "machine_cores": (_machine_busy_s() - self._machine0) / wall,
        }
        for role, pid in self.servers.items():
            out[f"{role}_cores"] = (self._cpu(pid) - self._servers0[role]) / wall
        if self._pids:
            used = sum(self._cpu(p) - self._loader0[p] for p in self._pids)
            out["loader_cores"] = used / wall
        return out


def _batches_per_s(ds: Any, batches: int, meter: Meter | None = None) -> dict[str, Any]:
    import zephon as zp

    source = zp.StaticMixtureWorkSource({"d": ds}, None, seed=0, chunk_size=8)
    with zp.Pipeline(source, canonical_replicas=LANES, workers=WORKERS).fetch().batch(8) as pipe:
        for _ in range(LANES * 2):  # every lane started, every file's ends checked
            next(pipe)
        if meter is not None:
            meter.start()
        t0 = time.perf_counter()
        for _ in range(batches):
            next(pipe)
        rate = batches / (time.perf_counter() - t0)
        measured = meter.stop() if meter is not None else {}
    requests = measured.pop("requests", None)
    if requests is not None:
        measured["requests_per_batch"] = requests / batches
    for role in ("loader", "server", "relay"):  # CPU per unit: steadier than rates under load
        if f"{role}_cores" in measured:
            measured[f"{role}_ms_per_batch"] = measured[f"{role}_cores"] / rate * 1e3
    if requests and "server_cores" in measured:
        measured["server_ms_per_request"] = measured["server_ms_per_batch"] * batches / requests
    return {"batches_per_s": rate, **measured}


def _upload(client: Any, folder: Path) -> None:
    client.create_bucket(Bucket="bench")
    for path in sorted(folder.glob("*.jsonl")):
        client.put_object(Bucket="bench", Key=f"d/{path.name}", Body=path.read_bytes())


def _remote_cases(
    stack: contextlib.ExitStack, kind: str, folder: Path, latency_ms: float
) -> list[tuple[str, Any, Meter]]:
    """(label, dataset, meter) for ``kind``'s server: with ``latency_ms`` added to every
    request (moto: by the server; SeaweedFS: by a relay in a process of its own) and with
    none, each read concurrently (Zephon's way) and one request per sample."""
    import zephon as zp
    from benchmarks.s3_local import DelayProxyProcess, S3ServerProcess, SeaweedServer

    cases = []
    weed = stack.enter_context(SeaweedServer()) if kind == "seaweedfs" else None
    if weed is not None:
        _upload(weed.client(), folder)
    for delay in (latency_ms, 0.0):
        servers: dict[str, int]
        if weed is None:
            moto = stack.enter_context(S3ServerProcess(delay_s=delay / 1000))
            _upload(moto.client(), folder)
            opts, count, servers = moto.storage_options, moto.requests, {"server": moto.pid}
        elif delay:
            relay = stack.enter_context(DelayProxyProcess(weed, delay_s=delay / 1000))
            opts, count = relay.storage_options, relay.requests
            servers = {"server": weed.pid, "relay": relay.pid}
        else:
            opts, count, servers = weed.storage_options, None, {"server": weed.pid}
        remote = zp.JsonlSource("s3://bench/d/*.jsonl", field="text", storage_options=opts)
        name = f"{kind} +{delay:g} ms" if delay else f"{kind}, no delay"
        for how, ds in (("concurrent", remote), ("one request per sample", OneAtATime(remote))):
            cases.append((f"{name}, {how}", ds, Meter(servers, count)))
    return cases


def part_remote(
    work: Path, latency_ms: float, batches: int, servers: list[str], repeats: int
) -> list[dict[str, Any]]:
    """Every case ``repeats`` times, interleaved (local disk, then each server's cases, then
    again), so that load from elsewhere on the machine falls on all of them alike."""
    import zephon as zp

    folder = work / "remote"
    write_shards(folder, 8, 400)
    local = zp.JsonlSource(str(folder / "*.jsonl"), field="text")
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        cases: list[tuple[str, Any, Meter]] = [("local disk", local, Meter({}, None))]
        for kind in servers:
            cases += _remote_cases(stack, kind, folder, latency_ms)
        pids = {pid for _, _, meter in cases for pid in meter.servers.values()}
        for _, _, meter in cases:
            meter.not_loader = pids
        for _ in range(repeats):
            for label, ds, meter in cases:
                n = batches * 25 if label == "local disk" else batches  # about 1 s each
                n = max(4, batches // 8) if "per sample" in label else n
                runs.setdefault(label, []).append(_batches_per_s(ds, n, meter))
    rows = []
    for label, measured in runs.items():
        rates = sorted(m["batches_per_s"] for m in measured)
        row: dict[str, Any] = {"part": "remote", "read": label}
        row["batches_per_s"] = statistics.median(rates)
        row["min"], row["max"] = rates[0], rates[-1]
        for key in measured[0]:
            if key != "batches_per_s" and measured[0][key] is not None:
                row[key] = statistics.median(m[key] for m in measured)
        rows.append(row)
    base = {r["read"]: r["batches_per_s"] for r in rows}
    for r in rows:
        r["vs_local"] = r["batches_per_s"] / base["local disk"]
        sequential = base.get(r["read"].replace("concurrent", "one request per sample"))
        if r["read"].endswith("concurrent") and sequential:
            r["vs_one_per_sample"] = r["batches_per_s"] / sequential
    return rows


REMOTE_COLUMNS = [
    "read",
    ("batches_per_s", "batches/s"),
    "min",
    "max",
    "vs_local",
    "vs_one_per_sample",
    ("requests_per_batch", "req/batch"),
    "server_cores",
    "relay_cores",
    "loader_cores",
    "machine_cores",
    ("loader_ms_per_batch", "loader ms/batch"),
    ("server_ms_per_request", "server ms/req"),
]


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
    ap.add_argument(
        "--server",
        choices=("moto", "seaweedfs", "both"),
        default="both",
        help="the S3 server(s) of the remote part",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs of each remote case")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1; got {args.repeats}")
    parts = args.parts.split(",")
    files, megabytes, batches, repeats = (
        (200, 8, 16, 1) if args.quick else (args.files, args.index_mb, args.batches, args.repeats)
    )
    servers = ["moto", "seaweedfs"] if args.server == "both" else [args.server]
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
                remote = part_remote(work, args.latency_ms, batches, servers, repeats)
                rows += remote
                print_table(
                    remote,
                    REMOTE_COLUMNS,
                    title=f"fetch over S3, 8 lanes, 2 workers (median of {repeats}; cores: "
                    "CPU seconds / wall seconds)",
                )
        finally:
            if saved is None:
                os.environ.pop("ZEPHON_CACHE_DIR", None)
            else:
                os.environ["ZEPHON_CACHE_DIR"] = saved
    write_results("data_at_scale", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
