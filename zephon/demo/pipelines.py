"""The LM chain: ``fetch -> tokenize -> split -> pack -> shuffle -> ensure_mixture -> batch``,
appended to a pipeline by :func:`lm_chain`.

One builder for the demo (:func:`zephon.demo.corpus.demo_pipeline`), the integration tests
that pin its seeded outputs (``tests/integration/corpus.py``) and the benchmarks that measure
it (``benchmarks/zephon_lm.py`` and the scripts built on it), so that all of them run the same
operators with the same parameters. Each caller keeps its own work source and ``zp.Pipeline``
options (lanes, ``flush_every_k_chunks``, workers, output, ...); what differs in the chain
(the tokenizer, a map after tokenize, pack's options, whether to shuffle or keep the mixture)
is a parameter here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zephon as zp


def lm_chain(
    pipe: zp.Pipeline,
    *,
    seq_len: int,
    batch_size: int,
    num_bins: int | None = None,
    tokenizer: Any = None,
    map_tokens: Callable[[Any], Any] | None = None,
    pack_kw: Mapping[str, Any] | None = None,
    shuffle_buffer: int | None = None,
    ensure_mixture: bool | Sequence[float] = False,
) -> zp.Pipeline:
    """``pipe`` with ``fetch -> tokenize -> [map] -> split -> pack -> [shuffle] ->
    [ensure_mixture] -> batch`` after it.

    Args:
      pipe: a pipeline over its work source, with no operators yet.
      seq_len: the length of a packed row (and split's ``max_len``).
      batch_size: records per batch (``batch``'s defaults otherwise).
      num_bins: pack's open rows per lane (pack's default when None). Not passed with
        ``strategy="concat_then_split"``, which keeps one row open.
      tokenizer: the tokenizer (default ``zp.ByteTokenizer()``).
      map_tokens: a function mapped over the tokenized documents before split, e.g. one that
        adds a per-token feature for pack's ``meta_features``.
      pack_kw: more of pack's options (``strategy``, ``max_segments``, ``pad_values``,
        ``order``, ...). With ``strategy="concat_then_split"`` there is no split: that
        packer cuts whole documents itself.
      shuffle_buffer: when given, a ``shuffle(buffer_size=shuffle_buffer)`` after pack.
      ensure_mixture: ``True``: an ``ensure_mixture()`` after that (the work source's
        weights); a sequence of weights: ``ensure_mixture(weights)``; ``False``: none.

    Returns:
      The pipeline of batches.
    """
    pack_kw = dict(pack_kw or {})
    pipe = pipe.fetch().tokenize(zp.ByteTokenizer() if tokenizer is None else tokenizer)
    if map_tokens is not None:
        pipe = pipe.map(map_tokens)
    if pack_kw.get("strategy") == "concat_then_split":
        pipe = pipe.pack(seq_len=seq_len, **pack_kw)
    else:
        pipe = pipe.split(max_len=seq_len).pack(seq_len=seq_len, num_bins=num_bins, **pack_kw)
    if shuffle_buffer is not None:
        pipe = pipe.shuffle(buffer_size=shuffle_buffer)
    if ensure_mixture is True:
        pipe = pipe.ensure_mixture()
    elif ensure_mixture is not False:
        pipe = pipe.ensure_mixture(list(ensure_mixture))
    return pipe.batch(batch_size)
