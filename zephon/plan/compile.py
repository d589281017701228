"""Operators to a plan: eviction mode, flush cadence, replay-filter placement, and what runs.

The compiler decides from the operators' traits:

* eviction: ``monotone`` when every operator preserves cursor order, ``epoch`` otherwise;
* ``flush_every_k_chunks``: ``None`` means 4 for epoch mode and 0 for monotone; an explicit
  0 on an epoch pipeline is an error, an explicit positive value on a monotone one is forced
  to 0 with a warning (sentinels would perturb batch boundaries for nothing);
* where the replay filter goes: right before ``batch``, else at the tail;

and what the runners execute (:meth:`Plan.build`): a head that turns a work chunk into
records (reading its samples when the pipeline starts with a built-in ``fetch`` on one
thread) and one step per operator, except where ``[tokenize ->] split -> pack`` on
``"tokens"`` run as one fused stage (:class:`~zephon.operators.pack.fused.SplitPack`), which
the replay filter lets know which lanes are replaying; when that stage takes the head's
pre-tokenized samples, the head reads documents of token files as spans of the mapped
files (:attr:`Plan.spans`). ``explain()`` prints exactly that, with where it runs (the
pipeline's options: worker processes, rings, prefetch), which a plan does not keep.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from zephon.operators.base import Operator, PipelineContext
from zephon.operators.batch import Batch
from zephon.operators.fetch import Fetch
from zephon.operators.pack.fused import SplitPack, fusable
from zephon.operators.replay import ReplayFilter, ReplayView
from zephon.plan.read import ReadChunks
from zephon.plan.steps import Step, operator_step
from zephon.tracking.tracker import EPOCH, MONOTONE

DEFAULT_FLUSH_EVERY_K_CHUNKS = 4
MICROBATCHES = "microbatches"
STREAM_ITEMS = "stream_items"


@dataclass
class Plan:
    """A compiled pipeline: its operators (the replay filter included) and what runs.
    Only what compiling decides: the pipeline's options stay the pipeline's (what runs the
    plan reads them from :mod:`zephon.pipeline.options`).

    Attributes:
        ops: the operators, the replay filter at ``filter_index``.
        reads: the head reads each chunk's samples with ``ops[0]`` (a built-in fetch on
            this thread); otherwise records of pointers go to ``ops[0]``.
        fused: ``(first, count)`` of each run of operators one fused stage stands for.
        padding: the index of the operator that makes padding batches for lanes that ended
            (``batch(pad_last=True)``), or ``None``.
        readers: the indices of the operators that read samples (``fetch``), whose I/O
            retries the runners count.
        hold_text: a fused ``tokenize, split, pack`` stage keeps the samples waiting in its
            bins and rows as their text and token counts, tokenizing a sample when its
            row is assembled (where the tokenizer can count tokens), instead of holding
            their tokens: chosen when one process runs :data:`HOLD_TEXT_LANES` lanes or
            more (an elastic shrink onto few hosts), where every lane's held tokens add up;
            the batches are the same.
        spans: the head reads the documents of datasets that offer token spans (token
            files: :mod:`zephon.sources.token_span`) as spans of their mapped files,
            copied once, into their rows: chosen where a fused ``split, pack`` (no
            tokenize) takes what the head reads, which only that stage ever sees.
    """

    ops: list[Operator]
    eviction: str
    flush_every_k_chunks: int
    filter_index: int
    reads: bool
    fused: tuple[tuple[int, int], ...]
    padding: int | None
    readers: tuple[int, ...]
    hold_text: bool = False
    spans: bool = False

    def build(self, ops: list[Operator]) -> tuple[ReadChunks, list[Step]]:
        """The head and the steps that run ``ops`` (fresh copies of :attr:`ops`, index for
        index): what a runner executes."""
        head = ReadChunks(ops[0] if self.reads else None, self.spans)  # type: ignore[arg-type]
        view = ReplayView(ops[self.filter_index].targets)  # type: ignore[attr-defined]
        fused = dict(self.fused)
        steps: list[Step] = []
        i = head.start
        while i < len(ops):
            n = fused.get(i, 0)
            if not n:
                steps.append(operator_step(ops[i], i))
                i += 1
                continue
            run = ops[i : i + n]
            stage = SplitPack(run[0] if n == 3 else None, run[-2], run[-1])  # type: ignore[arg-type]
            stage.replay = view
            stage.hold_text = self.hold_text and stage.can_hold_text
            name = "+".join(op.name for op in run) + ("[text]" if stage.hold_text else "")
            steps.append(Step(stage, tuple(range(i, i + n)), name))
            i += n
        return head, steps


def op_mode(op: Operator) -> str:
    t = op.traits
    return MICROBATCHES if t.preserves_cursor_order and not t.stateful else STREAM_ITEMS


def resolve_flush(ops: list[Operator], flush_every_k_chunks: int | None) -> tuple[str, int]:
    reorderers = [op.name for op in ops if not op.traits.preserves_cursor_order]
    if not reorderers:
        if flush_every_k_chunks:
            warnings.warn(
                f"flush_every_k_chunks={flush_every_k_chunks} ignored: every operator preserves "
                "cursor order, so the pipeline evicts by watermark and flush sentinels would only "
                "perturb batch boundaries; using 0",
                UserWarning,
                stacklevel=4,
            )
        return MONOTONE, 0
    if flush_every_k_chunks is None:
        return EPOCH, DEFAULT_FLUSH_EVERY_K_CHUNKS
    if not isinstance(flush_every_k_chunks, int) or flush_every_k_chunks <= 0:
        raise ValueError(
            f"flush_every_k_chunks must be > 0 for a pipeline with reordering operators "
            f"({', '.join(reorderers)}); got {flush_every_k_chunks!r}. Without flush sentinels "
            "their state depends on unbounded history and nothing could ever be evicted"
        )
    return EPOCH, flush_every_k_chunks


#: Lanes one process runs from which fused stages hold samples as text (see
#: :attr:`Plan.hold_text`): about 220 KB of tokens a lane held for the LM workload, so
#: 225 MB at this many.
HOLD_TEXT_LANES = 1024


def compile_plan(
    ops: list[Operator], *, flush_every_k_chunks: int | None, lanes_per_process: int = 1
) -> Plan:
    """The plan of ``ops`` with the flush cadence the pipeline asks for, for processes
    that run ``lanes_per_process`` lanes each (derived from the rank's lanes and worker
    processes)."""
    batch_at = [i for i, op in enumerate(ops) if op.name == "batch"]
    if len(batch_at) > 1:
        raise ValueError(f"a pipeline may have one batch operator; got {len(batch_at)}")
    if batch_at and batch_at[0] != len(ops) - 1:
        after = ", ".join(op.name for op in ops[batch_at[0] + 1 :])
        raise ValueError(
            f"batch must be the last operator; got {after} after it. Apply per-batch work in "
            "your training loop, or move it before .batch()"
        )
    eviction, k = resolve_flush(ops, flush_every_k_chunks)
    if batch_at:
        at, name = batch_at[0], "batch_replay_filter"
    else:
        at, name = len(ops), f"{ops[-1].name}_replay_filter" if ops else "replay_filter"
    full = [*ops[:at], ReplayFilter(name, monotone=eviction == MONOTONE), *ops[at:]]
    # A pool exists when some operator asks for threads; a tokenize that does keeps them.
    threaded = max((op.parallelism for op in full), default=1) > 1
    reads = type(full[0]) is Fetch and full[0].parallelism <= 1
    last = ops[batch_at[0]] if batch_at else None
    padding = at + 1 if isinstance(last, Batch) and last.pad_last else None
    fused: list[tuple[int, int]] = []
    i = 1 if reads else 0
    while i < len(full):
        n = fusable(full, i, threaded)
        if n:
            fused.append((i, n))
        i += max(n, 1)
    # The fused stage right after the head, without a tokenize, takes what it reads.
    spans = reads and bool(fused) and fused[0] == (1, 2)
    return Plan(
        ops=full,
        eviction=eviction,
        flush_every_k_chunks=k,
        filter_index=at,
        reads=reads,
        fused=tuple(fused),
        padding=padding,
        readers=tuple(i for i, op in enumerate(full) if isinstance(op, Fetch)),
        hold_text=lanes_per_process >= HOLD_TEXT_LANES,
        spans=spans,
    )


def compile_pipeline(
    ops: Sequence[Operator],
    source: Any,
    *,
    flush_every_k_chunks: int | None,
    seed: int | None,
    lanes_per_process: int = 1,
) -> Plan:
    """The plan of a pipeline's operators (fresh copies of ``ops``) over the work source
    ``source`` (see :func:`compile_plan`), every operator bound to the source's context:
    its datasets, weights and names, and ``seed`` (None: the source's)."""
    if not ops:
        raise ValueError("the pipeline has no operators; add at least .fetch()")
    plan = compile_plan(
        [op.fresh() for op in ops],
        flush_every_k_chunks=flush_every_k_chunks,
        lanes_per_process=lanes_per_process,
    )
    ctx = PipelineContext(
        datasets=tuple(getattr(source, "datasets", ())),
        weights=getattr(source, "weights", None),
        seed=seed if seed is not None else int(getattr(source, "seed", 0)),
        num_components=int(getattr(source, "num_components", 0)),
        names=tuple(getattr(source, "names", ())),
    )
    for op in plan.ops:
        op.bind(ctx)
    return plan


class Placement(Protocol):
    """Where a plan runs, as :func:`explain` shows it: the pipeline's options
    (:class:`~zephon.pipeline.options.Options`) under their names."""

    @property
    def workers(self) -> int: ...

    @property
    def ring_slots(self) -> int: ...

    @property
    def prefetch(self) -> int: ...


def explain(plan: Plan, where: Placement, chunk_size: int) -> str:
    """The plan as it runs ``where``, in the seed page's format: stages of consecutive
    steps of one mode (``microbatches``: order-keeping stateless steps, a chunk's records
    at a time; ``stream_items``: history-dependent ones), each step as ``name@pN`` (a fused
    stage names its operators with ``+``), ``in_q`` the records a step hands the next at
    once (a chunk of ``chunk_size``), then the worker rings and the consumer's prefetch."""
    head, steps = plan.build(plan.ops)
    entries: list[tuple[str, str, int]] = []  # (mode, shown name, parallelism)
    if head.fetch is not None:
        entries.append((MICROBATCHES, "fetch[spans]" if head.spans else "fetch", 1))
    for step in steps:
        mode = STREAM_ITEMS if step.counts_itself else op_mode(step.run)
        entries.append((mode, step.name, step.run.parallelism))
    stages: list[list[tuple[str, str, int]]] = []
    for entry in entries:
        if stages and stages[-1][0][0] == entry[0]:
            stages[-1].append(entry)
        else:
            stages.append([entry])
    workers = where.workers
    remote = getattr(where, "remote", None) is not None  # zp.RayWorkers: lanes on actors
    place = "ray" if remote else "worker" if workers > 0 else "local"
    lines = []
    for index, stage in enumerate(stages):
        mode = stage[0][0]
        cap = max(p for _, _, p in stage) if mode == MICROBATCHES else 1
        runner = (
            "ray"
            if remote
            else "processes"
            if workers > 0
            else ("threads" if cap > 1 else "inline")
        )
        if workers > 0:
            cap = workers  # a worker runs every step of its lanes
        lines.append(f"Stage[{index}] place={place} runner={runner} cap={cap} mode={mode}")
        sep = f" -[in_q={chunk_size}]-> " if mode == MICROBATCHES else " -> "
        lines.append("  " + sep.join(f"{name}@p{p}" for _, name, p in stage))
        if index < len(stages) - 1:
            lines.append(f"  --[stage_out={chunk_size}]-->")
    if remote:
        lines.append("  ==[Ray object store, per lane]==> parent")
    elif workers > 0:
        lines.append(f"  ==[ring_slots={where.ring_slots} per worker]==> parent")
    lines.append(f"  ==[final_prefetch={where.prefetch}]==> pipeline_end")
    lines.append(
        f"eviction={plan.eviction} flush_every_k_chunks={plan.flush_every_k_chunks}"
        + (f" workers={workers}" if workers else "")
    )
    return "\n".join(lines)
