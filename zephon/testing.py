"""Checks that a pipeline resumes exactly, for Zephon's tests and for custom operators.

``assert_resumes_exactly(build)`` runs the pipeline that ``build()`` makes without stopping,
then for each cut point: runs a fresh one to the cut, checkpoints (through the file format),
restores into another fresh one and checks that the remaining batches are equal bit for bit,
and that a checkpoint taken right after the restore equals the restored state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from zephon.checkpoint import dumps, loads
from zephon.checkpoint.state import merge_states
from zephon.errors import DroppedRecordsWarning
from zephon.pipeline.pipeline import Pipeline

Build = Callable[[], Pipeline]


def take(pipe: Pipeline, n: int | None = None) -> list[Any]:
    """Up to ``n`` batches (all remaining when ``n`` is None).

    The helpers here run pipelines to their end again and again on purpose: the
    :class:`~zephon.DroppedRecordsWarning` a pipeline gives at its end (``batch`` dropped
    its lanes' last partial batches) is not theirs to repeat, and they leave it out."""
    out: list[Any] = []
    if n is not None and n <= 0:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedRecordsWarning)
        for batch in pipe:
            out.append(batch)
            if n is not None and len(out) >= n:
                break
    return out


def batches_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
        )
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and np.array_equal(a, b)


def assert_same_batches(expected: Sequence[Any], got: Sequence[Any], context: str = "") -> None:
    where = f" ({context})" if context else ""
    if len(expected) != len(got):
        raise AssertionError(f"expected {len(expected)} batches, got {len(got)}{where}")
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if not batches_equal(a, b):
            raise AssertionError(f"batch {i} differs{where}")


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Through the on-disk format, so tests exercise exactly what a resume reads."""
    return loads(dumps(state))


def assert_resumes_exactly(
    build: Build,
    *,
    cuts: Iterable[int] | None = None,
    limit: int | None = None,
    reference: Sequence[Any] | None = None,
    restore_build: Build | None = None,
) -> list[Any]:
    """Check resume at every cut (default: every step, and the end) against a reference run.

    Args:
        build: makes a fresh, identical pipeline each call.
        cuts: steps to checkpoint at; steps past the end mean "after exhaustion".
        limit: compare at most this many batches (for infinite streams).
        reference: the uninterrupted run's batches, if already computed.
        restore_build: builds the pipeline to restore into (default ``build``): another
            ``workers`` count, say. It must yield the same batch order.

    Returns:
        The reference batches.
    """
    if reference is None:
        with build() as ref_pipe:
            reference = take(ref_pipe, limit)
    total = len(reference)
    cut_list = sorted(set(range(total + 1) if cuts is None else cuts))
    for cut in cut_list:
        cut = min(cut, total)
        with build() as first:
            head = take(first, cut) if cut else []
            assert_same_batches(reference[:cut], head, f"head before cut {cut}")
            state = roundtrip(first.checkpoint())
        with (restore_build or build)() as second:
            second.restore(state)
            again = roundtrip(second.checkpoint())
            if again != state:
                raise AssertionError(
                    f"checkpoint right after restore differs from the restored state (cut {cut})"
                )
            tail = take(second, total - cut)
            assert_same_batches(reference[cut:], tail, f"after restoring at step {cut}")
    return list(reference)


def assert_resumes_through_breaks(
    build: Build, breaks: Sequence[int], *, limit: int | None = None
) -> None:
    """Stop and resume at several steps in one run; the concatenation equals the reference."""
    with build() as ref_pipe:
        reference = take(ref_pipe, limit)
    got: list[Any] = []
    state: dict[str, Any] | None = None
    prev = 0
    for stop in [*sorted(breaks), len(reference)]:
        with build() as pipe:
            if state is not None:
                pipe.restore(state)
            got.extend(take(pipe, stop - prev) if stop > prev else [])
            state = roundtrip(pipe.checkpoint())
        prev = stop
    assert_same_batches(reference, got, f"breaks at {list(breaks)}")


def global_batches(
    build: Callable[[int, int], Pipeline],
    world_size: int,
    steps: int,
    state: dict[str, Any] | None = None,
) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
    """A job of ``world_size`` ranks in this process, for checks across rank counts:
    ``build(rank, world_size)`` makes a rank's pipeline (with ``output="lockstep"``), each
    restored from ``state`` when given; returns ``steps`` global batches (the ranks' batches
    of a step concatenated in rank order) and the ranks' states after them, merged as a
    checkpoint round merges them (through the file format).

    Example::

        head, state = global_batches(build, 2, 3)   # 3 steps on 2 ranks
        tail, _ = global_batches(build, 1, 4, state)  # then 4 on 1 rank
        reference, _ = global_batches(build, 1, 7)
        assert_same_batches(reference, head + tail)
    """
    pipes = [build(rank, world_size) for rank in range(world_size)]
    try:
        if state is not None:
            for p in pipes:
                p.restore(state)
        out = [
            {k: np.concatenate([b[k] for b in bs]) for k in bs[0]}
            for bs in ([next(p) for p in pipes] for _ in range(steps))
        ]
        return out, merge_states([roundtrip(p.checkpoint()) for p in pipes])
    finally:
        for p in pipes:
            p.close()
