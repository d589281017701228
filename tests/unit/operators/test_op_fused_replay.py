"""A restore replays a fused ``tokenize -> split -> pack`` lane by token counts alone
(:meth:`TokenizeSplitPack.forward`): it must give exactly what replaying every sample
through the operators gives — the same batches, the same drop count, the same next
checkpoint — and never build a record per sample or tokens for a dropped bin."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.operators import fused
from zephon.operators.fused import TokenizeSplitPack, _Doc
from zephon.operators.tokenize import Tokenize
from zephon.testing import assert_same_batches, roundtrip, take

ASCII = [("ab" * ((i * 7919) % 300)) + f" a{i}" for i in range(300)]
# Multi-byte text (counted by encoding), bytes samples and empty ones.
MIXED = [("é€" * ((i * 31) % 50)) + f" m{i}" if i % 3 else b"raw" * (i % 40) for i in range(200)]
EMPTY = ["", "x", "", "yz" * 9, ""] * 40


class CountingByteTokenizer(zp.ByteTokenizer):
    """Counts how many texts were encoded (a dropped bin's samples never are)."""

    def __init__(self, add_eos: bool = True) -> None:
        super().__init__(add_eos)
        self.encoded = 0

    def encode(self, text: Any) -> np.ndarray:
        self.encoded += 1
        return super().encode(text)

    def encode_batch(self, texts: list[Any]) -> list[np.ndarray]:
        self.encoded += len(texts)
        return super().encode_batch(texts)


def _build(
    docs: list[Any],
    max_len: int,
    seq_len: int,
    k: int,
    chunk: int,
    add_eos: bool = True,
    fetch_threads: int = 1,
    tokenizer: zp.ByteTokenizer | None = None,
) -> zp.Pipeline:
    half = len(docs) // 2
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(docs[:half]), zp.ArraySource(docs[half:])],
        weights=[0.5, 0.5],
        seed=3,
        chunk_size=chunk,
    )
    return (
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=k, prefetch=0)
        .fetch(parallelism=fetch_threads)
        .tokenize(tokenizer or zp.ByteTokenizer(add_eos=add_eos))
        .split(max_len=max_len)
        .pack(seq_len=seq_len, num_bins=3)
        .batch(2)
    )


def _restore(
    build: Any, step: int, n: int, forward: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], dict[str, Any], dict[str, Any], int]:
    """The ``n`` batches after restoring a checkpoint taken at ``step``, the stats, the
    checkpoint after them, and how many chunks went through ``forward``."""
    with build() as p:
        take(p, step)
        state = roundtrip(p.checkpoint())
    calls = []
    real_forward = TokenizeSplitPack.forward
    with monkeypatch.context() as m:
        if not forward:
            m.setattr(TokenizeSplitPack, "forwards", lambda self, lane: False)

        def spy(self: TokenizeSplitPack, *args: Any, **kwargs: Any) -> Any:
            calls.append(args[0])
            return real_forward(self, *args, **kwargs)

        m.setattr(TokenizeSplitPack, "forward", spy)
        with build() as q:
            q.restore(state)
            got = take(q, n)
            return got, q.stats(), q.checkpoint(), len(calls)


CONFIGS = {
    "ascii, whole samples": dict(docs=ASCII, max_len=256, seq_len=256, k=2, chunk=16),
    "multi-byte and bytes, split pieces": dict(docs=MIXED, max_len=37, seq_len=64, k=3, chunk=7),
    "empty samples without eos, a flush per chunk": dict(
        docs=EMPTY, max_len=8, seq_len=8, k=1, chunk=5, add_eos=False
    ),
    "fetch on threads: the stage gets records": dict(
        docs=ASCII, max_len=100, seq_len=128, k=2, chunk=9, fetch_threads=2
    ),
}


@pytest.fixture(params=["C", "Python"])
def drop_phase(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The replay's drop phase in C (``zephon._pack``), or its pure-Python twin."""
    if request.param == "C":
        if fused._NATIVE is None:
            pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
    else:
        monkeypatch.setattr(fused, "_NATIVE", None)
    return str(request.param)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("step", [1, 4, 11, 26])
def test_replay_by_length_equals_the_full_replay_and_the_uninterrupted_run(
    monkeypatch: pytest.MonkeyPatch, config: str, step: int, drop_phase: str
) -> None:
    def build() -> zp.Pipeline:
        return _build(**CONFIGS[config])

    with build() as p:
        expected = take(p, step + 12)[step:]
    fast, fast_stats, fast_after, forwarded = _restore(build, step, 12, True, monkeypatch)
    full, full_stats, full_after, none = _restore(build, step, 12, False, monkeypatch)
    assert forwarded > 0 and none == 0
    assert_same_batches(expected, fast, f"{config}, step {step}, by length")
    assert_same_batches(expected, full, f"{config}, step {step}, full replay")
    assert fast_stats["replay_dropped_records"] == full_stats["replay_dropped_records"] > 0
    assert fast_stats["replayed_chunks"] == full_stats["replayed_chunks"]
    assert fast_after == full_after


def test_dropped_bins_are_never_tokenized(monkeypatch: pytest.MonkeyPatch, drop_phase: str) -> None:
    counted: dict[bool, int] = {}
    for forward in (True, False):
        tok = CountingByteTokenizer()
        build = lambda tok=tok: _build(ASCII, 256, 256, 4, 16, tokenizer=tok)  # noqa: E731
        with build() as p:
            take(p, 40)
            state = roundtrip(p.checkpoint())
        if not forward:
            monkeypatch.setattr(TokenizeSplitPack, "forwards", lambda self, lane: False)
        tok.encoded = 0
        with build() as q:
            q.restore(state)
            next(q)
            counted[forward] = tok.encoded
            dropped = q.stats()["replay_dropped_records"]
    # The full replay tokenizes every replayed sample; by length, only those whose bins
    # the first batches assemble.
    assert dropped > 4
    assert 0 < counted[True] < counted[False] / 2


def test_a_tokenizer_whose_count_disagrees_with_encode_is_named() -> None:
    tok = Tokenize(zp.ByteTokenizer())
    with pytest.raises(ValueError, match=r"ByteTokenizer.count_tokens said 5 tokens but encode"):
        _Doc("abc", tok, 5).tokens()
    assert list(_Doc("abc", tok, 4)[0]) == [100, 101, 102, 1]


def test_the_c_drop_phase_rejects_what_it_cannot_place() -> None:
    if fused._NATIVE is None:
        pytest.skip("zephon._pack is not built (or ZEPHON_PURE_PYTHON=1)")
    from zephon.records import Contributor

    drop = fused._NATIVE.drop_until_target
    with pytest.raises(ValueError, match="a token count is negative"):
        drop([[], []], [0, 0], 8, 8, [(0, 0)], [0], ["x"], [-1], (0, 0, 0), Contributor, [])
    with pytest.raises(ValueError, match="need 1 <= max_len <= cap"):
        drop([[]], [0], 8, 9, [], [], [], [], (0, 0, 0), Contributor, [])
    with pytest.raises(ValueError, match="differ in length"):
        drop([[]], [0], 8, 8, [(0, 0)], [], ["x"], [1], (0, 0, 0), Contributor, [])
    # A bin of 3 tokens and one of 2; a 4-token piece fits nowhere in cap 4: the fullest bin
    # (a real piece and a bare one) is dropped, the piece lands there and fills it: dropped
    # too, and it starts with the target.
    real = ([Contributor(7, 0, 0, True)], {0: 1}, None, 1)
    held = [[real, ((7, 1), 0, True, 0, 2, 0, "ab", 2)], [((7, 2), 1, True, 2, 4, 0, "cdef", 4)]]
    fill, dropped = [3, 2], []
    k, child, drops, found = drop(
        held, fill, 4, 4, [(8, 0)], [1], ["wxyz"], [4], (8, 0, 0), Contributor, dropped
    )
    assert (k, child, drops) == (1, 0, 1) and found == (8, 0, 0, True)
    assert dropped == [(7, 0, 0, True), (7, 1, 0, True), (8, 0, 0, True)]
    assert all(type(c) is Contributor for c in dropped)
    assert held == [[], [((7, 2), 1, True, 2, 4, 0, "cdef", 4)]] and fill == [0, 2]
    # The target is the first piece of a split sample: the rest of it is left to Python.
    held, fill, dropped = [[], []], [0, 0], []
    got = drop(held, fill, 4, 4, [(8, 3)], [0], ["x" * 10], [10], (8, 3, 0), Contributor, dropped)
    assert got == (0, 1, 0, (8, 3, 0, False)) and held == [[], []] and fill == [0, 0]
