"""Small deterministic corpora for integration tests (imported by the test modules)."""

from __future__ import annotations

import numpy as np

import zephon as zp


def docs(n: int, seed: int, lo: int = 5, hi: int = 300, alphabet: str = "abcdefgh ") -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list(alphabet))
    return [
        "".join(letters[rng.integers(0, len(letters), int(k))]) for k in rng.integers(lo, hi, n)
    ]


def lm_pipeline(
    *,
    seed: int = 0,
    lanes: int = 4,
    k: int | None = 2,
    chunk_size: int = 7,
    n_docs: int = 60,
    num_epochs: int | None = 1,
    seq_len: int = 64,
    batch_size: int = 3,
    prefetch: int = 2,
    output: str = "interleave",
    **kw,
) -> zp.Pipeline:
    """tokenize -> split -> pack -> shuffle -> ensure_mixture -> batch over two components
    whose documents differ in length."""
    src = zp.StaticMixtureWorkSource(
        datasets={
            "long": zp.ArraySource(docs(n_docs, seed, 20, 200)),
            "short": zp.ArraySource(docs(n_docs, seed + 1, 3, 40)),
        },
        weights={"long": 0.6, "short": 0.4},
        seed=seed,
        chunk_size=chunk_size,
        num_epochs=num_epochs,
    )
    return (
        zp.Pipeline(
            src,
            canonical_replicas=lanes,
            flush_every_k_chunks=k,
            prefetch=prefetch,
            output=output,
            **kw,
        )
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(max_len=seq_len)
        .pack(seq_len=seq_len, num_bins=3)
        .shuffle(buffer_size=4)
        .ensure_mixture()
        .batch(batch_size)
    )
