"""A document of a token file as a span of the mapped file: no copy until its row is written.

A pipeline that packs pre-tokenized documents straight from their files (``fetch``,
``split`` and ``pack`` fused into one stage, the plan's choice: see
:attr:`~zephon.plan.compile.Plan.spans`) reads each document as a :data:`Span`: the mapped
file's array and the document's first and end token. Split cuts a long one into spans of
the same array, pack places them by length, and the row writer copies each straight from
the file into its row of the batch, widened to int32 as ``astype(np.int32)`` widens: one
copy per token, where a document read as an array is copied twice (into its array, then
into the row), and no array or dict per document.

As a piece's arrays a span has one column, its tokens: ``span[0]`` makes them as a new
int32 array (what every other reader of a piece gets). ``zephon._tokens.Span``
(``native/span.h``) is the same type in C; :data:`Span` is whichever runs, chosen once for
the process (``ZEPHON_PURE_PYTHON=1``: this one).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon._native import load

_INT32 = np.dtype(np.int32)


class TokenSpan:
    """Tokens ``lo:hi`` of ``tokens``, a 1-D contiguous array of uint16 or uint32 ids (a
    token file as mapped), made an int32 array when read (``span[0]``)."""

    __slots__ = ("tokens", "lo", "hi")

    def __init__(self, tokens: np.ndarray, lo: int, hi: int) -> None:
        if not isinstance(tokens, np.ndarray):
            raise TypeError(f"tokens must be a numpy array; got {type(tokens).__name__}")
        if (
            tokens.ndim != 1
            or not tokens.flags.c_contiguous
            or tokens.dtype.kind != "u"
            or tokens.dtype.itemsize not in (2, 4)
        ):
            raise ValueError("tokens must be a 1-D contiguous array of uint16 or uint32 ids")
        if not 0 <= lo <= hi <= len(tokens):
            raise ValueError(f"span {lo}:{hi} is not inside the {len(tokens)} tokens")
        self.tokens, self.lo, self.hi = tokens, int(lo), int(hi)

    def __len__(self) -> int:
        return 1  # one column, as a piece's arrays: the tokens

    def __getitem__(self, column: int) -> np.ndarray:
        if column != 0:
            raise IndexError("a span has one column, its tokens (span[0])")
        return self.tokens[self.lo : self.hi].astype(_INT32)

    def __repr__(self) -> str:
        return f"Span({self.lo}:{self.hi}, uint{self.tokens.dtype.itemsize * 8})"


def _spans(tokens: np.ndarray, bounds: np.ndarray, indices: Sequence[int]) -> list[Any] | None:
    """``zephon._tokens.spans`` in Python: document ``indices[k]`` (tokens ``bounds[i]:
    bounds[i + 1]``) as a span; None where an index is not an int in range."""
    docs = len(bounds) - 1
    out = []
    for index in indices:
        try:
            i = operator.index(index)
        except TypeError:
            return None
        if not 0 <= i < docs:
            return None
        out.append(TokenSpan(tokens, int(bounds[i]), int(bounds[i + 1])))
    return out


# The C type reads the ids in this machine's order: token files are little-endian.
_NATIVE = load("_tokens") if sys.byteorder == "little" else None
#: The span type of this process: ``zephon._tokens.Span`` where it is built, else
#: :class:`TokenSpan`.
Span: Any = _NATIVE.Span if _NATIVE is not None else TokenSpan
#: The C span type where it is built (what ``zephon._pack`` takes), else None.
NATIVE_SPAN: Any = _NATIVE.Span if _NATIVE is not None else None
#: ``spans(tokens, bounds, indices) -> list[Span] | None``, in C where it is built.
spans: Any = _NATIVE.spans if _NATIVE is not None else _spans
