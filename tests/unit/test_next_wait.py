"""stats()["next_wait_fraction"] and the once-per-run DataStallWarning."""

from __future__ import annotations

import time
import warnings

import pytest

import zephon as zp


def _pipeline(delay_s: float) -> zp.Pipeline:
    def slow(x):
        time.sleep(delay_s)
        return x

    source = zp.StaticMixtureWorkSource([zp.ArraySource(list(range(4000)))], seed=0, chunk_size=4)
    return zp.Pipeline(source, canonical_replicas=1, prefetch=0).fetch().map(slow).batch(4)


def test_a_busy_loop_starved_of_data_is_warned_once_naming_the_knobs():
    with _pipeline(delay_s=0.004) as pipe:  # ~16 ms of loading per batch
        with pytest.warns(
            zp.DataStallWarning, match=r"waiting in next\(\).*workers=0, prefetch=0"
        ) as got:
            for _ in range(80):
                next(pipe)
                time.sleep(0.02)  # the training step
        stats = pipe.stats()
    assert len(got) == 1
    assert 0.15 < stats["next_wait_fraction"] < 0.8, stats["next_wait_fraction"]
    assert stats["first_batch_s"] > 0 and stats["next_wait_s"] > 0


def test_a_fed_loop_and_a_draining_loop_are_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error", zp.DataStallWarning)
        # A long step (50 ms) against ~0.2 ms of loading: a machine busy with other work
        # may slow next() tenfold and still stay well under the 10% that warns.
        with _pipeline(delay_s=0.0) as pipe:
            for _ in range(25):
                next(pipe)
                time.sleep(0.05)
            assert pipe.stats()["next_wait_fraction"] < 0.10
        with _pipeline(delay_s=0.002) as pipe:  # nothing done between batches: no stall
            for _ in range(300):
                next(pipe)
            assert pipe.stats()["next_wait_fraction"] > 0.5
