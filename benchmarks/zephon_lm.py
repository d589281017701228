"""Zephon's pipeline for the LM workload, the counterpart of ``grain_baseline``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import zephon as zp
from benchmarks.workload import BATCH_SIZE, NUM_BINS, SEQ_LEN
from zephon.demo.pipelines import lm_chain


def zephon_lm_pipeline(
    docs: Sequence[str],
    seed: int,
    workers: int = 0,
    *,
    lanes: int = 8,
    chunk_size: int = 64,
    flush_every_k_chunks: int = 4,
    seq_len: int = SEQ_LEN,
    num_bins: int = NUM_BINS,
    batch_size: int = BATCH_SIZE,
    prefetch: int | None = None,
    shuffle_buffer: int | None = None,
    pack_kw: Mapping[str, Any] | None = None,
    **pipeline_kw: Any,
) -> zp.Pipeline:
    """Shuffled (Feistel) source -> byte tokens -> split -> first-fit pack -> batch, with all
    tracking on (:func:`zephon.demo.pipelines.lm_chain`). The pack operator reorders, so
    epoch-based eviction and flush sentinels run exactly as in a real job. ``shuffle_buffer``
    adds ``.shuffle(...)`` before ``batch``; ``pack_kw`` goes to ``pack`` (another
    ``strategy``: with ``"concat_then_split"`` there is no split); ``pipeline_kw`` goes to
    ``zp.Pipeline`` (``rank``, ``world_size``, ``output``, ...)."""
    src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=seed, chunk_size=chunk_size)
    return lm_chain(
        zp.Pipeline(
            src,
            canonical_replicas=lanes,
            flush_every_k_chunks=flush_every_k_chunks,
            workers=workers,
            prefetch=prefetch,
            **pipeline_kw,
        ),
        seq_len=seq_len,
        num_bins=num_bins,
        pack_kw=pack_kw,
        shuffle_buffer=shuffle_buffer,
        batch_size=batch_size,
    )
