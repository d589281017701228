"""ensure_mixture: reorder so each component's token share tracks the weights."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import zephon as zp
from zephon.chunks import WorkChunk
from zephon.operators.base import PipelineContext
from zephon.operators.ensure_mixture import EnsureMixture
from zephon.records import Contributor, Record
from zephon.testing import assert_resumes_exactly, take

# Component 0: long documents (80..120 bytes), component 1: ten times shorter (8..12).
LONG = ["L" * (100 + (i * 37) % 41 - 20) for i in range(96)]
SHORT = ["s" * (10 + (i * 7) % 5 - 2) for i in range(96)]


class ComponentRuns(zp.StaticMixtureWorkSource):
    """The static mixture with each chunk's pointers grouped by component: the same samples
    and element weights, but the input arrives in runs (8 long, then 8 short, ...), which is
    what ensure_mixture exists to smooth out."""

    def next_chunk(self) -> WorkChunk | None:
        c = super().next_chunk()
        if c is None:
            return None
        order = np.argsort(c.components, kind="stable")
        return WorkChunk(c.lane, c.chunk_id, c.components[order], c.indices[order], c.seed)


def _mixture_pipeline(
    h, *, tail: str, weights=None, buffer_size: int = 16, lanes: int = 1
) -> tuple[zp.Pipeline, object]:
    rec = h.Recorder()
    pipe = h.make_pipeline(
        [LONG, SHORT], weights=[0.5, 0.5], lanes=lanes, k=4, chunk_size=16, source_cls=ComponentRuns
    )
    pipe = pipe.fetch().tokenize(zp.ByteTokenizer(add_eos=False))
    if tail == "ensure_mixture":
        pipe = pipe.ensure_mixture(weights, buffer_size=buffer_size)
    else:
        pipe = pipe.shuffle(1)  # the same epochs, in input order
    return pipe.apply(rec), rec


def _stream(rec) -> list[tuple[int, int]]:
    return [(next(iter(r.component_tokens)), len(r.data["tokens"])) for r in rec.seen]


def _window_shares(stream: list[tuple[int, int]], w: int) -> np.ndarray:
    shares = []
    for i in range(0, len(stream) - w + 1, w):
        win = stream[i : i + w]
        shares.append(sum(n for c, n in win if c == 0) / sum(n for _, n in win))
    return np.array(shares)


def test_output_token_share_tracks_the_weights_much_better_than_the_input(h) -> None:
    pipe, rec = _mixture_pipeline(h, tail="shuffle")
    take(pipe)
    inp = _stream(rec)
    share = sum(n for c, n in inp if c == 0) / sum(n for _, n in inp)
    assert 0.90 < share < 0.92  # documents 10x longer at element weights 0.5/0.5
    target = [10 / 11, 1 / 11]
    pipe, rec = _mixture_pipeline(h, tail="ensure_mixture", weights=target)
    take(pipe)
    out = _stream(rec)
    assert Counter(out) == Counter(inp)  # reordered, nothing lost or added

    for w in (4, 8):
        dev_in = np.abs(_window_shares(inp, w) - target[0])
        dev_out = np.abs(_window_shares(out, w) - target[0])
        # Input windows are all-long (share 1) or all-short (share 0).
        assert dev_in.mean() > 0.45
        # Measured: mean 0.008 / 0.005, max 0.025 / 0.021 for windows of 4 / 8 records.
        assert dev_out.mean() < 0.02
        assert dev_out.max() < 0.05
        assert dev_out.mean() < dev_in.mean() / 20


def test_token_totals_per_epoch_are_conserved(h) -> None:
    # A bounded reordering cannot move the long-run share: what goes into an epoch comes out
    # of it, whatever the weights. (Asking for 0.5/0.5 tokens here only front-loads the
    # short documents of every epoch.)
    pipe, rec = _mixture_pipeline(h, tail="ensure_mixture", weights=[0.5, 0.5])
    take(pipe)
    per_epoch: Counter[tuple[int, int]] = Counter()
    for r in rec.seen:
        chunk = r.contributors[0].chunk_id
        per_epoch[chunk // 4, next(iter(r.component_tokens))] += len(r.data["tokens"])
    pipe, rec = _mixture_pipeline(h, tail="shuffle")
    take(pipe)
    expected: Counter[tuple[int, int]] = Counter()
    for r in rec.seen:
        expected[r.contributors[0].chunk_id // 4, next(iter(r.component_tokens))] += len(
            r.data["tokens"]
        )
    assert per_epoch == expected


def test_default_weights_come_from_the_work_source(h) -> None:
    def run(weights):
        pipe = h.make_pipeline([LONG[:40], SHORT[:40]], weights=[3, 1], lanes=1, k=2, chunk_size=8)
        pipe = pipe.fetch().tokenize(zp.ByteTokenizer()).ensure_mixture(weights, buffer_size=4)
        return pipe, take(pipe.map(lambda d: len(d["tokens"])))

    default_pipe, default_out = run(None)
    explicit_pipe, explicit_out = run([0.75, 0.25])
    _, other_out = run([0.25, 0.75])
    assert default_out == explicit_out
    assert default_out != other_out
    assert default_pipe.fingerprint() == explicit_pipe.fingerprint()
    op = next(op for op in default_pipe._compiled().ops if op.name == "ensure_mixture")
    assert op._w == pytest.approx((0.75, 0.25))


def test_emits_from_the_component_with_the_largest_deficit() -> None:
    op = EnsureMixture([0.5, 0.5], buffer_size=10)
    op.bind(PipelineContext(num_components=2))

    def rec(comp: int, n: int, off: int) -> Record:
        return Record({"tokens": np.zeros(n)}, 0, [Contributor(0, off, 0, True)], {comp: n})

    # Nothing goes out until every positive-weight component has a record waiting.
    assert list(op.process(rec(0, 10, 0))) == []
    assert list(op.process(rec(0, 10, 1))) == []
    # Now both wait: c0 (deficit tie, lowest index) goes, then c1 (deficit 5 vs -5) until
    # its queue is empty.
    out = list(op.process(rec(1, 2, 2)))
    assert [r.contributors[0].offset for r in out] == [0, 2]
    assert op.pending(0) == 1
    # c1's deficit (0.5 * 12 - 2 = 4) beats c0's (6 - 10 = -4): a new c1 goes first.
    out = list(op.process(rec(1, 2, 3)))
    assert [r.contributors[0].offset for r in out] == [3]
    assert [r.contributors[0].offset for r in op.flush(True, 0)] == [1]
    assert op.pending(0) == 0


def test_buffer_size_bounds_what_waits() -> None:
    op = EnsureMixture([0.5, 0.5], buffer_size=3)
    op.bind(PipelineContext(num_components=2))
    outs = []
    for i in range(6):
        outs.append(len(list(op.process(Record({}, 0, [Contributor(0, i, 0, True)], {0: 1})))))
        assert op.pending(0) <= 3
    assert outs == [0, 0, 0, 1, 1, 1]


def test_bad_weights_are_errors(h) -> None:
    base = h.make_pipeline([LONG[:10], SHORT[:10]], k=2).fetch()
    cases = [
        ([1.0], r"1 weights for 2 components; give one weight per dataset"),
        ([1, 2, 3], r"3 weights for 2 components"),
        ([-1, 2], r"must be finite, non-negative and sum to > 0; got \[-1\.0, 2\.0\]"),
        ([float("nan"), 1], r"must be finite, non-negative"),
        ([float("inf"), 1], r"must be finite, non-negative"),
        ([0, 0], r"sum to > 0; got \[0\.0, 0\.0\]"),
    ]
    for weights, message in cases:
        with pytest.raises(ValueError, match=message):
            base.ensure_mixture(weights).explain()
    with pytest.raises(
        ValueError, match=r"ensure_mixture\(buffer_size=\.\.\.\) must be a positive int; got 0"
    ):
        base.ensure_mixture(buffer_size=0)


def test_no_weights_anywhere_is_an_error() -> None:
    op = EnsureMixture()
    with pytest.raises(
        ValueError,
        match=r"no weights: the work source has none; pass ensure_mixture\(weights=\[\.\.\.\]\)",
    ):
        op.bind(PipelineContext())


def test_record_of_an_unknown_component_is_an_error() -> None:
    op = EnsureMixture([1.0])
    op.bind(PipelineContext())
    with pytest.raises(ValueError, match=r"record of component 3, but weights cover 1 components"):
        op.process(Record({}, 0, [Contributor(0, 0, 0, True)], {3: 1}))


def test_weights_by_dataset_name(h) -> None:
    src = zp.StaticMixtureWorkSource(
        {"long": zp.ArraySource(LONG[:16]), "short": zp.ArraySource(SHORT[:16])},
        seed=1,
        chunk_size=8,
        num_epochs=1,
    )
    base = zp.Pipeline(src, canonical_replicas=1).fetch().map(len)
    by_name = take(base.ensure_mixture({"short": 3, "long": 1}, buffer_size=4))
    assert sorted(by_name) == sorted(len(d) for d in LONG[:16] + SHORT[:16])
    assert by_name == take(base.ensure_mixture([0.25, 0.75], buffer_size=4))
    with pytest.raises(
        ValueError,
        match=r"ensure_mixture weights name \['long', 'tiny'\] but the work source's datasets are \['long', 'short'\]",
    ):
        base.ensure_mixture({"long": 1, "tiny": 3}).explain()


def test_ensure_mixture_resumes_exactly(h) -> None:
    def build() -> zp.Pipeline:
        return (
            h.make_pipeline(
                [LONG[:40], SHORT[:40]],
                weights=[0.5, 0.5],
                lanes=2,
                k=2,
                chunk_size=6,
                source_cls=ComponentRuns,
            )
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .map(lambda d: {"tokens": d["tokens"][:8], "n": np.int32(len(d["tokens"]))})
            .ensure_mixture([0.8, 0.2], buffer_size=5)
            .batch(2)
        )

    ref = assert_resumes_exactly(build)
    assert len(ref) == 40
