"""The metric families: every figure a pipeline exports, named once, read at call time.

The Prometheus collector (:mod:`zephon.metrics.exporter`) and :func:`scalars` both read
:func:`families`, so the endpoint and a logger see the same figures. Names follow
Prometheus conventions (a counter's ``_total`` is added on export, base units in the name);
labels: ``rank`` on every sample, ``worker`` (a worker id or ``parent``) and ``stage`` (an
operator's name, ``map#2`` for a second ``map``) and ``component`` or ``source`` (a
dataset of the mixture by name, up to :data:`MAX_COMPONENT_LABELS` of them; never a file
path) where they carry meaning. Lanes are
never a label (a rank may own thousands): in-flight chunks go per worker and as the
largest lane's count.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from zephon.metrics.observe import observed, places, skipped_records, stage_names

#: A mixture of more components exports no per-component samples (a bounded label set).
MAX_COMPONENT_LABELS = 64

Labels = dict[str, str]


class Family(NamedTuple):
    """One metric: ``kind`` is ``counter`` (``name`` without ``_total``), ``gauge``,
    ``summary`` (samples' values are ``(count, sum)``) or ``histogram`` (values are
    ``(upper bounds, counts per bucket, sum)``; the last count is above the last bound)."""

    name: str
    kind: str
    help: str
    samples: list[tuple[Labels, Any]]


def snapshot(pipe: Any) -> dict[str, Any] | None:
    """``pipe.stats()`` without starting anything (None before the pipeline has run, or
    once it is closed): safe from another thread, such as the endpoint's."""
    engine = pipe._engine  # noqa: SLF001 - the pipeline's own
    if engine is None or pipe._closed:  # noqa: SLF001
        return None
    st = engine.stats()
    st.update(observed(pipe, engine))
    last = pipe._last_checkpoint  # noqa: SLF001
    st["checkpoint_bytes"] = (
        len(msgpack.packb(last, use_bin_type=True)) if isinstance(last, dict) else last
    )
    st["skipped_records"] = skipped_records(pipe.source)
    st["_places"] = places(engine)
    st["_engine"] = engine
    return st


def families(pipe: Any) -> list[Family]:
    """Every metric of ``pipe`` now (none before its first ``next()``)."""
    st = snapshot(pipe)
    if st is None:
        return []
    rank = {"rank": str(pipe._topology.rank)}  # noqa: SLF001
    engine = st["_engine"]
    out: list[Family] = []

    def add(name: str, kind: str, help_: str, samples: list[tuple[Labels, Any]]) -> None:
        out.append(Family(name, kind, help_, [({**rank, **lb}, v) for lb, v in samples]))

    def one(name: str, kind: str, help_: str, value: Any) -> None:
        if value is not None:
            add(name, kind, help_, [({}, value)])

    one("zephon_batches_delivered", "counter", "Batches next() returned.", st["batches_delivered"])
    one("zephon_step", "gauge", "Batches delivered since the start of the data.", st["step"])
    # -------------------------------------------------------------- the consumer's wait
    hist = st["next_wait_histogram"]
    add(
        "zephon_next_wait_seconds",
        "histogram",
        "Time the consumer waited inside next() per batch (the first call left out).",
        [({}, (hist["le_s"], hist["counts"], st["next_wait_s"]))],
    )
    one(
        "zephon_next_wait_ratio",
        "gauge",
        "Share of the consumer's time since its first batch spent waiting in next().",
        st["next_wait_fraction"],
    )
    one("zephon_first_batch_seconds", "gauge", "The first next() call.", st["first_batch_s"])
    # ------------------------------------------------------------------ busy time
    names = stage_names(engine.plan.ops)
    busy = st["busy"]
    add(
        "zephon_stage_busy_seconds",
        "counter",
        "Operator time per stage and place (worker id or parent), as of each lane's last "
        "delivered batch.",
        [
            ({"worker": _worker(b), "stage": name}, seconds)
            for b in busy
            for name, seconds in b["stages"].items()
        ],
    )
    add(
        "zephon_worker_busy_seconds",
        "counter",
        "Operator time per place (worker id or parent).",
        [({"worker": _worker(b)}, b["seconds"]) for b in busy],
    )
    add(
        "zephon_worker_busy_ratio",
        "gauge",
        "Operator time per place over the wall time since the first batch.",
        [({"worker": _worker(b)}, b["fraction"]) for b in busy if b["fraction"] is not None],
    )
    ops = st["operators"]
    add(
        "zephon_stage_records_in",
        "counter",
        "Records each stage was given.",
        [({"stage": n}, o["records_in"]) for n, o in zip(names, ops, strict=True)],
    )
    add(
        "zephon_stage_records_out",
        "counter",
        "Records each stage emitted.",
        [({"stage": n}, o["records_out"]) for n, o in zip(names, ops, strict=True)],
    )
    b = st["bottleneck"]
    if b is not None:
        add(
            "zephon_bottleneck_info",
            "gauge",
            "1 for the place and stage the loader spends its time in (see stats()['bottleneck']).",
            [({"where": b["where"], "stage": b["stage"]}, 1)],
        )
        one(
            "zephon_bottleneck_busy_ratio",
            "gauge",
            "The bottleneck place's busy fraction.",
            b["busy_fraction"],
        )
    # ------------------------------------------------------------- queues and lanes
    one(
        "zephon_prefetch_queue_batches",
        "gauge",
        "Batches the prefetch pump holds ready.",
        st["queue_fill"],
    )
    one(
        "zephon_prefetch_queue_capacity_batches",
        "gauge",
        "The prefetch depth.",
        st["final_prefetch"],
    )
    workers = st.get("workers") or []
    add(
        "zephon_ring_filled_slots",
        "gauge",
        "Finished batches waiting in a worker's ring.",
        [({"worker": str(w["id"])}, w["ring_fill"]) for w in workers if "ring_fill" in w],
    )
    add(
        "zephon_ring_slots",
        "gauge",
        "Slots of a worker's ring.",
        [({"worker": str(w["id"])}, w["ring_slots"]) for w in workers if "ring_slots" in w],
    )
    add(
        "zephon_worker_up",
        "gauge",
        "1 while a worker process is alive.",
        [({"worker": str(w["id"])}, int(bool(w["alive"]))) for w in workers],
    )
    lanes = st["lanes"]
    add(
        "zephon_inflight_chunks",
        "gauge",
        "Chunks in flight (read, not yet evicted) over each place's lanes.",
        [
            (
                {"worker": "parent" if p.worker is None else str(p.worker)},
                sum(lanes[lane]["inflight_chunks"] for lane in p.lanes if lane in lanes),
            )
            for p in st["_places"]
        ],
    )
    one(
        "zephon_lane_inflight_chunks_max",
        "gauge",
        "Chunks in flight in the lane that has the most.",
        max((v["inflight_chunks"] for v in lanes.values()), default=0),
    )
    one("zephon_lanes", "gauge", "Lanes this rank owns.", len(lanes))
    one(
        "zephon_lanes_done",
        "gauge",
        "Lanes whose end was delivered.",
        sum(1 for v in lanes.values() if v["done"]),
    )
    one(
        "zephon_evicted_chunks",
        "counter",
        "Chunks evicted (every offset delivered) since the start of the data.",
        sum(v["evicted_chunks"] for v in lanes.values()),
    )
    # ---------------------------------------------------------- replay and failures
    one(
        "zephon_replayed_chunks",
        "gauge",
        "Chunks the last restore replayed.",
        st["replayed_chunks"],
    )
    one(
        "zephon_replay_dropped_records",
        "counter",
        "Records the replay filter dropped after a restore.",
        st["replay_dropped_records"],
    )
    one(
        "zephon_io_retries",
        "counter",
        "Reads retried after transient storage failures.",
        st["io_retries"],
    )
    sources = st["reads"]
    if len(sources) <= MAX_COMPONENT_LABELS:
        for key, metric, help_ in (
            (
                "bytes",
                "zephon_source_read_bytes",
                "Bytes the range reads of each source returned (local pread, object-storage "
                "GET), in all processes since the pipeline started.",
            ),
            (
                "requests",
                "zephon_source_read_requests",
                "Read requests each source sent to storage, the retried ones included.",
            ),
            (
                "retries",
                "zephon_source_read_retries",
                "Reads of each source retried after transient storage failures.",
            ),
        ):
            add(metric, "counter", help_, [({"source": n}, r[key]) for n, r in sources.items()])
    add(
        "zephon_skipped_records",
        "counter",
        "Records a dataset left out, by kind.",
        [
            ({"component": comp, "kind": kind}, n)
            for comp, kinds in st["skipped_records"].items()
            for kind, n in kinds.items()
        ][: MAX_COMPONENT_LABELS * 4],
    )
    # ------------------------------------------------------------------ checkpoints
    add(
        "zephon_checkpoint_seconds",
        "summary",
        "checkpoint() calls and their time (a round's included).",
        [({}, (st["checkpoints"], st["checkpoint_seconds_total"]))],
    )
    one(
        "zephon_checkpoint_last_seconds",
        "gauge",
        "The last checkpoint() call.",
        st["checkpoint_s"],
    )
    one(
        "zephon_checkpoint_bytes",
        "gauge",
        "The last checkpoint's size, msgpack'd.",
        st["checkpoint_bytes"],
    )
    if st["rounds"]:
        add(
            "zephon_round_seconds",
            "summary",
            "Checkpoint rounds across ranks and their time.",
            [({}, (st["rounds"], st["round_seconds_total"]))],
        )
        one("zephon_round_last_seconds", "gauge", "The last checkpoint round.", st["round_s"])
    # ---------------------------------------------------------------------- mixture
    mix = st["mixture"]
    if 0 < len(mix) <= MAX_COMPONENT_LABELS:
        add(
            "zephon_tokens_delivered",
            "counter",
            "Tokens (samples before tokenize) of each component in the delivered batches.",
            [({"component": c}, m["tokens"]) for c, m in mix.items()],
        )
        add(
            "zephon_documents_delivered",
            "counter",
            "Documents of each component in the delivered batches (counted with the batch "
            "that holds a document's last piece).",
            [({"component": c}, m["documents"]) for c, m in mix.items()],
        )
        for key, metric, help_ in (
            ("target", "zephon_mixture_target_ratio", "Each component's target weight."),
            (
                "token_share",
                "zephon_mixture_token_ratio",
                "Each component's share of the delivered tokens.",
            ),
            (
                "document_share",
                "zephon_mixture_document_ratio",
                "Each component's share of the delivered documents.",
            ),
        ):
            add(
                metric,
                "gauge",
                help_,
                [({"component": c}, m[key]) for c, m in mix.items() if m[key] is not None],
            )
    return out


def _worker(b: dict[str, Any]) -> str:
    return "parent" if b["worker"] is None else str(b["worker"])


def _key(name: str, labels: Labels) -> str:
    rest = "".join(f"/{k}={v}" for k, v in labels.items() if k != "rank")
    return name + rest


def scalars(pipe: Any) -> dict[str, float]:
    """The same figures as the endpoint, as one flat dict of numbers for any logger
    (TensorBoard, W&B, CLU): ``{"zephon_batches_delivered_total": 120,
    "zephon_stage_busy_seconds_total/worker=0/stage=map": 3.2, ...}``; a histogram or
    summary gives ``_sum`` and ``_count``. Empty before the first ``next()``.

    Example::

        for step, batch in enumerate(pipe):
            loss = train_step(batch)
            if step % 100 == 0:
                writer.add_scalars("loader", zp.metrics.scalars(pipe), step)
    """
    out: dict[str, float] = {}
    for f in families(pipe):
        for labels, value in f.samples:
            if f.kind == "counter":
                out[_key(f.name + "_total", labels)] = float(value)
            elif f.kind == "gauge":
                out[_key(f.name, labels)] = float(value)
            elif f.kind == "summary":
                count, total = value
                out[_key(f.name + "_count", labels)] = float(count)
                out[_key(f.name + "_sum", labels)] = float(total)
            else:  # histogram
                _, counts, total = value
                out[_key(f.name + "_count", labels)] = float(sum(counts))
                out[_key(f.name + "_sum", labels)] = float(total)
    return out
