"""Tokenizers: :class:`ByteTokenizer` (no files, for tests and demos) and the file-backed
:class:`HFTokenizer` and :class:`SentencePieceTokenizer`, whose fingerprint is the file's
digest."""

from zephon.tokenizers.adapters import HFTokenizer, SentencePieceTokenizer
from zephon.tokenizers.base import ByteTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer"]
