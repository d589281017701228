"""Helpers shared by the file-backed sources: path arguments, opening local paths or
fsspec URLs, and index checks."""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import IO

PathArg = str | os.PathLike[str]
PathsArg = PathArg | Sequence[PathArg]


def normalize_paths(owner: str, paths: PathsArg) -> list[str]:
    """Turn one path or a sequence of paths into a non-empty list of strings."""
    if isinstance(paths, str | os.PathLike):
        return [os.fspath(paths)]
    result = [os.fspath(p) for p in paths]
    if not result:
        raise ValueError(f"{owner}: paths is empty; pass at least one file")
    return result


def is_url(path: str) -> bool:
    """Whether `path` names a protocol (``s3://``, ``memory://``) that fsspec must open."""
    return "://" in path


def open_binary(owner: str, path: str) -> IO[bytes]:
    """Open a local path or an fsspec URL for binary reading; the caller closes it."""
    if not is_url(path):
        return open(path, "rb")
    try:
        import fsspec
    except ImportError as e:
        raise ImportError(
            f"{owner}: reading {path!r} needs fsspec; install it with `pip install zephon[fsspec]`"
        ) from e
    return fsspec.open(path, "rb").open()


def check_index(owner: str, index: int, length: int) -> int:
    """Return `index` as an int in ``[0, length)``.

    Negative indices are rejected rather than wrapped: an index that came out of a
    permutation or a checkpoint should never be negative, so one is a bug upstream.
    """
    i = operator.index(index)
    if not 0 <= i < length:
        raise IndexError(
            f"{owner}: index {i} is out of range for length {length}; indices must be in [0, {length})"
        )
    return i


def describe_paths(paths: Sequence[str]) -> str:
    """A short repr of a path list, so that reprs of sources over many files stay readable."""
    if len(paths) <= 3:
        return repr(list(paths))
    return f"[{paths[0]!r}, ... {len(paths)} files]"
