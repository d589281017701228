"""Elastic resume: a checkpoint merged from one topology continues every lane exactly in
another (ranks x workers), in one process (ranks simulated one after another)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.integration.corpus import PACK_OPTIONS, lm_pipeline
from zephon.checkpoint.state import merge_states
from zephon.testing import assert_same_batches, global_batches, roundtrip, take

LANES = 4


def digest(batch) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:16]


def per_lane(pipe, steps: int) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for _ in range(steps):
        batch = next(pipe)
        (lane,) = pipe.last_batch_lanes
        out.setdefault(lane, []).append(digest(batch))
    return out


def build(**kw):
    return lm_pipeline(seed=31, lanes=LANES, num_epochs=None, **kw)


@pytest.mark.parametrize("option", sorted(PACK_OPTIONS))
def test_pack_options_continue_exactly_from_world_size_2_to_1(option):
    """Interleave: every lane continues exactly; lockstep: the same global batches."""
    kw = {"pack_kw": PACK_OPTIONS[option]}
    with build(**kw) as p:
        ref = per_lane(p, 40)
    before, merged = run_ranks(2, 0, steps=[6, 9], state=None, **kw)
    after, _ = run_ranks(1, 0, steps=[20], state=merged, **kw)
    for lane in range(LANES):
        got = before.get(lane, []) + after.get(lane, [])
        assert got == ref[lane][: len(got)], f"lane {lane} diverged"
        assert after.get(lane)

    def build_rank(rank, world_size):
        return build(rank=rank, world_size=world_size, output="lockstep", **kw)

    ref_global, _ = global_batches(build_rank, 1, 8)
    head, merged = global_batches(build_rank, 2, 3)
    tail, _ = global_batches(build_rank, 1, 5, merged)
    assert_same_batches(ref_global, head + tail)


@pytest.fixture(scope="module")
def uninterrupted():
    with build() as p:
        return per_lane(p, 120)


def run_ranks(world_size: int, workers: int, steps: list[int], state=None, **kw):
    streams: dict[int, list[str]] = {}
    states = []
    for rank in range(world_size):
        with build(rank=rank, world_size=world_size, workers=workers, **kw) as p:
            if state is not None:
                p.restore(state)
            for lane, ds in per_lane(p, steps[rank]).items():
                streams.setdefault(lane, []).extend(ds)
            states.append(roundtrip(p.checkpoint()))
    return streams, merge_states(states)


@pytest.mark.processes
@pytest.mark.parametrize("world_size,workers", [(1, 0), (2, 1), (4, 2), (1, 2)])
def test_interleave_lanes_continue_exactly_in_another_topology(uninterrupted, world_size, workers):
    before, merged = run_ranks(4, 2 if world_size == 4 else 0, steps=[5, 9, 2, 7])
    after, _ = run_ranks(world_size, workers, steps=[12] * world_size, state=merged)
    for lane in range(LANES):
        got = before.get(lane, []) + after.get(lane, [])
        assert got == uninterrupted[lane][: len(got)], f"lane {lane} diverged"
        assert len(after.get(lane, [])) > 0


def test_lockstep_global_batches_identical_for_any_world_size():
    def build_rank(rank, world_size):
        return build(rank=rank, world_size=world_size, output="lockstep")

    ref, _ = global_batches(build_rank, 1, 10)
    head, merged = global_batches(build_rank, 4, 4)
    tail2, _ = global_batches(build_rank, 2, 6, merged)
    tail1, _ = global_batches(build_rank, 1, 6, merged)
    assert_same_batches(ref, head + tail2)
    assert_same_batches(ref, head + tail1)


def test_merge_rejects_disagreeing_model_parallel_peers():
    from zephon.errors import AggregationError

    states = []
    for rank, steps in [(0, 2), (1, 3)]:  # two MP peers of one DP group, at different steps
        with build(rank=rank, world_size=2, dp_rank=0, dp_size=1) as p:
            take(p, steps)
            states.append(p.checkpoint())
    with pytest.raises(AggregationError, match="report different states for lane"):
        merge_states(states)
