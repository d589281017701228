"""The running side of a :class:`~zephon.Pipeline`: what it delegates to once it runs.

* :func:`start_engine`: the per-rank :class:`~zephon.engine.Engine` over the compiled
  plan, with a lane tracker per lane this rank owns and the executor that makes the
  batches (in this process, or in worker processes with ``workers``);
* :func:`open_aggregator`: this rank's side of the multi-rank checkpoint rounds (see
  :mod:`zephon.checkpoint.rounds`; the states they merge are described in
  :mod:`zephon.checkpoint.state`);
* :func:`skipped_records`: what ``stats()`` reports that only the datasets know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zephon.checkpoint.state import lanes_of_rank, merge_states
from zephon.engine import Engine
from zephon.runners.local import LocalExecutor
from zephon.runners.processes import ProcessExecutor
from zephon.tracking import LaneTracker

if TYPE_CHECKING:
    from zephon.checkpoint.aggregate import Aggregator
    from zephon.pipeline import Pipeline


def start_engine(pipe: Pipeline) -> Engine:
    """A fresh engine for ``pipe``: nothing runs until its first ``next()``."""
    plan = pipe._compiled()
    trackers = {
        lane: LaneTracker(
            lane,
            pipe.source.for_lane(lane, pipe.canonical_replicas),
            plan.eviction,
            plan.flush_every_k_chunks,
        )
        for lane in pipe.lanes
    }
    executor: Any
    if pipe.workers > 0:
        executor = ProcessExecutor(
            plan,
            pipe.workers,
            zero_copy=pipe.zero_copy,
            slot_bytes=pipe.ring_slot_bytes,
            nslots=pipe.ring_slots,
            start_method=pipe.worker_start_method,
            worker_timeout_s=pipe.worker_timeout_s,
            components=_components(pipe.source),
        )
    else:
        executor = LocalExecutor(plan)
    engine = Engine(plan, trackers, pipe.output, pipe.prefetch, executor)
    engine.knobs = f"workers={pipe.workers}, prefetch={pipe.prefetch}"
    return engine


def _components(source: Any) -> tuple[tuple[str, Any], ...]:
    """``(name, dataset)`` of the work source's mixture, to name a dataset in errors."""
    datasets = tuple(getattr(source, "datasets", ()))
    names = tuple(getattr(source, "names", ())) or tuple(map(str, range(len(datasets))))
    return tuple(zip(names, datasets, strict=False))


def open_aggregator(pipe: Pipeline) -> Aggregator:
    """This rank's :class:`~zephon.checkpoint.aggregate.Aggregator` on ``pipe``'s
    ``aggregate_dir`` or ``aggregate_store``: it expects every rank's lanes by ``pipe``'s
    layout and, leading a round, merges the states with
    :func:`~zephon.checkpoint.state.merge_states`. The store is closed if it fails."""
    from zephon.checkpoint.aggregate import Aggregator, open_store

    topo = pipe._topology
    store = open_store(pipe.aggregate_dir, pipe.aggregate_store)
    try:
        return Aggregator(
            store,
            rank=topo.rank,
            world_size=topo.world_size,
            timeout_s=pipe.aggregate_timeout_s,
            expected_lanes=lambda r: lanes_of_rank(topo, r),
            merge=merge_states,
            fingerprint=pipe.fingerprint(),  # rounds of two pipelines never meet
        )
    except BaseException:
        store.close()
        raise


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
