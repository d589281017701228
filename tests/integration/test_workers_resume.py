"""Worker processes: identical batches for any worker count, and resume across counts."""

from __future__ import annotations

import pytest

from tests.integration.corpus import PACK_OPTIONS, lm_pipeline
from zephon.testing import assert_resumes_exactly, assert_same_batches, take

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def reference():
    with lm_pipeline(seed=21) as p:
        return take(p)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_give_the_same_batches_as_in_process(reference, workers):
    with lm_pipeline(seed=21, workers=workers) as p:
        assert_same_batches(reference, take(p))


@pytest.mark.filterwarnings("ignore::zephon.errors.DroppedRecordsWarning")  # runs to the end
def test_zero_copy_views_are_valid_until_the_next_call(reference):
    got = []
    with lm_pipeline(seed=21, workers=2, zero_copy=True, prefetch=3) as p:
        for batch in p:
            got.append({k: v.copy() for k, v in batch.items()})
    assert_same_batches(reference, got)


@pytest.mark.parametrize("before,after", [(2, 0), (0, 2), (2, 1), (1, 3), (3, 2)])
def test_restore_into_another_worker_count(reference, before, after):
    n = len(reference)
    assert_resumes_exactly(
        lambda: lm_pipeline(seed=21, workers=before),
        restore_build=lambda: lm_pipeline(seed=21, workers=after),
        cuts=[0, 7, n // 2],
        reference=reference,
    )


def test_lockstep_with_workers_matches_in_process():
    with lm_pipeline(seed=22, output="lockstep", num_epochs=None) as p:
        ref = take(p, 10)
    with lm_pipeline(seed=22, output="lockstep", num_epochs=None, workers=2) as p:
        assert_same_batches(ref, take(p, 10))


@pytest.mark.parametrize("option", sorted(PACK_OPTIONS))
@pytest.mark.parametrize("output", ["interleave", "lockstep"])
def test_pack_options_resume_across_worker_counts(option, output):
    """pack's strategies and options: workers 0 -> 2 -> 1, each restore exact."""

    def build(workers):
        return lm_pipeline(seed=23, workers=workers, output=output, pack_kw=PACK_OPTIONS[option])

    with build(0) as p:
        ref = take(p)
    assert len(ref) > (4 if output == "lockstep" else 10)
    assert_resumes_exactly(
        lambda: build(0), restore_build=lambda: build(2), cuts=[3], reference=ref
    )
    assert_resumes_exactly(
        lambda: build(2), restore_build=lambda: build(1), cuts=[len(ref) // 2], reference=ref
    )
