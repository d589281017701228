"""A pipeline that is closed, or dropped, is freed at once by reference counting: no
reference cycle is left for the garbage collector, whose passes over a dead pipeline's
objects would otherwise land, milliseconds long, in some later step of the training loop."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

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
