"""A pipeline that is closed, or dropped, is freed at once by reference counting: no
reference cycle is left for the garbage collector, whose passes over a dead pipeline's
objects would otherwise land, milliseconds long, in some later step of the training loop."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

import zephon as zp
from zephon.testing import take

DOCS = [("word " * ((i * 37) % 90)) + str(i) for i in range(300)]


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _pipe(prefetch: int) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource([zp.ArraySource(DOCS)], seed=1, chunk_size=16)
    return (
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2, prefetch=prefetch)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(max_len=64)
        .pack(seq_len=64, num_bins=3)
        .batch(2)
    )


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_a_finished_pipeline_is_freed_without_the_garbage_collector(
    no_gc: None, prefetch: int, how: str
) -> None:
    p = _pipe(prefetch)
    take(p, 5)
    state = p.checkpoint()
    q = _pipe(prefetch)
    q.restore(state)
    take(q, 3)
    engines = [weakref.ref(p._engine), weakref.ref(q._engine)]
    if how == "closed":
        p.close()
        q.close()
    del p, q
    assert [e() for e in engines] == [None, None]


def _small(workers: int, prefetch: int) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(500))], seed=0, chunk_size=8)
    pipe = zp.Pipeline(src, canonical_replicas=2, workers=workers, prefetch=prefetch)
    return pipe.fetch().shuffle(buffer_size=4).batch(4)


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.processes)])
@pytest.mark.parametrize("taken", [0, 1, 5])
def test_next_after_close_is_one_clear_error(workers: int, prefetch: int, taken: int) -> None:
    with _small(0, 0) as ref:
        expected = take(ref, taken + 3)[taken:]
    pipe = _small(workers, prefetch)
    for _ in range(taken):
        next(pipe)
    pipe.close()
    for _ in range(3):  # every time, never a batch
        with pytest.raises(zp.PipelineClosedError, match=r"the pipeline is closed: next\(\) after"):
            next(pipe)
    state = pipe.checkpoint()  # the state at the last delivered batch stays readable
    with pytest.raises(zp.PipelineClosedError):
        pipe.restore(state)
    with _small(0, 0) as again:
        again.restore(state)
        assert all(np.array_equal(a, b) for a, b in zip(take(again, 3), expected, strict=True))


_LEFT_OPEN = """
import atexit, threading

@atexit.register  # registered before zephon's handler, so it runs after it
def _pumps_left():
    alive = [t.name for t in threading.enumerate() if t.name == "zephon-pump" and t.is_alive()]
    print("pumps alive at exit:", len(alive), flush=True)

import zephon as zp

src = zp.StaticMixtureWorkSource([zp.ArraySource([f"doc {i} " * 20 for i in range(500)])], seed=0)
pipe = (zp.Pipeline(src, canonical_replicas=2, prefetch=2).fetch().tokenize(zp.ByteTokenizer())
        .split(max_len=32).pack(seq_len=32).batch(4))
next(pipe)
next(pipe)  # the prefetch pump runs from the second output on
print("pumping:", any(t.name == "zephon-pump" for t in threading.enumerate()), flush=True)
# no close(): the interpreter exits with the pipeline open
"""


def test_an_open_pipeline_s_prefetch_thread_is_stopped_before_the_interpreter_exits() -> None:
    # A daemon pump still inside a tokenizer's C++ when the interpreter finalizes aborted the
    # process ("terminate called without an active exception", 5 runs in 10 with
    # SentencePieceTokenizer): an atexit handler closes every engine whose pump runs.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _LEFT_OPEN], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "pumping: True" in out.stdout, out.stdout
    assert "pumps alive at exit: 0" in out.stdout, out.stdout
