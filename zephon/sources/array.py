"""An in-memory random-access dataset."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from zephon.sources._fs import check_index
from zephon.sources.identity import array_identity, items_sample


class ArraySource:
    """Random access over items held in memory.

    A numpy array is kept as is (not copied) and ``ds[i]`` returns its row ``i``; any
    other iterable is copied into a tuple, so later changes to the caller's list cannot
    change what a resumed run reads.

    With worker processes a numpy array is not copied into each worker: a memory-mapped
    one (``np.load(path, mmap_mode="r")``) is mapped again from its file, any other of
    64 KiB or more is placed once in shared memory that the workers map read-only. A
    tuple of Python objects is pickled into every worker.
    """

    def __init__(self, items: np.ndarray | Iterable[Any]) -> None:
        if isinstance(items, np.ndarray):
            if items.ndim == 0:
                raise ValueError(
                    f"ArraySource: a numpy array needs at least one dimension; got a 0-d array "
                    f"({items!r}); wrap it in a list"
                )
            self._items: np.ndarray | tuple[Any, ...] = items
        else:
            self._items = tuple(items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Any:
        return self._items[check_index("ArraySource", index, len(self._items))]

    def read(self, indices: Sequence[int]) -> list[Any]:
        """Items at `indices`, in that order."""
        items = self._items
        if type(items) is tuple and indices:
            try:  # all in range: nothing to check one by one
                if min(indices) >= 0 and max(indices) < len(items):
                    return [items[i] for i in indices]
            except TypeError:
                pass  # not all ints: check_index below says which
        checked = [check_index("ArraySource", i, len(self._items)) for i in indices]
        if isinstance(self._items, np.ndarray):
            return list(self._items[checked])
        return [self._items[i] for i in checked]

    def token_lengths(self) -> np.ndarray:
        """Each item's token count, for token-denominated mixture weights: the length of an
        item that is a 1-D array or a sequence of ints, or of its ``"tokens"`` when it is a
        dict; the row length of a 2-D numpy array.

        Raises:
            TypeError: an item holds no tokens (text, say: its count depends on the
                tokenizer; build a length index with ``zephon lengths``).
        """
        items = self._items
        if isinstance(items, np.ndarray):
            if items.ndim >= 2 and items.dtype.kind in "iu":
                return np.full(len(items), items.shape[1], dtype=np.int64)
            if items.dtype != object:
                raise TypeError(
                    f"ArraySource of a {items.ndim}-D {items.dtype} array: its items are not "
                    "token arrays"
                )
        out = np.empty(len(items), dtype=np.int64)
        for i, item in enumerate(items):
            tokens = item.get("tokens") if isinstance(item, dict) else item
            if isinstance(tokens, np.ndarray) and tokens.ndim == 1:
                out[i] = tokens.shape[0]
            elif isinstance(tokens, list | tuple):
                out[i] = len(tokens)
            else:
                raise TypeError(
                    f"ArraySource item {i} is a {type(item).__name__}, not token ids (a 1-D "
                    "array, or a dict with a 'tokens' array); its token count depends on the "
                    "tokenizer"
                )
        return out

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: a numpy array's dtype and
        shape plus a digest of sampled elements (at most 512 KiB of them, copied), other
        items by a digest of up to 64 sampled items (plain values, bytes, arrays, lists and
        dicts by value; other objects by type only)."""
        items = self._items
        if isinstance(items, np.ndarray):
            return array_identity(items)
        return {"kind": "items", "sample": items_sample(items)}

    def __repr__(self) -> str:
        return f"ArraySource(len={len(self._items)})"
