"""The LM layout operators (random_map, lm_targets, trim_or_pad, batch(pad_last=True))
across worker counts and world sizes: every worker count yields the in-process stream,
and a checkpoint continues exactly into another worker count (0 -> 2 -> 1) and another
world size (2 -> 1), in interleave and in padded lockstep."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import zephon as zp
from tests.integration.corpus import docs
from zephon.checkpoint.state import merge_states
from zephon.testing import assert_same_batches, roundtrip, take

pytestmark = pytest.mark.processes

LANES = 4


def _jitter(d: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    t = d["tokens"]
    return {"tokens": t, "noise": rng.integers(0, 7, size=len(t)).astype(np.int32)}


def build(
    packed: bool = True,
    output: str = "interleave",
    workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        datasets={
            "long": zp.ArraySource(docs(50, 3, 20, 160)),
            "short": zp.ArraySource(docs(50, 4, 3, 40)),
        },
        seed=3,
        chunk_size=5,
        num_epochs=1,
    )
    p = (
        zp.Pipeline(
            src,
            canonical_replicas=LANES,
            flush_every_k_chunks=2 if packed else 0,
            output=output,
            workers=workers,
            rank=rank,
            world_size=world_size,
            prefetch=1,
        )
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .random_map(_jitter)
    )
    if packed:
        p = p.split(48).pack(48, 2, features=("tokens", "noise")).shuffle(3)
    else:
        p = p.trim_or_pad(48)
    return p.lm_targets().batch(3, pad_last=True)


@pytest.mark.parametrize("output", ["interleave", "lockstep"])
@pytest.mark.parametrize("packed", [True, False], ids=["pack", "trim_or_pad"])
def test_workers_yield_the_in_process_stream_and_resume_across_worker_counts(
    output: str, packed: bool
) -> None:
    with build(packed, output) as p:
        ref = take(p)
    assert len(ref) > 8
    with build(packed, output, workers=2) as p:
        assert_same_batches(ref, take(p), "workers=2")
    cut1, cut2 = 3, len(ref) - 2  # the second cut falls where lanes have ended
    with build(packed, output) as p:
        got = take(p, cut1)
        state = roundtrip(p.checkpoint())
    with build(packed, output, workers=2) as p:
        p.restore(state)
        got += take(p, cut2 - cut1)
        state = roundtrip(p.checkpoint())
    with build(packed, output, workers=1) as p:
        p.restore(state)
        got += take(p)
    assert_same_batches(ref, got, "workers 0 -> 2 -> 1")


def test_world_size_two_to_one_continues_every_lane() -> None:
    def per_lane(pipe: zp.Pipeline, steps: int | None) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {}
        for i, b in enumerate(pipe):
            (lane,) = pipe.last_batch_lanes
            out.setdefault(lane, []).append(b["inputs"].tobytes() + b["noise"].tobytes())
            if steps is not None and i + 1 == steps:
                break
        return out

    with build() as p:
        ref = per_lane(p, None)
    before: dict[int, list[bytes]] = {}
    states = []
    for rank, steps in ((0, 3), (1, 5)):
        with build(rank=rank, world_size=2, workers=1) as p:
            for lane, rows in per_lane(p, steps).items():
                before.setdefault(lane, []).extend(rows)
            states.append(roundtrip(p.checkpoint()))
    with build() as p:
        p.restore(merge_states(states))
        after = per_lane(p, None)
    for lane in range(LANES):
        assert before.get(lane, []) + after.get(lane, []) == ref[lane], f"lane {lane}"


def test_padded_lockstep_every_row_once_with_workers() -> None:
    with build(output="lockstep", workers=2) as p:
        steps = take(p)
    with build() as p:
        rows = sum(int(b["batch_mask"].sum()) for b in take(p))
    assert sum(int(s["batch_mask"].sum()) for s in steps) == rows
    assert {s["inputs"].shape for s in steps} == {(LANES * 3, 48)}
    assert (steps[-1]["targets"][~steps[-1]["batch_mask"]] == -100).all()


def test_padded_lockstep_world_size_two_to_one_continues_every_lanes_rows() -> None:
    """Lockstep with pad_last: each step holds every lane's rows in lane order; the real
    rows (batch_mask) of each lane continue exactly from a 2-rank run into a 1-rank one."""

    def lane_rows(pipes: list[zp.Pipeline], steps: int | None) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {}
        for pipe in pipes:
            for i, b in enumerate(pipe):
                lanes = pipe.last_batch_lanes
                rows = len(b["inputs"]) // len(lanes)
                for j, lane in enumerate(lanes):
                    sl = slice(j * rows, (j + 1) * rows)
                    real = b["batch_mask"][sl]
                    out.setdefault(lane, []).extend(r.tobytes() for r in b["inputs"][sl][real])
                if steps is not None and i + 1 == steps:
                    break
        return out

    with build(output="lockstep") as p:
        ref = lane_rows([p], None)
    pipes = [build(output="lockstep", rank=r, world_size=2, workers=1) for r in range(2)]
    try:
        before = lane_rows(pipes, 4)
        states = [roundtrip(p.checkpoint()) for p in pipes]
    finally:
        for p in pipes:
            p.close()
    with build(output="lockstep") as p:
        p.restore(merge_states(states))
        after = lane_rows([p], None)
    for lane in range(LANES):
        assert before.get(lane, []) + after.get(lane, []) == ref[lane], f"lane {lane}"
