"""Tokenizers for the ``tokenize`` operator.

A tokenizer is any object with ``encode(text) -> np.ndarray[int32]``; ``encode_batch`` is
used when present, and so is ``count_tokens(texts) -> list[int]`` (``len(encode(t))`` for
each text, without building the ids): a restore then replays samples that are dropped
again without tokenizing them. :class:`ByteTokenizer` is built in; adapters for Hugging Face
``tokenizers`` and sentencepiece live beside it once their extras are installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BYTE_OFFSET = 3


class ByteTokenizer:
    """ByT5's byte-level scheme: pad 0, eos 1, unk 2, byte ``b`` -> ``b + 3``.

    Args:
        add_eos: append ``EOS_ID`` to every document (ByT5 does).
    """

    vocab_size = 256 + BYTE_OFFSET

    def __init__(self, add_eos: bool = True) -> None:
        self.add_eos = add_eos

    @staticmethod
    def _bytes(text: str | bytes) -> bytes:
        if isinstance(text, str):
            return text.encode("utf-8")
        if isinstance(text, (bytes, bytearray, memoryview)):
            return bytes(text)
        raise TypeError(
            f"ByteTokenizer.encode takes str or bytes; got {type(text).__name__}. "
            "Use .map() to pull the text out of your samples, or tokenize(field=...)"
        )

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = self._bytes(text)
        n = len(raw)
        out = np.empty(n + (1 if self.add_eos else 0), dtype=np.int32)
        np.add(np.frombuffer(raw, dtype=np.uint8), BYTE_OFFSET, out=out[:n], dtype=np.int32)
        if self.add_eos:
            out[n] = EOS_ID
        return out

    def encode_batch(self, texts: list[Any]) -> list[np.ndarray]:
        """All texts in one pass over one buffer; each result is a view of its own span."""
        raws = [self._bytes(t) for t in texts]
        if len(raws) < 2:
            return [self.encode(r) for r in raws]
        sizes = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
        if self.add_eos:
            # A placeholder byte after every text becomes EOS once the bytes are shifted.
            sizes += 1
            joined = b"\0".join(raws) + b"\0"
        else:
            joined = b"".join(raws)
        ends = np.cumsum(sizes)
        out = np.empty(len(joined), dtype=np.int32)
        np.add(np.frombuffer(joined, dtype=np.uint8), BYTE_OFFSET, out=out, dtype=np.int32)
        if self.add_eos:
            out[ends - 1] = EOS_ID
        bounds = ends.tolist()
        return [out[a:b] for a, b in zip([0, *bounds[:-1]], bounds, strict=True)]

    def count_tokens(self, texts: list[Any]) -> list[int]:
        """``len(self.encode(t))`` for each text, without encoding (an ASCII str's length is
        its byte count)."""
        eos = 1 if self.add_eos else 0
        try:
            if all(map(str.isascii, texts)):  # plain ASCII strings, the common case
                return [n + eos for n in map(len, texts)]
        except TypeError:
            pass  # not all str
        return [
            (len(t) if t.isascii() else len(t.encode("utf-8"))) + eos
            if type(t) is str
            else len(self._bytes(t)) + eos
            for t in texts
        ]

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        body = ids[ids >= BYTE_OFFSET] - BYTE_OFFSET
        return body.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(add_eos={self.add_eos})"
