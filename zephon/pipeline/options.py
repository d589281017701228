"""Pipeline's constructor arguments: the checks (each message names the argument and shows
the value), the defaults that depend on other arguments (``prefetch``, ``ring_slots``),
the rank's topology, and what ``workers="auto"`` picks (:func:`auto_workers`).

The arguments are documented once, on :class:`~zephon.Pipeline`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal, NamedTuple, TypeGuard

import numpy as np

from zephon.runners.lanes import OUTPUTS
from zephon.runners.ray_options import RayWorkers
from zephon.topology import Topology, resolve_topology

#: Slots per worker ring when ``ring_slots`` is not given (see benchmarks.ring_depth).
DEFAULT_RING_SLOTS = 16
#: The pump's depth in process when ``prefetch`` is not given (0 with workers).
DEFAULT_PREFETCH = 3
#: The most worker processes ``workers="auto"`` picks.
AUTO_WORKERS_MAX = 8
#: The most lanes a pipeline may have. A lane costs the rank that runs it about 5 KB and
#: 20 us before its first batch (65,536 lanes on one rank: 334 MB, 1.2 s), and every lane's
#: state is in every merged checkpoint; 2**20 is 1,024 ranks of 1,024 lanes. Far more (10**7)
#: does not fail: the first ``next()`` runs for minutes while memory fills.
MAX_CANONICAL_REPLICAS = 2**20
#: The most bytes a worker ring slot may have (1 TiB, past any host's memory): the C ring
#: (native/ring.h) sizes itself as ``slots * slot_bytes`` in a uint64, which larger values
#: overflow (``ring_slot_bytes=2**62`` with 16 slots wraps to a ring of 0 bytes).
MAX_RING_SLOT_BYTES = 2**40
#: The most slots a worker ring may have: the C ring counts them in a uint32, and a slot
#: holds a whole batch (the default is 16); with :data:`MAX_RING_SLOT_BYTES` the ring's size
#: stays far below uint64's.
MAX_RING_SLOTS = 2**16


class Options(NamedTuple):
    """Pipeline's arguments as the pipeline keeps them: checked, defaults filled in,
    ``workers="auto"`` resolved, numbers of seconds as floats, the seed as an int.

    The one copy of them: the pipeline shows them as read-only properties, its engine
    reads them here, the worker processes get theirs by name
    (:class:`~zephon.runners.options.WorkerOptions`), and the plan is compiled from the
    few that decide it (never keeping them)."""

    topology: Topology
    canonical_replicas: int
    flush_every_k_chunks: int | None
    workers: int
    output: str
    aggregate_dir: str | None
    aggregate_store: str | None
    aggregate_timeout_s: float
    aggregate_lease_s: float
    job_id: str | None
    prefetch: int
    ring_slots: int
    zero_copy: bool
    ring_slot_bytes: int | None
    worker_timeout_s: float
    worker_start_method: str
    seed: int | None
    metrics_port: int | None = None
    #: ``workers=zp.RayWorkers(...)``: the lanes run on Ray actors (``workers`` is then
    #: its ``num_workers``); None: local worker processes or this process.
    remote: Any = None

    @property
    def lanes_per_process(self) -> int:
        """Derived: the most lanes one process runs (this rank's lanes dealt to its worker
        processes, or all of them in this process)."""
        return -(-len(self.topology.lanes) // max(self.workers, 1))


def checked_options(
    source: Any,
    *,
    canonical_replicas: int,
    flush_every_k_chunks: int | None,
    workers: int | Literal["auto"] | RayWorkers,
    rank: int | None,
    world_size: int | None,
    dp_rank: int | None,
    dp_size: int | None,
    output: str,
    aggregate_dir: str | None,
    aggregate_store: str | None,
    aggregate_timeout_s: float,
    aggregate_lease_s: float,
    job_id: str | None,
    prefetch: int | None,
    ring_slots: int | None,
    zero_copy: bool,
    ring_slot_bytes: int | None,
    worker_timeout_s: float,
    worker_start_method: str,
    seed: int | None,
    metrics_port: int | None = None,
) -> Options:
    """:class:`~zephon.Pipeline`'s arguments checked and resolved.

    Raises:
        TypeError: ``source`` is not a work source (it has no ``for_lane``).
        ValueError: any other argument is out of range; the message names it.
    """
    if not callable(getattr(source, "for_lane", None)):
        raise TypeError(
            f"Pipeline needs a work source with for_lane(lane, num_lanes) (e.g. "
            f"zp.StaticMixtureWorkSource); got {type(source).__name__}"
        )
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}; got {output!r}")
    remote = None
    if _is_ray_workers(workers):
        remote, workers = workers, workers.num_workers
    if workers != "auto" and (
        not isinstance(workers, int) or isinstance(workers, bool) or workers < 0
    ):
        raise ValueError(
            f"workers must be an int >= 0, 'auto' or zp.RayWorkers(...); got {workers!r}"
        )
    if prefetch is not None and (
        not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0
    ):
        raise ValueError(f"prefetch must be None or an int >= 0; got {prefetch!r}")
    if prefetch is None:
        prefetch = DEFAULT_PREFETCH if workers == 0 else 0
    if ring_slots is None:
        ring_slots = DEFAULT_RING_SLOTS
    if not isinstance(ring_slots, int) or isinstance(ring_slots, bool) or ring_slots < 2:
        raise ValueError(f"ring_slots must be None or an int >= 2; got {ring_slots!r}")
    if ring_slots > MAX_RING_SLOTS:
        raise ValueError(
            f"ring_slots must be at most {MAX_RING_SLOTS} (2**16: each slot holds a whole "
            f"batch, and the C ring counts slots in 32 bits); got ring_slots={ring_slots}: "
            f"leave it None ({DEFAULT_RING_SLOTS}) or give a few dozen at most"
        )
    if zero_copy and (workers == "auto" or workers > 0) and ring_slots < prefetch + 2:
        raise ValueError(
            f"zero_copy=True needs ring_slots >= prefetch + 2 (the batch handed out and "
            f"the {prefetch} prefetched ones hold ring slots while they live); got "
            f"ring_slots={ring_slots}, prefetch={prefetch}: raise ring_slots or lower prefetch"
        )
    if not (
        isinstance(aggregate_timeout_s, (int, float))
        and math.isfinite(aggregate_timeout_s)
        and aggregate_timeout_s > 0
    ):
        raise ValueError(
            f"aggregate_timeout_s must be a positive number of seconds; got {aggregate_timeout_s!r}"
        )
    if not (
        isinstance(aggregate_lease_s, (int, float))
        and not isinstance(aggregate_lease_s, bool)
        and math.isfinite(aggregate_lease_s)
        and aggregate_lease_s > 0
    ):
        raise ValueError(
            f"aggregate_lease_s must be a positive number of seconds; got {aggregate_lease_s!r}"
        )
    if job_id is not None and (not isinstance(job_id, str) or not job_id or len(job_id) > 200):
        raise ValueError(
            f"job_id must be None (taken from ZEPHON_JOB_ID or the launcher) or a non-empty"
            f" str of at most 200 chars; got {job_id!r}"
        )
    if aggregate_dir is not None and aggregate_store is not None:
        raise ValueError("give aggregate_dir or aggregate_store, not both")
    if (
        isinstance(canonical_replicas, int)
        and not isinstance(canonical_replicas, bool)
        and canonical_replicas > MAX_CANONICAL_REPLICAS
    ):
        raise ValueError(
            f"canonical_replicas must be at most {MAX_CANONICAL_REPLICAS} (2**20 lanes: each "
            f"costs its rank memory and start-up time, and is in every checkpoint); got "
            f"canonical_replicas={canonical_replicas}: use fewer lanes, a multiple of every "
            "data-parallel size you will run with (e.g. 8 x the most ranks)"
        )
    topology = resolve_topology(canonical_replicas, rank, world_size, dp_rank, dp_size)
    if flush_every_k_chunks is not None and (
        not isinstance(flush_every_k_chunks, int) or flush_every_k_chunks < 0
    ):
        raise ValueError(
            f"flush_every_k_chunks must be None or an int >= 0; got {flush_every_k_chunks!r}"
        )
    if workers == "auto":
        workers = auto_workers(len(topology.lanes))
    if ring_slot_bytes is not None and (
        not isinstance(ring_slot_bytes, int)
        or isinstance(ring_slot_bytes, bool)
        or ring_slot_bytes < 4096
    ):
        raise ValueError(
            f"ring_slot_bytes must be None (sized from the batches) or an int >= 4096; "
            f"got {ring_slot_bytes!r}"
        )
    if ring_slot_bytes is not None and ring_slot_bytes > MAX_RING_SLOT_BYTES:
        raise ValueError(
            f"ring_slot_bytes must be at most {MAX_RING_SLOT_BYTES} (2**40, 1 TiB a slot: the C "
            f"ring's size, slots x slot bytes, must fit in 64 bits); got "
            f"ring_slot_bytes={ring_slot_bytes}: give the bytes of your largest batch, or "
            "leave it None to size the slots from the batches"
        )
    if not (isinstance(worker_timeout_s, (int, float)) and worker_timeout_s > 0):
        raise ValueError(f"worker_timeout_s must be a positive number; got {worker_timeout_s!r}")
    if worker_start_method not in ("spawn", "forkserver", "fork"):
        raise ValueError(
            f"worker_start_method must be 'spawn', 'forkserver' or 'fork'; got {worker_start_method!r}"
        )
    if seed is not None and (
        not isinstance(seed, (int, np.integer))
        or isinstance(seed, bool)
        or not -(2**63) <= int(seed) < 2**64
    ):
        raise ValueError(f"seed must be None or an int in [-2**63, 2**64); got {seed!r}")
    if metrics_port is not None and (
        not isinstance(metrics_port, int)
        or isinstance(metrics_port, bool)
        or not 0 <= metrics_port <= 65535
    ):
        raise ValueError(
            f"metrics_port must be None (no metrics endpoint) or a TCP port in 0..65535 (0: "
            f"any free one); got {metrics_port!r}"
        )
    return Options(
        topology=topology,
        canonical_replicas=canonical_replicas,
        flush_every_k_chunks=flush_every_k_chunks,
        workers=workers,
        output=output,
        aggregate_dir=aggregate_dir,
        aggregate_store=aggregate_store,
        aggregate_timeout_s=float(aggregate_timeout_s),
        aggregate_lease_s=float(aggregate_lease_s),
        job_id=job_id,
        prefetch=prefetch,
        ring_slots=ring_slots,
        zero_copy=zero_copy,
        ring_slot_bytes=ring_slot_bytes,
        worker_timeout_s=float(worker_timeout_s),
        worker_start_method=worker_start_method,
        seed=None if seed is None else int(seed),
        metrics_port=metrics_port,
        remote=remote,
    )


def _is_ray_workers(workers: Any) -> TypeGuard[RayWorkers]:
    return isinstance(workers, RayWorkers)


def auto_workers(lanes: int) -> int:
    """What ``Pipeline(workers="auto")`` picks: the CPUs this process may run on (its
    affinity mask, else ``os.cpu_count()``) less one for the training loop, at most
    :data:`AUTO_WORKERS_MAX` and at most ``lanes`` (a worker owns whole lanes)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(0, min(cpus - 1, AUTO_WORKERS_MAX, lanes))
