"""The demo's corpus: text that ships with every CPython, so the demo needs no download.

Two components of very different document lengths: the 79 long help topics of
``pydoc_data.topics`` (what ``help("TOPIC")`` prints) and their ~2,000 paragraphs.
"""

from __future__ import annotations

from pydoc_data.topics import topics

import zephon as zp
from zephon.demo.pipelines import lm_chain


def topic_texts() -> list[str]:
    return [topics[k] for k in sorted(topics)]


def paragraphs(min_chars: int = 40) -> list[str]:
    return [
        p.strip()
        for k in sorted(topics)
        for p in topics[k].split("\n\n")
        if len(p.strip()) >= min_chars
    ]


def demo_source(seed: int = 0, chunk_size: int = 32) -> zp.StaticMixtureWorkSource:
    return zp.StaticMixtureWorkSource(
        datasets={
            "topics": zp.ArraySource(topic_texts()),
            "paragraphs": zp.ArraySource(paragraphs()),
        },
        weights={"topics": 0.3, "paragraphs": 0.7},
        seed=seed,
        chunk_size=chunk_size,
    )


def demo_pipeline(
    *,
    seed: int = 0,
    seq_len: int = 1024,
    batch_size: int = 8,
    lanes: int = 4,
    workers: int = 0,
    flush_every_k_chunks: int = 4,
) -> zp.Pipeline:
    """tokenize -> split -> pack -> shuffle -> ensure_mixture -> batch (:func:`lm_chain`)."""
    return lm_chain(
        zp.Pipeline(
            demo_source(seed),
            canonical_replicas=lanes,
            flush_every_k_chunks=flush_every_k_chunks,
            workers=workers,
        ),
        seq_len=seq_len,
        num_bins=8,
        shuffle_buffer=16,
        ensure_mixture=True,
        batch_size=batch_size,
    )
