"""The builder users touch: ``Pipeline(source, ...).fetch().tokenize(...)...batch(n)``.

Builder methods return a new Pipeline; nothing runs until the first ``next()`` (or
``checkpoint()``/``explain()``). A Pipeline is its own iterator: iterating it twice continues
the same stream. ``checkpoint()`` returns a plain msgpack-able dict; ``restore(state)`` on a
freshly built, identical pipeline continues exactly where the checkpoint was taken.

This module is that surface and its documentation; the Pipeline delegates the rest: its
arguments' checks to :mod:`zephon.options`, the plan to :mod:`zephon.compile`, the
fingerprint to :mod:`zephon._fingerprint`, the engine and the checkpoint round to
:mod:`zephon.running`, the state's schema to :mod:`zephon.checkpoint.state` and
restore's checks to :mod:`zephon.restoring`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import msgpack
import numpy as np

from zephon._fingerprint import pipeline_fingerprints
from zephon.checkpoint.state import build_state
from zephon.collector import collector_paused
from zephon.compile import Plan, compile_pipeline, explain
from zephon.engine import Engine, closed_error
from zephon.errors import CheckpointError
from zephon.operators.base import Operator
from zephon.operators.batch import Batch
from zephon.operators.ensure_mixture import EnsureMixture
from zephon.operators.fetch import Fetch
from zephon.operators.filter import Filter
from zephon.operators.lm import LmTargets, TrimOrPad
from zephon.operators.map import Map
from zephon.operators.pack import Pack
from zephon.operators.random_map import RandomMap
from zephon.operators.shuffle import Shuffle
from zephon.operators.split import Split
from zephon.operators.tokenize import Tokenize
from zephon.options import (  # the defaults and auto_workers stay importable from here
    AUTO_WORKERS_MAX,
    DEFAULT_PREFETCH,
    DEFAULT_RING_SLOTS,
    auto_workers,
    checked_options,
)
from zephon.restoring import plan_restore
from zephon.runners.lanes import INTERLEAVE
from zephon.running import open_aggregator, skipped_records, start_engine
from zephon.topology import Topology
from zephon.work_sources.mixture_change import (
    MixtureChange,
)

__all__ = ["AUTO_WORKERS_MAX", "DEFAULT_PREFETCH", "DEFAULT_RING_SLOTS", "Pipeline", "auto_workers"]


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
            ``None`` (the default): 3 in process, 0 with workers, whose rings already hold
            up to ``ring_slots`` finished batches each; there a pump thread only competes
            with the workers for the cores (two workers on 2 cores: 55-93% of the best
            throughput with a pump of 3, 100% without; ``python -m benchmarks.ring_depth``).
        ring_slots: with workers, the slots of each worker's shared-memory ring: how many
            batches a worker may have finished ahead of the parent (``None``: 16; 8 slots
            gave 74-75% of the best on the LM workload, 16 gave 100%).
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
        prefetch: int | None = None,
        ring_slots: int | None = None,
        zero_copy: bool = False,
        ring_slot_bytes: int | None = None,
        worker_timeout_s: float = 60.0,
        worker_start_method: str = "spawn",
        seed: int | None = None,
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
            prefetch=prefetch,
            ring_slots=ring_slots,
            zero_copy=zero_copy,
            ring_slot_bytes=ring_slot_bytes,
            worker_timeout_s=worker_timeout_s,
            worker_start_method=worker_start_method,
            seed=seed,
        )
        self._options = options
        self._topology: Topology = options.topology
        self.source = source
        self.canonical_replicas = options.canonical_replicas
        self.flush_every_k_chunks = options.flush_every_k_chunks
        self.workers = options.workers
        self.output = options.output
        self.aggregate_dir = options.aggregate_dir
        self.aggregate_store = options.aggregate_store
        self.aggregate_timeout_s = options.aggregate_timeout_s
        self.prefetch = options.prefetch
        self.ring_slots = options.ring_slots
        self.zero_copy = options.zero_copy
        self.seed = options.seed
        self.ring_slot_bytes = options.ring_slot_bytes
        self.worker_timeout_s = options.worker_timeout_s
        self.worker_start_method = options.worker_start_method
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
        if type(op) is RandomMap and op.stream is None:
            op = copy.copy(op)
            op.stream = sum(type(o) is RandomMap for o in self._ops)
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

    def random_map(
        self, fn: Callable[[Any, np.random.Generator], Any], parallelism: int = 1
    ) -> Pipeline:
        """``fn(data, rng) -> new data`` for every record, ``rng`` a
        :class:`numpy.random.Generator` seeded from the pipeline's ``seed`` and the record's
        identity (lane, chunk id, offset, child), never from processing order: a record
        gets the same numbers with any worker count, world size or restore point.

        Example::

            def mask_tokens(data, rng):
                tokens = data["tokens"].copy()
                tokens[rng.random(len(tokens)) < 0.15] = MASK_ID
                return {**data, "tokens": tokens}

            pipe = pipe.tokenize(tok).random_map(mask_tokens)

        Each ``random_map`` of a pipeline draws from its own stream (the first, the second,
        ... by position), so two of them never share numbers."""
        return self.apply(RandomMap(fn, None, _parallelism(parallelism)))

    def filter(self, pred: Callable[[Any], bool]) -> Pipeline:
        """Keep records whose data satisfies ``pred``; the rest become tombstones."""
        return self.apply(Filter(pred))

    def tokenize(self, tokenizer: Any, field: str | None = None, parallelism: int = 1) -> Pipeline:
        """Returns a pipeline whose samples are tokenized: text (or ``data[field]``, default
        ``"text"``, of a dict sample) becomes ``{"tokens": int32}`` by ``tokenizer.encode``
        (``encode_batch`` when it has one).

        A dict sample keeps its other fields (the text field is replaced by ``tokens``), so
        a document's scalars and per-token arrays reach ``split`` and ``pack``.

        Example usage::

          pipe = zp.Pipeline(src).fetch().tokenize(zp.ByteTokenizer(add_eos=False))
          # a sample {"text": "hi", "loss_weight": 0.5} becomes
          # {"tokens": array([104, 105], dtype=int32), "loss_weight": 0.5}

        Args:
          tokenizer: an object with ``encode(text)`` (``zp.ByteTokenizer``, the Hugging Face
            and sentencepiece adapters).
          field: the text field of dict samples (default ``"text"``).
          parallelism: threads tokenizing slices of a chunk at once.
        """
        return self.apply(Tokenize(tokenizer, field, _parallelism(parallelism)))

    def split(self, max_len: int, feature: str = "tokens") -> Pipeline:
        """Returns a pipeline whose samples are cut into pieces of at most ``max_len``.

        ``feature`` sets the length; every other array of that same length (a per-token
        feature: targets, a loss mask) is cut at the same places, and every other field is
        copied to each piece. Piece ``i`` of ``n`` is child ``i`` of the sample, the last
        flagged, so completion tracking knows when a sample is whole.

        Example usage::

          pipe = pipe.split(max_len=4)
          # {"tokens": [1, 2, 3, 4, 5, 6], "mask": [1, 1, 0, 1, 1, 1], "id": 7} becomes
          # {"tokens": [1, 2, 3, 4], "mask": [1, 1, 0, 1], "id": 7} (child 0) and
          # {"tokens": [5, 6], "mask": [1, 1], "id": 7} (child 1, the last)

        Args:
          max_len: the most tokens per piece.
          feature: the feature whose length is cut (default ``"tokens"``).
        """
        return self.apply(Split(max_len, feature))

    def pack(
        self,
        seq_len: int,
        num_bins: int | None = None,
        features: Sequence[str] = ("tokens",),
        *,
        strategy: str = "first_fit",
        max_segments: int | None = None,
        pad_values: Mapping[str, Any] | None = None,
        meta_features: Sequence[str] = (),
        broadcast: Sequence[str] | Mapping[str, Any] = (),
        component_feature: str | None = None,
        bos_id: int | None = None,
        bos_handling: str | None = None,
        order: str = "filled",
    ) -> Pipeline:
        """Returns a pipeline of rows of ``seq_len`` tokens packed from several pieces.

        Each packed feature ``f`` becomes ``f`` (the pieces concatenated, padded),
        ``f_segment_ids`` (1, 2, ... per piece, 0 on padding) and ``f_positions`` (0, 1, ...
        within each piece), int32 (Grain's names). How pieces are placed:

        * ``"first_fit"`` (default): ``num_bins`` open rows (default 8); a piece goes to the
          lowest row it fits (Grain's ``FirstFitPackIterDataset``);
        * ``"best_fit"``: to the row with the least room that still fits it, the lowest on
          ties (Grain's ``BestFitPackIterDataset``). Either way a row leaves when full
          (``seq_len`` tokens or ``max_segments`` pieces), or, when a piece fits no row, the
          fullest row leaves (lowest on ties) and the piece starts it again.
        * ``"concat_then_split"``: one open row (Grain's ``ConcatThenSplitIterDataset``):
          documents are concatenated and cut at exactly ``seq_len``, so rows are padded only
          at a flush sentinel, at the end of data or by ``max_segments``. No ``split``
          before it: it cuts documents itself, and needs whole samples. As in Grain, a
          document cut across rows continues in the next row as a new segment: segment id
          1 there (the first of that row) and positions restarting at 0.

        Example usage::

          pipe = pipe.tokenize(tok).split(max_len=8).pack(seq_len=8, num_bins=2)
          # pieces [1, 2, 3], [4, 5], [6, 7, 8, 9, 10] give the row
          #   tokens             [1, 2, 3, 4, 5, 0, 0, 0]   (first fit: [1, 2, 3] then [4, 5];
          #   tokens_segment_ids [1, 1, 1, 2, 2, 0, 0, 0]    [6, ..., 10] fits no more there
          #   tokens_positions   [0, 1, 2, 0, 1, 0, 0, 0]    and opens the second row)
          pipe = pipe.tokenize(tok).pack(seq_len=4, strategy="concat_then_split")
          # documents [1, 2, 3], [4, 5, 6] give rows [1, 2, 3, 4] (segment ids [1, 1, 1, 2],
          # positions [0, 1, 2, 0]) and [5, 6, ...] (segment ids [1, 1, ...], positions
          # [0, 1, ...])

        Args:
          seq_len: tokens per row.
          num_bins: open rows (first and best fit; default 8; concat-then-split has one).
          features: the per-token features packed with their own segment ids and positions
            (all of one length in a piece).
          strategy: ``"first_fit"``, ``"best_fit"`` or ``"concat_then_split"``.
          max_segments: at most this many segments per row (Grain's
            ``max_sequences_per_bin``, MaxText's ``max_segments_per_seq``); a row that
            reaches it leaves, padded.
          pad_values: pad value per feature, e.g. ``{"targets": -100}`` (default 0); it must
            be exactly representable in the feature's dtype (``ValueError`` otherwise).
            Segment ids and positions always pad with 0.
          meta_features: per-token features packed alongside (concatenated, padded, cut
            along by concat-then-split) without segment ids or positions (Grain's
            ``meta_features``).
          broadcast: scalar fields of each document (kept by ``tokenize``, copied to every
            piece by ``split``) turned into per-token features of the piece's length and
            packed like meta features, e.g. ``broadcast={"loss_weight": "float32"}`` (a list
            of names keeps each number's own dtype).
          component_feature: if given, the name of an int32 feature holding, per token, the
            index of the mixture component it came from (for loss per dataset).
          bos_id: the BOS token id for ``bos_handling``.
          bos_handling: ``"replace_first_token"`` sets the first token of every segment of
            each packed feature (a document's continuation in the next row included) to
            ``bos_id``, dropping the token that was there (Grain's
            ``BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS``); default None adds nothing.
          order: when rows leave. ``"filled"`` (default, as Grain's packers): as soon as a
            row is emptied (full, or the fullest when a piece fits nowhere). ``"arrival"``:
            the same rows, in the order their first pieces arrived; an emptied row waits
            while an older one is still open (until the next flush at most). First fit lets
            short documents wait in open rows while long ones fill rows at once; in arrival
            order each component's token share of every few batches follows what the work
            source dealt (with ``weight_unit="tokens"``: within 0.5 points of the weights over
            windows of 100 batches in ``benchmarks.mixture_fidelity``, against 1.2 filled).
            It costs the waiting rows' memory (their pieces), never padding.

        Returns:
          A pipeline of dicts of arrays of shape ``(seq_len,)``; a packed record's identity
          is its first piece's.
        """
        if strategy == "concat_then_split":
            splits = [op for op in self._ops if isinstance(op, Split)]
            if splits:
                raise ValueError(
                    f"pack(strategy='concat_then_split') cuts documents itself and needs whole "
                    f"samples; remove {splits[-1]!r} before it"
                )
        return self.apply(
            Pack(
                seq_len,
                num_bins,
                features,
                strategy=strategy,
                max_segments=max_segments,
                pad_values=pad_values,
                meta_features=meta_features,
                broadcast=broadcast,
                component_feature=component_feature,
                bos_id=bos_id,
                bos_handling=bos_handling,
                order=order,
            )
        )

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

    def lm_targets(
        self, feature: str = "tokens", ignore_id: int = -100, names: str = "zephon"
    ) -> Pipeline:
        """Next-token layout on packed rows: ``inputs`` (the tokens), ``targets``
        (``targets[i]`` is token ``i + 1`` when it is of the same segment; ``ignore_id`` at
        a segment's last token, on padding and at the row's end), their segment ids and
        positions. A document cut across two rows (``split`` or ``concat_then_split``) has
        no target at its piece's last token: the next token is in another row.

        ``names="zephon"``: ``inputs``, ``targets``, ``inputs_segment_ids``,
        ``inputs_positions``, ``targets_segment_ids``, ``targets_positions``;
        ``names="maxtext"``: ``inputs_segmentation``, ``inputs_position``,
        ``targets_segmentation``, ``targets_position`` (MaxText's model inputs). The
        targets' segment ids are 0 wherever the target is ``ignore_id``: a loss mask.
        Unlike MaxText's ``ShiftData``, which shifts across segment boundaries (a
        segment's last token is trained to predict the next document's first token unless
        that token is an ignored id), no target crosses a document boundary. Other
        features pass through.

        Example::

            pipe = pipe.tokenize(tok).pack(2048, strategy="best_fit").lm_targets(
                ignore_id=0, names="maxtext").batch(8)
            # batch["targets"][r, i] == batch["inputs"][r, i + 1] where
            # batch["targets_segmentation"][r, i] != 0

        Needs ``feature``, ``feature_segment_ids`` and ``feature_positions`` (made by
        ``pack`` or ``trim_or_pad``); may run before or after ``batch``."""
        return self.apply(LmTargets(feature, ignore_id, names))

    def trim_or_pad(
        self, max_len: int, pad_values: Mapping[str, Any] | None = None, feature: str = "tokens"
    ) -> Pipeline:
        """The non-packed path (MaxText's ``PadOrTrimToMaxLength``): every per-token feature
        (a 1-D array as long as ``feature``) cut to ``max_len`` or padded to it with its
        pad value (``pad_values``, default 0), plus ``{feature}_segment_ids`` (1 on real
        tokens, 0 on padding), ``{feature}_positions`` and a boolean ``{feature}_mask``.

        Example::

            pipe = pipe.tokenize(tok).trim_or_pad(512, pad_values={"tokens": PAD_ID})
            # {"tokens": int32[512], "tokens_segment_ids": ..., "tokens_positions": ...,
            #  "tokens_mask": bool[512]}

        Tokens past ``max_len`` are dropped (use ``split`` to keep them as more rows)."""
        return self.apply(TrimOrPad(max_len, pad_values, feature))

    def batch(
        self,
        batch_size: int,
        drop_last: bool = True,
        pad_last: bool = False,
        pad_values: Mapping[str, Any] | None = None,
    ) -> Pipeline:
        """Stack ``batch_size`` records of one lane into numpy arrays.

        Args:
            batch_size: records per lane batch (``output="lockstep"``: per lane of a step).
            drop_last: drop a lane's last partial batch (False: deliver it short).
            pad_last: pad a lane's last partial batch to ``batch_size`` with padding rows
                and add a boolean ``batch_mask`` feature (True on real rows) to every batch,
                so every batch has one shape. In ``lockstep``, lanes that ended contribute
                padding rows (mask False) until every lane of the rank has ended: an eval
                pass delivers every record exactly once. Overrides ``drop_last``.
            pad_values: a padding row's value per feature (default: what the operators
                before pad with, such as ``pack(pad_values=...)`` and ``lm_targets``'s
                ``ignore_id`` for ``targets``; else 0).

        Example::

            pipe = pipe.pack(1024).lm_targets().batch(8, pad_last=True)
            for b in pipe:                 # b["inputs"]: int32[8, 1024]
                loss = step(b, weights=b["batch_mask"])

        The checkpoint cut is on records, before ``batch``: a checkpoint restores into a
        pipeline that differs only in ``batch``'s parameters, whose stream goes on from
        the same record batched the new way (in ``lockstep``, a step then holds every
        lane's next ``batch_size`` records)."""
        if pad_values is None and pad_last:
            pad_values = _upstream_pads(self._ops)
        return self.apply(Batch(batch_size, drop_last, pad_last, pad_values))

    # ------------------------------------------------------------- compile
    @property
    def lanes(self) -> list[int]:
        """The lanes this rank owns."""
        return self._topology.lanes

    def _compiled(self) -> Plan:
        if self._plan is None:
            self._plan = compile_pipeline(
                self._ops,
                self.source,
                flush_every_k_chunks=self.flush_every_k_chunks,
                workers=self.workers,
                prefetch=self.prefetch,
                ring_slots=self.ring_slots,
                seed=self.seed,
                lanes=len(self._topology.lanes),
            )
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
        return self._engine

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
        return self.aggregate(self.local_checkpoint())

    def local_checkpoint(self) -> dict[str, Any]:
        """This rank's own state at its last delivered batch, without a checkpoint round
        (cheap; what :meth:`checkpoint` merges across ranks)."""
        plan = self._compiled()
        topo = self._topology
        engine = self._get_engine()
        with collector_paused():  # an acyclic value of thousands of dicts: see the module
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
        by_lane, holds, next_lane, change = plan_restore(self, state, allow_mixture_change)
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        engine = self._get_engine()
        try:
            # Another topology: the engine gives the turn to the least advanced lane.
            engine.restore(by_lane, holds, next_lane)
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
        batches, a ``DataStallWarning`` names the knobs, once per run."""
        st = self._get_engine().stats()
        if isinstance(self._last_checkpoint, dict):
            self._last_checkpoint = len(msgpack.packb(self._last_checkpoint, use_bin_type=True))
        st["checkpoint_bytes"] = self._last_checkpoint
        st["skipped_records"] = skipped_records(self.source)
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


def _upstream_pads(ops: Sequence[Operator]) -> dict[str, Any]:
    """The pad value per feature that the operators declare (``pad_values``), later ones
    winning: what a padding row of ``batch(pad_last=True)`` holds."""
    pads: dict[str, Any] = {}
    for op in ops:
        declared = getattr(op, "pad_values", None)
        if isinstance(declared, Mapping):
            pads.update(declared)
    return pads


def _parallelism(p: int) -> int:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"parallelism must be a positive int; got {p!r}")
    return p
