"""Operators to a plan: eviction mode, flush cadence, replay-filter placement, stages.

The compiler decides three things from the operators' traits:

* eviction: ``monotone`` when every operator preserves cursor order, ``epoch`` otherwise;
* ``flush_every_k_chunks``: ``None`` means 4 for epoch mode and 0 for monotone; an explicit
  0 on an epoch pipeline is an error, an explicit positive value on a monotone one is forced
  to 0 with a warning (sentinels would perturb batch boundaries for nothing);
* where the replay filter goes: right before ``batch``, else at the tail.

Stages group consecutive operators by mode: order-preserving stateless operators run in
``microbatches`` (a chunk at a time, on threads when their parallelism asks for it);
history-dependent ones in ``stream_items``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from zephon.operators.base import Operator
from zephon.replay import ReplayFilter
from zephon.tracking import EPOCH, MONOTONE

DEFAULT_FLUSH_EVERY_K_CHUNKS = 4
MICROBATCHES = "microbatches"
STREAM_ITEMS = "stream_items"


@dataclass
class Stage:
    index: int
    place: str
    runner: str
    cap: int
    mode: str
    ops: list[Operator]


@dataclass
class Plan:
    ops: list[Operator]
    stages: list[Stage]
    eviction: str
    flush_every_k_chunks: int
    filter_index: int
    in_q: int
    stage_out: int
    final_prefetch: int
    workers: int

    @property
    def replay_filter(self) -> ReplayFilter:
        op = self.ops[self.filter_index]
        assert isinstance(op, ReplayFilter)
        return op


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


def compile_plan(
    ops: list[Operator],
    *,
    flush_every_k_chunks: int | None,
    workers: int,
    prefetch: int,
    chunk_size: int,
) -> Plan:
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

    place = "worker" if workers > 0 else "local"
    stages: list[Stage] = []
    for op in full:
        mode = op_mode(op)
        if stages and stages[-1].mode == mode:
            stages[-1].ops.append(op)
        else:
            stages.append(Stage(len(stages), place, "inline", 1, mode, [op]))
    for st in stages:
        cap = max(op.parallelism for op in st.ops)
        if st.mode == MICROBATCHES and cap > 1:
            st.runner, st.cap = "threads", cap
    return Plan(
        ops=full,
        stages=stages,
        eviction=eviction,
        flush_every_k_chunks=k,
        filter_index=at,
        in_q=chunk_size,
        stage_out=chunk_size,
        final_prefetch=prefetch,
        workers=workers,
    )


def explain(plan: Plan) -> str:
    lines = []
    for st in plan.stages:
        runner = "processes" if plan.workers > 0 else st.runner
        lines.append(
            f"Stage[{st.index}] place={st.place} runner={runner} cap={st.cap} mode={st.mode}"
        )
        sep = f" -[in_q={plan.in_q}]-> " if st.mode == MICROBATCHES else " -> "
        lines.append("  " + sep.join(f"{op.name}@p{op.parallelism}" for op in st.ops))
        if st.index < len(plan.stages) - 1:
            lines.append(f"  --[stage_out={plan.stage_out}]-->")
    lines.append(f"  ==[final_prefetch={plan.final_prefetch}]==> pipeline_end")
    lines.append(
        f"eviction={plan.eviction} flush_every_k_chunks={plan.flush_every_k_chunks}"
        + (f" workers={plan.workers}" if plan.workers else "")
    )
    return "\n".join(lines)
