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
