"""What ``zephon top`` and ``zephon report`` show, from flat figures: the keys of
:func:`~zephon.metrics.scalars` (``name/label=value/...``), read from a series that
:func:`~zephon.metrics.record` wrote or from a scrape of the endpoint (:func:`parse_text`
turns the Prometheus text format into the same keys, with no ``prometheus_client``).

:func:`frame` makes one picture of the loader from two such readings ``dt`` seconds apart:
rates over that interval, and the cumulative figures of the later one.
"""

from __future__ import annotations

import math
import re
from typing import Any

Flat = dict[str, float]

#: Where a label starts in a flat key (a component's name may hold a "/").
_LABEL = re.compile(r"/(?=(?:worker|stage|component|source|kind|where|le)=)")
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_PAIR = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def parse_text(text: str) -> Flat:
    """The ``zephon_*`` samples of a Prometheus text exposition as flat keys (``rank``
    left out, ``_created`` samples dropped, histogram buckets kept as ``.../le=0.01``;
    labels in the exposition's order, which :func:`canonical` is)."""
    out: Flat = {}
    for line in text.splitlines():
        if not line.startswith("zephon_"):
            continue
        m = _SAMPLE.match(line)
        if m is None or m["name"].endswith("_created"):
            continue
        key = m["name"]
        for k, v in _PAIR.findall(m["labels"] or ""):
            if k != "rank":
                v = v.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
                key += f"/{k}={v}"
        try:
            out[key] = float(m["value"])
        except ValueError:
            continue
    return out


def canonical(flat: Flat) -> Flat:
    """The same figures with each key's labels sorted by name (as the Prometheus text
    format writes them; :func:`~zephon.metrics.scalars` keeps the order of definition)."""
    out: Flat = {}
    for key, value in flat.items():
        name, labels = split(key)
        out[name + "".join(f"/{k}={labels[k]}" for k in sorted(labels))] = value
    return out


def split(key: str) -> tuple[str, dict[str, str]]:
    """A flat key's metric name and labels."""
    name, *parts = _LABEL.split(key)
    return name, dict(p.split("=", 1) for p in parts)


def select(flat: Flat, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric: (labels, value)."""
    out = []
    for key, value in flat.items():
        if key == name or key.startswith(name + "/"):
            n, labels = split(key)
            if n == name:
                out.append((labels, value))
    return out


def _rate(now: Flat, prev: Flat | None, key: str, dt: float | None) -> float | None:
    if prev is None or not dt or key not in now or key not in prev:
        return None
    d = now[key] - prev[key]
    return None if d < 0 else d / dt  # < 0: the counter started again (another run)


def quantile(now: Flat, prev: Flat | None, q: float) -> float | None:
    """The ``q`` quantile of the consumer's waits in next() (over the interval when
    ``prev`` is given), from the histogram's buckets: the upper bound of the bucket that
    holds it (None without buckets or waits)."""
    bounds = []
    for labels, value in select(now, "zephon_next_wait_seconds_bucket"):
        le = math.inf if labels["le"] == "+Inf" else float(labels["le"])
        before = 0.0
        if prev is not None:
            before = prev.get("zephon_next_wait_seconds_bucket/le=" + labels["le"], 0.0)
        bounds.append((le, value - before))
    bounds.sort()
    if not bounds or bounds[-1][1] <= 0:
        return None
    want = q * bounds[-1][1]
    for le, cum in bounds:
        if cum >= want:
            return le
    return None


def frame(now: Flat, prev: Flat | None = None, dt: float | None = None) -> dict[str, Any]:
    """One picture of the loader: ``now``'s cumulative figures and, given the reading
    ``prev`` taken ``dt`` seconds earlier, the rates between them (None where unknown)."""
    now = canonical(now)
    prev = None if prev is None else canonical(prev)
    g = now.get
    batch_rate = _rate(now, prev, "zephon_batches_delivered_total", dt)
    tokens = select(now, "zephon_tokens_delivered_total")
    token_rate = None
    if prev is not None and dt and tokens:
        d = sum(v for _, v in tokens) - sum(
            v for _, v in select(prev, "zephon_tokens_delivered_total")
        )
        token_rate = None if d < 0 else d / dt
    # the consumer's wait: seconds waited per second over the interval
    wait_ratio = _rate(now, prev, "zephon_next_wait_seconds_sum", dt)
    places: dict[str, dict[str, Any]] = {}
    for labels, seconds in select(now, "zephon_stage_busy_seconds_total"):
        place = places.setdefault(labels["worker"], {"stages": {}, "ratio": None})
        key = f"zephon_stage_busy_seconds_total/stage={labels['stage']}/worker={labels['worker']}"
        place["stages"][labels["stage"]] = {"seconds": seconds, "ratio": _rate(now, prev, key, dt)}
    for labels, ratio in select(now, "zephon_worker_busy_ratio"):
        places.setdefault(labels["worker"], {"stages": {}, "ratio": None})["ratio"] = ratio
    for place in places.values():
        rates = [s["ratio"] for s in place["stages"].values()]
        place["ratio_now"] = sum(rates) if rates and None not in rates else None
    stages: dict[str, float | None] = {}
    for place in places.values():
        for stage, s in place["stages"].items():
            r = s["ratio"]
            stages[stage] = (
                None if r is None or stages.get(stage, 0.0) is None else stages.get(stage, 0.0) + r
            )
    bottleneck = None
    for labels, value in select(now, "zephon_bottleneck_info"):
        if value:
            bottleneck = {
                "where": labels.get("where", "?"),
                "stage": labels.get("stage", "?"),
                "busy_ratio": g("zephon_bottleneck_busy_ratio"),
            }
    rings = {
        labels["worker"]: (value, g(f"zephon_ring_slots/worker={labels['worker']}"))
        for labels, value in select(now, "zephon_ring_filled_slots")
    }
    up = {labels["worker"]: value for labels, value in select(now, "zephon_worker_up")}
    mixture: dict[str, dict[str, float | None]] = {}
    for metric, field in (
        ("zephon_mixture_target_ratio", "target"),
        ("zephon_mixture_token_ratio", "token_share"),
        ("zephon_mixture_document_ratio", "document_share"),
        ("zephon_tokens_delivered_total", "tokens"),
    ):
        for labels, value in select(now, metric):
            mixture.setdefault(labels["component"], {})[field] = value
    if prev is not None:  # each component's share of the interval's tokens
        moved = {
            c: now.get(f"zephon_tokens_delivered_total/component={c}", 0.0)
            - prev.get(f"zephon_tokens_delivered_total/component={c}", 0.0)
            for c in mixture
        }
        total = sum(moved.values())
        for c, m in mixture.items():
            ok = total > 0 and min(moved.values()) >= 0
            m["interval_share"] = moved[c] / total if ok else None
    reads: dict[str, dict[str, float | None]] = {}
    for metric, field in (
        ("zephon_source_read_bytes_total", "bytes"),
        ("zephon_source_read_requests_total", "requests"),
        ("zephon_source_read_retries_total", "retries"),
    ):
        for labels, value in select(now, metric):
            r = reads.setdefault(labels["source"], {})
            r[field] = value
            r[field + "_rate"] = _rate(now, prev, f"{metric}/source={labels['source']}", dt)
    for m in mixture.values():  # the weights are over documents: drift is theirs
        t, s = m.get("target"), m.get("document_share")
        m["drift"] = None if t is None or s is None else s - t
    return {
        "batches": g("zephon_batches_delivered_total"),
        "step": g("zephon_step"),
        "batch_rate": batch_rate,
        "token_rate": token_rate,
        "wait_ratio": wait_ratio,
        "wait_ratio_total": g("zephon_next_wait_ratio"),
        "wait_p50_s": quantile(now, prev, 0.5),
        "wait_p90_s": quantile(now, prev, 0.9),
        "places": places,
        "stages": stages,
        "bottleneck": bottleneck,
        "rings": rings,
        "workers_up": up,
        "prefetch": (
            g("zephon_prefetch_queue_batches"),
            g("zephon_prefetch_queue_capacity_batches"),
        ),
        "inflight_chunks": {lb["worker"]: v for lb, v in select(now, "zephon_inflight_chunks")},
        "mixture": mixture,
        "reads": reads,
        "checkpoints": g("zephon_checkpoint_seconds_count"),
        "checkpoint_last_s": g("zephon_checkpoint_last_seconds"),
        "checkpoint_bytes": g("zephon_checkpoint_bytes"),
    }
