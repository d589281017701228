"""Reading many rows of a random-access dataset at once."""

from __future__ import annotations

from typing import Any


def read_many(dataset: Any, indices: list[int]) -> list[Any]:
    """``dataset.read(indices)`` when the dataset offers it, else one ``__getitem__`` each."""
    read = getattr(dataset, "read", None)
    if read is not None:
        out = list(read(indices))
        if len(out) != len(indices):
            raise ValueError(
                f"{type(dataset).__name__}.read returned {len(out)} items for "
                f"{len(indices)} indices; read(indices) must return one item per index"
            )
        return out
    return [dataset[i] for i in indices]


def read_token_spans(dataset: Any, indices: list[int]) -> list[Any]:
    """Rows ``indices`` of ``dataset`` as token spans (``dataset.token_spans(indices)``, see
    :mod:`zephon.sources.token_span`) where it offers them and gives them (None: a token
    file behind a URL), else as :func:`read_many` reads them."""
    token_spans = getattr(dataset, "token_spans", None)
    if token_spans is not None:
        got = token_spans(indices)
        if got is not None:
            if len(got) != len(indices):
                raise ValueError(
                    f"{type(dataset).__name__}.token_spans returned {len(got)} spans for "
                    f"{len(indices)} indices; it must return one per index"
                )
            return list(got)
    return read_many(dataset, indices)
