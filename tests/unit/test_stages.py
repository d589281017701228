"""The plan's stages give what the operators give one by one: the fused ``[tokenize ->]
split -> pack`` stage, the head that reads a chunk's samples as it expands it, deferred
batch stacking, and the runner's stepwise first feed: the same batches, counts, restores
and errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.chunks import WorkChunk
from zephon.errors import ContractViolation
from zephon.operators.base import OpStats, PipelineContext
from zephon.operators.fetch import Fetch
from zephon.operators.map import Map
from zephon.operators.pack.fused import SplitPack
from zephon.operators.pack.pack import Pack
from zephon.operators.split import Split
from zephon.operators.tokenize import Tokenize
from zephon.plan.compile import compile_plan
from zephon.plan.read import ReadChunks
from zephon.records import Contributor, Record
from zephon.runners.chain import ChainRunner
from zephon.testing import assert_resumes_exactly, batches_equal, take

DOCS_A = [("ab" * ((i * 7919) % 700)) + f" a{i}" for i in range(500)]
DOCS_B = [("xyz " * ((i * 104729) % 300)) + f" b{i}" for i in range(400)]


def _keep(data: Any) -> Any:
    return data


def _build(
    seed: int,
    max_len: int,
    seq_len: int,
    k: int,
    chunk: int,
    prefetch: int = 0,
    docs: int = 500,
    fused: bool = True,
    pack_kw: dict[str, Any] | None = None,
) -> Any:
    """The LM chain; with ``fused=False`` an identity map between split and pack keeps the
    three operators apart (the plan fuses only what follows each other as built)."""
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(DOCS_A[:docs]), zp.ArraySource(DOCS_B[:docs])],
        weights=[0.6, 0.4],
        seed=seed,
        chunk_size=chunk,
        num_epochs=1,
    )
    pipe = (
        zp.Pipeline(src, canonical_replicas=3, flush_every_k_chunks=k, prefetch=prefetch)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(max_len=max_len)
    )
    if not fused:
        pipe = pipe.map(_keep)
    return pipe.pack(seq_len=seq_len, num_bins=4, **(pack_kw or {})).batch(3)


def _counts(stats: dict) -> list[tuple[str, int, int]]:
    return [(o["name"], o["records_in"], o["records_out"]) for o in stats["operators"]]


def _run(fused: bool, n: int, **kw: Any) -> tuple[list, list]:
    with _build(fused=fused, **kw) as p:
        assert ("tokenize+split+pack@p1" in p.explain()) == fused
        return take(p, n), [c for c in _counts(p.stats()) if c[0] != "map"]


@pytest.mark.parametrize(
    ("seed", "max_len", "seq_len", "k", "chunk"),
    [(0, 256, 256, 2, 16), (1, 100, 256, 1, 7), (2, 2048, 2048, 4, 64), (3, 1, 8, 3, 5)],
)
def test_fused_stage_gives_the_operators_batches_and_counts(
    seed: int, max_len: int, seq_len: int, k: int, chunk: int
) -> None:
    kw = dict(seed=seed, max_len=max_len, seq_len=seq_len, k=k, chunk=chunk)
    plain, plain_counts = _run(False, 80, **kw)
    fused, fused_counts = _run(True, 80, **kw)
    assert len(plain) == len(fused) > 10
    assert all(batches_equal(a, b) for a, b in zip(plain, fused, strict=True))
    assert fused_counts == plain_counts


def test_fused_pipeline_resumes_exactly() -> None:
    assert_resumes_exactly(lambda: _build(5, 300, 512, 2, 9, docs=40))


#: pack's options that the fused stage keeps (they live in placement and assembly).
FUSED_OPTIONS = [
    {"strategy": "best_fit"},
    {"strategy": "best_fit", "max_segments": 2, "pad_values": {"tokens": -1}},
    {"max_segments": 1, "component_feature": "tokens_component"},
    {"bos_id": 1, "bos_handling": "replace_first_token", "pad_values": {"tokens_component": 9},
     "component_feature": "tokens_component"},
    {"order": "arrival"},
]  # fmt: skip


@pytest.mark.parametrize("pack_kw", FUSED_OPTIONS, ids=lambda kw: ",".join(kw))
def test_fused_stage_gives_the_operators_batches_with_pack_options(pack_kw) -> None:
    kw = dict(seed=7, max_len=100, seq_len=256, k=2, chunk=7, pack_kw=pack_kw)
    plain, plain_counts = _run(False, 60, **kw)
    fused, fused_counts = _run(True, 60, **kw)
    assert len(plain) == len(fused) > 10
    assert all(batches_equal(a, b) for a, b in zip(plain, fused, strict=True))
    assert fused_counts == plain_counts
    default, _ = _run(True, 60, seed=7, max_len=100, seq_len=256, k=2, chunk=7)
    assert not all(batches_equal(a, b) for a, b in zip(default, fused, strict=False))


@pytest.mark.parametrize(
    "pack_kw", [*FUSED_OPTIONS[1:3], FUSED_OPTIONS[4]], ids=lambda kw: ",".join(kw)
)
def test_fused_pipeline_with_pack_options_resumes_exactly(pack_kw) -> None:
    # Restores replay by token counts (tokens made on assembly): the options must agree.
    assert_resumes_exactly(
        lambda: _build(5, 100, 128, 2, 9, docs=40, pack_kw=pack_kw), cuts=[0, 3, 8, 20]
    )


def _plan(ops: list[Any]) -> Any:
    return compile_plan(ops, flush_every_k_chunks=None)


def _step_names(ops: list[Any]) -> list[str]:
    return [step.name for step in _plan(ops).build(_plan(ops).ops)[1]]


def test_the_plan_fuses_only_the_built_in_chain_on_tokens() -> None:
    tok, split, pack = Tokenize(zp.ByteTokenizer()), Split(64), Pack(64)
    assert _step_names([Fetch(), tok, split, pack]) == ["tokenize+split+pack", "pack_replay_filter"]
    assert _step_names([Fetch(), split, pack]) == ["split+pack", "pack_replay_filter"]
    apart = _step_names([Fetch(), tok, Split(64, feature="ids"), pack])
    assert apart == ["tokenize", "split", "pack", "pack_replay_filter"]
    between = _step_names([Fetch(), tok, split, Map(_keep), pack])
    assert between == ["tokenize", "split", "map", "pack", "pack_replay_filter"]
    # A tokenize that asks for threads keeps them (then there is a pool): split and pack fuse.
    tok_par = Tokenize(zp.ByteTokenizer(), parallelism=2)
    assert _step_names([Fetch(), tok_par, split, pack]) == [
        "tokenize",
        "split+pack",
        "pack_replay_filter",
    ]
    # Options placement and assembly carry fuse; meta features and broadcast fields do not.
    options = Pack(64, strategy="best_fit", max_segments=3, component_feature="c")
    assert _step_names([Fetch(), tok, split, options])[0] == "tokenize+split+pack"
    for unfused in (Pack(64, meta_features=("m",)), Pack(64, broadcast=("w",))):
        assert _step_names([Fetch(), tok, split, unfused])[:3] == ["tokenize", "split", "pack"]
    # The head reads with a leading fetch on one thread; fetch on threads is a step.
    assert _plan([Fetch(), tok, split, pack]).reads
    assert _step_names([Fetch(parallelism=2), tok, split, pack])[0] == "fetch"


def _stage(max_len: int = 4, seq_len: int = 8) -> tuple[SplitPack, list[OpStats]]:
    stage = SplitPack(Tokenize(zp.ByteTokenizer(add_eos=False)), Split(max_len), Pack(seq_len, 2))
    return stage, stage.counters


def _sample(text: str, offset: int, contributors: list[Contributor] | None = None) -> Record:
    return Record(text, 0, contributors or [Contributor(0, offset, 0, True)], {0: 1})


def test_fused_stage_raises_split_s_error_for_a_record_that_is_already_a_piece() -> None:
    stage, _ = _stage()
    piece = _sample("abcdefgh", 0, [Contributor(0, 0, 1, False)])
    with pytest.raises(ContractViolation, match="split whole samples once"):
        stage.process_batch([piece])


def test_fused_stage_raises_pack_s_error_for_a_piece_longer_than_seq_len() -> None:
    stage, _ = _stage(max_len=16, seq_len=8)
    with pytest.raises(ValueError, match=r"longer than seq_len=8; put \.split\(max_len=8\)"):
        stage.process_batch([_sample("x" * 12, 0)])


def test_fused_stage_counts_into_the_three_operators_stats() -> None:
    stage, (st_tok, st_split, st_pack) = _stage(max_len=4, seq_len=8)
    out = stage.process_batch([_sample("abcdefghij", 0), _sample("kl", 1)])
    # "abcdefghij" -> 4 + 4 + 2, "kl" -> 2: bins of 8 fill as [4, 4] and [2, 2]
    assert (st_tok.records_in, st_tok.records_out) == (2, 2)
    assert (st_split.records_in, st_split.records_out) == (2, 4)
    assert (st_pack.records_in, st_pack.records_out) == (4, len(out)) == (4, 1)
    assert [tuple(c) for c in out[0].contributors] == [(0, 0, 0, False), (0, 0, 1, False)]
    assert stage.pending(0) == 2
    flushed = list(stage.flush(True, 0))
    assert stage.pending(0) == 0 and st_pack.records_out == 2
    (rec,) = flushed
    assert rec.component_tokens == {0: 4}
    np.testing.assert_array_equal(rec.data["tokens"][:4], np.frombuffer(b"ijkl", np.uint8) + 3)
    np.testing.assert_array_equal(rec.data["tokens_segment_ids"], [1, 1, 2, 2, 0, 0, 0, 0])


class _Rows:
    """A dataset with ``read(indices)``, which fetch prefers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[list[int]] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        return f"row{i}"

    def read(self, indices: list[int]) -> list[str]:
        self.reads.append(list(indices))
        return [f"row{i}" for i in indices]


def test_the_head_reading_a_chunk_equals_pointers_then_fetch() -> None:
    a, b = _Rows(50), zp.ArraySource([f"b{i}" for i in range(50)])
    fetch = Fetch()
    fetch.bind(PipelineContext(datasets=[a, b]))
    chunk = WorkChunk(
        2, 7, np.array([0, 1, 1, 0, 1], np.int32), np.array([4, 9, 3, 40, 0], np.int64), 0
    )
    got, rest = ReadChunks(fetch).read(chunk).take(10)
    pointers, _ = ReadChunks(None).read(chunk).take(10)
    want = fetch.process_batch(pointers)
    assert rest is None
    assert [r.data for r in got] == [r.data for r in want] == ["row4", "b9", "b3", "row40", "b0"]
    assert [r.contributors for r in got] == [r.contributors for r in want]
    assert [r.component_tokens for r in got] == [r.component_tokens for r in want] and {
        r.lane for r in got
    } == {2}
    assert a.reads[-1] == [4, 40]  # one read per component, in chunk order
    first, rest = ReadChunks(fetch).read(chunk).take(2)  # taken in steps: the same records
    assert rest is not None and len(rest) == 3
    second, none = rest.take(5)
    assert none is None and [r.data for r in first + second] == [r.data for r in got]
    assert [r.contributors for r in first + second] == [r.contributors for r in got]


def test_a_batch_that_fails_to_stack_is_an_error_at_next_and_is_not_delivered() -> None:
    class Ragged(zp.Operator):
        traits = zp.OpTraits(preserves_cursor_order=True, stateful=False)
        name = "ragged"

        def process(self, record: Record) -> list[Record]:
            # the second record of each batch is one element longer: batch cannot stack
            return [record.replace(np.zeros(1 + record.contributors[0].offset % 2, np.int32))]

    src = zp.StaticMixtureWorkSource([zp.ArraySource(list(range(40)))], seed=0, chunk_size=8)
    with zp.Pipeline(src, canonical_replicas=1, prefetch=0).fetch().apply(Ragged()).batch(2) as p:
        with pytest.raises(ValueError, match="cannot be stacked"):
            next(iter(p))
        assert p.stats()["lanes"][0]["batches"] == 0
        with pytest.raises(ValueError, match="cannot be stacked"):
            next(iter(p))  # final: the same error again, nothing skipped


def test_prefetching_pipeline_stacks_ahead_and_matches_an_unprefetched_one() -> None:
    with _build(4, 256, 256, 2, 16, prefetch=0) as p:
        plain = take(p, 40)
    with _build(4, 256, 256, 2, 16, prefetch=3) as p:
        ahead = take(p, 40)
    assert all(batches_equal(a, b) for a, b in zip(plain, ahead, strict=True))


def _lane_units(pipe: zp.Pipeline, lane: int, n: int) -> tuple[Any, list[list[Any]]]:
    """``pipe``'s plan and ``lane``'s first ``n`` feed units."""
    src = pipe.source.for_lane(lane, pipe.canonical_replicas)
    return pipe._compiled(), [[src.next_chunk()] for _ in range(n)]


def _outputs(outs: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (o.lane, o.end, o.tombstones, None if o.record is None else o.record.contributors)
        for o in outs
    ]


def test_a_lane_s_first_feed_stops_at_its_first_output_and_resumes_to_the_same_outputs() -> None:
    with _build(5, 256, 256, 2, 64) as p:
        plan, units = _lane_units(p, 0, 3)
    plain = ChainRunner(plan)
    want = [o for unit in units for o in plain.feed(unit)]
    runner = ChainRunner(plan)
    got = runner.feed(units[0], first=True)
    assert got and got[-1].record is not None  # stopped at the lane's first batch ...
    assert runner.suspended(0) and not runner.suspended(1)
    tokenize = runner.stats[1]
    assert 0 < tokenize.records_in < len(units[0][0])  # ... before the chunk's end
    got += runner.resume(0)
    assert not runner.suspended(0)
    assert tokenize.records_in == len(units[0][0])
    got += [o for unit in units[1:] for o in runner.feed(unit)]
    assert _outputs(got) == _outputs(want)
    assert all(
        batches_equal(a.record.data, b.record.data)
        for a, b in zip(got, want, strict=True)
        if a.record is not None
    )


def test_read_ahead_only_over_object_storage_and_same_samples() -> None:
    import threading

    from zephon.plan.read import ReadChunks

    class Remote:
        _paths = ["s3://bucket/a.jsonl"]

        def __init__(self) -> None:
            self.threads: set[str] = set()

        def __len__(self) -> int:
            return 100

        def read(self, indices: list[int]) -> list[int]:
            self.threads.add(threading.current_thread().name)
            return [i * 10 for i in indices]

    class Local(Remote):
        _paths = ["/data/a.jsonl"]

    for cls, ahead in ((Remote, True), (Local, False)):
        ds = cls()
        fetch = Fetch()
        fetch.bind(PipelineContext(datasets=(ds,)))
        assert fetch.remote is ahead
        head = ReadChunks(fetch)
        chunk = WorkChunk(1, 7, np.zeros(4, np.int32), np.arange(3, 7, dtype=np.int64), 0)
        head.read_ahead(chunk)
        records, _ = head.read(chunk).take(4)
        assert [r.data for r in records] == [30, 40, 50, 60]
        assert any(t.startswith("zephon-read") for t in ds.threads) is ahead


# ------------------------------------------------------------------ pre-tokenized samples


def _pre_tokenized(lengths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 1000, n, dtype=np.int32)} for n in lengths]


def _python_pieces(stage: SplitPack, datas: list, contribs: list, mixes: list) -> list:
    from zephon.operators.pack import fused as split_pack

    saved, split_pack._NATIVE = split_pack._NATIVE, None
    try:
        return split_pack._Pieces(stage, 0, datas, contribs, mixes, None, None, datas, False).pieces
    finally:
        split_pack._NATIVE = saved


def _same_pieces(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        type(p) is type(q)
        and list(p.contributors) == list(q.contributors)
        and all(type(c) is Contributor for c in p.contributors)
        and p.component_tokens == q.component_tokens
        and p.length == q.length
        and len(p.arrays) == len(q.arrays) == 1
        and p.arrays[0].dtype == q.arrays[0].dtype
        and np.array_equal(p.arrays[0], q.arrays[0])
        for p, q in zip(a, b, strict=True)
    )


@pytest.mark.native
def test_pre_tokenized_pieces_made_in_c_are_the_python_ones() -> None:
    from zephon.operators.pack import fused as split_pack
    from zephon.records import whole_samples

    assert split_pack._NATIVE is not None, "zephon._pack is not built (native tests need it)"
    max_len = 8
    stage = SplitPack(None, Split(max_len), Pack(8, 2))
    lengths = [0, 1, 7, 8, 9, 16, 17, 24, 25, 3]
    datas = _pre_tokenized(lengths)
    datas[2] = {"tokens": np.arange(14, dtype=np.uint16)[::2], "other": 1}  # strided, 7 long
    datas[5] = {"tokens": np.arange(16, dtype=np.int64)}
    mixes = [{k % 2: 1} for k in range(len(datas))]
    for contribs in (
        whole_samples(4, 10, 10 + len(datas)),
        [[c] for (c,) in whole_samples(4, 0, 10)],
    ):
        got = split_pack._NATIVE.split_pieces(
            split_pack.Piece,
            Contributor,
            np.ndarray,
            None,
            datas,
            contribs,
            mixes,
            "tokens",
            max_len,
        )
        assert got is not None
        assert _same_pieces(got, _python_pieces(stage, datas, contribs, mixes))
        assert [p.length for p in got] == [0, 1, 7, 8, 8, 1, 8, 8, 8, 8, 1, 8, 8, 8, 8, 8, 8, 1, 3]
        cut = [
            tuple(c) for p in got for c in p.contributors if c.chunk_id == 4 and c.offset % 10 == 8
        ]
        assert cut == [(4, contribs[8][0].offset, j, j == 3) for j in range(4)]
        assert got[0].component_tokens is mixes[0]  # a whole sample keeps its mix
        assert [p.component_tokens for p in got if p.contributors[0].offset % 10 == 4] == [
            {0: 8},
            {0: 1},
        ]


@pytest.mark.native
@pytest.mark.parametrize(
    "odd",
    [
        "not a dict",
        {"text": np.zeros(3, np.int32)},
        {"tokens": [1, 2, 3]},
        {"tokens": np.zeros((2, 2), np.int32)},
        {"tokens": np.zeros(3, np.int32).view(np.memmap)},
    ],
    ids=["str", "no-tokens", "list", "2-d", "subclass"],
)
def test_pre_tokenized_pieces_leave_the_c_path_for_anything_else(odd: Any) -> None:
    from zephon.operators.pack import fused as split_pack
    from zephon.records import whole_samples

    datas = [*_pre_tokenized([3]), odd]
    got = split_pack._NATIVE.split_pieces(
        split_pack.Piece, Contributor, np.ndarray, None, datas, whole_samples(0, 0, 2), [{0: 1}] * 2,
        "tokens", 8,
    )  # fmt: skip
    assert got is None


@pytest.mark.native
def test_pre_tokenized_long_samples_that_are_not_one_whole_sample_leave_the_c_path() -> None:
    from zephon.operators.pack import fused as split_pack

    native = split_pack._NATIVE
    datas = _pre_tokenized([12])
    piece = [[Contributor(0, 0, 1, False)]]  # already a piece of a sample
    two = [[Contributor(0, 0, 0, True), Contributor(0, 1, 0, True)]]
    for contribs, mixes in (
        (piece, [{0: 1}]),
        (two, [{0: 1}]),
        ([[Contributor(0, 0, 0, True)]], [{0: 1, 1: 1}]),
    ):
        assert (
            native.split_pieces(
                split_pack.Piece, Contributor, np.ndarray, None, datas, contribs, mixes, "tokens", 8
            )
            is None
        )
    stage = SplitPack(None, Split(8), Pack(8, 2))
    with pytest.raises(ContractViolation, match="split whole samples once"):
        stage.process_batch([Record(datas[0], 0, piece[0], {0: 1})])
    with pytest.raises(ValueError, match="one length"):
        native.split_pieces(
            split_pack.Piece, Contributor, np.ndarray, None, datas, [], [], "tokens", 8
        )


def _token_pipeline(path: Any, fused: bool) -> Any:
    src = zp.StaticMixtureWorkSource(
        [zp.TokenFileSource(path, eos_id=1)], seed=3, chunk_size=16, num_epochs=1
    )
    pipe = zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2, prefetch=0).fetch()
    pipe = pipe.split(64)
    if not fused:
        pipe = pipe.map(_keep)
    return pipe.pack(64, 3).batch(2)


def test_pre_tokenized_fused_stage_gives_the_operators_batches_and_resumes_exactly(
    tmp_path,
) -> None:
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(3.0, 1.2, 300).astype(np.int64) + 1, 400)
    tokens = rng.integers(2, 500, int(lengths.sum()), dtype=np.uint16)
    tokens[np.cumsum(lengths) - 1] = 1
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    with _token_pipeline(path, True) as p:
        assert "split+pack@p1" in p.explain()
        fused = take(p, 10_000)
    with _token_pipeline(path, False) as p:
        plain = take(p, 10_000)
    assert len(fused) == len(plain) > 50
    assert all(batches_equal(a, b) for a, b in zip(plain, fused, strict=True))
    assert_resumes_exactly(lambda: _token_pipeline(path, True))


# ------------------------------------------------------------------ token spans


def _spans_of(lengths: list[int], dtype: str = "uint16", seed: int = 0) -> list[Any]:
    """Documents of ``lengths`` as spans of one array of ids (a token file as mapped)."""
    from zephon.sources.token_span import Span

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, np.iinfo(dtype).max, sum(lengths), dtype=np.uint64).astype(dtype)
    ends = np.cumsum([0, *lengths]).tolist()
    return [Span(tokens, lo, hi) for lo, hi in zip(ends, ends[1:], strict=False)]


def _as_arrays(pieces: list) -> list:
    """Pieces whose arrays are spans as pieces of their tokens (what assembly reads)."""
    return [p._replace(arrays=(p.arrays[0],)) for p in pieces]


@pytest.mark.native
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_span_pieces_made_in_c_are_the_python_ones_and_the_arrays_ones(dtype) -> None:
    from zephon.operators.pack import fused as split_pack
    from zephon.records import whole_samples
    from zephon.sources.token_span import NATIVE_SPAN

    assert split_pack._NATIVE is not None and NATIVE_SPAN is not None, "not built"
    stage = SplitPack(None, Split(8), Pack(8, 2))
    lengths = [0, 1, 7, 8, 9, 16, 17, 24, 25, 3]
    spans = _spans_of(lengths, dtype)
    # A token file's spans and another dataset's arrays in one chunk.
    datas: list[Any] = [*spans[:5], {"tokens": spans[5][0]}, *spans[6:]]
    arrays = [{"tokens": s[0]} for s in spans]
    contribs = whole_samples(4, 10, 10 + len(datas))
    mixes = [{k % 2: 1} for k in range(len(datas))]
    got = split_pack._NATIVE.split_pieces(
        split_pack.Piece, Contributor, np.ndarray, NATIVE_SPAN, datas, contribs, mixes,
        "tokens", 8,
    )  # fmt: skip
    assert got is not None
    assert all(type(p.arrays) is NATIVE_SPAN for p in got if p.contributors[0].offset != 15)
    python = _python_pieces(stage, datas, contribs, mixes)
    assert [(type(p.arrays), len(p.arrays)) for p in got] == [(type(p.arrays), 1) for p in python]
    assert _same_pieces(_as_arrays(got), _as_arrays(python))
    from_arrays = split_pack._NATIVE.split_pieces(
        split_pack.Piece, Contributor, np.ndarray, None, arrays, contribs, mixes, "tokens", 8
    )
    assert _same_pieces(_as_arrays(got), from_arrays)
    # Cut spans are spans of the same array, nothing copied.
    (cut,) = [s for s in spans if s.hi - s.lo == 25]
    parts = [p.arrays for p in got if p.contributors[0].offset == 18]
    assert [(p.lo - cut.lo, p.hi - cut.lo) for p in parts] == [(0, 8), (8, 16), (16, 24), (24, 25)]
    assert all(p.tokens is cut.tokens for p in parts)


@pytest.mark.native
def test_rows_of_token_spans_are_written_as_rows_of_their_tokens() -> None:
    from zephon.operators.pack import assembly
    from zephon.operators.pack.assembly import Piece, RowAssembler, columns
    from zephon.sources.token_span import NATIVE_SPAN

    assert NATIVE_SPAN is not None, "zephon._tokens is not built (native tests need it)"
    rows = RowAssembler(12, ("tokens",), (), {}, None, None, {"tokens": 7})
    spans = _spans_of([3, 0, 5, 4], "uint32", seed=2)  # ids past 2**31 wrap, as astype does
    as_spans = [[Piece((), {}, s, s.hi - s.lo) for s in spans[:3]], [Piece((), {}, spans[3], 4)]]
    as_arrays = [[p._replace(arrays=(p.arrays[0],)) for p in row] for row in as_spans]

    for a, b in zip(as_spans, as_arrays, strict=True):
        got = rows.assemble(a)
        want = rows.assemble_numpy(*columns(b))
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in got)
    with pytest.raises(ValueError, match="a span is one int32 column"):
        assembly._NATIVE.assemble_rows(
            [as_spans[0]], 0, np.empty((1, 8), np.int64), b"\0" * 8, None, None, NATIVE_SPAN
        )
    with pytest.raises(TypeError, match="span must be zephon._tokens.Span"):
        assembly._NATIVE.assemble_rows(
            [as_spans[0]], 0, np.empty((1, 8), np.int32), b"\0" * 4, None, None, tuple
        )


def test_the_plan_reads_token_spans_only_for_a_fused_split_pack_right_after_fetch() -> None:
    split, pack = Split(64), Pack(64)
    assert _plan([Fetch(), split, pack]).spans
    assert _plan([Fetch(), split, pack, zp.operators.batch.Batch(2)]).spans
    tok = Tokenize(zp.ByteTokenizer())
    assert not _plan([Fetch(), tok, split, pack]).spans  # the tokenizer reads the samples
    assert not _plan([Fetch(), Map(_keep), split, pack]).spans  # so does a map
    assert not _plan([Fetch(), split, Map(_keep), pack]).spans  # nothing fused
    assert not _plan([Fetch(parallelism=2), split, pack]).spans  # fetch runs as a step
    assert not _plan([Fetch(), split, Pack(64, meta_features=("m",))]).spans


def _mixed_pipeline(paths: list[Any], arrays: list[np.ndarray], fused: bool, **kw: Any) -> Any:
    """Two token files (one uint32, several files) and an in-memory dataset of token arrays
    mixed in every chunk; with ``fused=False`` a map keeps split and pack apart."""
    src = zp.StaticMixtureWorkSource(
        [
            zp.TokenFileSource(paths[0], eos_id=1),
            zp.TokenFileSource(paths[1:], dtype="uint32", eos_id=1),
            zp.ArraySource([{"tokens": a} for a in arrays]),
        ],
        weights=[0.5, 0.3, 0.2],
        seed=7,
        chunk_size=12,
        num_epochs=1,
    )
    pipe = zp.Pipeline(src, canonical_replicas=3, flush_every_k_chunks=3, prefetch=0, **kw)
    pipe = pipe.fetch().split(40)
    if not fused:
        pipe = pipe.map(_keep)
    return pipe.pack(48, 3).batch(2)


def test_token_spans_mixed_with_other_samples_give_the_operators_batches(tmp_path) -> None:
    rng = np.random.default_rng(9)

    def write(path: Any, docs: int, dtype: str) -> Any:
        lengths = np.minimum(rng.lognormal(2.5, 1.3, docs).astype(np.int64) + 1, 150)
        tokens = rng.integers(2, np.iinfo(dtype).max, int(lengths.sum()), dtype=np.uint64)
        tokens = tokens.astype(dtype)
        tokens[np.cumsum(lengths) - 1] = 1
        tokens.tofile(path)
        return path

    paths = [write(tmp_path / "a.bin", 120, "uint16")]
    paths += [write(tmp_path / f"b{i}.bin", 40, "uint32") for i in range(2)]
    arrays = [rng.integers(2, 900, int(n), dtype=np.int32) for n in rng.integers(1, 90, 60)]
    with _mixed_pipeline(paths, arrays, True) as p:
        assert "fetch[spans]@p1" in p.explain()
        fused = take(p, 10_000)
    with _mixed_pipeline(paths, arrays, False) as p:
        assert "fetch[spans]" not in p.explain()
        plain = take(p, 10_000)
    assert len(fused) == len(plain) > 20
    assert all(batches_equal(a, b) for a, b in zip(plain, fused, strict=True))
    assert max(int(b["tokens"].max()) for b in fused) > 2**16  # the uint32 files' ids
    assert_resumes_exactly(lambda: _mixed_pipeline(paths, arrays, True), cuts=[0, 2, 9, 30])
