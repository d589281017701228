"""The builder users touch: ``Pipeline(source, ...).fetch().tokenize(...)...batch(n)``.

Builder methods return a new Pipeline; nothing runs until the first ``next()`` (or
``checkpoint()``/``explain()``). A Pipeline is its own iterator: a second loop after a
``break`` continues the same stream, and a loop over an ended one raises
:class:`~zephon.PipelineEndedError`. ``checkpoint()`` returns a plain msgpack-able dict; ``restore(state)`` on a
freshly built, identical pipeline continues exactly where the checkpoint was taken.

This module is the running half of that surface and its documentation; the builder
methods, with their checks and user docs, are inherited from :mod:`zephon.pipeline.building`. The
Pipeline delegates the rest: its arguments' checks to :mod:`zephon.pipeline.options`, the plan to
:mod:`zephon.plan.compile`, the fingerprint to :mod:`zephon._fingerprint`, the engine and the
checkpoint round to :mod:`zephon.pipeline.running`, the state's schema to
:mod:`zephon.checkpoint.state` and restore's checks to :mod:`zephon.pipeline.restoring`.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal, Self

import msgpack

from zephon._fingerprint import pipeline_fingerprints
from zephon.checkpoint.state import build_state, check_header, state_step
from zephon.errors import CheckpointError, DroppedRecordsWarning, PipelineEndedError
from zephon.metrics.observe import CheckpointClock, observed, skipped_records
from zephon.metrics.series import finish as finish_recording
from zephon.operators.base import Operator
from zephon.pipeline.building import ChainBuilder
from zephon.pipeline.collector import PROMOTE_LANES, collector_paused
from zephon.pipeline.engine import Engine, closed_error
from zephon.pipeline.options import (  # the defaults and auto_workers stay importable from here
    AUTO_WORKERS_MAX,
    DEFAULT_PREFETCH,
    DEFAULT_RING_SLOTS,
    auto_workers,
    checked_options,
)
from zephon.pipeline.restoring import plan_restore
from zephon.pipeline.running import open_aggregator, start_engine
from zephon.plan.compile import Plan, compile_pipeline, explain
from zephon.runners.lanes import INTERLEAVE
from zephon.runners.ray_options import RayWorkers
from zephon.topology import Topology
from zephon.work_sources.mixture_change import (
    MixtureChange,
)

__all__ = ["AUTO_WORKERS_MAX", "DEFAULT_PREFETCH", "DEFAULT_RING_SLOTS", "Pipeline", "auto_workers"]


class Pipeline(ChainBuilder):
    """A deterministic, exactly-resumable data pipeline over lanes of a work source.

    Args:
        source: a work source that can be sharded per lane (``for_lane(lane, num_lanes)``),
            such as :class:`~zephon.StaticMixtureWorkSource`.
        canonical_replicas: the number of lanes, fixed for the life of a training run.
        flush_every_k_chunks: chunks per epoch of a lane; ``None`` picks 4 when an operator
            reorders records and 0 otherwise.
        workers: worker processes for this rank (0: run in this process). Datasets reach
            them by reference (memory-mapped files reopened, in-memory arrays shared once;
            a dataset may define ``__zephon_reopen__``: see ``zephon.runners.shipping``).
            ``"auto"``: :func:`auto_workers` — one per CPU this process may run on, less
            one for the training loop, at most 8 and at most this rank's lanes (a machine
            with one CPU gets 0). :class:`~zephon.RayWorkers`: the lanes run on Ray actors
            (see :mod:`zephon.runners.ray`); ``workers`` then reads its ``num_workers``.
        rank: this process's rank in a multi-host job; defaults to
            ``jax.process_index()`` when ``jax.distributed`` is initialised, else to
            ``torch.distributed.get_rank()`` when its default process group is, else 0.
        world_size: the number of ranks; defaults to ``jax.process_count()`` or
            ``torch.distributed.get_world_size()`` the same way, else 1.
        dp_rank: this rank's data-parallel group (default: ``rank``); model-parallel peers
            of one group read the same lanes.
        dp_size: the number of data-parallel groups (default: ``world_size``); it must
            divide ``canonical_replicas``.
        output: ``"interleave"`` (one lane's batch per step, round-robin) or ``"lockstep"``
            (one batch of every lane per step, concatenated in lane order). At the end of
            a finite stream, interleave goes on round-robin over the lanes that have data
            left until every lane has ended (each lane's last batch may be partial with
            ``batch(drop_last=False)``). Lockstep stops at the first step in which some
            lane has no batch left: the global batch of every step has every lane's rows
            (with ``drop_last=False`` the last step may hold lanes' partial batches), and
            what the other lanes still held is not delivered. Either way every worker
            count yields exactly the stream of ``workers=0``.
        aggregate_dir: a directory or fsspec URL that every rank can reach, where the
            ranks run their checkpoint rounds (see :meth:`checkpoint`).
        aggregate_store: a key-value store for the rounds instead: ``"etcd://host:port"``
            (``?blobs=DIR`` puts the ranks' states in a directory), ``"jax://"`` (the JAX
            coordination service) or ``"torch://"`` (torch's TCPStore).
        aggregate_timeout_s: one round's whole budget, in seconds.
        aggregate_lease_s: how long a rank's liveness key outlives its process: a job
            restarted on another host after a crash waits this long for the dead ranks'
            keys (on the same host it takes them over at once), and followers give a round
            up this long after its leader died. Keep it below ``aggregate_timeout_s``.
        job_id: what tells this job's rounds from another job's on the same store location
            (ranks of one job must agree). ``None``: ``ZEPHON_JOB_ID``, else the launcher's
            (torchrun, Slurm, MPI, the JAX coordinator, ``MASTER_ADDR:MASTER_PORT``), else
            ``"default"``; two jobs that cannot be told apart are refused with an error
            naming this option (see :mod:`zephon.checkpoint.rounds.job`).
        prefetch: batches a pump thread of this process prepares ahead of the consumer's
            ``next()`` (0: no pump thread; each batch is made when asked for). In process
            the pump runs the operators; with workers it takes batches out of their rings,
            so copying them out and tracking overlap with the training step. Prefetched
            batches are not delivered: the checkpoint cut stays at the last ``next()``.
            ``None`` (the default): 3 in process, 0 with workers, whose rings already hold
            up to ``ring_slots`` finished batches each; there a pump thread only competes
            with the workers for the cores (measured by ``python -m benchmarks.ring_depth``).
        ring_slots: with workers, the slots of each worker's shared-memory ring: how many
            batches a worker may have finished ahead of the parent (``None``: 16, the
            depth that ``python -m benchmarks.ring_depth`` found best).
        zero_copy: with workers, yield views into shared memory valid until the next
            ``next()`` instead of arrays the caller owns (needs ``ring_slots >=
            prefetch + 2``: the views and the prefetched batches hold slots).
        ring_slot_bytes: bytes per shared-memory ring slot; one batch must fit in a slot.
            ``None`` (the default): sized from the batches: a worker's ring starts with
            1 MiB slots and, when an output does not fit, the worker moves to a ring whose
            slots hold it with a quarter to spare (up to 1 GiB; a bigger batch is an error
            quoting both sizes). An int fixes the size (a batch above it is that error).
        worker_timeout_s: a worker that produces nothing for this long is reported hung.
        worker_start_method: ``"spawn"`` (safe beside JAX's threads), ``"forkserver"`` or
            ``"fork"``.
        seed: the root of the operators' randomness: ``shuffle`` without a seed of its own
            and ``random_map`` derive their random numbers from it and from each record's
            identity, never from processing order. ``None``: the work source's seed, which
            also orders the source's samples, so by default one seed drives everything
            (give both to vary the order and the operators' draws apart).
        metrics_port: serve Prometheus metrics (``zephon_*``) on this port of 127.0.0.1
            from the first ``next()`` until ``close()`` (0: any free port; needs
            ``prometheus_client``, the ``metrics`` extra). See :mod:`zephon.metrics`.
    """

    def __init__(
        self,
        source: Any,
        *,
        canonical_replicas: int = 8,
        flush_every_k_chunks: int | None = None,
        workers: int | Literal["auto"] | RayWorkers = 0,
        rank: int | None = None,
        world_size: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        output: str = INTERLEAVE,
        aggregate_dir: str | None = None,
        aggregate_store: str | None = None,
        aggregate_timeout_s: float = 60.0,
        aggregate_lease_s: float = 10.0,
        job_id: str | None = None,
        prefetch: int | None = None,
        ring_slots: int | None = None,
        zero_copy: bool = False,
        ring_slot_bytes: int | None = None,
        worker_timeout_s: float = 60.0,
        worker_start_method: str = "spawn",
        seed: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        options = checked_options(
            source,
            canonical_replicas=canonical_replicas,
            flush_every_k_chunks=flush_every_k_chunks,
            workers=workers,
            rank=rank,
            world_size=world_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            output=output,
            aggregate_dir=aggregate_dir,
            aggregate_store=aggregate_store,
            aggregate_timeout_s=aggregate_timeout_s,
            aggregate_lease_s=aggregate_lease_s,
            job_id=job_id,
            prefetch=prefetch,
            ring_slots=ring_slots,
            zero_copy=zero_copy,
            ring_slot_bytes=ring_slot_bytes,
            worker_timeout_s=worker_timeout_s,
            worker_start_method=worker_start_method,
            seed=seed,
            metrics_port=metrics_port,
        )
        self._options = options  # the one copy of the arguments: see the properties below
        self.source = source
        super().__init__()  # the chain: no operators yet
        self._plan: Plan | None = None
        self._engine: Engine | None = None
        self._last_checkpoint: dict[str, Any] | int = 0  # the state, or its size once asked
        self._agg: Any = None
        self._fingerprint: tuple[str, dict[str, str], str] | None = None
        self._closed = False
        self._ckpt_clock = CheckpointClock()
        self._metrics: Any = None  # the metrics endpoint (metrics_port), once started

    def _extended(self, ops: tuple[Operator, ...]) -> Self:
        # A new pipeline: nothing compiled, fingerprinted or started for the old chain.
        new = super()._extended(ops)
        new._plan = None
        new._engine = None
        new._agg = None
        new._fingerprint = None
        new._closed = False
        new._ckpt_clock = CheckpointClock()
        new._metrics = None
        return new

    # ------------------------------------------------------- the arguments
    # Read-only, as checked and resolved; each is documented on the class.
    @property
    def canonical_replicas(self) -> int:
        """The number of lanes."""
        return self._options.canonical_replicas

    @property
    def flush_every_k_chunks(self) -> int | None:
        """As given (None: chosen by the plan; ``checkpoint()`` shows the one in use)."""
        return self._options.flush_every_k_chunks

    @property
    def workers(self) -> int:
        """Worker processes (``"auto"`` resolved)."""
        return self._options.workers

    @property
    def output(self) -> str:
        """``"interleave"`` or ``"lockstep"``."""
        return self._options.output

    @property
    def aggregate_dir(self) -> str | None:
        """Where the checkpoint rounds run (None: no rounds, or a store)."""
        return self._options.aggregate_dir

    @property
    def aggregate_store(self) -> str | None:
        """The key-value store of the checkpoint rounds (None: no rounds, or a directory)."""
        return self._options.aggregate_store

    @property
    def aggregate_timeout_s(self) -> float:
        """One checkpoint round's whole budget, in seconds."""
        return self._options.aggregate_timeout_s

    @property
    def aggregate_lease_s(self) -> float:
        """How long a rank's liveness key outlives its process, in seconds."""
        return self._options.aggregate_lease_s

    @property
    def job_id(self) -> str | None:
        """As given (None: resolved by the checkpoint rounds)."""
        return self._options.job_id

    @property
    def prefetch(self) -> int:
        """The pump's depth (its default resolved)."""
        return self._options.prefetch

    @property
    def ring_slots(self) -> int:
        """Slots per worker ring (its default resolved)."""
        return self._options.ring_slots

    @property
    def zero_copy(self) -> bool:
        """With workers, batches are views into shared memory."""
        return self._options.zero_copy

    @property
    def ring_slot_bytes(self) -> int | None:
        """As given (None: sized from the batches)."""
        return self._options.ring_slot_bytes

    @property
    def worker_timeout_s(self) -> float:
        """Seconds a worker may produce nothing before it is reported hung."""
        return self._options.worker_timeout_s

    @property
    def worker_start_method(self) -> str:
        """How worker processes start: ``"spawn"``, ``"forkserver"`` or ``"fork"``."""
        return self._options.worker_start_method

    @property
    def seed(self) -> int | None:
        """As given (None: the work source's)."""
        return self._options.seed

    @property
    def metrics_port(self) -> int | None:
        """As given (None: no metrics endpoint)."""
        return self._options.metrics_port

    @property
    def _topology(self) -> Topology:
        return self._options.topology

    # ------------------------------------------------------------- compile
    @property
    def lanes(self) -> list[int]:
        """The lanes this rank owns."""
        return self._topology.lanes

    def _compiled(self) -> Plan:
        if self._plan is None:
            opts = self._options
            self._plan = compile_pipeline(
                self._ops,
                self.source,
                flush_every_k_chunks=opts.flush_every_k_chunks,
                seed=opts.seed,
                lanes_per_process=opts.lanes_per_process,
            )
        return self._plan

    def explain(self) -> str:
        """Stages, runners and queue sizes, in the seed page's format."""
        chunk_size = int(getattr(self.source, "chunk_size", 64))
        return explain(self._compiled(), self._options, chunk_size)

    def fingerprint(self) -> str:
        """A hash of the pipeline definition that a checkpoint must match to be restored:
        the work source's config (with every dataset's content identity), the operators and
        their parameters, ``canonical_replicas`` and the flush cadence. Computed once per
        pipeline (reading a few blocks of each dataset; see :mod:`zephon.sources.identity`)."""
        return self._fingerprints()[0]

    def fingerprint_parts(self) -> dict[str, str]:
        """The fingerprint part by part (``"op.3.seq_len" -> "2048"``, ``"component.0.
        identity.sample" -> "'9f3a…'"``): what a checkpoint carries so that a mismatch can
        name what differs. A mixture of more than 64 components keeps its component parts
        in columns (see :mod:`zephon._fingerprint`)."""
        return dict(self._fingerprints()[1])

    def _fingerprints(self) -> tuple[str, dict[str, str], str]:
        """(fingerprint, parts, legacy fingerprint): the last is what checkpoints without a
        part map hold (no content identities)."""
        if self._fingerprint is None:
            plan = self._compiled()
            self._fingerprint = pipeline_fingerprints(
                self.source, self.canonical_replicas, plan.flush_every_k_chunks, plan.ops
            )
        return self._fingerprint

    def _get_engine(self) -> Engine:
        if self._engine is None:
            self._engine = start_engine(self._compiled(), self.source, self._options)
            if self._metrics is None and self._options.metrics_port is not None:
                from zephon.metrics.exporter import serve

                self._metrics = serve(self, self._options.metrics_port)
        return self._engine

    # ------------------------------------------------------------ iterate
    def __iter__(self) -> Pipeline:
        """The pipeline itself: a loop that stops early (``break``) and a later loop go on
        with the same stream. Once the stream has ended there is no other pass: a loop
        over it then raises :class:`~zephon.PipelineEndedError` (``next()`` goes on
        raising ``StopIteration``, as an iterator does)."""
        if self._engine is not None and self._engine._finished:  # noqa: SLF001 - ours
            raise PipelineEndedError(
                "the pipeline has ended: it was iterated to its end already, and a second "
                "loop over it would yield nothing. For another pass, build a new pipeline, "
                "or make the work source repeat its data: StaticMixtureWorkSource(..., "
                "num_epochs=N) (None: endless)"
            )
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise closed_error()
        engine = self._get_engine()
        ended = engine._finished  # noqa: SLF001 - ours
        try:
            return engine.next()
        except StopIteration:
            if not ended:  # the end was reached by this call: said once per run
                _warn_dropped(engine)
            raise

    @property
    def last_batch_lanes(self) -> tuple[int, ...]:
        """The lanes the last returned batch came from (one lane for ``interleave``, the
        rank's lanes in order for ``lockstep``)."""
        return () if self._engine is None else self._engine.last_lanes

    # --------------------------------------------------------- checkpoint
    def checkpoint(self) -> dict[str, Any]:
        """The loader state at the last delivered batch: msgpack-able and small. The cut is
        the last batch ``next()`` returned, however far the prefetch pump has run ahead;
        chunks the pump already pulled are carried in full and replayed on restore.

        With ``aggregate_dir``/``aggregate_store`` every rank must call it at the same step
        and the ranks run one checkpoint round. Rank 0 (the round's leader) returns the
        merged state, covering every lane. Every other rank returns its *share*: the same
        merged header (fingerprint, topology, round-robin positions) with its own lanes and
        a ``"share"`` entry naming the round; a follower reads no other rank's lanes (see
        :mod:`zephon.checkpoint.rounds`). Without aggregation a rank returns the state of
        its own lanes.

        Treat the state as read-only: a lane's part is shared with later checkpoints until
        the lane moves (which keeps a checkpoint of thousands of lanes cheap). ``zp.save``,
        :meth:`restore` and the Orbax handler only read it; ``copy.deepcopy`` it before
        changing anything in place.
        """
        t0 = time.perf_counter()
        state = self.local_checkpoint()
        t1 = time.perf_counter()
        state = self.aggregate(state)
        t2 = time.perf_counter()
        self._ckpt_clock.record(t2 - t0, t2 - t1 if self._aggregated() else None)
        return state

    def local_checkpoint(self) -> dict[str, Any]:
        """This rank's own state at its last delivered batch, without a checkpoint round
        (cheap; what :meth:`checkpoint` merges across ranks)."""
        plan = self._compiled()
        topo = self._topology
        engine = self._get_engine()
        # An acyclic value of thousands of dicts; with thousands of lanes, what waits in
        # their bins is promoted unscanned (see zephon.pipeline.collector).
        with collector_paused(promote=len(engine.lanes) >= PROMOTE_LANES):
            return build_state(
                self.fingerprint(),
                self.fingerprint_parts(),
                plan.flush_every_k_chunks,
                plan.eviction,
                topo,
                engine.state(),
            )

    def aggregate(self, state: dict[str, Any]) -> dict[str, Any]:
        """Run the checkpoint round on a :meth:`local_checkpoint` state when aggregation is
        configured (every rank must call it), else return it as it is."""
        if self._aggregated():
            state = self._aggregator().round(state)
        self._last_checkpoint = state  # sized when stats() asks (packing it costs)
        return state

    def _aggregated(self) -> bool:
        return self.aggregate_dir is not None or self.aggregate_store is not None

    def _aggregator(self) -> Any:
        if self._agg is None:
            self._agg = open_aggregator(self._options, self.fingerprint())
        return self._agg

    def restore(
        self, state: dict[str, Any], allow_mixture_change: bool = False
    ) -> MixtureChange | None:
        """Continue from ``state`` (from :meth:`checkpoint`) on this freshly built pipeline.

        Args:
            state: the checkpoint.
            allow_mixture_change: let the work source's mixture differ from the
                checkpoint's: datasets added, removed or reweighted, another schedule,
                ``weight_unit``, ``num_epochs`` or ``on_exhausted`` (everything else must
                still match). In-flight chunks replay exactly as they were made; new chunks
                follow the new weights; a dataset that stays (matched by name, with the same
                content) keeps its cursor; a new one, or one whose content changed, starts
                at its beginning (the latter with a ``UserWarning``). See
                :mod:`zephon.work_sources.mixture_change` for the whole contract.

        Returns:
            With ``allow_mixture_change`` and a mixture that differs, a
            :class:`~zephon.MixtureChange` saying what was kept, added, replaced and
            removed; otherwise None.

        Example::

            pipe = build(weights={"web": 0.5, "code": 0.3, "math": 0.2})  # math is new
            change = pipe.restore(zp.load("loader.zph"), allow_mixture_change=True)
            print(change)  # mixture change: kept ['web', 'code']; added ['math']; ...

        Raises:
            CheckpointError: iteration already began, the state is not a Zephon pipeline
                checkpoint of a supported version, the fingerprint differs (outside the
                mixture, with ``allow_mixture_change``), lanes that this rank owns are
                missing, or the new mixture drops (or changes the data of) a dataset whose
                samples are still in flight.
        """
        if self._closed:
            raise closed_error()
        if isinstance(state, dict):  # (plan_restore says what is wrong with anything else)
            check_header(state)
            step = state_step(state)
        by_lane, holds, next_lane, change = plan_restore(self, state, allow_mixture_change)
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        engine = self._get_engine()
        try:
            # Another topology: the engine gives the turn to the least advanced lane.
            engine.restore(by_lane, holds, next_lane, step)
        except CheckpointError:
            # Nothing half-restored survives: the next restore() or next() starts clean.
            engine.close()
            self._engine = None
            raise
        self._last_checkpoint = 0
        return change

    # ---------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """Per-operator counts and time, queue fill, in-flight chunks per lane, the last
        checkpoint's size and how many chunks the last restore replayed.

        ``operators`` lists, per operator, ``records_in`` (records it was given; flush
        sentinels and tombstones are not records), ``records_out`` (records it emitted;
        what it dropped is not output) and ``seconds``, summed over the lanes, each lane
        counted as of its last delivered batch: the work done for everything delivered so
        far (including the rest of the chunk run that produced the last batch), however
        far the prefetch pump or the workers ran ahead. So the counts are the same with
        any number of workers at every call made after a ``next()`` returns.
        ``replay_dropped_records`` counts records the replay filter dropped after a
        restore, counted the same way. ``skipped_records``: per component name, the
        records its dataset left out by kind (for datasets with a ``skipped_records()``
        method, such as ``JsonlSource(on_error="skip")``). ``io_retries``: reads the
        fetch operator retried after transient storage failures (counted per lane, with or
        without workers). ``next_wait_fraction``: the share of the consumer's time since
        its first batch spent waiting inside ``next()`` (``next_wait_s`` in seconds;
        ``first_batch_s`` the first call's); above 10% for a loop that is busy between
        batches, a ``DataStallWarning`` names the knobs, once per run.

        For the metrics (:mod:`zephon.metrics`, which exports these): ``busy`` per place
        (each worker, or the parent) its operators' seconds by stage and its busy fraction;
        ``bottleneck`` the busiest place and stage with the knob to turn (None before the
        first batch); ``mixture`` per component its target weight, delivered tokens and
        documents delivered with their shares; ``reads`` per source its ``bytes``,
        ``requests`` and ``retries``; ``batches_delivered`` (by this pipeline),
        ``step``, ``next_wait_histogram``, and the ``checkpoint()`` timings
        (``checkpoints``, ``checkpoint_s`` the last, ``checkpoint_seconds_total``, the
        same for ``rounds``)."""
        engine = self._get_engine()
        st = engine.stats()
        st.update(observed(self, engine))
        if isinstance(self._last_checkpoint, dict):
            self._last_checkpoint = len(msgpack.packb(self._last_checkpoint, use_bin_type=True))
        st["checkpoint_bytes"] = self._last_checkpoint
        st["skipped_records"] = skipped_records(self.source)
        return st

    def resize_workers(self, num_workers: int) -> None:
        """Ray workers only (``workers=zp.RayWorkers(n)``): run on ``num_workers`` actors
        from the next batch on. Added actors take lanes from the most loaded ones, removed
        ones give theirs away, each lane moving as when an actor dies (it replays its
        in-flight chunks on the new actor): no batch changes. Before the first batch, the
        pipeline starts with that many actors."""
        if self._options.remote is None:
            raise ValueError(
                "resize_workers() needs workers=zp.RayWorkers(n); this pipeline has "
                f"workers={self.workers}"
            )
        ray_executor: Any = self._get_engine().executor  # a RayExecutor (options.remote)
        ray_executor.resize_workers(num_workers)

    def close(self) -> None:
        """Stop the pump and release threads, workers and shared memory. Idempotent.

        Afterwards ``next()`` raises :class:`~zephon.PipelineClosedError`; ``checkpoint()``
        still returns the state at the last delivered batch. A running
        :func:`zp.metrics.record <zephon.metrics.record>` writes its last sample (the
        figures now) and closes its file first."""
        try:
            if not self._closed:
                finish_recording(self)
        finally:
            self._closed = True
            if self._metrics is not None:
                self._metrics.close()
            if self._engine is not None:
                self._engine.close()
            if self._agg is not None:
                self._agg.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        ops = ".".join(repr(op) for op in self._ops)
        return f"Pipeline(lanes={self.canonical_replicas}, ops={ops})"


def _warn_dropped(engine: Engine) -> None:
    """At the end of the data: how many records ``batch(drop_last=True)`` dropped with the
    lanes' last partial batches (nothing when it dropped none)."""
    dropped = {lane: c.dropped_at_end for lane, c in engine.lane_counts.items() if c.dropped_at_end}
    if not dropped:
        return
    total = sum(dropped.values())
    batch = next((op for op in engine.plan.ops if hasattr(op, "dropped_at_end")), None)
    size = getattr(batch, "batch_size", None)
    most = f" (at most {len(engine.lanes)} lanes x (batch_size {size} - 1) a pass)" if size else ""
    warnings.warn(
        f"zephon: the pipeline ended and batch(drop_last=True) dropped {total} record"
        f"{'s' if total != 1 else ''}: the last partial batch of {len(dropped)} of its "
        f"{len(engine.lanes)} lanes{most}. To deliver them, build it with batch(..., "
        "drop_last=False) (short last batches) or batch(..., pad_last=True) (full-size "
        "batches padded, with a 'batch_mask' feature)",
        DroppedRecordsWarning,
        stacklevel=3,
    )
