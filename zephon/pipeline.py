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
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from zephon.compile import Plan, compile_plan, explain
from zephon.engine import INTERLEAVE, LOCKSTEP, Engine, LocalExecutor
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
from zephon.runners.processes import ProcessExecutor
from zephon.topology import Topology, resolve_topology
from zephon.tracking import LaneTracker

FORMAT = "zephon.pipeline"
FORMAT_VERSION = 1
_OUTPUTS = (INTERLEAVE, LOCKSTEP)


class Pipeline:
    """A deterministic, exactly-resumable data pipeline over lanes of a work source.

    Args:
        source: a work source that can be sharded per lane (``for_lane(lane, num_lanes)``),
            such as :class:`~zephon.StaticMixtureWorkSource`.
        canonical_replicas: the number of lanes, fixed for the life of a training run.
        flush_every_k_chunks: chunks per epoch of a lane; ``None`` picks 4 when an operator
            reorders records and 0 otherwise.
        workers: worker processes for this rank (0: run in this process).
        rank, world_size, dp_rank, dp_size: this process's place in a multi-host job;
            default to JAX's process index/count when ``jax.distributed`` is initialised.
        output: ``"interleave"`` (one lane's batch per step, round-robin) or ``"lockstep"``
            (one batch of every lane per step, concatenated in lane order).
        aggregate_dir, aggregate_store, aggregate_timeout_s: multi-rank checkpoint rounds.
        prefetch: outputs the pump prepares ahead of the consumer (0: no pump thread).
        zero_copy: with workers, yield views into shared memory valid until the next
            ``next()`` instead of arrays the caller owns.
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
        workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        output: str = INTERLEAVE,
        aggregate_dir: str | None = None,
        aggregate_store: str | None = None,
        aggregate_timeout_s: float = 60.0,
        prefetch: int = 3,
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
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"workers must be an int >= 0; got {workers!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0; got {prefetch!r}")
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
        self.source = source
        self.canonical_replicas = canonical_replicas
        self.flush_every_k_chunks = flush_every_k_chunks
        self.workers = workers
        self.output = output
        self.aggregate_dir = aggregate_dir
        self.aggregate_store = aggregate_store
        self.aggregate_timeout_s = float(aggregate_timeout_s)
        self.prefetch = prefetch
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
        self._last_checkpoint_bytes = 0
        self._agg: Any = None
        self._fingerprint: str | None = None

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
        the work source's) batch by batch. It only reorders within an epoch, so the totals
        come from the work source: give it weights corrected for document length when the
        components' documents differ in length (see benchmarks.mixture_fidelity)."""
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
        """A hash of the pipeline definition that a checkpoint must match to be restored."""
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        plan = self._compiled()
        config = (
            self.source.config()
            if callable(getattr(self.source, "config", None))
            else repr(type(self.source))
        )
        desc = {
            "source": config,
            "canonical_replicas": self.canonical_replicas,
            "flush_every_k_chunks": plan.flush_every_k_chunks,
            "ops": [op.fingerprint() for op in plan.ops],
        }
        return hashlib.sha256(msgpack.packb(desc, use_bin_type=True, default=repr)).hexdigest()

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
                    nslots=max(4, self.prefetch + 2),
                    start_method=self.worker_start_method,
                    worker_timeout_s=self.worker_timeout_s,
                )
            else:
                executor = LocalExecutor(plan)
            self._engine = Engine(plan, trackers, self.output, self.prefetch, executor)
        return self._engine

    # ------------------------------------------------------------ iterate
    def __iter__(self) -> Pipeline:
        return self

    def __next__(self) -> Any:
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

        With ``aggregate_dir``/``aggregate_store`` every rank must call it at the same step
        and the ranks run one checkpoint round. Rank 0 (the round's leader) returns the
        merged state, covering every lane: save that one to resume on any number of ranks.
        Every other rank returns its *share*: the same merged header (fingerprint,
        topology, round-robin positions) with its own lanes and a ``"share"`` entry naming
        the round; it restores that rank as it is, and a follower reads no other rank's
        lanes (see :mod:`zephon.checkpoint.rounds`). Without aggregation a rank returns the
        state of its own lanes.
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
        self._last_checkpoint_bytes = len(msgpack.packb(state, use_bin_type=True))
        return state

    def _aggregated(self) -> bool:
        return self.aggregate_dir is not None or self.aggregate_store is not None

    def _aggregator(self) -> Any:
        if self._agg is None:
            from zephon.checkpoint.aggregate import Aggregator, open_store

            topo = self._topology
            store = open_store(self.aggregate_dir, self.aggregate_store)
            try:
                self._agg = Aggregator(
                    store,
                    rank=topo.rank,
                    world_size=topo.world_size,
                    timeout_s=self.aggregate_timeout_s,
                    expected_lanes=lambda r: _lanes_of_rank(topo, r),
                    merge=merge_states,
                    fingerprint=self.fingerprint(),  # rounds of two pipelines never meet
                )
            except BaseException:
                store.close()
                raise
        return self._agg

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`checkpoint`) on this freshly built pipeline.

        Raises:
            CheckpointError: iteration already began, the state is not a Zephon pipeline
                checkpoint of a supported version, the fingerprint differs, or lanes that
                this rank owns are missing.
        """
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
        mine = self.fingerprint()
        if state.get("fingerprint") != mine:
            raise CheckpointError(
                f"checkpoint fingerprint {str(state.get('fingerprint'))[:12]}… does not match this "
                f"pipeline's {mine[:12]}…: the pipeline definition (source, operators or their "
                "parameters, flush_every_k_chunks) differs from the one that was checkpointed"
            )
        try:
            by_lane = {int(ls["lane"]): ls for ls in state["lanes"]}
            rr = state["round_robin"]
            next_lanes = {int(k): int(v) for k, v in rr["next_lanes"].items()}
            saved_dp_size = int(rr["dp_size"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"malformed checkpoint: {e!r}") from e
        missing = [lane for lane in self.lanes if lane not in by_lane]
        if missing and isinstance(state.get("share"), dict):
            share = state["share"]
            raise CheckpointError(
                f"checkpoint is rank {share.get('rank')}'s share of merged round "
                f"{share.get('round_id')} (its own {len(by_lane)} of "
                f"{share.get('lanes_total')} lanes) and has no state for lanes {missing} that "
                "this rank owns; restore the merged state that rank 0 returned (or saved) "
                "from that round, which holds every lane"
            )
        if missing:
            raise CheckpointError(
                f"checkpoint has no state for lanes {missing} that this rank owns; restore a "
                "merged (all-rank) checkpoint: set aggregate_dir= or aggregate_store="
            )
        self._engine = None
        engine = self._get_engine()
        replayed = 0
        for lane in self.lanes:
            tracker = engine.trackers[lane]
            replayed += tracker.load(by_lane[lane])
            engine.executor.set_target(lane, tracker.cursor)
        engine.replayed_chunks = replayed
        topo = self._topology
        if saved_dp_size == topo.dp_size and topo.dp_rank in next_lanes:
            engine.next_lane = next_lanes[topo.dp_rank]
        else:
            # Another topology: the round-robin turn goes to the least advanced lane, which
            # is where a rank's round-robin would be (ties: the lowest lane).
            live = [lane for lane in self.lanes if not engine.trackers[lane].done] or self.lanes
            engine.next_lane = min(live, key=lambda lane: (engine.trackers[lane].batches, lane))
        self._last_checkpoint_bytes = 0

    # ---------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """Per-operator counts and time, queue fill, in-flight chunks per lane, the last
        checkpoint's size and how many chunks the last restore replayed."""
        st = self._get_engine().stats()
        st["checkpoint_bytes"] = self._last_checkpoint_bytes
        return st

    def close(self) -> None:
        """Stop the pump and release threads, workers and shared memory. Idempotent."""
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
            raise AggregationError(
                f"rank {rank}'s pipeline fingerprint {st['fingerprint'][:12]}… differs from rank 0's "
                f"{first['fingerprint'][:12]}…: every rank must build the same pipeline"
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
