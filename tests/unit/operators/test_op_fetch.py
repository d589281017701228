"""fetch: pointers to raw samples, ``read(indices)`` when offered, threads for I/O."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.operators.fetch import Fetch
from zephon.sources.reading import read_many
from zephon.testing import assert_resumes_exactly, take

# Calls are logged here, by dataset name, rather than on the instance, so these counts
# would hold even if the pipeline copied datasets (it must not: see the last test).
CALLS: dict[str, list[Any]] = defaultdict(list)


class CountingReads:
    """A dataset with a batched ``read``; logs calls of both access paths."""

    def __init__(self, name: str, items: list[Any]) -> None:
        self.name = name
        self.items = items
        CALLS[name + ".read"].clear()
        CALLS[name + ".getitem"].clear()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        CALLS[self.name + ".getitem"].append(int(i))
        return self.items[i]

    def read(self, indices: list[int]) -> list[Any]:
        CALLS[self.name + ".read"].append([int(i) for i in indices])
        return [self.items[i] for i in indices]


class GetItemOnly:
    """Only ``__len__``/``__getitem__`` (Grain's RandomAccessDataSource)."""

    def __init__(self, name: str, items: list[Any]) -> None:
        self.name = name
        self.items = items
        CALLS[name + ".getitem"].clear()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        CALLS[self.name + ".getitem"].append(int(i))
        return self.items[i]


class ShortRead(GetItemOnly):
    def read(self, indices: list[int]) -> list[Any]:
        return [self.items[i] for i in indices][:-1]


def _values(n: int, base: int = 0) -> list[int]:
    return [base + 10 * i for i in range(n)]


def test_uses_read_once_per_chunk_and_component(h) -> None:
    a, b = CountingReads("a", _values(20)), CountingReads("b", _values(10, base=1000))
    pipe = h.make_pipeline([a, b], lanes=2, weights=[2, 1], chunk_size=5).fetch()
    out = take(pipe)
    assert sorted(out) == sorted(a.items + b.items)
    assert CALLS["a.getitem"] == [] and CALLS["b.getitem"] == []
    # 30 samples in chunks of 5 over 2 lanes: 6 chunks; each chunk reads each of its
    # components once, with all of that component's indices of the chunk in chunk order.
    chunks = []
    for lane in range(2):
        ws = pipe.source.for_lane(lane, 2)
        while (c := ws.next_chunk()) is not None:
            chunks.append(c)
    assert len(chunks) == 6
    for comp, name in ((0, "a.read"), (1, "b.read")):
        expected = [[i for c, i in ch.pointers if c == comp] for ch in chunks]
        assert sorted(CALLS[name]) == sorted(x for x in expected if x)


def test_output_is_the_samples_at_the_pointers(h) -> None:
    items = [f"s{i}" for i in range(12)]
    pipe = h.make_pipeline([items], lanes=1, chunk_size=4, shuffle=True).fetch()
    order = [i for _, (_, i) in sorted(h.pointer_map(pipe.source, 1).items())]
    assert sorted(order) == list(range(12)) and order != list(range(12))
    assert take(pipe) == [items[i] for i in order]


def test_falls_back_to_getitem(h) -> None:
    ds = GetItemOnly("g", _values(15))
    out = take(h.make_pipeline([ds], lanes=1, shuffle=False).fetch())
    assert out == _values(15)
    assert CALLS["g.getitem"] == list(range(15))


def test_read_returning_wrong_count_is_a_value_error(h) -> None:
    with pytest.raises(ValueError, match=r"ShortRead\.read returned 4 items for 5 indices"):
        take(h.make_pipeline([ShortRead("s", _values(10))], lanes=1).fetch())


def test_read_many_direct() -> None:
    ds = CountingReads("r", ["a", "b", "c"])
    assert read_many(ds, [2, 0, 2]) == ["c", "a", "c"]
    assert CALLS["r.read"] == [[2, 0, 2]] and CALLS["r.getitem"] == []
    assert read_many(GetItemOnly("g2", ["x", "y"]), [1, 1, 0]) == ["y", "y", "x"]
    assert CALLS["g2.getitem"] == [1, 1, 0]
    with pytest.raises(ValueError, match="must return one item per index"):
        read_many(ShortRead("s", ["x", "y"]), [0, 1])


def test_parallelism_gives_identical_output(h) -> None:
    docs = [np.full(3, i, dtype=np.int64) for i in range(60)]
    one = take(h.make_pipeline([docs], lanes=2, chunk_size=8).fetch(parallelism=1).batch(4))
    four = take(h.make_pipeline([docs], lanes=2, chunk_size=8).fetch(parallelism=4).batch(4))
    assert len(one) == len(four) == 14
    for x, y in zip(one, four, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    # Parallelism changes speed, never results, so the fingerprint ignores it.
    assert Fetch(1).fingerprint() == Fetch(4).fingerprint()


def test_parallel_fetch_really_uses_threads(h) -> None:
    names: set[str] = set()

    class Probe(GetItemOnly):
        def read(self, indices: list[int]) -> list[Any]:
            names.add(threading.current_thread().name)
            return [self.items[i] for i in indices]

    take(h.make_pipeline([Probe("p", _values(40))], lanes=1, chunk_size=8).fetch(parallelism=4))
    assert any(n.startswith("zephon-op") for n in names), names


def test_fetch_bad_parallelism(h) -> None:
    pipe = h.make_pipeline([_values(4)])
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=rf"parallelism must be a positive int; got {bad!r}"):
            pipe.fetch(parallelism=bad)


def test_fetch_needs_datasets() -> None:
    class NoDatasets:
        chunk_size = 4

        def for_lane(self, lane: int, num_lanes: int) -> Any:
            raise AssertionError("never reached")

    with pytest.raises(ValueError, match=r"fetch needs the work source's datasets"):
        zp.Pipeline(NoDatasets(), canonical_replicas=1).fetch().explain()


def test_fetch_resumes_exactly(h) -> None:
    docs = [np.array([i, i * i, -i], dtype=np.int64) for i in range(50)]
    other = [np.array([100 + i, 0, 1], dtype=np.int64) for i in range(30)]

    def build() -> zp.Pipeline:
        return h.make_pipeline([docs, other], weights=[0.6, 0.4]).fetch(parallelism=4).batch(2)

    ref = assert_resumes_exactly(build)
    assert len(ref) == 40
    rows = Counter(tuple(r) for b in ref for r in b.tolist())
    assert rows == Counter(tuple(x.tolist()) for x in docs + other)


def test_fetch_reads_the_users_dataset_objects(h) -> None:
    class Locked:
        def __init__(self) -> None:
            self.lock = threading.Lock()  # a client, a connection pool, ...
            self.reads = 0

        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> int:
            with self.lock:
                self.reads += 1
            return int(i)

    ds = Locked()
    assert sorted(take(h.make_pipeline([ds], lanes=1).fetch())) == list(range(10))
    assert ds.reads == 10


class Missing:
    """A dataset whose row ``bad`` raises ``error`` (its own ``IndexError``/``KeyError``),
    by ``ds[i]`` and, with ``batched``, by ``read(indices)`` too."""

    def __init__(self, error: Exception, bad: int = 3, batched: bool = False) -> None:
        self.error, self.bad = error, bad
        if batched:
            self.read = lambda indices: [self[i] for i in indices]

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise self.error
        return i


class RowMissing(KeyError):
    """A dataset's own KeyError subclass."""


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize(
    "error", [KeyError("row 3"), IndexError("list index out of range"), RowMissing("row 3")]
)
def test_a_datasets_own_lookup_error_names_the_component_and_index(error, batched) -> None:
    src = zp.StaticMixtureWorkSource(
        {"web": zp.ArraySource([0] * 10), "docs": Missing(error, batched=batched)},
        weights=[0.0, 1.0],
        shuffle=False,
        num_epochs=1,
    )
    pipe = zp.Pipeline(src, canonical_replicas=1).fetch().batch(2)
    with pytest.raises(type(error)) as raised:  # its own type: `except KeyError` still works
        take(pipe)
    text = str(raised.value)
    assert type(raised.value) is type(error) and raised.value.__cause__ is error
    assert (
        f"fetch: dataset 'docs' (component 1, a Missing) raised {error!r} reading sample "
        "SamplePointer(component=1, index=3); a dataset must give ds[i] (and "
        "ds.read(indices)) for every 0 <= i < len(ds) (len(ds) says 10): fix its __getitem__, "
        "or its __len__ if it counts samples it does not have"
    ) in text


def test_a_lookup_error_of_a_failing_batched_read_names_the_indices_it_read() -> None:
    class ReadFails(Missing):
        def read(self, indices: list[int]) -> list[int]:
            raise IndexError("bad block")

    fetch = Fetch()
    fetch.bind(zp.operators.base.PipelineContext(datasets=(ReadFails(KeyError("x"), bad=-1),)))
    with pytest.raises(IndexError, match=r"reading one of indices \[1, 2\] \(read together\)"):
        fetch.read([0, 0], [1, 2])
