"""Timing: the throughput of a batch iterator over a window (with its CPU cost), candidates
run in interleaved rounds, and calls timed one by one."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from benchmarks.harness.batches import batch_token_counts
from benchmarks.harness.cpu import CpuMeter

_T = TypeVar("_T")

# ---------------------------------------------------------------------------------------------
# Throughput


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
    candidate's results in run order; :func:`benchmarks.harness.stats.summarize` turns them
    into median/min/max.
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
