"""A rank running thousands of lanes holds its samples as text in the fused
tokenize+split+pack stage (``Plan.hold_text``): the same batches, and exact resume."""

from __future__ import annotations

import pytest

import zephon as zp
from tests.integration.corpus import lm_pipeline
from zephon.plan import compile as compile_mod
from zephon.testing import assert_resumes_exactly, assert_same_batches, take


def _many_lanes(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setattr(compile_mod, "HOLD_TEXT_LANES", 1 if on else 10**9)


def test_the_plan_holds_text_from_many_lanes_a_process_and_says_so() -> None:
    docs = [f"w{i} " * (1 + i % 40) for i in range(200)]

    def pipe(lanes: int, workers: int) -> zp.Pipeline:
        src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=0, chunk_size=4)
        return (
            zp.Pipeline(src, canonical_replicas=lanes, workers=workers, prefetch=0)
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .split(max_len=32)
            .pack(seq_len=32, num_bins=2)
            .batch(2)
        )

    assert "[text]" not in pipe(compile_mod.HOLD_TEXT_LANES - 1, 0).explain()
    assert "tokenize+split+pack[text]@p1" in pipe(compile_mod.HOLD_TEXT_LANES, 0).explain()
    # Lanes a process runs: with 2 workers each runs half the rank's lanes.
    assert "[text]" not in pipe(compile_mod.HOLD_TEXT_LANES, 2).explain()
    assert "[text]" in pipe(2 * compile_mod.HOLD_TEXT_LANES, 2).explain()


@pytest.mark.parametrize("workers", [0, 2])
def test_text_held_gives_the_same_batches(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    _many_lanes(monkeypatch, False)
    with lm_pipeline(workers=workers, n_docs=120, k=2) as p:
        expected = take(p, 40)
    _many_lanes(monkeypatch, True)
    with lm_pipeline(workers=workers, n_docs=120, k=2) as q:
        assert "[text]" in q.explain()
        got = take(q, 40)
    assert_same_batches(expected, got, "text held")


def test_text_held_resumes_exactly_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _many_lanes(monkeypatch, False)
    with lm_pipeline(n_docs=60) as p:
        reference = take(p)
    _many_lanes(monkeypatch, True)
    assert_resumes_exactly(lambda: lm_pipeline(n_docs=60), reference=reference)


def test_text_held_checks_count_tokens_against_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    class Miscounting(zp.ByteTokenizer):
        def count_tokens(self, texts):  # one short for every text
            return [len(t) - 1 for t in texts]

    _many_lanes(monkeypatch, True)
    src = zp.StaticMixtureWorkSource([zp.ArraySource(["abcdef"] * 40)], seed=0, chunk_size=4)
    pipe = (
        zp.Pipeline(src, canonical_replicas=1, prefetch=0)
        .fetch()
        .tokenize(Miscounting())
        .split(max_len=16)
        .pack(seq_len=16, num_bins=2)
        .batch(2)
    )
    with pipe, pytest.raises(ValueError, match="count_tokens said 5 tokens but encode returned"):
        take(pipe, 3)


def test_text_held_keeps_no_tokens_in_waiting_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a lane's bins and rows hold is text: no token array bigger than one sample."""
    from zephon.operators.pack.assembly import PackedRow

    _many_lanes(monkeypatch, True)
    docs = [f"w{i} " * (1 + (i * 7) % 60) for i in range(400)]
    src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=0, chunk_size=16)
    pipe = (
        zp.Pipeline(src, canonical_replicas=4, prefetch=0)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(max_len=64)
        .pack(seq_len=64, num_bins=4)
        .batch(2)
    )
    rows: list[PackedRow] = []
    original = PackedRow.__init__

    def keep(self, *args, **kwargs):  # every row made, to look inside the waiting ones
        original(self, *args, **kwargs)
        rows.append(self)

    monkeypatch.setattr(PackedRow, "__init__", keep)
    with pipe:
        take(pipe, 10)
        waiting = [r for r in rows if not r.built]
        assert waiting
        for r in waiting:
            for arrays in (p.arrays for p in r._pieces):
                assert type(arrays) is not tuple  # a lazy piece: text and a count
                docs_of = arrays.docs
                assert not docs_of.keep and not docs_of.ids  # no tokens kept


def test_text_held_with_workers_restores_into_another_worker_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Text held in 2 workers, checkpointed, restored into 1 worker and into the eager
    stage in process: the same batches on (a plan choice, not part of the state)."""
    _many_lanes(monkeypatch, False)
    with lm_pipeline(n_docs=60) as p:
        reference = take(p)
    _many_lanes(monkeypatch, True)
    cuts = [0, 3, len(reference) // 2, len(reference)]
    assert_resumes_exactly(
        lambda: lm_pipeline(n_docs=60, workers=2),
        reference=reference,
        cuts=cuts,
        restore_build=lambda: lm_pipeline(n_docs=60, workers=1),
    )

    def eager_in_process() -> zp.Pipeline:
        monkeypatch.setattr(compile_mod, "HOLD_TEXT_LANES", 10**9)
        pipe = lm_pipeline(n_docs=60)
        assert "[text]" not in pipe.explain()  # compiled now, as it will run
        monkeypatch.setattr(compile_mod, "HOLD_TEXT_LANES", 1)
        return pipe

    assert_resumes_exactly(
        lambda: lm_pipeline(n_docs=60, workers=2),
        reference=reference,
        cuts=cuts,
        restore_build=eager_in_process,
    )
