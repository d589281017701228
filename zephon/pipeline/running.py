"""The running side of a :class:`~zephon.Pipeline`: what it delegates to once it runs.

* :func:`start_engine`: the per-rank :class:`~zephon.pipeline.engine.Engine` over the compiled
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
from zephon.pipeline.engine import Engine
from zephon.runners.local import LocalExecutor
from zephon.runners.options import WorkerOptions
from zephon.runners.processes import ProcessExecutor
from zephon.tracking.tracker import LaneTracker

if TYPE_CHECKING:
    from zephon.checkpoint.aggregate import Aggregator
    from zephon.pipeline.options import Options
    from zephon.plan.compile import Plan


def start_engine(plan: Plan, source: Any, opts: Options) -> Engine:
    """A fresh engine running ``plan`` over ``source`` with the pipeline's options
    ``opts``, for the lanes of ``opts.topology``: nothing runs until its first
    ``next()``."""
    trackers = {
        lane: LaneTracker(
            lane,
            source.for_lane(lane, opts.canonical_replicas),
            plan.eviction,
            plan.flush_every_k_chunks,
        )
        for lane in opts.topology.lanes
    }
    executor: Any
    if opts.remote is not None:
        from zephon.runners.ray import RayExecutor  # imports Ray when the pipeline runs

        executor = RayExecutor(plan, opts.remote, WorkerOptions.of(opts))
    elif opts.workers > 0:
        executor = ProcessExecutor(plan, WorkerOptions.of(opts), _components(source))
    else:
        executor = LocalExecutor(plan)
    return Engine(plan, trackers, opts, executor)


def _components(source: Any) -> tuple[tuple[str, Any], ...]:
    """``(name, dataset)`` of the work source's mixture, to name a dataset in errors."""
    datasets = tuple(getattr(source, "datasets", ()))
    names = tuple(getattr(source, "names", ())) or tuple(map(str, range(len(datasets))))
    return tuple(zip(names, datasets, strict=False))


def open_aggregator(opts: Options, fingerprint: str) -> Aggregator:
    """This rank's :class:`~zephon.checkpoint.aggregate.Aggregator` on the options'
    ``aggregate_dir`` or ``aggregate_store``, for the pipeline of ``fingerprint``: it
    expects every rank's lanes by the options' layout and, leading a round, merges the
    states with :func:`~zephon.checkpoint.state.merge_states`. The store is closed if it
    fails."""
    from zephon.checkpoint.aggregate import Aggregator, open_store

    topo = opts.topology
    store = open_store(opts.aggregate_dir, opts.aggregate_store)
    try:
        return Aggregator(
            store,
            rank=topo.rank,
            world_size=topo.world_size,
            timeout_s=opts.aggregate_timeout_s,
            expected_lanes=lambda r: lanes_of_rank(topo, r),
            merge=merge_states,
            lease_ttl_s=opts.aggregate_lease_s,
            job_id=opts.job_id,
            fingerprint=fingerprint,  # rounds of two pipelines never meet
        )
    except BaseException:
        store.close()
        raise
