"""``tokenize``: text to ``{"tokens": int32 array}``, keeping a dict sample's other fields.

A sample that is a dict keeps every field but the text one (``field``, default ``"text"``),
which ``tokens`` replaces: a document's ``loss_weight`` or ``source`` reaches ``split``
(which cuts per-token features along and copies the rest to each piece) and ``pack``
(``meta_features``, ``broadcast``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from zephon.chunks import SamplePointer
from zephon.operators.base import Operator, OpTraits, Output
from zephon.records import Record

_INT32 = np.dtype(np.int32)


class Tokenize(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "tokenize"

    def __init__(self, tokenizer: Any, field: str | None = None, parallelism: int = 1) -> None:
        if isinstance(tokenizer, (str, bytes)):
            raise TypeError(
                f"tokenize needs a tokenizer object, not the name {tokenizer!r}; load one, e.g. "
                "zp.ByteTokenizer() or HFTokenizer('path/to/tokenizer.json')"
            )
        if not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(
                f"tokenize needs an object with encode(text); got {type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        self.field = field
        self.parallelism = parallelism
        self._encode_batch = getattr(tokenizer, "encode_batch", None)

    def _text(self, data: Any) -> Any:
        if isinstance(data, dict):
            key = self.field or "text"
            try:
                return data[key]
            except KeyError:
                raise KeyError(
                    f"tokenize: sample has no field {key!r} (fields: {sorted(data)}); "
                    "pass tokenize(tokenizer, field=...)"
                ) from None
        if isinstance(data, SamplePointer):
            raise TypeError(
                "tokenize got a SamplePointer, not a sample: add .fetch() before .tokenize()"
            )
        return data

    def texts(self, samples: list[Any]) -> list[Any]:
        """What each sample gives the tokenizer (:meth:`_text`; plain strings as they are)."""
        if all(type(x) is str for x in samples):
            return samples
        return [self._text(x) for x in samples]

    def _emit(self, record: Record, ids: Any) -> Record:
        tokens = ids if type(ids) is np.ndarray and ids.dtype is _INT32 else np.asarray(ids, _INT32)
        (component,) = record.component_tokens  # a sample: one component
        data = record.data
        if isinstance(data, dict) and len(data) > 1:
            text = self.field or "text"
            out = {"tokens": tokens}
            for k, v in data.items():
                if k != text and k != "tokens":
                    out[k] = v
        else:
            out = {"tokens": tokens}
        return Record(out, record.lane, record.contributors, {component: len(tokens)})

    def process(self, record: Record) -> Iterable[Output]:
        return (self._emit(record, self.tokenizer.encode(self._text(record.data))),)

    def encode_texts(self, texts: list[Any]) -> Sequence[Any]:
        """The tokenizer's ids for each text (``encode_batch`` when it has one)."""
        if self._encode_batch is None:
            return [self.tokenizer.encode(t) for t in texts]
        encoded = self._encode_batch(texts)
        if len(encoded) != len(texts):
            raise ValueError(
                f"{type(self.tokenizer).__name__}.encode_batch returned {len(encoded)} results "
                f"for {len(texts)} texts; it must return one per text"
            )
        return encoded

    def process_batch(self, records: list[Record]) -> list[Output]:
        encoded = self.encode_texts(self.texts([r.data for r in records]))
        return [self._emit(r, ids) for r, ids in zip(records, encoded, strict=True)]

    def fresh(self) -> Operator:
        return self

    def fingerprint(self) -> str:
        return f"Tokenize({self.tokenizer!r}, field={self.field!r})"

    def fingerprint_parts(self) -> dict[str, str]:
        return {"tokenizer": repr(self.tokenizer), "field": repr(self.field)}

    def __repr__(self) -> str:
        return f"Tokenize(tokenizer={self.tokenizer!r}, field={self.field!r}, parallelism={self.parallelism})"
