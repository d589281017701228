"""Issue 33 item 1: a round is one step of one job. Ranks whose ``checkpoint()`` calls come
at different steps (rank 0 after step 5, rank 1 after step 7, in lockstep) get no round:
every call fails naming both steps, nothing is saved that mixes two steps, and the next
call at a step both reach commits a state that restores at that step."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import zephon as zp
from tests.integration.corpus import lm_pipeline
from zephon.errors import AggregationError

pytestmark = pytest.mark.stores

LANES = 4


def _build(rank: int, agg: str, **kw) -> zp.Pipeline:
    return lm_pipeline(
        seed=3,
        lanes=LANES,
        num_epochs=None,
        output="lockstep",
        rank=rank,
        world_size=2,
        aggregate_dir=agg,
        aggregate_timeout_s=2.0,
        aggregate_lease_s=1.0,
        job_id="steps",
        **kw,
    )


def _both(pipes: list[zp.Pipeline], steps: list[int]) -> list:
    """Each rank takes its batches, then checkpoints; the results (or errors)."""
    out: list = [None, None]

    def one(r: int) -> None:
        for _ in range(steps[r]):
            next(pipes[r])
        try:
            out[r] = pipes[r].checkpoint()
        except AggregationError as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _global(state: dict, n: int) -> list[np.ndarray]:
    with lm_pipeline(seed=3, lanes=LANES, num_epochs=None, output="lockstep") as p:
        p.restore(state)
        return [next(p)["tokens"] for _ in range(n)]


@pytest.mark.parametrize("ahead", [1, 0])
def test_ranks_at_different_steps_get_no_round_then_the_next_common_step_commits(tmp_path, ahead):
    agg = str(tmp_path / "agg")
    pipes = [_build(r, agg) for r in (0, 1)]
    try:
        steps = [5, 5]
        steps[ahead] = 7
        out = _both(pipes, steps)
        for r in (0, 1):
            assert isinstance(out[r], AggregationError), (r, out[r])
        behind = 1 - ahead
        # The rank that learns of the other step names both.
        told = str(out[behind]) if ahead == 1 else str(out[1])
        assert "step 7" in told and "step 5" in told, told
        assert "called checkpoint() at different steps" in told, told
        # The next call at a step both reach: rank `behind` catches up to 9, the other too.
        out = _both(pipes, [9 - steps[0], 9 - steps[1]])
        assert all(isinstance(st, dict) for st in out), out
        assert out[0]["step"] == 9 and out[0]["round"]["step"] == 9
        merged = out[0]
        assert sorted(ls["batches"] for ls in merged["lanes"]) == [9] * LANES
        # It restores at step 9: the uninterrupted run's global batches 9 and 10 follow.
        with lm_pipeline(seed=3, lanes=LANES, num_epochs=None, output="lockstep") as ref:
            want = [next(ref)["tokens"] for _ in range(11)][9:]
        got = _global(merged, 2)
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
    finally:
        for p in pipes:
            p.close()


def test_pipeline_options_for_rounds_are_checked():
    src = zp.StaticMixtureWorkSource({"a": zp.ArraySource([[1]])}, {"a": 1.0}, seed=0)
    with pytest.raises(ValueError, match="aggregate_lease_s must be a positive number"):
        zp.Pipeline(src, aggregate_lease_s=0)
    with pytest.raises(ValueError, match=r"job_id must be None \(taken from ZEPHON_JOB_ID"):
        zp.Pipeline(src, job_id="")
    pipe = zp.Pipeline(src, job_id="run-7", aggregate_lease_s=2.5)
    assert (pipe.job_id, pipe.aggregate_lease_s) == ("run-7", 2.5)
