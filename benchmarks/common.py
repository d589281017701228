"""Helpers shared by the benchmark scripts: timing, interleaved repeats, results, tables."""

from __future__ import annotations

import datetime as _dt
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

_T = TypeVar("_T")

# ---------------------------------------------------------------------------------------------
# CPU accounting


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_children(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc (``task/*/children``, or a scan of every
    ``/proc/N/stat`` for its parent pid where the kernel lacks that file); empty without /proc."""
    out: list[int] = []
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except FileNotFoundError:
            return _scan_children(pid)
        except OSError:
            continue
    return out


def _scan_children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                data = f.read()
        except OSError:
            continue
        if int(data[data.rindex(")") + 2 :].split()[1]) == pid:
            out.append(int(entry))
    return out


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process in seconds (its own, not its children's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields resume after the last ')'.
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime/stime are fields 14/15.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def descendant_pids(pid: int | None = None) -> list[int]:
    """Every live descendant process of ``pid`` (this process by default)."""
    stack = _proc_children(os.getpid() if pid is None else pid)
    seen: list[int] = []
    while stack:
        child = stack.pop()
        if child not in seen:
            seen.append(child)
            stack.extend(_proc_children(child))
    return seen


def descendant_cpu() -> dict[int, float]:
    """CPU seconds so far of every live descendant process of this process, by pid."""
    result: dict[int, float] = {}
    for pid in descendant_pids():
        cpu = _proc_cpu_s(pid)
        if cpu is not None:
            result[pid] = cpu
    return result


def _rusage_children_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class CpuMeter:
    """Parent and children CPU time over a window.

    Parent: ``time.process_time`` (all threads of this process). Children: live descendants
    read from /proc at both ends (a process born inside the window counts from 0), plus
    ``getrusage(RUSAGE_CHILDREN)`` for children reaped inside the window, minus what those
    had already used when the window opened.
    """

    def start(self) -> CpuMeter:
        self._wall0 = time.perf_counter()
        self._cpu0 = time.process_time()
        self._ru0 = _rusage_children_s()
        self._kids0 = descendant_cpu()
        return self

    def stop(self) -> dict[str, float]:
        kids1 = descendant_cpu()
        ru1 = _rusage_children_s()
        cpu1 = time.process_time()
        wall = time.perf_counter() - self._wall0
        live = sum(c - self._kids0.get(pid, 0.0) for pid, c in kids1.items())
        gone_before = sum(c for pid, c in self._kids0.items() if pid not in kids1)
        reaped = max(0.0, (ru1 - self._ru0) - gone_before)
        children = max(0.0, live) + reaped
        parent = cpu1 - self._cpu0
        return {
            "wall_s": wall,
            "parent_cpu_s": parent,
            "children_cpu_s": children,
            "parent_cpu_per_wall": parent / wall if wall > 0 else math.nan,
            "children_cpu_per_wall": children / wall if wall > 0 else math.nan,
        }


# ---------------------------------------------------------------------------------------------
# Throughput


def batch_token_counts(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(real tokens, padded positions) of one batch.

    Real tokens: positions with ``tokens_segment_ids > 0`` when the batch has both ``tokens``
    and ``tokens_segment_ids``; otherwise non-pad (``!= 0``) entries of ``tokens``. Padded
    positions: every entry of ``tokens``. A batch without ``tokens`` counts (0, 0).
    """
    if "tokens" not in batch:
        return 0, 0
    tokens = np.asarray(batch["tokens"])
    seg = batch.get("tokens_segment_ids")
    if seg is not None:
        real = int(np.count_nonzero(np.asarray(seg) > 0))
    else:
        real = int(np.count_nonzero(tokens))
    return real, int(tokens.size)


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if callable(close):
        close()


def measure_throughput(
    make_iter: Callable[[], Iterable[Mapping[str, Any]]],
    num_batches: int,
    warmup: int = 10,
    rate: float | None = None,
) -> dict[str, Any]:
    """Time ``num_batches`` batches after ``warmup`` untimed ones.

    With ``rate`` the consumer takes at most that many batches per second, as a training
    loop bound by its step time does (it sleeps until each batch is due): then the CPU
    columns say what the loader costs at that rate rather than flat out.

    ``make_iter()`` returns an iterator or iterable of batches (dicts of arrays); it is closed
    afterwards if it has ``close()``. Returns batches/s, real and padded tokens/s, the padding
    fraction, parent and children CPU seconds and CPU/wall ratios for the timed window, and
    ``startup_s`` (``make_iter()`` to the first batch). Raises ``RuntimeError`` if the iterator
    ends before ``warmup + num_batches`` batches.
    """
    if num_batches <= 0:
        raise ValueError(f"num_batches must be positive, got {num_batches}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    gc.collect()
    t0 = time.perf_counter()
    source = make_iter()
    it = iter(source)
    try:
        produced = 0

        def pull() -> Mapping[str, Any]:
            nonlocal produced
            try:
                b = next(it)
            except StopIteration:
                raise RuntimeError(
                    f"iterator ended after {produced} batches; "
                    f"needed warmup={warmup} + num_batches={num_batches}"
                ) from None
            produced += 1
            return b

        pull()
        startup_s = time.perf_counter() - t0
        for _ in range(max(0, warmup - 1)):
            pull()
        real = padded = 0
        meter = CpuMeter().start()
        started = time.perf_counter()
        for i in range(num_batches):
            if rate is not None:
                wait = started + i / rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            r, p = batch_token_counts(pull())
            real += r
            padded += p
        cpu = meter.stop()
    finally:
        _close(it)
        if it is not source:
            _close(source)
    wall = cpu["wall_s"]
    return {
        "batches": num_batches,
        "warmup": warmup,
        "startup_s": startup_s,
        "batches_per_s": num_batches / wall,
        "real_tokens_per_s": real / wall,
        "padded_tokens_per_s": padded / wall,
        "padding_fraction": 1.0 - real / padded if padded else math.nan,
        "real_tokens": real,
        "padded_tokens": padded,
        **cpu,
    }


# ---------------------------------------------------------------------------------------------
# Interleaved repetitions


def interleaved_repeats(
    candidates: Mapping[str, Callable[[], Any]],
    repeats: int | Mapping[str, int],
    *,
    rotate: bool = False,
    on_result: Callable[[str, int, Any], None] | None = None,
) -> dict[str, list[Any]]:
    """Run the candidates alternately (A B C A B C ...), ``repeats`` rounds.

    Alternating spreads machine noise (thermal, neighbours, page cache) over all candidates
    instead of letting it land on one. With ``rotate``, round r starts at candidate r mod n
    (A B C, B C A, ...), which also evens out position effects. ``repeats`` may also give a
    count per candidate: a candidate leaves the rounds once it has run its count (with
    ``rotate``, round r then starts at r mod the number still running). Returns each
    candidate's results in run order; :func:`summarize` turns them into median/min/max.
    """
    names = list(candidates)
    if isinstance(repeats, int):
        counts = dict.fromkeys(names, repeats)
        if repeats <= 0:
            raise ValueError(f"repeats must be positive, got {repeats}")
    else:
        counts = {name: repeats[name] for name in names}
        if any(c <= 0 for c in counts.values()):
            raise ValueError(f"repeats must be positive, got {counts}")
    results: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(max(counts.values(), default=0)):
        active = [name for name in names if counts[name] > r]
        start = r % len(active) if rotate else 0
        for name in active[start:] + active[:start]:
            gc.collect()
            res = candidates[name]()
            results[name].append(res)
            if on_result is not None:
                on_result(name, r, res)
    return results


def time_calls(fn: Callable[[], _T], calls: int) -> tuple[list[float], _T]:
    """Call ``fn`` ``calls`` times in a row: the wall seconds of each call and the last result."""
    if calls <= 0:
        raise ValueError(f"calls must be positive, got {calls}")
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return times, result


def summarize(values: Sequence[float]) -> dict[str, float]:
    """median / min / max / n of a list of numbers (NaNs ignored)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def median_and_range(
    label: str, values: Sequence[float], *, scale: float = 1.0, digits: int = 1
) -> dict[str, Any]:
    """Two table columns from repeated measurements: ``label``, the median, and ``label +
    " range"``, ``"min–max"``; both scaled by ``scale`` and given to ``digits`` decimals. Without
    a measurement both are None."""
    s = summarize(values)
    if s["n"] == 0:
        return {label: None, f"{label} range": None}
    lo, hi = s["min"] * scale, s["max"] * scale
    return {
        label: round(s["median"] * scale, digits),
        f"{label} range": f"{lo:.{digits}f}–{hi:.{digits}f}",
    }


def copy_batch(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A batch as ordinary arrays of its own (not views into a loader's shared memory, which
    can then be released)."""
    return {k: np.array(v, copy=True) for k, v in batch.items()}


def batches_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two batches have the same keys and equal arrays under each."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def summarize_results(
    results: Mapping[str, Sequence[Mapping[str, Any]]], metrics: Sequence[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """``{name: {metric: {median, min, max, n}}}`` from :func:`interleaved_repeats` output
    whose results are dicts (e.g. :func:`measure_throughput`'s)."""
    return {
        name: {m: summarize([r[m] for r in runs if m in r]) for m in metrics}
        for name, runs in results.items()
    }


# ---------------------------------------------------------------------------------------------
# Results and machine info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


_PACKAGES = (
    "zephon",
    "numpy",
    "grain",
    "msgpack",
    "zstandard",
    "multiprocess",
    "tqdm",
    "jax",
    "jaxlib",
    "pyarrow",
    "matplotlib",
)


def package_versions(packages: Iterable[str] = _PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            # Not installed (e.g. zephon run from a source checkout): ask the module itself.
            try:
                out[name] = str(importlib.import_module(name).__version__)
            except Exception:  # noqa: BLE001 - any failure just means "unknown"
                out[name] = None
    return out


def machine_info() -> dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_model": _cpu_model(),
        "nproc": affinity if affinity is not None else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "packages": package_versions(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return repr(obj)


def _finite(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_results(
    name: str,
    rows: Any,
    results_dir: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``{name, machine, rows, ...extra}`` to ``results_dir/name.json``; returns the path.

    The write is atomic (temp file + rename) so an interrupted run leaves no half file.
    """
    out_dir = Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"name": name, "machine": machine_info(), "rows": rows, **(extra or {})}
    text = json.dumps(
        _finite(json.loads(json.dumps(payload, default=_json_default))), indent=2, allow_nan=False
    )
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# Tables


def format_value(value: Any) -> str:
    """Compact human formatting: ints with thousands separators, floats to ~4 significant
    digits, None/NaN as '-'."""
    if value is None:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1e5:
            return f"{v:,.0f}"
        if a >= 1:
            return f"{v:,.{max(0, 3 - int(math.floor(math.log10(a))))}f}"
        if a >= 1e-3:
            return f"{v:.4f}"
        return f"{v:.3g}"
    return str(value)


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str | tuple[str, str]] | None = None,
    *,
    title: str | None = None,
    file: Any = None,
) -> str:
    """Print ``rows`` (dicts) as an aligned text table and return the text.

    ``columns`` picks and orders the keys; an entry may be ``(key, header)``. Numbers are
    right-aligned, text left-aligned. Missing values print as '-'.
    """
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    keys = [c[0] if isinstance(c, tuple) else c for c in columns]
    headers = [c[1] if isinstance(c, tuple) else c for c in columns]
    cells = [[format_value(row.get(k)) for k in keys] for row in rows]
    numeric = [
        all(
            isinstance(row.get(k), (int, float, np.integer, np.floating)) or row.get(k) is None
            for row in rows
        )
        for k in keys
    ]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def fmt(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(fmt(headers))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in cells)
    text = "\n".join(lines)
    print(text, file=file if file is not None else sys.stdout, flush=True)
    return text
