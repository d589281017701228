"""map: user functions see data (never Records), lambdas/closures work, order is kept."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import zephon as zp
from zephon.chunks import SamplePointer
from zephon.operators.map import Map
from zephon.records import Record
from zephon.testing import assert_resumes_exactly, take


def test_map_receives_the_raw_sample_after_fetch(h) -> None:
    seen: list[object] = []

    def fn(x: object) -> object:
        seen.append(x)
        return x

    out = take(h.make_pipeline([list(h.DOCS)], lanes=1, shuffle=False).fetch().map(fn))
    assert out == list(h.DOCS)
    assert seen == list(h.DOCS)
    assert all(type(x) is str for x in seen)


def test_map_receives_a_dict_of_arrays_after_tokenize(h) -> None:
    seen: list[object] = []
    tok = zp.ByteTokenizer()
    pipe = h.make_pipeline([list(h.DOCS)], lanes=1, shuffle=False).fetch().tokenize(tok)
    out = take(pipe.map(lambda d: seen.append(d) or len(d["tokens"])))
    assert out == [len(tok.encode(d)) for d in h.DOCS]
    assert all(isinstance(d, dict) and set(d) == {"tokens"} for d in seen)
    assert all(isinstance(d["tokens"], np.ndarray) and d["tokens"].dtype == np.int32 for d in seen)
    assert not any(isinstance(d, Record) for d in seen)


def test_map_without_fetch_receives_sample_pointers(h) -> None:
    pipe = h.make_pipeline([list(h.DOCS), ["x"] * 5], lanes=1, weights=[1, 1], shuffle=False)
    out = take(pipe.map(lambda p: p))
    assert all(type(p) is SamplePointer for p in out)
    assert sorted(out) == [SamplePointer(0, i) for i in range(40)] + [
        SamplePointer(1, i) for i in range(5)
    ]


def test_map_lambda_and_closure(h) -> None:
    def scaler(k: int):
        def f(x: int) -> int:
            return x * k + 1

        return f

    base = h.make_pipeline([list(range(20))], lanes=1, shuffle=False).fetch()
    assert take(base.map(lambda x: -x)) == [-i for i in range(20)]
    assert take(base.map(scaler(3))) == [3 * i + 1 for i in range(20)]
    # Builders return new pipelines; the base is untouched.
    assert take(base) == list(range(20))


def test_map_chain_composes_in_order(h) -> None:
    pipe = h.make_pipeline([list(range(10))], lanes=1, shuffle=False).fetch()
    out = take(pipe.map(lambda x: x + 1).map(lambda x: x * 10))
    assert out == [(i + 1) * 10 for i in range(10)]


def test_map_parallelism_keeps_order(h) -> None:
    threads: set[str] = set()

    def slow_square(x: int) -> int:
        threads.add(threading.current_thread().name)
        # Later items of a chunk finish first if anything reorders them.
        threading.Event().wait(0.0005 * (7 - x % 7))
        return x * x

    one = take(h.make_pipeline([list(range(60))], lanes=2, chunk_size=7).fetch().map(slow_square))
    threads.clear()
    three = take(
        h.make_pipeline([list(range(60))], lanes=2, chunk_size=7)
        .fetch()
        .map(slow_square, parallelism=3)
    )
    assert three == one
    assert sorted(one) == [i * i for i in range(60)]
    assert sum(n.startswith("zephon-op") for n in threads) >= 2, threads


def test_map_validation(h) -> None:
    with pytest.raises(TypeError, match=r"map needs a callable; got int 3"):
        Map(3)
    with pytest.raises(ValueError, match=r"parallelism must be a positive int; got 0"):
        h.make_pipeline([[1]]).map(abs, parallelism=0)


def test_map_error_reaches_the_consumer(h) -> None:
    def boom(x: int) -> int:
        if x == 7:
            raise ZeroDivisionError(f"bad sample {x}")
        return x

    pipe = h.make_pipeline([list(range(10))], lanes=1, shuffle=False).fetch().map(boom)
    with pytest.raises(ZeroDivisionError, match="bad sample 7"):
        take(pipe)


def test_map_fingerprint_is_stable_for_equal_lambdas_and_differs_for_others(h) -> None:
    def build(fn):
        return h.make_pipeline([list(range(4))]).fetch().map(fn)

    assert build(lambda x: x + 1).fingerprint() == build(lambda x: x + 1).fingerprint()
    assert build(lambda x: x + 1).fingerprint() != build(lambda x: x + 2).fingerprint()


def test_map_resumes_exactly(h) -> None:
    def build() -> zp.Pipeline:
        k = 5  # captured by the closure below

        def shift(d: dict[str, np.ndarray]) -> np.ndarray:
            return h.pad_to(12)(d) + k

        return (
            h.make_pipeline([list(h.DOCS), [d.upper() for d in h.DOCS]], weights=[0.7, 0.3])
            .fetch()
            .tokenize(zp.ByteTokenizer())
            .map(shift, parallelism=3)
            .map(lambda a: a * 2)
            .batch(2)
        )

    ref = assert_resumes_exactly(build)
    assert len(ref) == 40
    assert all(b.shape == (2, 12) and b.dtype == np.int32 for b in ref)


def _forgets_return(data: object) -> None:
    data = data  # no return: the map gives None


def test_a_map_function_that_returns_none_names_itself_the_sample_and_the_fix() -> None:
    src = zp.StaticMixtureWorkSource({"web": zp.ArraySource(["ab", "cd"])}, shuffle=False)
    pipe = zp.Pipeline(src, canonical_replicas=1).fetch().tokenize(zp.ByteTokenizer())
    with pytest.raises(
        TypeError,
        match=r"map: _forgets_return returned None for the sample of component 'web' \(0\) at "
        r"lane 0, chunk 0, offset 0; a map function must return the record's new data \(a "
        r"missing `return`\? e\.g\. `return data`\)\. To drop records, use \.filter\(pred\)",
    ):
        take(pipe.map(_forgets_return).split(4).batch(1), 1)
    with pytest.raises(TypeError, match=r"random_map: \S*<lambda> returned None for the sample"):
        take(pipe.random_map(lambda d, rng: None).batch(1), 1)


def test_a_map_in_two_pipelines_names_each_ones_components() -> None:
    op = Map(_forgets_return)  # one operator in two pipelines over other components
    pipes = [
        zp.Pipeline(zp.StaticMixtureWorkSource({name: zp.ArraySource([1])}), canonical_replicas=1)
        .fetch()
        .apply(op)
        .batch(1)
        for name in ("a", "b")
    ]
    for p in pipes:
        p.explain()  # both compiled (bound to their sources) before either runs
    for name, p in zip("ab", pipes, strict=True):
        with pytest.raises(TypeError, match=rf"for the sample of component '{name}' \(0\)"):
            take(p, 1)
