"""The shared resume helper itself: it must be able to fail, and work on endless streams."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import zephon as zp
from zephon.testing import assert_resumes_exactly, assert_resumes_through_breaks, take


def _endless(h) -> zp.Pipeline:
    return h.make_pipeline([list(range(10))], lanes=1, num_epochs=None).fetch().batch(2)


def test_the_helper_catches_a_pipeline_that_does_not_resume(h) -> None:
    counter = itertools.count()

    def build() -> zp.Pipeline:
        # State outside the pipeline: a restored run cannot reproduce it.
        return h.make_pipeline([list(range(20))]).fetch().map(lambda x: x + next(counter)).batch(2)

    with pytest.raises(AssertionError, match=r"differs"):
        assert_resumes_exactly(build)
    with pytest.raises(AssertionError, match=r"differs"):
        assert_resumes_through_breaks(build, [3])


def test_endless_stream_with_cuts_before_the_limit(h) -> None:
    ref = assert_resumes_exactly(lambda: _endless(h), limit=8, cuts=range(8))
    assert len(ref) == 8
    assert sorted(np.concatenate(ref[:5]).tolist()) == list(range(10))  # one dataset epoch
    assert_resumes_through_breaks(lambda: _endless(h), [2, 5], limit=8)


def test_take_zero_takes_nothing(h) -> None:
    assert take(_endless(h), 0) == []


def test_endless_stream_with_default_cuts(h) -> None:
    assert_resumes_exactly(lambda: _endless(h), limit=6)
