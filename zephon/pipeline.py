"""The builder users touch: ``Pipeline(source, ...).fetch().tokenize(...)...batch(n)``.

Builder methods return a new Pipeline; nothing runs until the first ``next()`` (or
``checkpoint()``/``explain()``). A Pipeline is its own iterator: iterating it twice continues
the same stream. ``checkpoint()`` returns a plain msgpack-able dict; ``restore(state)`` on a
freshly built, identical pipeline continues exactly where the checkpoint was taken.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgpack
import numpy as np

from zephon._fingerprint import describe_differences, fingerprint_parts
from zephon.compile import Plan, compile_plan, explain
from zephon.engine import Engine, LocalExecutor, closed_error
from zephon.errors import CheckpointError
from zephon.operators.base import Operator, PipelineContext
from zephon.operators.batch import Batch
from zephon.operators.ensure_mixture import EnsureMixture
from zephon.operators.fetch import Fetch
from zephon.operators.filter import Filter
from zephon.operators.map import Map
from zephon.operators.pack import Pack
from zephon.operators.shuffle import Shuffle
from zephon.operators.split import Split
from zephon.operators.tokenize import Tokenize
from zephon.runners.lanes import INTERLEAVE, OUTPUTS
from zephon.runners.processes import ProcessExecutor
from zephon.topology import Topology, resolve_topology
from zephon.tracking import HELD, LaneTracker, checked_holds
from zephon.work_sources.mixture_change import (
    MixtureChange,
    check_inflight,
    is_mixture_part,
    plan_change,
    remap_inflight,
)

FORMAT = "zephon.pipeline"
#: Slots per worker ring when ``ring_slots`` is not given (see benchmarks.ring_depth).
DEFAULT_RING_SLOTS = 8
FORMAT_VERSION = 1
#: The part map beside the fingerprint (see :mod:`zephon._fingerprint`); checkpoints made
#: before it existed lack it.
FINGERPRINT_PARTS = "fingerprint_parts"
_OUTPUTS = OUTPUTS


class Pipeline:
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
            with one CPU gets 0).
        rank, world_size, dp_rank, dp_size: this process's place in a multi-host job;
            default to JAX's process index/count when ``jax.distributed`` is initialised.
        output: ``"interleave"`` (one lane's batch per step, round-robin) or ``"lockstep"``
            (one batch of every lane per step, concatenated in lane order). At the end of
            a finite stream, interleave goes on round-robin over the lanes that have data
            left until every lane has ended (each lane's last batch may be partial with
            ``batch(drop_last=False)``). Lockstep stops at the first step in which some
            lane has no batch left: the global batch of every step has every lane's rows
            (with ``drop_last=False`` the last step may hold lanes' partial batches), and
            what the other lanes still held is not delivered. Either way every worker
            count yields exactly the stream of ``workers=0``.
        aggregate_dir, aggregate_store, aggregate_timeout_s: multi-rank checkpoint rounds.
        prefetch: batches a pump thread of this process prepares ahead of the consumer's
            ``next()`` (0: no pump thread; each batch is made when asked for). In process
            the pump runs the operators; with workers it takes batches out of their rings,
            so copying them out and tracking overlap with the training step. Prefetched
            batches are not delivered: the checkpoint cut stays at the last ``next()``.
        ring_slots: with workers, the slots of each worker's shared-memory ring: how many
            batches a worker may have finished ahead of the parent (``None``: 8).
        zero_copy: with workers, yield views into shared memory valid until the next
            ``next()`` instead of arrays the caller owns (needs ``ring_slots >=
            prefetch + 2``: the views and the prefetched batches hold slots).
        ring_slot_bytes: bytes per shared-memory ring slot; one batch must fit in a slot.
        worker_timeout_s: a worker that produces nothing for this long is reported hung.
        worker_start_method: ``"spawn"`` (safe beside JAX's threads), ``"forkserver"`` or
            ``"fork"``.
    """

    def __init__(
        self,
        source: Any,
        *,
        canonical_replicas: int = 8,
        flush_every_k_chunks: int | None = None,
        workers: int | Literal["auto"] = 0,
        rank: int | None = None,
        world_size: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        output: str = INTERLEAVE,
        aggregate_dir: str | None = None,
        aggregate_store: str | None = None,
        aggregate_timeout_s: float = 60.0,
        prefetch: int = 3,
        ring_slots: int | None = None,
        zero_copy: bool = False,
        ring_slot_bytes: int = 4 << 20,
        worker_timeout_s: float = 60.0,
        worker_start_method: str = "spawn",
    ) -> None:
        if not callable(getattr(source, "for_lane", None)):
            raise TypeError(
                f"Pipeline needs a work source with for_lane(lane, num_lanes) (e.g. "
                f"zp.StaticMixtureWorkSource); got {type(source).__name__}"
            )
        if output not in _OUTPUTS:
            raise ValueError(f"output must be one of {_OUTPUTS}; got {output!r}")
        if workers != "auto" and (
            not isinstance(workers, int) or isinstance(workers, bool) or workers < 0
        ):
            raise ValueError(f"workers must be an int >= 0 or 'auto'; got {workers!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0; got {prefetch!r}")
        if ring_slots is None:
            ring_slots = DEFAULT_RING_SLOTS
        if not isinstance(ring_slots, int) or isinstance(ring_slots, bool) or ring_slots < 2:
            raise ValueError(f"ring_slots must be None or an int >= 2; got {ring_slots!r}")
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
        if aggregate_dir is not None and aggregate_store is not None:
            raise ValueError("give aggregate_dir or aggregate_store, not both")
        self._topology: Topology = resolve_topology(
            canonical_replicas, rank, world_size, dp_rank, dp_size
        )
        if flush_every_k_chunks is not None and (
            not isinstance(flush_every_k_chunks, int) or flush_every_k_chunks < 0
        ):
            raise ValueError(
                f"flush_every_k_chunks must be None or an int >= 0; got {flush_every_k_chunks!r}"
            )
        if workers == "auto":
            workers = auto_workers(len(self._topology.lanes))
        self.source = source
        self.canonical_replicas = canonical_replicas
        self.flush_every_k_chunks = flush_every_k_chunks
        self.workers = workers
        self.output = output
        self.aggregate_dir = aggregate_dir
        self.aggregate_store = aggregate_store
        self.aggregate_timeout_s = float(aggregate_timeout_s)
        self.prefetch = prefetch
        self.ring_slots = ring_slots
        self.zero_copy = zero_copy
        if not isinstance(ring_slot_bytes, int) or ring_slot_bytes < 4096:
            raise ValueError(f"ring_slot_bytes must be an int >= 4096; got {ring_slot_bytes!r}")
        if not (isinstance(worker_timeout_s, (int, float)) and worker_timeout_s > 0):
            raise ValueError(
                f"worker_timeout_s must be a positive number; got {worker_timeout_s!r}"
            )
        if worker_start_method not in ("spawn", "forkserver", "fork"):
            raise ValueError(
                f"worker_start_method must be 'spawn', 'forkserver' or 'fork'; got {worker_start_method!r}"
            )
        self.ring_slot_bytes = ring_slot_bytes
        self.worker_timeout_s = float(worker_timeout_s)
        self.worker_start_method = worker_start_method
        self._ops: tuple[Operator, ...] = ()
        self._plan: Plan | None = None
        self._engine: Engine | None = None
        self._last_checkpoint: dict[str, Any] | int = 0  # the state, or its size once asked
        self._agg: Any = None
        self._fingerprint: tuple[str, dict[str, str], str] | None = None
        self._closed = False

    # ------------------------------------------------------------- builder
    def apply(self, op: Operator) -> Pipeline:
        """A new pipeline with a custom :class:`~zephon.Operator` appended."""
        if not isinstance(op, Operator):
            raise TypeError(f"apply() takes a zp.Operator; got {type(op).__name__}")
        new = copy.copy(self)
        new._ops = (*self._ops, op)
        new._plan = None
        new._engine = None
        new._agg = None
        new._fingerprint = None
        new._closed = False
        return new

    def fetch(self, parallelism: int = 1) -> Pipeline:
        """Resolve sample pointers to raw samples (``ds.read(indices)`` when the dataset has
        it), ``parallelism`` threads per chunk for I/O-bound sources."""
        return self.apply(Fetch(_parallelism(parallelism)))

    def map(self, fn: Callable[[Any], Any], parallelism: int = 1) -> Pipeline:
        """``fn(data) -> new data`` for every record; order is kept with any parallelism."""
        return self.apply(Map(fn, _parallelism(parallelism)))

    def filter(self, pred: Callable[[Any], bool]) -> Pipeline:
        """Keep records whose data satisfies ``pred``; the rest become tombstones."""
        return self.apply(Filter(pred))

    def tokenize(self, tokenizer: Any, field: str | None = None, parallelism: int = 1) -> Pipeline:
        """Text (or ``data[field]``) to ``{"tokens": int32}`` with ``tokenizer.encode``."""
        return self.apply(Tokenize(tokenizer, field, _parallelism(parallelism)))

    def split(self, max_len: int, feature: str = "tokens") -> Pipeline:
        """Cut each sample into pieces of at most ``max_len`` (child i of n, last flagged)."""
        return self.apply(Split(max_len, feature))

    def pack(
        self, seq_len: int, num_bins: int = 8, features: Sequence[str] = ("tokens",)
    ) -> Pipeline:
        """First-fit pack pieces into ``num_bins`` open bins of ``seq_len``; emits
        ``f``, ``f_segment_ids``, ``f_positions`` per feature, padded with 0."""
        return self.apply(Pack(seq_len, num_bins, features))

    def shuffle(self, buffer_size: int, seed: int | None = None) -> Pipeline:
        """Per-lane buffer shuffle, re-seeded every epoch from (seed, lane, epoch start)."""
        return self.apply(Shuffle(buffer_size, seed))

    def ensure_mixture(
        self, weights: Sequence[float] | None = None, buffer_size: int = 16
    ) -> Pipeline:
        """Reorder records so each component's token share tracks ``weights`` (default:
        the work source's) batch by batch.

        The two mechanisms: the work source decides *what* each epoch holds (with
        ``weight_unit="tokens"`` its token shares are the weights'); ``ensure_mixture`` only
        decides the *order* inside an epoch (a lane's ``flush_every_k_chunks`` chunks), so it
        evens out single batches but never changes the totals. With document weights it
        cannot turn them into token shares (see benchmarks.mixture_fidelity). With a
        :class:`~zephon.Schedule` it needs explicit ``weights``."""
        return self.apply(EnsureMixture(weights, buffer_size))

    def batch(self, batch_size: int, drop_last: bool = True) -> Pipeline:
        """Stack ``batch_size`` records of one lane into numpy arrays; must be last."""
        return self.apply(Batch(batch_size, drop_last))

    # ------------------------------------------------------------- compile
    @property
    def lanes(self) -> list[int]:
        """The lanes this rank owns."""
        return self._topology.lanes

    def _compiled(self) -> Plan:
        if self._plan is None:
            if not self._ops:
                raise ValueError("the pipeline has no operators; add at least .fetch()")
            plan = compile_plan(
                [op.fresh() for op in self._ops],
                flush_every_k_chunks=self.flush_every_k_chunks,
                workers=self.workers,
                prefetch=self.prefetch,
                chunk_size=int(getattr(self.source, "chunk_size", 64)),
                ring_slots=self.ring_slots,
            )
            ctx = PipelineContext(
                datasets=tuple(getattr(self.source, "datasets", ())),
                weights=getattr(self.source, "weights", None),
                seed=int(getattr(self.source, "seed", 0)),
                num_components=int(getattr(self.source, "num_components", 0)),
                names=tuple(getattr(self.source, "names", ())),
            )
            for op in plan.ops:
                op.bind(ctx)
            self._plan = plan
        return self._plan

    def explain(self) -> str:
        """Stages, runners and queue sizes, in the seed page's format."""
        return explain(self._compiled())

    def fingerprint(self) -> str:
        """A hash of the pipeline definition that a checkpoint must match to be restored:
        the work source's config (with every dataset's content identity), the operators and
        their parameters, ``canonical_replicas`` and the flush cadence. Computed once per
        pipeline (reading a few blocks of each dataset; see :mod:`zephon.sources.identity`)."""
        return self._fingerprints()[0]

    def fingerprint_parts(self) -> dict[str, str]:
        """The fingerprint part by part (``"op.3.seq_len" -> "2048"``, ``"component.0.
        identity.sample" -> "'9f3a…'"``): what a checkpoint carries so that a mismatch can
        name what differs."""
        return dict(self._fingerprints()[1])

    def _fingerprints(self) -> tuple[str, dict[str, str], str]:
        """(fingerprint, parts, legacy fingerprint): the last is what checkpoints without a
        part map hold (no content identities)."""
        if self._fingerprint is None:
            plan = self._compiled()
            config = (
                self.source.config()
                if callable(getattr(self.source, "config", None))
                else repr(type(self.source))
            )
            legacy_config = (
                {k: v for k, v in config.items() if k != "identities"}
                if isinstance(config, dict)
                else config
            )
            ops = [op.fingerprint() for op in plan.ops]
            k = plan.flush_every_k_chunks
            self._fingerprint = (
                _digest(config, self.canonical_replicas, k, ops),
                fingerprint_parts(config, self.canonical_replicas, k, plan.ops),
                _digest(legacy_config, self.canonical_replicas, k, ops),
            )
        return self._fingerprint

    def _get_engine(self) -> Engine:
        if self._engine is None:
            plan = self._compiled()
            trackers = {
                lane: LaneTracker(
                    lane,
                    self.source.for_lane(lane, self.canonical_replicas),
                    plan.eviction,
                    plan.flush_every_k_chunks,
                )
                for lane in self.lanes
            }
            executor: Any
            if self.workers > 0:
                executor = ProcessExecutor(
                    plan,
                    self.workers,
                    zero_copy=self.zero_copy,
                    slot_bytes=self.ring_slot_bytes,
                    nslots=self.ring_slots,
                    start_method=self.worker_start_method,
                    worker_timeout_s=self.worker_timeout_s,
                    components=self._components(),
                )
            else:
                executor = LocalExecutor(plan)
            self._engine = Engine(plan, trackers, self.output, self.prefetch, executor)
            self._engine.knobs = f"workers={self.workers}, prefetch={self.prefetch}"
        return self._engine

    def _components(self) -> tuple[tuple[str, Any], ...]:
        """``(name, dataset)`` of the work source's mixture, to name a dataset in errors."""
        datasets = tuple(getattr(self.source, "datasets", ()))
        names = tuple(getattr(self.source, "names", ())) or tuple(map(str, range(len(datasets))))
        return tuple(zip(names, datasets, strict=False))

    # ------------------------------------------------------------ iterate
    def __iter__(self) -> Pipeline:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise closed_error()
        return self._get_engine().next()

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

        With ``aggregate_dir``/``aggregate_store`` every rank must call it at the same step;
        the ranks run one checkpoint round and all return the same merged state, covering
        every lane. Without them a rank returns the state of its own lanes.

        Treat the state as read-only: a lane's part is shared with later checkpoints until
        the lane moves (which keeps a checkpoint of thousands of lanes cheap). ``zp.save``,
        :meth:`restore` and the Orbax handler only read it; ``copy.deepcopy`` it before
        changing anything in place.
        """
        return self.aggregate(self.local_checkpoint())

    def local_checkpoint(self) -> dict[str, Any]:
        """This rank's own state at its last delivered batch, without a checkpoint round
        (cheap; what :meth:`checkpoint` merges across ranks)."""
        plan = self._compiled()
        topo = self._topology
        engine = self._get_engine()
        state = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint(),
            FINGERPRINT_PARTS: self.fingerprint_parts(),
            "canonical_replicas": self.canonical_replicas,
            "flush_every_k_chunks": plan.flush_every_k_chunks,
            "eviction": plan.eviction,
            "topology": {
                "rank": topo.rank,
                "world_size": topo.world_size,
                "dp_rank": topo.dp_rank,
                "dp_size": topo.dp_size,
                "canonical_replicas": topo.canonical_replicas,
            },
            **engine.state(),
        }
        state["round_robin"] = {
            "dp_size": topo.dp_size,
            "next_lanes": {str(topo.dp_rank): state.pop("next_lane")},
        }
        return state

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
            from zephon.checkpoint.aggregate import Aggregator, open_store

            topo = self._topology
            store = open_store(self.aggregate_dir, self.aggregate_store)
            self._agg = Aggregator(
                store,
                rank=topo.rank,
                world_size=topo.world_size,
                timeout_s=self.aggregate_timeout_s,
                expected_lanes=lambda r: _lanes_of_rank(topo, r),
                merge=merge_states,
            )
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
        if self._engine is not None and self._engine.started:
            raise CheckpointError(
                "restore() after iteration began; build a fresh pipeline and restore into it"
            )
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint state must be a dict; got {type(state).__name__}")
        if state.get("format") != FORMAT:
            raise CheckpointError(
                f"not a Zephon pipeline checkpoint (format={state.get('format')!r})"
            )
        if state.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format version {state.get('version')!r} is not supported by this "
                f"Zephon (supports {FORMAT_VERSION}); upgrade zephon"
            )
        if state.get("canonical_replicas") != self.canonical_replicas:
            raise CheckpointError(
                f"checkpoint has canonical_replicas={state.get('canonical_replicas')!r} but this "
                f"pipeline has {self.canonical_replicas}; lanes are fixed for a training run"
            )
        planned = self._check_fingerprint(state, allow_mixture_change)
        by_lane, next_lanes, saved_dp_size = _checked_layout(state)
        missing = [lane for lane in self.lanes if lane not in by_lane]
        if missing:
            raise CheckpointError(
                f"checkpoint has no state for lanes {missing} that this rank owns; restore a "
                "merged (all-rank) checkpoint: set aggregate_dir= or aggregate_store="
            )
        holds: dict[int, list[list[Any]]] = {}
        for lane in self.lanes:
            if isinstance(by_lane[lane], dict):
                try:
                    holds[lane] = checked_holds(by_lane[lane])
                except CheckpointError as e:
                    raise CheckpointError(f"lane {lane}: {e}") from e
        change = None
        if planned is not None:
            change, kept = planned
            by_lane, holds = self._change_mixture(state, change, kept, by_lane, holds)
        for i, op in enumerate(self._compiled().ops):
            if isinstance(op, EnsureMixture):  # (replacing what an earlier restore held)
                op.hold(
                    {
                        lane: [(until, w) for o, until, w in entries if o == i]
                        for lane, entries in holds.items()
                    }
                )
        topo = self._topology
        same_layout = saved_dp_size == topo.dp_size
        if same_layout and topo.dp_rank not in next_lanes:
            raise CheckpointError(
                f"malformed checkpoint: round_robin next_lanes has no entry for DP rank "
                f"{topo.dp_rank} (it has {sorted(next_lanes)}) though dp_size={saved_dp_size} "
                "is this pipeline's"
            )
        if same_layout and next_lanes[topo.dp_rank] not in self.lanes:
            raise CheckpointError(
                f"malformed checkpoint: round_robin next_lanes gives DP rank {topo.dp_rank} "
                f"lane {next_lanes[topo.dp_rank]}, which it does not own (its lanes: {self.lanes})"
            )
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        engine = self._get_engine()
        replayed = 0
        try:
            for lane in self.lanes:
                tracker = engine.trackers[lane]
                replayed += tracker.load(by_lane[lane])
                tracker.held = holds.get(lane, [])
                engine.executor.set_target(lane, tracker.cursor)
        except CheckpointError:
            # Nothing half-restored survives: the next restore() or next() starts clean.
            engine.close()
            self._engine = None
            raise
        engine.replayed_chunks = replayed
        if same_layout:
            engine.next_lane = next_lanes[topo.dp_rank]
        else:
            # Another topology: the round-robin turn goes to the least advanced lane, which
            # is where a rank's round-robin would be (ties: the lowest lane).
            live = [lane for lane in self.lanes if not engine.trackers[lane].done] or self.lanes
            engine.next_lane = min(live, key=lambda lane: (engine.trackers[lane].batches, lane))
        self._last_checkpoint = 0
        return change

    def _change_mixture(
        self,
        state: dict[str, Any],
        change: MixtureChange,
        kept: dict[str, str],
        by_lane: dict[int, Any],
        holds: dict[int, list[list[Any]]],
    ) -> tuple[dict[int, Any], dict[int, list[list[Any]]]]:
        """The lane states of this rank translated into the new mixture (see
        :mod:`zephon.work_sources.mixture_change`), and what each ``ensure_mixture`` must hold
        per lane while the in-flight epochs replay: ``[op, until, weights]`` entries in the
        new component order."""
        source = self.source
        if not callable(getattr(source, "remapped_state", None)):
            raise CheckpointError(
                f"allow_mixture_change=True needs a work source that can take a state into "
                f"another mixture (StaticMixtureWorkSource); this one is a {type(source).__name__}"
            )
        new_names = list(source.names)
        old_names = list(change.old_names)
        mine = {lane: by_lane[lane] for lane in self.lanes}
        check_inflight(change, mine, new_names)
        old_index = {n: c for c, n in enumerate(old_names)}
        old_to_new = np.full(len(old_names), -1, dtype=np.int64)
        for c, name in enumerate(new_names):
            if name in kept:
                old_to_new[old_index[kept[name]]] = c

        def remapped(weights: list[float]) -> list[float]:
            if len(weights) != len(old_names):
                raise CheckpointError(
                    f"a held entry has {len(weights)} weights for the checkpoint's "
                    f"{len(old_names)} components"
                )
            return [0.0 if n not in kept else weights[old_index[kept[n]]] for n in new_names]

        plan = self._compiled()
        ensure = [(i, op) for i, op in enumerate(plan.ops) if isinstance(op, EnsureMixture)]
        if ensure:
            order = [old_index[kept[n]] for n in new_names if n in kept]
            if order != sorted(order):
                raise CheckpointError(
                    "allow_mixture_change=True with ensure_mixture: the datasets that stay must "
                    f"keep their relative order (was {[old_names[c] for c in sorted(order)]}, now "
                    f"{[old_names[c] for c in order]}), because ensure_mixture breaks ties by "
                    "component order and the replayed epochs must come out as they did; put "
                    "them back in that order (new datasets may go anywhere)"
                )
        saved_parts = state.get(FINGERPRINT_PARTS) or {}
        k = plan.flush_every_k_chunks
        new_holds: dict[int, list[list[Any]]] = {}
        for lane, ls in mine.items():
            entries = [[o, until, remapped(w)] for o, until, w in holds.get(lane, [])]
            next_id = ls.get("next_chunk_id") if isinstance(ls, dict) else None
            if isinstance(next_id, int) and next_id > 0 and k > 0:
                until = -(-next_id // k) * k  # the flush that ends the lane's last epoch
                for i, op in ensure:
                    if any(o == i and u >= until for o, u, _ in entries):
                        continue  # an earlier hold already covers that epoch
                    old_w = _old_ensure_weights(saved_parts, i, op, len(old_names))
                    entries.append([i, until, remapped(old_w)])
            new_holds[lane] = sorted(entries, key=lambda e: (e[0], e[1]))
        out = dict(by_lane)
        for lane, ls in mine.items():
            if not isinstance(ls, dict):
                continue  # malformed: the tracker's checks name it
            try:
                translated = source.for_lane(lane, self.canonical_replicas).remapped_state(
                    ls.get("source"), old_names, kept
                )
            except CheckpointError as e:
                raise CheckpointError(f"lane {lane}: work source state: {e}") from e
            lane_state = {**remap_inflight(ls, old_to_new), "source": translated}
            lane_state.pop(HELD, None)
            out[lane] = lane_state
        if change.replaced:
            warnings.warn(
                f"restore: the data of {list(change.replaced)} is not what the checkpoint was "
                "made with (another content identity or length): they are treated as new "
                "datasets and start at their beginning",
                UserWarning,
                stacklevel=3,
            )
        return out, new_holds

    def _check_fingerprint(
        self, state: dict[str, Any], allow_mixture_change: bool = False
    ) -> tuple[MixtureChange, dict[str, str]] | None:
        mine, parts, legacy = self._fingerprints()
        theirs = state.get("fingerprint")
        if theirs == mine:
            return None
        saved_parts = state.get(FINGERPRINT_PARTS)
        if saved_parts is None and theirs == legacy:
            warnings.warn(
                "the checkpoint predates dataset content identities (it has no "
                f"{FINGERPRINT_PARTS!r}): its pipeline definition matches this one, but "
                "whether the datasets hold the same data cannot be checked. Checkpoints made "
                "from now on carry it",
                UserWarning,
                stacklevel=3,
            )
            return None
        head = (
            f"checkpoint fingerprint {str(theirs)[:12]}… does not match this pipeline's "
            f"{mine[:12]}…"
        )
        if saved_parts is None:
            raise CheckpointError(
                f"{head}: the pipeline definition (source, operators or their parameters, "
                "flush_every_k_chunks) differs from the one that was checkpointed"
            )
        if not isinstance(saved_parts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in saved_parts.items()
        ):
            raise CheckpointError(
                f"{head}, and the checkpoint's {FINGERPRINT_PARTS!r} is malformed (a "
                f"{type(saved_parts).__name__}, expected a dict of str to str), so what differs "
                "cannot be said; restore a checkpoint written by zephon.save"
            )
        if allow_mixture_change:
            ensure = [
                i for i, op in enumerate(self._compiled().ops) if isinstance(op, EnsureMixture)
            ]
            outside = describe_differences(
                {k: v for k, v in saved_parts.items() if not is_mixture_part(k, ensure)},
                {k: v for k, v in parts.items() if not is_mixture_part(k, ensure)},
            )
            if outside:
                raise CheckpointError(
                    f"{head}, and not only in the mixture (allow_mixture_change=True lets the "
                    f"datasets and weights change, nothing else): {'; '.join(outside)}"
                )
            return plan_change(saved_parts, parts)
        differences = describe_differences(saved_parts, parts)
        if not differences:
            raise CheckpointError(
                f"{head}, though every part it records agrees: what differs is something the "
                "parts do not show (such as an operator's class behind the same name and "
                f"parameters), or the checkpoint's {FINGERPRINT_PARTS!r} was edited"
            )
        content = any("content identity" in d for d in differences)
        raise CheckpointError(
            f"{head}: {'; '.join(differences)}. Restore into the pipeline (and datasets) that "
            "made the checkpoint"
            + (
                "; a content identity differs when a dataset holds other data (another file, "
                "or the same one edited)"
                if content
                else ""
            )
        )

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
        batches, a ``DataStallWarning`` names the knobs, once per run."""
        st = self._get_engine().stats()
        if isinstance(self._last_checkpoint, dict):
            self._last_checkpoint = len(msgpack.packb(self._last_checkpoint, use_bin_type=True))
        st["checkpoint_bytes"] = self._last_checkpoint
        st["skipped_records"] = _skipped_records(self.source)
        return st

    def close(self) -> None:
        """Stop the pump and release threads, workers and shared memory. Idempotent.

        Afterwards ``next()`` raises :class:`~zephon.PipelineClosedError`; ``checkpoint()``
        still returns the state at the last delivered batch."""
        self._closed = True
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


def _old_ensure_weights(parts: Any, i: int, op: EnsureMixture, count: int) -> list[float]:
    """The weights operator ``i`` (an ``ensure_mixture``) had in the checkpoint's pipeline,
    by its old component order: from its fingerprint part, or, when that was too long to
    keep and the operator follows the work source, from the old components' weights."""
    import ast

    def literal(text: Any) -> Any:
        try:
            return ast.literal_eval(text) if isinstance(text, str) else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None

    value = literal(parts.get(f"op.{i}.weights"))
    if (
        isinstance(value, list)
        and len(value) == count
        and all(isinstance(w, float | int) for w in value)
    ):
        return [float(w) for w in value]
    if op.weights is None:
        weights = [literal(parts.get(f"component.{c}.weight")) for c in range(count)]
        if all(isinstance(w, float | int) for w in weights) and sum(weights) > 0:
            s = sum(weights)
            return [w / s for w in weights]
    raise CheckpointError(
        f"allow_mixture_change=True: the checkpoint does not say which weights operator {i} "
        "(ensure_mixture) had, which replaying its epochs needs; restore without changing "
        "the mixture, or give ensure_mixture no weights (it then follows the work source)"
    )


def _checked_layout(state: dict[str, Any]) -> tuple[dict[int, Any], dict[int, int], int]:
    """The lane states by lane, the round-robin's next lane per DP rank and its dp_size,
    checked for shape; a CheckpointError names what is malformed."""
    from zephon.tracking import checked_count

    def fail(what: str, value: Any) -> CheckpointError:
        return CheckpointError(
            f"malformed checkpoint: {what}; got {type(value).__name__} {value!r:.80}"
        )

    def count(what: str, value: Any) -> int:
        try:
            return checked_count(what, value)
        except CheckpointError as e:
            raise CheckpointError(f"malformed checkpoint: {e}") from None

    lanes, rr = state.get("lanes"), state.get("round_robin")
    if not isinstance(lanes, list):
        raise fail("'lanes' must be a list of lane states", lanes)
    by_lane: dict[int, Any] = {}
    for ls in lanes:
        if not isinstance(ls, dict) or "lane" not in ls:
            raise fail("every entry of 'lanes' must be a dict with a 'lane'", ls)
        lane = count("a lane id", ls["lane"])
        if lane in by_lane:
            raise CheckpointError(f"malformed checkpoint: lane {lane} appears twice in 'lanes'")
        by_lane[lane] = ls
    if not isinstance(rr, dict) or not isinstance(rr.get("next_lanes"), dict):
        raise fail("'round_robin' must be a dict with a 'next_lanes' dict", rr)
    saved_dp_size = count("round_robin dp_size", rr.get("dp_size"))
    next_lanes = {}
    for key, value in rr["next_lanes"].items():
        if not (isinstance(key, str) and key.isdigit()):
            raise fail("round_robin next_lanes keys must be DP ranks written as str", key)
        next_lanes[int(key)] = count(f"round_robin next_lanes[{key!r}]", value)
    return by_lane, next_lanes, saved_dp_size


def _skipped_records(source: Any) -> dict[str, dict[str, int]]:
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


def _digest(config: Any, canonical_replicas: int, k: int, ops: list[str]) -> str:
    desc = {
        "source": config,
        "canonical_replicas": canonical_replicas,
        "flush_every_k_chunks": k,
        "ops": ops,
    }
    return hashlib.sha256(msgpack.packb(desc, use_bin_type=True, default=repr)).hexdigest()


def _parallelism(p: int) -> int:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"parallelism must be a positive int; got {p!r}")
    return p


def _lanes_of_rank(topo: Topology, rank: int) -> list[int]:
    """Lanes that ``rank`` must report, by this rank's view of the job's layout: ranks are
    dealt to DP groups like the default (dp_rank = rank * dp_size // world_size)."""
    dp_rank = rank * topo.dp_size // topo.world_size
    per = topo.canonical_replicas // topo.dp_size
    return list(range(dp_rank * per, (dp_rank + 1) * per))


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's state (index = rank) into one covering all lanes.

    Model-parallel peers of one DP group read the same lanes, so their lane states must
    be identical; the group's lowest rank speaks for it.
    """
    from zephon.errors import AggregationError

    first = states[0]
    lanes: dict[int, Any] = {}
    owner: dict[int, int] = {}
    next_lanes: dict[str, int] = {}
    for rank, st in enumerate(states):
        if st["fingerprint"] != first["fingerprint"]:
            parts, first_parts = st.get(FINGERPRINT_PARTS), first.get(FINGERPRINT_PARTS)
            what = (
                "; ".join(describe_differences(parts, first_parts, f"rank {rank}", "rank 0"))
                if isinstance(parts, dict) and isinstance(first_parts, dict)
                else ""
            )
            raise AggregationError(
                f"rank {rank}'s pipeline fingerprint {st['fingerprint'][:12]}… differs from rank 0's "
                f"{first['fingerprint'][:12]}…{': ' + what if what else ''}: every rank must build "
                "the same pipeline over the same data"
            )
        next_lanes.update(st["round_robin"]["next_lanes"])
        for ls in st["lanes"]:
            lane = int(ls["lane"])
            if lane in lanes:
                if lanes[lane] != ls:
                    raise AggregationError(
                        f"ranks {owner[lane]} and {rank} report different states for lane {lane}: "
                        "model-parallel peers of a DP group must consume the same batches"
                    )
                continue
            lanes[lane] = ls
            owner[lane] = rank
    merged = {k: v for k, v in first.items() if k not in ("lanes", "topology", "round_robin")}
    merged["lanes"] = [lanes[lane] for lane in sorted(lanes)]
    merged["topology"] = {
        "rank": 0,
        "world_size": first["topology"]["world_size"],
        "dp_rank": 0,
        "dp_size": first["topology"]["dp_size"],
        "canonical_replicas": first["topology"]["canonical_replicas"],
        "merged": True,
    }
    merged["round_robin"] = {"dp_size": first["round_robin"]["dp_size"], "next_lanes": next_lanes}
    return merged


#: The most worker processes ``workers="auto"`` picks.
AUTO_WORKERS_MAX = 8


def auto_workers(lanes: int) -> int:
    """What ``Pipeline(workers="auto")`` picks: the CPUs this process may run on (its
    affinity mask, else ``os.cpu_count()``) less one for the training loop, at most
    :data:`AUTO_WORKERS_MAX` and at most ``lanes`` (a worker owns whole lanes)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(0, min(cpus - 1, AUTO_WORKERS_MAX, lanes))
