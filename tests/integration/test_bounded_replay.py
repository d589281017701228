"""Restore cost is bounded by flush_every_k_chunks, not by how far the run got."""

from __future__ import annotations

import msgpack
import pytest

from tests.integration.corpus import lm_pipeline
from zephon.testing import assert_same_batches, roundtrip, take

K = 4
LANES = 2


def build():
    return lm_pipeline(
        seed=11,
        lanes=LANES,
        k=K,
        chunk_size=8,
        num_epochs=None,
        n_docs=50,
        seq_len=128,
        batch_size=2,
    )


@pytest.mark.slow
def test_replayed_chunks_do_not_grow_with_the_step():
    steps = (50, 5000)
    states, tails = {}, {}
    with build() as p:
        done = 0
        for s in steps:
            take(p, s - done)
            done = s
            states[s] = roundtrip(p.checkpoint())
            tails[s] = None
        # the uninterrupted continuation after the last cut
        tails[steps[-1]] = take(p, 10)
    replayed = {}
    for s in steps:
        with build() as q:
            q.restore(states[s])
            replayed[s] = q.stats()["replayed_chunks"]
            got = take(q, 10)
        if tails[s] is not None:
            assert_same_batches(tails[s], got, f"after restoring at step {s}")
    # Per lane at most: the open epoch, the epoch the cursor is pinned in, and what the
    # pump had pulled ahead (prefetch outputs' worth of chunks) -- 3 epochs of K chunks.
    bound = LANES * 3 * K
    assert all(0 < r <= bound for r in replayed.values()), (replayed, bound)
    size = {s: len(msgpack.packb(states[s])) for s in steps}
    assert size[5000] <= size[50] * 1.25, size
