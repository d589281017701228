"""The end of a finite pipeline (issue 33): it says once how many records
``batch(drop_last=True)`` dropped (nothing when none were), and a second loop over an ended
pipeline is an error that names how to get another pass; ``next()`` keeps raising
``StopIteration``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import zephon as zp


def _row(x: np.int64) -> dict[str, np.int64]:
    return {"x": x}


def _pipe(n: int = 50, lanes: int = 2, workers: int = 0, **batch_kw) -> zp.Pipeline:
    """``n`` samples over ``lanes`` lanes (50 over 2: 25 a lane), rows ``{"x": sample}``."""
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(np.arange(n, dtype=np.int64))], seed=0, chunk_size=8, num_epochs=1
    )
    pipe = zp.Pipeline(src, canonical_replicas=lanes, workers=workers).fetch().map(_row)
    return pipe.batch(batch_kw.pop("batch_size", 4), **batch_kw)


def _rows(batches: list[dict[str, np.ndarray]]) -> int:
    return sum(int(b.get("batch_mask", np.ones(len(b["x"]), bool)).sum()) for b in batches)


def _drain(pipe: zp.Pipeline) -> tuple[list[np.ndarray], list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [b for b in pipe]
    return got, [w for w in caught if issubclass(w.category, zp.DroppedRecordsWarning)]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_end_says_once_how_many_records_drop_last_dropped(workers: int) -> None:
    # 25 samples a lane, batches of 4: each lane's last sample is dropped.
    with _pipe(workers=workers) as pipe:
        got, warned = _drain(pipe)
        assert _rows(got) == 48
        (w,) = warned
        msg = str(w.message)
        assert (
            "batch(drop_last=True) dropped 2 records: the last partial batch of 2 of its 2 " in msg
        )
        assert "at most 2 lanes x (batch_size 4 - 1)" in msg
        assert "batch(..., drop_last=False)" in msg and "batch(..., pad_last=True)" in msg
        assert w.filename == __file__, "the warning points at the loop that reached the end"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):  # said once: later calls raise StopIteration, silently
                with pytest.raises(StopIteration):
                    next(pipe)


@pytest.mark.parametrize(
    "kw",
    [{"drop_last": False}, {"pad_last": True}, {"batch_size": 5}],
    ids=["keep_last", "pad_last", "nothing_left_over"],
)
def test_an_end_that_dropped_nothing_says_nothing(kw: dict) -> None:
    # With batches of 5, lanes of 25 samples leave nothing over.
    with _pipe(**kw) as pipe:
        got, warned = _drain(pipe)
    assert _rows(got) == 50 and not warned


def test_a_second_loop_over_an_ended_pipeline_is_an_error_naming_the_ways_to_another_pass():
    with _pipe(drop_last=False) as pipe:
        first = [b for b in pipe]
        assert _rows(first) == 50
        with pytest.raises(zp.PipelineEndedError) as info:
            for _ in pipe:
                pytest.fail("an ended pipeline yielded a batch")
        assert isinstance(info.value, RuntimeError)
        msg = str(info.value)
        assert "has ended" in msg and "build a new pipeline" in msg
        assert "StaticMixtureWorkSource(..., num_epochs=N)" in msg
        with pytest.raises(zp.PipelineEndedError):
            list(pipe)
        with pytest.raises(StopIteration):  # the iterator protocol stays as it is
            next(pipe)


def test_a_loop_left_with_break_goes_on_in_the_next_loop():
    with _pipe(drop_last=False) as pipe:
        head = []
        for b in pipe:
            head.append(b)
            if len(head) == 3:
                break
        rest = [b for b in pipe]
    with _pipe(drop_last=False) as ref:
        want = [b for b in ref]
    assert len(head) + len(rest) == len(want)
    for a, b in zip(head + rest, want, strict=True):
        np.testing.assert_array_equal(a["x"], b["x"])


def test_a_restored_ended_pipeline_is_a_new_run():
    with _pipe(drop_last=False) as pipe:
        [b for b in pipe]
        state = pipe.checkpoint()
    with _pipe(drop_last=False) as again:
        again.restore(state)
        assert [b for b in again] == []  # the state is at the end: nothing left, no error
        with pytest.raises(zp.PipelineEndedError):
            list(again)
