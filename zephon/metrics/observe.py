"""What the metrics read off a running pipeline: busy time by place and stage, the
bottleneck, the mixture's realized shares, checkpoint timings.

Everything here is read at call time from figures the engine keeps anyway: the operators'
counters of each lane as of its last delivered batch (which a worker process sends with its
outputs, so they reach the parent whatever the number of workers), the consumer's waits,
the lanes' trackers and work sources. Nothing here imports ``prometheus_client``.

**Stall attribution.** A *place* is where operators run: each worker process, or the parent
with ``workers=0``. Its busy fraction is the operators' seconds for its lanes over the wall
time since the first batch was delivered (a worker runs its lanes' operators one after
another, so it can be at most 1; the figure is clamped there, as the first batch's work
counts before the clock starts). The bottleneck is the busiest place and, in it, the stage
(operator) with the most seconds. With workers, a consumer that waits while no worker is
even half busy waits on the parent itself (reading the rings, tracking, the work sources):
then the parent is named.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

#: The consumer is warned (DataStallWarning) when it waits in next() more than this fraction
#: of its time, once it has been busy between batches for STALL_MIN_BUSY_S.
STALL_FRACTION = 0.10
STALL_MIN_BUSY_S = 1.0
#: Upper bounds of the buckets that count the consumer's waits in next() (the metrics'
#: histogram; one more bucket counts what is above the last).
WAIT_BUCKETS_S = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: An engine (:class:`~zephon.pipeline.engine.Engine`, which imports this module).
Engine = Any

#: With workers, below this busy fraction the busiest worker is not what the consumer
#: waits for: the parent is.
IDLE_FRACTION = 0.5


class Place(NamedTuple):
    """Where operators run and what they did there: ``seconds`` per operator of the plan,
    summed over the place's lanes (as of each lane's last delivered batch)."""

    where: str  # "worker 0", ..., or "parent"
    worker: int | None
    lanes: list[int]
    seconds: list[float]


def stage_names(ops: list[Any]) -> list[str]:
    """The operators' names, a repeated one numbered from its second use
    (``map``, ``map#2``): the ``stage`` label of the metrics."""
    seen: dict[str, int] = {}
    names = []
    for op in ops:
        k = seen[op.name] = seen.get(op.name, 0) + 1
        names.append(op.name if k == 1 else f"{op.name}#{k}")
    return names


def places(engine: Engine) -> list[Place]:
    """Each place's lanes and operator seconds."""
    with engine.lock:
        counts = dict(engine.lane_counts)
    handles = getattr(engine.executor, "handles", None)
    if engine.executor.place == "local" or not handles:
        where = "parent" if engine.executor.place == "local" else str(engine.executor.place)
        groups = [(where, None, list(engine.lanes))]
    else:
        groups = [(f"worker {h.id}", h.id, list(h.lanes)) for h in handles]
    n = len(engine.plan.ops)
    out = []
    for where, worker, lanes in groups:
        seconds = [0.0] * n
        for lane in lanes:
            c = counts.get(lane)
            if c is not None:
                for i, op in enumerate(c.ops):
                    seconds[i] += op[2]
        out.append(Place(where, worker, lanes, seconds))
    return out


def elapsed_s(engine: Engine) -> float | None:
    """Wall time since the first batch was delivered (None before)."""
    return None if engine.first_at is None else max(time.perf_counter() - engine.first_at, 1e-9)


def busy(engine: Engine) -> list[dict[str, Any]]:
    """``stats()["busy"]``: per place, its operators' seconds (by stage) and busy fraction."""
    el = elapsed_s(engine)
    names = stage_names(engine.plan.ops)
    return [
        {
            "where": p.where,
            "worker": p.worker,
            "lanes": len(p.lanes),
            "seconds": round(sum(p.seconds), 6),
            "fraction": None if el is None else round(min(1.0, sum(p.seconds) / el), 4),
            "stages": {name: round(s, 6) for name, s in zip(names, p.seconds, strict=True)},
        }
        for p in places(engine)
    ]


def bottleneck(engine: Engine) -> dict[str, Any] | None:
    """``stats()["bottleneck"]``: where the loader spends its time and what to turn, or
    None before the first batch. See the module's docstring for the rule."""

    el = elapsed_s(engine)
    ps = places(engine)
    if el is None or not ps:
        return None
    names = stage_names(engine.plan.ops)
    top = max(ps, key=lambda p: (sum(p.seconds), -(p.worker or 0)))
    fraction = min(1.0, sum(top.seconds) / el)
    wait = engine.wait_fraction()
    stalled = wait > STALL_FRACTION
    opts = engine.options
    if opts.workers > 0 and stalled and fraction < IDLE_FRACTION:
        return {
            "where": "parent",
            "worker": None,
            "stage": "ring reads and tracking",
            "busy_fraction": None,
            "stage_fraction": None,
            "knob": (
                f"prefetch= (a pump thread takes batches out of the rings beside the training "
                f"step; now {opts.prefetch}) or zero_copy=True; no worker is even "
                f"{IDLE_FRACTION:.0%} busy (the busiest, {top.where}: {fraction:.0%})"
            ),
            "next_wait_fraction": round(wait, 4),
            "stalled": stalled,
        }
    i = max(range(len(names)), key=lambda k: top.seconds[k])
    op = engine.plan.ops[i]
    where = top.where
    if op.name == "fetch":
        where = f"source reads ({top.where})"
    return {
        "where": where,
        "worker": top.worker,
        "stage": names[i],
        "busy_fraction": round(fraction, 4),
        "stage_fraction": round(min(1.0, top.seconds[i] / el), 4),
        "knob": knob(op, opts.workers),
        "next_wait_fraction": round(wait, 4),
        "stalled": stalled,
    }


def knob(op: Any, workers: int) -> str:
    """What to turn for a stage that is the bottleneck."""
    more = (
        f"Pipeline(workers=) (now {workers}): more processes share the lanes"
        if workers
        else "Pipeline(workers=N): the operators then run in N worker processes"
    )
    p = getattr(op, "parallelism", 1)
    if op.name == "fetch":
        return f"fetch(parallelism=) reads with threads (now {p}), or faster storage; or {more}"
    if not op.traits.stateful and op.name in ("map", "filter", "tokenize", "random_map"):
        return f"{op.name}(parallelism=) runs it on threads (now {p}; helps where it releases the GIL); or {more}"
    return more


def stall_cause(engine: Engine) -> str:
    """The DataStallWarning's sentence naming the stage and its knob ('' if unknown)."""
    b = bottleneck(engine)
    if b is None:
        return ""
    busy_part = "" if b["busy_fraction"] is None else f" ({b['busy_fraction']:.0%} busy)"
    return f"The bottleneck: {b['stage']} in {b['where']}{busy_part}; turn {b['knob']}. "


class CheckpointClock:
    """How long ``checkpoint()`` took: the calls, their total and the last; the same for the
    round (with ``aggregate_dir``/``aggregate_store``)."""

    __slots__ = ("count", "total_s", "last_s", "rounds", "round_total_s", "round_last_s")

    def __init__(self) -> None:
        self.count = self.rounds = 0
        self.total_s = self.round_total_s = 0.0
        self.last_s: float | None = None
        self.round_last_s: float | None = None

    def record(self, seconds: float, round_s: float | None) -> None:
        self.count += 1
        self.total_s += seconds
        self.last_s = seconds
        if round_s is not None:
            self.rounds += 1
            self.round_total_s += round_s
            self.round_last_s = round_s


def mixture(pipe: Any, engine: Engine) -> dict[str, dict[str, Any]]:
    """Per component name: its target weight, and of the batches ``next()`` returned (by
    this pipeline: a restored one counts from its restore) the tokens (samples before
    ``tokenize``) and the documents (each counted once, with the batch that holds its
    last piece; a document a ``filter`` dropped is not delivered), each with its share."""
    source = pipe.source
    names = tuple(getattr(source, "names", ()))
    if not names:
        return {}
    target = getattr(source, "weights", None)
    with engine.lock:
        tokens = dict(engine.component_tokens)
        docs = dict(engine.component_docs)
        if target is None:  # a schedule: the lanes' weights now, averaged
            rows = [getattr(t.source, "current_weights", None) for t in engine.trackers.values()]
            rows = [r for r in rows if r is not None]
            if rows:
                target = tuple(sum(col) / len(rows) for col in zip(*rows, strict=True))
    all_tokens = sum(tokens.values())
    all_docs = sum(docs.values())
    out = {}
    for c, name in enumerate(names):
        t = tokens.get(c, 0)
        d = docs.get(c, 0)
        out[name] = {
            "target": None if target is None else round(float(target[c]), 6),
            "tokens": t,
            "token_share": round(t / all_tokens, 6) if all_tokens else None,
            "documents": d,
            "document_share": round(d / all_docs, 6) if all_docs else None,
        }
    return out


def reads(pipe: Any, engine: Engine) -> dict[str, dict[str, int]]:
    """Per source (a component of the mixture, by name): ``bytes``, ``requests`` and
    ``retries`` of the range reads the fetch operator made for it (see
    :mod:`zephon.sources._fs`), in every process, since this pipeline started: each
    lane's counters as of its last delivered batch, like the operators' seconds (the
    reads of chunks read ahead count once a batch of them is delivered). Sources that
    read through their own library (Parquet, ArrayRecord) or from memory make no range
    reads: zeros."""
    source = pipe.source
    names = tuple(getattr(source, "names", None) or ()) or tuple(
        str(c) for c in range(len(getattr(source, "datasets", None) or ()))
    )
    totals = [[0, 0, 0] for _ in names]
    with engine.lock:
        rows = [r for c in engine.lane_counts.values() for r in c.reads]
        rows.extend(engine.moved_reads)
    for comp, nbytes, requests, retries in rows:
        if 0 <= comp < len(totals):
            t = totals[comp]
            t[0] += nbytes
            t[1] += requests
            t[2] += retries
    return {
        name: {"bytes": t[0], "requests": t[1], "retries": t[2]}
        for name, t in zip(names, totals, strict=True)
    }


def observed(pipe: Any, engine: Engine) -> dict[str, Any]:
    """What ``stats()`` adds for the metrics (see :meth:`zephon.Pipeline.stats`)."""

    clock: CheckpointClock = pipe._ckpt_clock  # noqa: SLF001 - the pipeline's own
    return {
        "batches_delivered": engine.step - engine.first_step,
        "step": engine.step,
        "next_wait_histogram": {"le_s": list(WAIT_BUCKETS_S), "counts": list(engine.wait_buckets)},
        "busy": busy(engine),
        "bottleneck": bottleneck(engine),
        "mixture": mixture(pipe, engine),
        "reads": reads(pipe, engine),
        "checkpoints": clock.count,
        "checkpoint_s": None if clock.last_s is None else round(clock.last_s, 6),
        "checkpoint_seconds_total": round(clock.total_s, 6),
        "rounds": clock.rounds,
        "round_s": None if clock.round_last_s is None else round(clock.round_last_s, 6),
        "round_seconds_total": round(clock.round_total_s, 6),
    }


def skipped_records(source: Any) -> dict[str, dict[str, int]]:
    """``ds.skipped_records()`` per component name. These datasets decide what to skip while
    they are built, in this process, so this process's objects know the counts whatever
    the number of workers."""
    names = tuple(getattr(source, "names", ()))
    datasets = tuple(getattr(source, "datasets", ()))
    out: dict[str, dict[str, int]] = {}
    for name, ds in zip(names, datasets, strict=False):
        counts = getattr(ds, "skipped_records", None)
        if callable(counts):
            out[name] = dict(counts())
    return out
