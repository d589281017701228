"""Content identities: what a dataset holds, cheaply, for the pipeline fingerprint.

A checkpoint must not restore into a pipeline over other data. The fingerprint therefore
covers each component's *content identity*: a small dict of plain values that changes when
the data changes, computed from bounded reads whatever the dataset's size, and that does not
name where the data lives (a copied dataset still matches).

The sampled digest covers the size plus fixed, deterministic blocks: the first, the last and
``SAMPLE_BLOCKS - 2`` spread evenly between, ``SAMPLE_BLOCK_BYTES`` each (512 KiB read per
file at most; a file that small is digested whole). It notices another file, a change of
size, and any edit inside a sampled block; an edit that keeps the size and falls between the
blocks of a file over 512 KiB is not seen. That is the price of never scanning a file just to
identify it.

A dataset offers its own identity with a ``content_identity()`` method returning such a dict
(str keys; None, bool, int, float, str or lists of them). A plain numpy array, list or tuple
used as a dataset is identified as :class:`~zephon.ArraySource` would identify it. Any other
dataset without the method is identified by its type's name only, so its content is not
checked (its length is, separately, as before content identities existed).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon.sources._fs import open_binary

__all__ = [
    "SAMPLE_BLOCKS",
    "SAMPLE_BLOCK_BYTES",
    "SAMPLE_FILES",
    "SAMPLE_ITEMS",
    "array_identity",
    "array_sample",
    "dataset_identity",
    "files_sample",
    "items_sample",
    "sample_positions",
    "sample_spans",
    "short_digest",
]

SAMPLE_BLOCK_BYTES = 64 << 10
SAMPLE_BLOCKS = 8
SAMPLE_FILES = 8  # files of a sharded set whose blocks are digested
SAMPLE_ITEMS = 64  # items of an in-memory sequence (or rows of a table) digested at most
_DIGEST_BYTES = 8  # 16 hex digits: a check against accidents, not an adversary
_MAX_DEPTH = 16  # nesting followed inside one item before it is described by type only
_PLAIN = (type(None), bool, int, float, str)
_WHOLE_BYTES = SAMPLE_BLOCK_BYTES * SAMPLE_BLOCKS  # sample_spans covers this much whole


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=_DIGEST_BYTES)


def sample_spans(
    size: int, block: int = SAMPLE_BLOCK_BYTES, count: int = SAMPLE_BLOCKS
) -> list[tuple[int, int]]:
    """``(start, length)`` of the blocks that identify ``size`` units: the whole range when
    it fits in ``count`` blocks, else the first, the last and ``count - 2`` evenly between."""
    if size <= block * count:
        return [(0, size)] if size else []
    span = size - block
    return [(span * i // (count - 1), block) for i in range(count)]


def sample_positions(n: int, count: int = SAMPLE_ITEMS) -> list[int]:
    """Indices of the items that identify a sequence of ``n``: all of them up to ``count``,
    else the first, the last and ``count - 2`` evenly between."""
    if n <= count:
        return list(range(n))
    return [(n - 1) * i // (count - 1) for i in range(count)]


def files_sample(
    owner: str,
    paths: Sequence[str],
    sizes: Sequence[int] | None = None,
    counts: Sequence[int] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, str]:
    """The total size of ``paths`` and a digest identifying them.

    Up to ``SAMPLE_FILES`` files: each file's size and sampled blocks. More (a sharded set):
    every file's size (``sizes``, from metadata) and sample count (``counts``, from the
    index) and the sampled blocks of ``SAMPLE_FILES`` files spread over the set (the first,
    the last, evenly between), so that identifying 10,000 files reads no more than
    identifying 8. Reads at most ``SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES`` bytes per sampled
    file.

    Raises:
        OSError: a file cannot be read (or shrank while it was read); the message names it.
    """
    h = _hasher()
    if len(paths) <= SAMPLE_FILES or sizes is None:
        total = 0
        for path in paths:
            total += _feed_file(h, owner, path, storage_options)
        return total, h.hexdigest()
    h.update(b"files%d;" % len(paths))
    h.update(np.asarray(sizes, dtype="<i8").tobytes())
    if counts is not None:
        h.update(b"counts;" + np.asarray(counts, dtype="<i8").tobytes())
    for k in sample_positions(len(paths), SAMPLE_FILES):
        _feed_file(h, owner, paths[k], storage_options)
    return int(np.sum(np.asarray(sizes, dtype=np.int64))), h.hexdigest()


def _feed_file(h: Any, owner: str, path: str, storage_options: Mapping[str, Any] | None) -> int:
    with open_binary(owner, path, storage_options) as f:
        size = f.seek(0, os.SEEK_END)
        h.update(size.to_bytes(8, "little"))
        for start, length in sample_spans(size):
            f.seek(start)
            data = f.read(length)
            if len(data) != length:
                raise OSError(
                    f"{owner}: {path} ended at {start + len(data)} bytes while identifying "
                    f"it ({size} bytes a moment before); is it being written?"
                )
            h.update(data)
    return int(size)


def array_sample(array: np.ndarray) -> str:
    """A digest of an array's dtype, shape and sampled elements (bounded whatever its size
    or layout: only the sampled elements are copied; a memory-mapped array reads only
    their pages). Arrays of Python objects are digested item by item."""
    h = _hasher()
    h.update(f"{array.dtype.str}{array.shape}".encode())
    _feed_array(h, array, 0)
    return h.hexdigest()


def items_sample(items: Sequence[Any]) -> str:
    """A digest of a sequence's length and of sampled items, each through a stable encoding
    (plain values, bytes, numpy arrays, lists and dicts by value; other objects by type)."""
    h = _hasher()
    _feed(h, items, 0)
    return h.hexdigest()


def short_digest(text: str) -> str:
    """16 hex digits identifying ``text``."""
    h = _hasher()
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def array_identity(array: np.ndarray) -> dict[str, Any]:
    """The identity of a numpy array: dtype, shape and a digest of sampled elements."""
    return {
        "kind": "array",
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "sample": array_sample(array),
    }


def dataset_identity(ds: Any) -> dict[str, Any]:
    """``ds.content_identity()`` when the dataset offers one, checked; a plain numpy array,
    list or tuple as :class:`~zephon.ArraySource` identifies it; any other dataset by its
    type's name only.

    Raises:
        TypeError: ``content_identity()`` returned something other than a dict of str keys
            to plain values (None, bool, int, float, str, or lists of them).
    """
    offer: Callable[[], Any] | None = getattr(ds, "content_identity", None)
    if not callable(offer):
        if isinstance(ds, np.ndarray) and ds.ndim > 0:
            return array_identity(ds)
        if isinstance(ds, list | tuple):
            return {"kind": "items", "sample": items_sample(ds)}
        return {"kind": "type", "type": type(ds).__qualname__}
    identity = offer()
    if not isinstance(identity, Mapping) or not all(
        isinstance(k, str) and _is_plain(v) for k, v in identity.items()
    ):
        raise TypeError(
            f"{type(ds).__qualname__}.content_identity() must return a dict of str keys to "
            f"None, bool, int, float, str or lists of them; got {identity!r:.200}"
        )
    return dict(identity)


def _is_plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(x, _PLAIN) for x in value)
    return isinstance(value, _PLAIN)


# ---------------------------------------------------------------- stable encoding


def _feed(h: Any, value: Any, depth: int) -> None:
    """Feed a type-tagged, length-prefixed encoding of ``value`` to ``h``: equal data gives
    equal bytes in every process (never a repr that holds an address)."""
    if type(value) is str:  # the common item: first
        _feed_bytes(h, b"s", value.encode("utf-8", "surrogatepass"))
    elif depth > _MAX_DEPTH:
        h.update(b"d")
    elif value is None:
        h.update(b"n")
    elif isinstance(value, bool):
        h.update(b"t" if value else b"f")
    elif isinstance(value, int):
        h.update(b"i%d;" % value)
    elif isinstance(value, float):
        h.update(b"r" + value.hex().encode() + b";")
    elif isinstance(value, str):
        _feed_bytes(h, b"s", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes | bytearray | memoryview):
        _feed_bytes(h, b"b", bytes(value))
    elif isinstance(value, np.ndarray):
        h.update(f"a{value.dtype.str}{value.shape};".encode())
        _feed_array(h, value, depth)
    elif isinstance(value, np.generic):
        h.update(f"g{value.dtype.str};".encode())
        h.update(value.tobytes())
    elif isinstance(value, Mapping):
        h.update(b"m%d;" % len(value))
        for i, (k, v) in enumerate(value.items()):
            if i == SAMPLE_ITEMS:
                break
            _feed(h, k, depth + 1)
            _feed(h, v, depth + 1)
    elif isinstance(value, list | tuple) or (
        isinstance(value, Sequence) and hasattr(value, "__getitem__")
    ):
        n = len(value)
        h.update(b"l%d;" % n)
        for i in sample_positions(n):
            _feed(h, value[i], depth + 1)
    else:
        kind = type(value)
        h.update(f"o{kind.__module__}.{kind.__qualname__};".encode())


def _feed_bytes(h: Any, tag: bytes, data: bytes) -> None:
    h.update(b"%s%d;" % (tag, len(data)))
    if len(data) <= _WHOLE_BYTES:
        h.update(data)
        return
    view = memoryview(data)
    for start, length in sample_spans(len(data)):
        h.update(view[start : start + length])


def _feed_array(h: Any, array: np.ndarray, depth: int) -> None:
    flat = array.flat  # indexes any layout without copying the whole array
    if array.dtype.hasobject:
        for i in sample_positions(array.size):
            _feed(h, flat[i], depth + 1)
        return
    per_block = max(1, SAMPLE_BLOCK_BYTES // max(array.dtype.itemsize, 1))
    for start, length in sample_spans(array.size, per_block):
        h.update(np.ascontiguousarray(flat[start : start + length]).tobytes())
