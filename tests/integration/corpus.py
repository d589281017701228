"""Small deterministic corpora for integration tests (imported by the test modules)."""

from __future__ import annotations

import numpy as np

import zephon as zp
from zephon.demo.pipelines import lm_chain


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
    pack_kw: dict | None = None,
    **kw,
) -> zp.Pipeline:
    """tokenize -> split -> pack -> shuffle -> ensure_mixture -> batch (the demo's
    :func:`~zephon.demo.pipelines.lm_chain`) over two components whose documents differ in
    length.

    ``pack_kw`` goes to ``pack`` (with ``strategy="concat_then_split"`` there is no split);
    when it names meta features or broadcast fields, documents are dicts with a ``weight``
    field and a map after tokenize adds a per-token ``mask``."""
    pack_kw = dict(pack_kw or {})
    fields = bool(pack_kw.get("meta_features") or pack_kw.get("broadcast"))
    long_docs, short_docs = docs(n_docs, seed, 20, 200), docs(n_docs, seed + 1, 3, 40)
    if fields:
        long_docs = [{"text": t, "weight": 0.5 + i % 3} for i, t in enumerate(long_docs)]
        short_docs = [{"text": t, "weight": 0.25} for t in short_docs]
    src = zp.StaticMixtureWorkSource(
        datasets={
            "long": zp.ArraySource(long_docs),
            "short": zp.ArraySource(short_docs),
        },
        weights={"long": 0.6, "short": 0.4},
        seed=seed,
        chunk_size=chunk_size,
        num_epochs=num_epochs,
    )
    return lm_chain(
        zp.Pipeline(
            src,
            canonical_replicas=lanes,
            flush_every_k_chunks=k,
            prefetch=prefetch,
            output=output,
            **kw,
        ),
        seq_len=seq_len,
        num_bins=3,
        map_tokens=with_mask if fields else None,
        pack_kw=pack_kw,
        shuffle_buffer=4,
        ensure_mixture=True,
        batch_size=batch_size,
    )


def with_mask(d: dict) -> dict:
    """A per-token feature for pack's meta features: the parity of each token."""
    return {**d, "mask": (d["tokens"] % 2).astype(np.int8)}


#: pack options the worker and elastic matrices run (issue 17).
PACK_OPTIONS = {
    "best_fit": {"strategy": "best_fit", "max_segments": 3, "pad_values": {"tokens": -1}},
    "concat_then_split": {
        "strategy": "concat_then_split",
        "bos_id": 1,
        "bos_handling": "replace_first_token",
        "component_feature": "tokens_component",
    },
    "fields": {
        "strategy": "best_fit",
        "meta_features": ("mask",),
        "broadcast": {"weight": "float32"},
        "component_feature": "tokens_component",
        "pad_values": {"mask": -1},
    },
}
