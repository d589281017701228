"""``stats()["operators"]`` with worker processes: every operator, ``batch`` included, with
the counts an in-process run of the same pipeline reports."""

from __future__ import annotations

import pytest

from tests.integration.corpus import lm_pipeline

# These runs end with batch(drop_last=True) dropping lanes' last partial batches, and the
# counts are the subject: the end's DroppedRecordsWarning is checked in one test only.
pytestmark = [
    pytest.mark.processes,
    pytest.mark.filterwarnings("ignore::zephon.errors.DroppedRecordsWarning"),
]


def _operators(workers: int, **kw) -> tuple[list[dict], int]:
    with lm_pipeline(workers=workers, **kw) as pipe:
        delivered = sum(1 for _ in pipe)
        return pipe.stats()["operators"], delivered


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_operator_counts_equal_the_in_process_ones_once_the_run_ends(workers):
    local, n_local = _operators(0)
    remote, n_remote = _operators(workers)
    assert n_remote == n_local > 0
    names = [o["name"] for o in local]
    assert names[-1] == "batch" and [o["name"] for o in remote] == names
    counts = [(o["name"], o["records_in"], o["records_out"]) for o in local]
    assert [(o["name"], o["records_in"], o["records_out"]) for o in remote] == counts
    (batch,) = [o for o in remote if o["name"] == "batch"]
    assert batch["records_out"] == n_local
    assert all(o["place"] == "workers" and o["seconds"] >= 0 for o in remote)
    assert batch["seconds"] > 0


def _keep_even(x) -> bool:
    return int(x) % 2 == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_what_an_operator_drops_is_not_counted_as_its_output(workers):
    import numpy as np

    import zephon as zp

    def build() -> zp.Pipeline:
        src = zp.StaticMixtureWorkSource(
            [zp.ArraySource(np.arange(200))], seed=0, chunk_size=8, num_epochs=1
        )
        pipe = zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=1, workers=workers)
        return pipe.fetch().filter(_keep_even).shuffle(buffer_size=4).batch(4, drop_last=True)

    # 50 kept a lane: 12 full batches, and the last 2 records of each of the 2 lanes dropped
    said = r"batch\(drop_last=True\) dropped 4 records: the last partial batch of 2 of its 2"
    with build() as pipe:
        head = [next(pipe) for _ in range(5)]
        state = pipe.checkpoint()
        with pytest.warns(zp.DroppedRecordsWarning, match=said):
            rest = sum(1 for _ in pipe)
        ops = {o["name"]: o for o in pipe.stats()["operators"]}
    assert head and (ops["filter"]["records_in"], ops["filter"]["records_out"]) == (200, 100)
    assert ops["batch"]["records_out"] == 5 + rest == 24
    with build() as again:
        again.restore(state)
        with pytest.warns(zp.DroppedRecordsWarning, match=said):
            assert sum(1 for _ in again) == rest
        ops = {o["name"]: o for o in again.stats()["operators"]}
    replay = ops["batch_replay_filter"]
    # Replayed records up to the target are dropped: fewer out than in, and never more
    # batches than the run had left.
    assert replay["records_out"] < replay["records_in"]
    assert ops["batch"]["records_out"] == rest


def _counts(pipe) -> list[tuple]:
    st = pipe.stats()
    ops = [(o["name"], o["records_in"], o["records_out"]) for o in st["operators"]]
    return [*ops, ("replay_dropped_records", st["replay_dropped_records"])]


def _counts_along(workers: int, points: list[int], state=None, **kw) -> tuple[list, object]:
    """The counts after each number of batches in ``points`` (and at the end, twice)."""
    seen = []
    with lm_pipeline(workers=workers, **kw) as pipe:
        if state is not None:
            pipe.restore(state)
        delivered = 0
        for point in points:
            while delivered < point:
                next(pipe)
                delivered += 1
            seen.append(_counts(pipe))
        mid = pipe.checkpoint()
        delivered += sum(1 for _ in pipe)
        seen.append(_counts(pipe))
        seen.append(_counts(pipe))  # nothing arrives late
    return seen, mid


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_counts_equal_the_in_process_ones_after_every_next(workers):
    # Counters are each lane's as of its last delivered batch: however far the workers
    # (or the prefetch pump) ran ahead, every call after a next() returns sees the same
    # numbers in process and with workers; after a restore too (replay included).
    points = [1, 2, 5, 11, 17, 30]
    local, state = _counts_along(0, points, prefetch=4)
    remote, _ = _counts_along(workers, points, prefetch=4)
    assert local == remote
    assert local[0] != local[-1]  # the counts grow as batches are delivered
    (batch,) = [c for c in local[2] if c[0] == "batch"]
    assert batch[2] >= 5
    after_local, _ = _counts_along(0, [1, 3, 8], state=state)
    after_remote, _ = _counts_along(workers, [1, 3, 8], state=state)
    assert after_local == after_remote
    assert after_local[0][-1][1] > 0  # the replay filter dropped the delivered prefix
