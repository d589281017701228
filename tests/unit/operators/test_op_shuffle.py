"""shuffle: a per-lane buffer shuffle, a permutation within every epoch, seeded, bounded."""

from __future__ import annotations

import numpy as np
import pytest

import zephon as zp
from zephon.operators.shuffle import Shuffle
from zephon.records import Contributor, Record
from zephon.testing import assert_resumes_exactly, take

N = 60  # samples 0..59 in one lane, read in order (shuffle=False): chunk of i is i // 5


def _shuffled(
    h, *, buffer_size: int = 4, k: int = 2, seed: int | None = 11, source_seed: int = 7
) -> list[int]:
    pipe = h.make_pipeline(
        [list(range(N))], lanes=1, k=k, shuffle=False, seed=source_seed, chunk_size=5
    )
    return take(pipe.fetch().shuffle(buffer_size, seed=seed))


def test_output_is_a_permutation_of_each_epoch(h) -> None:
    out = _shuffled(h, buffer_size=4, k=2)
    assert len(out) == N
    epoch = 10  # k=2 chunks of 5
    for e in range(N // epoch):
        assert sorted(out[e * epoch : (e + 1) * epoch]) == list(range(e * epoch, (e + 1) * epoch))
    assert out != list(range(N))
    # Every epoch is actually shuffled, not only some.
    assert all(
        out[e * epoch : (e + 1) * epoch] != list(range(e * epoch, (e + 1) * epoch))
        for e in range(6)
    )


def test_flush_bounds_displacement(h) -> None:
    for k in (1, 2, 3):
        out = _shuffled(h, buffer_size=8, k=k)
        window = 5 * k
        assert sorted(out) == list(range(N))
        # Nothing leaves its epoch: outputs of epoch e come after all of epoch e - 1.
        epochs = [x // window for x in out]
        assert epochs == sorted(epochs)
        assert max(abs(pos - x) for pos, x in enumerate(out)) < window


def test_deterministic_across_runs(h) -> None:
    assert _shuffled(h) == _shuffled(h)


def test_different_seed_different_order(h) -> None:
    a, b = _shuffled(h, seed=1), _shuffled(h, seed=2)
    assert sorted(a) == sorted(b) and a != b


def test_seed_none_takes_the_work_source_seed(h) -> None:
    # shuffle=False: the input order is the same whatever the source seed, so only the
    # shuffle's own seed can differ.
    a = _shuffled(h, seed=None, source_seed=1)
    b = _shuffled(h, seed=None, source_seed=2)
    assert a != b
    assert a == _shuffled(h, seed=1, source_seed=5)


def test_operator_level_buffer_and_flush() -> None:
    op = Shuffle(3, seed=0)
    recs = [Record(i, 0, [Contributor(0, i, 0, True)], {0: 1}) for i in range(8)]
    out: list[int] = []
    for r in recs[:3]:
        assert list(op.process(r)) == []  # filling the buffer
    assert op.pending(0) == 3
    for r in recs[3:]:
        emitted = list(op.process(r))
        assert len(emitted) == 1  # one in, one out once full
        out.extend(e.data for e in emitted)
    assert op.pending(0) == 3 and op.pending(1) == 0
    out.extend(r.data for r in op.flush(True, 0))
    assert sorted(out) == list(range(8))
    assert op.pending(0) == 0
    assert list(op.flush(True, 0)) == []


def test_buffer_size_one_keeps_order() -> None:
    op = Shuffle(1, seed=3)
    out: list[int] = []
    for i in range(6):
        out.extend(r.data for r in op.process(Record(i, 0, [Contributor(0, i, 0, True)], {0: 1})))
    out.extend(r.data for r in op.flush(True, 0))
    assert out == list(range(6))


def test_shuffle_validation() -> None:
    for bad in (0, -1, 2.0):
        with pytest.raises(
            ValueError, match=rf"shuffle\(buffer_size=\.\.\.\) must be a positive int; got {bad!r}"
        ):
            Shuffle(bad)


def test_fingerprint_includes_buffer_and_seed() -> None:
    assert Shuffle(4, seed=1).fingerprint() != Shuffle(4, seed=2).fingerprint()
    assert Shuffle(4, seed=1).fingerprint() != Shuffle(5, seed=1).fingerprint()


def test_shuffle_resumes_exactly(h) -> None:
    def build() -> zp.Pipeline:
        return (
            h.make_pipeline([list(h.DOCS), [d.upper() for d in h.DOCS]], k=3)
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .split(8)
            .map(h.pad_to(8))
            .shuffle(6)
            .batch(3)
        )

    ref = assert_resumes_exactly(build)
    assert 20 <= len(ref) <= 60
    assert all(b.shape == (3, 8) and b.dtype == np.int32 for b in ref)
