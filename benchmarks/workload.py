"""The LM workload shared by every throughput benchmark (Zephon and the Grain baseline).

Synthetic documents, each a pure function of ``(seed, index)``: a length in bytes drawn
log-uniform in [50, 5000], filled with pseudo-words whose ranks follow a Zipf(a=1.2) law
truncated to a fixed 20,000-word vocabulary, joined by spaces and cut to that length. Then a
ByT5-style byte tokenizer, first-fit packing to ``SEQ_LEN`` with ``NUM_BINS`` bins, batches of
``BATCH_SIZE``.

Generating one document is vectorised (a handful of numpy calls, ~20-50 us) so a benchmark
measures the loader, not the generator; the benchmarks go further and pregenerate the corpus
into a plain list (:func:`pregenerate`) so that both loaders read the same objects at the same
cost.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np

SEQ_LEN = 2048
NUM_BINS = 8
BATCH_SIZE = 8

MIN_DOC_BYTES = 50
MAX_DOC_BYTES = 5000
VOCAB_SIZE = 20_000
VOCAB_SEED = 1234
ZIPF_A = 1.2
MIN_WORD_LEN = 2
MAX_WORD_LEN = 10

# ByT5 special ids: pad 0, eos 1, unk 2; byte b -> b + 3.
PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BYTE_OFFSET = 3

_LOG_MIN = math.log(MIN_DOC_BYTES)
_LOG_MAX = math.log(MAX_DOC_BYTES)


class _Vocab:
    """The pseudo-word vocabulary (distinct words), laid out for vectorised gathering.

    ``buf`` holds every word followed by one space; word ``r`` (rank r, 0 = most frequent)
    occupies ``buf[start[r] : start[r] + size[r]]`` where ``size`` counts the trailing space.
    ``cdf`` is the cumulative truncated Zipf(a) distribution over ranks.
    """

    def __init__(self, size: int, seed: int, a: float) -> None:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
        # Distinct words: draw candidates (a few extra, since two-letter words collide often),
        # keep first occurrences, in draw order.
        words: dict[bytes, None] = {}
        while len(words) < size:
            n = size + size // 4
            lengths = rng.integers(MIN_WORD_LEN, MAX_WORD_LEN + 1, size=n)
            letters = rng.integers(ord("a"), ord("z") + 1, size=int(lengths.sum()), dtype=np.uint8)
            blob = letters.tobytes()
            ends = np.cumsum(lengths).tolist()
            starts = [0, *ends[:-1]]
            for s, e in zip(starts, ends, strict=True):
                words.setdefault(blob[s:e])
                if len(words) == size:
                    break
        chosen = list(words)
        # Each word with its trailing space.
        self.size = np.fromiter((len(w) + 1 for w in chosen), dtype=np.int64, count=size)
        self.start = np.zeros(size, dtype=np.int64)
        np.cumsum(self.size[:-1], out=self.start[1:])
        self.buf = np.frombuffer(b"".join(w + b" " for w in chosen), dtype=np.uint8)
        weights = np.arange(1, size + 1, dtype=np.float64) ** (-a)
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        cdf[-1] = 1.0
        self.cdf = cdf
        # Expected bytes per drawn word (with its space), used to size the first draw.
        self.mean_bytes = float(np.dot(weights / weights.sum(), self.size))

    def word(self, rank: int) -> str:
        s = int(self.start[rank])
        return self.buf[s : s + int(self.size[rank]) - 1].tobytes().decode("ascii")


@functools.cache
def _vocab() -> _Vocab:
    """Built once per process, deterministically from ``VOCAB_SEED``."""
    return _Vocab(VOCAB_SIZE, VOCAB_SEED, ZIPF_A)


def vocabulary() -> list[str]:
    """The pseudo-words, most frequent (rank 0) first."""
    v = _vocab()
    return [v.word(r) for r in range(VOCAB_SIZE)]


def make_doc(seed: int, index: int) -> str:
    """Document ``index`` of the corpus with ``seed``: a pure function of the pair."""
    v = _vocab()
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, index])))
    target = int(math.exp(rng.uniform(_LOG_MIN, _LOG_MAX)))
    target = min(max(target, MIN_DOC_BYTES), MAX_DOC_BYTES)
    # Draw enough words in one go almost always; top up (still deterministically) if short.
    n = int(target / v.mean_bytes * 1.3) + 8
    ranks = np.searchsorted(v.cdf, rng.random(n), side="right")
    sizes = v.size[ranks]
    ends = np.cumsum(sizes)
    while ends[-1] < target:
        more = np.searchsorted(v.cdf, rng.random(n), side="right")
        ranks = np.concatenate([ranks, more])
        sizes = v.size[ranks]
        ends = np.cumsum(sizes)
    m = int(np.searchsorted(ends, target, side="left")) + 1  # words needed to reach target
    sizes = sizes[:m]
    total = int(ends[m - 1])
    # Byte positions of the chosen words inside the vocabulary buffer.
    offsets = np.repeat(v.start[ranks[:m]] - (ends[:m] - sizes), sizes)
    idx = np.arange(total, dtype=np.int64) + offsets
    return v.buf[idx[:target]].tobytes().decode("ascii")


class SyntheticDocs:
    """Random-access dataset of synthetic documents (Grain's RandomAccessDataSource protocol).

    ``ds[i]`` depends only on ``(seed, i)``: two instances with the same seed agree, whatever
    order they are read in.
    """

    def __init__(self, num_docs: int, seed: int = 0) -> None:
        if num_docs < 0:
            raise ValueError(f"num_docs must be >= 0, got {num_docs}")
        self.num_docs = int(num_docs)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, index: int) -> str:
        i = int(index)
        if i < 0:
            i += self.num_docs
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document index {index} out of range [0, {self.num_docs})")
        return make_doc(self.seed, i)

    def read(self, indices: Iterable[int]) -> list[str]:
        return [self[i] for i in indices]

    def __repr__(self) -> str:
        return f"SyntheticDocs(num_docs={self.num_docs}, seed={self.seed})"


def pregenerate(ds: Sequence[str] | SyntheticDocs) -> tuple[str, ...]:
    """Materialise every document into a plain in-memory tuple (what the benchmarks read).

    A tuple, because it is immutable: ``zp.ArraySource`` keeps it as is where it would copy
    a list, and so does Grain's ``MapDataset.source``. Building a loader then costs the same
    for both, nothing per document."""
    n = len(ds)
    if hasattr(ds, "read"):
        return tuple(ds.read(range(n)))
    return tuple(ds[i] for i in range(n))


def byte_tokenize(text: str) -> np.ndarray:
    """ByT5-style ids: byte b -> b + 3, then EOS (1). int32. Pad 0 and unk 2 are never emitted."""
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    out = np.empty(raw.size + 1, dtype=np.int32)
    np.add(raw, BYTE_OFFSET, out=out[:-1], dtype=np.int32)
    out[-1] = EOS_ID
    return out


def split_tokens(tokens: np.ndarray, max_len: int = SEQ_LEN) -> list[np.ndarray]:
    """Consecutive pieces of at most ``max_len`` tokens (what Zephon's ``split`` does)."""
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if tokens.size <= max_len:
        return [tokens]
    return [tokens[i : i + max_len] for i in range(0, tokens.size, max_len)]
