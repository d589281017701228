"""A restore replays a fused ``tokenize -> split -> pack`` lane by token counts alone (the
stage places pieces by length while the replay view says the lane replays, and a piece's
tokens are made when its bin is assembled): it must give exactly what replaying every
sample with its tokens gives — the same batches, the same drop count, the same next
checkpoint — and never tokenize a sample whose bins the replay filter drops."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.operators.pack.fused import _Docs
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


class UncountedByteTokenizer(CountingByteTokenizer):
    """The same tokens, but it cannot count them: a replay tokenizes every sample."""

    count_tokens = None  # type: ignore[assignment]


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
    config: dict[str, Any], step: int, n: int, counted: bool
) -> tuple[list[Any], dict[str, Any], dict[str, Any], int]:
    """The ``n`` batches after restoring a checkpoint taken at ``step``, the stats, the
    lanes of the checkpoint after them, and how many samples the restore tokenized."""
    add_eos = config.get("add_eos", True)
    tok = (CountingByteTokenizer if counted else UncountedByteTokenizer)(add_eos=add_eos)
    with _build(**config, tokenizer=tok) as p:
        take(p, step)
        state = roundtrip(p.checkpoint())
    tok.encoded = 0
    with _build(**config, tokenizer=tok) as q:
        q.restore(state)
        got = take(q, n)
        return got, q.stats(), q.checkpoint()["lanes"], tok.encoded


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


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("step", [1, 4, 11, 26])
def test_replay_by_length_equals_the_full_replay_and_the_uninterrupted_run(
    config: str, step: int
) -> None:
    with _build(**CONFIGS[config]) as p:
        expected = take(p, step + 12)[step:]
    fast, fast_stats, fast_after, _ = _restore(CONFIGS[config], step, 12, counted=True)
    full, full_stats, full_after, _ = _restore(CONFIGS[config], step, 12, counted=False)
    assert_same_batches(expected, fast, f"{config}, step {step}, by length")
    assert_same_batches(expected, full, f"{config}, step {step}, full replay")
    assert fast_stats["replay_dropped_records"] == full_stats["replay_dropped_records"] > 0
    assert fast_stats["replayed_chunks"] == full_stats["replayed_chunks"]
    assert fast_after == full_after


def test_dropped_bins_are_never_tokenized() -> None:
    config = dict(docs=ASCII, max_len=256, seq_len=256, k=4, chunk=16)
    with _build(**config) as p:  # type: ignore[arg-type]
        expected = take(p, 41)[40]
    counted: dict[bool, int] = {}
    for by_length in (True, False):
        got, stats, _, counted[by_length] = _restore(config, 40, 1, counted=by_length)
        assert_same_batches([expected], got, f"by_length={by_length}")
        assert stats["replay_dropped_records"] > 4
    # The full replay tokenizes every replayed sample; by length, only those whose bins
    # the first batch assembles.
    assert 0 < counted[True] < counted[False] / 2


def test_a_tokenizer_whose_count_disagrees_with_encode_is_named() -> None:
    tok = Tokenize(zp.ByteTokenizer())
    with pytest.raises(ValueError, match=r"ByteTokenizer.count_tokens said 5 tokens but encode"):
        _Docs(["abc"], [5], tok).tokens(0)
    docs = _Docs(["ab", "abc", "x"], [3, 4, 2], tok)
    assert list(docs.tokens(1)) == [100, 101, 102, 1]
    assert docs.ids[0] is None and docs.ids[2] is not None  # later samples: in the same batch


class _BadCount(zp.ByteTokenizer):
    def count_tokens(self, texts: list[Any]) -> list[int]:
        return [1] * (len(texts) + 1)


def test_a_count_of_the_wrong_length_is_named() -> None:
    config = dict(docs=ASCII, max_len=256, seq_len=256, k=2, chunk=16)
    with _build(**config, tokenizer=_BadCount()) as p:  # type: ignore[arg-type]
        take(p, 5)
        state = roundtrip(p.checkpoint())
    with _build(**config, tokenizer=_BadCount()) as q:  # type: ignore[arg-type]
        q.restore(state)
        with pytest.raises(
            ValueError, match=r"_BadCount.count_tokens returned 17 counts for 16 texts"
        ):
            next(q)
