"""The end of a finite stream, with any number of worker processes.

For every lane count, ``drop_last``, output mode and kind of pipeline (order-keeping,
shuffling, packing): the stream of 1, 2 and 3 workers equals the in-process one, in
interleave every sample is delivered exactly once (with ``drop_last=True``: at most once,
only lanes' final partial batches missing), ``StopIteration`` follows the last batch at
once and again on every later call, and a checkpoint taken three batches before the end
restores into another worker count and yields the same tail and the same end. The end
says once how many records ``drop_last`` dropped (nothing when it dropped none), and a
second loop over an ended pipeline is an error.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.checkpoint.io import dumps, loads

pytestmark = pytest.mark.processes

N_SAMPLES = 203
BATCH = 4
KINDS = ("plain", "shuffle", "pack")
#: After a checkpoint in a run with w workers, the restore runs with this many.
RESTORE_INTO = {0: 1, 1: 2, 2: 3, 3: 0}
#: The end of a stream does not depend on how workers start; a fork server starts them
#: fastest (spawn, the default, is what the other worker tests use).
START_METHOD = "forkserver"


def _tokens(i: Any) -> dict[str, np.ndarray]:
    # Every token of sample i is i + 1: what a packed row holds says which samples it has.
    return {"tokens": np.full(int(i) % 11 + 1, int(i) + 1, dtype=np.int32)}


def build(kind: str, lanes: int, drop_last: bool, output: str, workers: int) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(np.arange(N_SAMPLES))], seed=3, chunk_size=8, num_epochs=1
    )
    pipe = zp.Pipeline(
        src,
        canonical_replicas=lanes,
        flush_every_k_chunks=None if kind == "plain" else 2,
        workers=workers,
        output=output,
        worker_timeout_s=30,
        worker_start_method=START_METHOD,
    ).fetch()
    if kind == "shuffle":
        pipe = pipe.shuffle(buffer_size=6)
    elif kind == "pack":
        pipe = pipe.map(_tokens).split(max_len=8).pack(seq_len=8, num_bins=3)
    return pipe.batch(BATCH, drop_last=drop_last)


def run(pipe: zp.Pipeline, checkpoint_at: int | None = None) -> tuple[list[Any], Any, float]:
    """Every batch to the end, the state after ``checkpoint_at`` batches, and the seconds
    from the last batch to StopIteration."""
    batches, state, ended_s, _ = run_warned(pipe, checkpoint_at)
    return batches, state, ended_s


def run_warned(
    pipe: zp.Pipeline, checkpoint_at: int | None = None
) -> tuple[list[Any], Any, float, list[str]]:
    """:func:`run`, and the DroppedRecordsWarnings the end gave (their messages)."""
    batches: list[Any] = []
    state = None
    last = time.monotonic()
    with pipe, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", zp.DroppedRecordsWarning)
        while True:
            if checkpoint_at is not None and len(batches) == checkpoint_at:
                state = loads(dumps(pipe.checkpoint()))  # as saved: msgpack + zstd
            try:
                batches.append(next(pipe))
            except StopIteration:
                ended_s = time.monotonic() - last
                break
            last = time.monotonic()
        for _ in range(3):  # and again on every later call
            with pytest.raises(StopIteration):
                next(pipe)
        with pytest.raises(zp.PipelineEndedError, match="build a new pipeline"):
            for _ in pipe:  # a second pass over an ended pipeline is an error, not nothing
                pass
    dropped = [str(w.message) for w in caught if issubclass(w.category, zp.DroppedRecordsWarning)]
    return batches, state, ended_s, dropped


def _length(sample: int) -> int:
    return sample % 11 + 1


def samples_of(kind: str, batches: list[Any]) -> Counter[int]:
    """How many times each sample was delivered; for ``pack``, how many of its tokens."""
    seen: Counter[int] = Counter()
    for b in batches:
        if kind == "pack":
            tokens = b["tokens"][b["tokens"] != 0]
            values, n = np.unique(tokens, return_counts=True)
            seen.update({int(v) - 1: int(c) for v, c in zip(values, n, strict=True)})
        else:
            seen.update(int(x) for x in np.asarray(b).ravel())
    return seen


def same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, dict):
            if x.keys() != y.keys() or not all(np.array_equal(x[k], y[k]) for k in x):
                return False
        elif not np.array_equal(x, y):
            return False
    return True


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("output", ["interleave", "lockstep"])
@pytest.mark.parametrize("drop_last", [True, False], ids=["drop_last", "keep_last"])
@pytest.mark.parametrize("lanes", [1, 2, 3, 5])
def test_the_end_of_a_finite_stream_is_the_same_with_any_worker_count(
    lanes: int, drop_last: bool, output: str, kind: str
) -> None:
    expected, _, _, warned = run_warned(build(kind, lanes, drop_last, output, 0))
    assert expected
    at = max(0, len(expected) - 3)
    if not drop_last:
        assert not warned, "nothing was dropped, yet the end warned"
    assert len(warned) <= 1, f"the end warned more than once: {warned}"
    if output == "interleave":
        seen = samples_of(kind, expected)
        want = {i: _length(i) if kind == "pack" else 1 for i in range(N_SAMPLES)}
        over = [i for i in seen if seen[i] > want[i]]
        assert not over, f"samples delivered twice: {over[:5]}"
        short = sum(want[i] - seen[i] for i in want)
        if not drop_last:
            assert short == 0, "samples lost at the end"
        else:  # only the lanes' final partial batches
            assert short < lanes * BATCH * (8 if kind == "pack" else 1)
            # ... and the end says how many (records: a packed row holds several samples)
            if kind != "pack":
                said = f"dropped {short} record{'s' if short != 1 else ''}: "
                assert bool(short) == bool(warned), (short, warned)
                assert not warned or said in warned[0], (said, warned)
                assert not warned or "drop_last=False" in warned[0] and "pad_last=True" in warned[0]
    for workers in (0, 1, 2, 3):
        where = f"{lanes} lanes, {workers} workers"
        got, state, ended_s = run(build(kind, lanes, drop_last, output, workers), at)
        assert same(got, expected), f"{where}: the stream differs from the in-process one"
        # The end arrives at once: a hang would wait out worker_timeout_s (30 s).
        assert ended_s < 2.0, f"{where}: StopIteration came {ended_s:.1f} s after the last batch"
        into = RESTORE_INTO[workers]
        tail, _, _ = run_restored(build(kind, lanes, drop_last, output, into), state)
        assert same(tail, expected[at:]), (
            f"{where}: restored into {into} workers at batch {at} of {len(expected)}, "
            "the tail differs"
        )


def run_restored(pipe: zp.Pipeline, state: Any) -> tuple[list[Any], Any, float]:
    pipe.restore(state)
    return run(pipe)
