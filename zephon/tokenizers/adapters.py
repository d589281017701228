"""Tokenizers loaded from local files, for the ``tokenize`` operator.

:class:`HFTokenizer` reads a Hugging Face ``tokenizer.json`` with the ``tokenizers``
package (``pip install zephon[hf]``); :class:`SentencePieceTokenizer` reads a
sentencepiece ``.model`` file (``pip install zephon[sentencepiece]``). Neither ever
reaches for a model hub: give them a file.

Both pickle as their path, settings and the file's sha256 and reload the file when
unpickled (in a worker process, say), refusing a file whose content changed. Their
``repr`` names the file and its hash and feeds the pipeline fingerprint, so a checkpoint
written with one tokenizer is not restored into a pipeline that uses another.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.sources._fs import PathArg

_HASH_HEX_IN_REPR = 12
_HASH_BLOCK_BYTES = 1 << 20


def file_sha256(path: str) -> str:
    """Hex sha256 of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            h.update(block)
    return h.hexdigest()


class _FileTokenizer:
    """What both adapters share: the file, its hash, pickling by path, int32 output."""

    _owner = ""

    def __init__(self, path: PathArg) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"{self._owner}: no file at {self.path!r}; pass the path of a local "
                f"{self._file_kind()} (nothing is downloaded)"
            )
        self.sha256 = file_sha256(self.path)
        self._load()

    def _file_kind(self) -> str:
        raise NotImplementedError

    def _load(self) -> None:
        raise NotImplementedError

    def _settings(self) -> str:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        # The native tokenizer (and anything bound to it, all in `_` attributes) is rebuilt
        # from the file: shipping the path keeps worker start-up small and lets the worker
        # check that the file is the same one.
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"{self._owner}: unpickling needs {self.path!r}, which is gone; every process "
                "that runs the pipeline must see the tokenizer file at the same path"
            )
        found = file_sha256(self.path)
        if found != self.sha256:
            raise ValueError(
                f"{self._owner}: {self.path!r} changed since this tokenizer was built "
                f"(sha256 {self.sha256[:_HASH_HEX_IN_REPR]} then, {found[:_HASH_HEX_IN_REPR]} "
                "now); another file would tokenize differently: restore the file or build a "
                "new pipeline"
            )
        self._load()

    def __repr__(self) -> str:
        # The file's name, not its full path: the same file under another directory (on
        # another machine, say) still restores the same checkpoints. No addresses: this
        # is part of the pipeline fingerprint.
        return (
            f"{type(self).__name__}({os.path.basename(self.path)!r}, "
            f"sha256={self.sha256[:_HASH_HEX_IN_REPR]!r}, {self._settings()})"
        )

    def _text(self, text: Any) -> str:
        if isinstance(text, str):
            return text
        if isinstance(text, bytes | bytearray | memoryview):
            try:
                return bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{self._owner}.encode got bytes that are not UTF-8 ({e}); decode them "
                    "with .map() first"
                ) from e
        raise TypeError(
            f"{self._owner}.encode takes str or UTF-8 bytes; got {type(text).__name__}. "
            "Use .map() to pull the text out of your samples, or tokenize(field=...)"
        )


def _ids_array(ids: Sequence[int], head: int | None, tail: int | None) -> np.ndarray:
    """`ids` as int32, with `head` before and `tail` after when they are not None."""
    start = 0 if head is None else 1
    n = len(ids)
    out = np.empty(start + n + (0 if tail is None else 1), dtype=np.int32)
    if head is not None:
        out[0] = head
    out[start : start + n] = ids
    if tail is not None:
        out[-1] = tail
    return out


class HFTokenizer(_FileTokenizer):
    """A Hugging Face ``tokenizers`` tokenizer read from a ``tokenizer.json`` file.

    ``encode`` runs the tokenizer's whole pipeline (normaliser, pre-tokeniser, model and,
    with `add_special_tokens`, its post-processor) and appends the EOS id when `add_eos`;
    ``encode_batch`` encodes a chunk of texts in one call to the Rust batch encoder.

    Args:
        path: a local ``tokenizer.json`` (what ``Tokenizer.save`` or
            ``PreTrainedTokenizerFast.save_pretrained`` writes).
        add_eos: append the EOS id to every document. If the tokenizer's post-processor
            already appends one, pass False.
        eos_token: the EOS token's text, or its id.
        add_special_tokens: let the post-processor add its special tokens (a BOS, say),
            as ``Tokenizer.encode`` does by default.
    """

    _owner = "HFTokenizer"

    def __init__(
        self,
        path: PathArg,
        add_eos: bool = True,
        eos_token: str | int = "</s>",
        add_special_tokens: bool = True,
    ) -> None:
        self.add_eos = add_eos
        self.eos_token = eos_token
        self.add_special_tokens = add_special_tokens
        super().__init__(path)

    def _file_kind(self) -> str:
        return "tokenizer.json"

    def _load(self) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package; install it with "
                "`pip install zephon[hf]`"
            ) from e
        try:
            self._model = Tokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises a bare Exception on a bad file
            raise ValueError(
                f"HFTokenizer: {self.path!r} is not a tokenizers JSON file ({e}); pass the "
                "tokenizer.json that Tokenizer.save or save_pretrained wrote"
            ) from e
        self.eos_id = self._resolve_eos()
        # encode_batch_fast skips computing character offsets, which nothing here reads.
        self._batch = getattr(self._model, "encode_batch_fast", self._model.encode_batch)

    def _resolve_eos(self) -> int | None:
        size = self._model.get_vocab_size(with_added_tokens=True)
        if isinstance(self.eos_token, bool) or not isinstance(self.eos_token, int | str):
            raise TypeError(
                f"HFTokenizer: eos_token must be a token's text or an id; got "
                f"{type(self.eos_token).__name__} {self.eos_token!r}"
            )
        if isinstance(self.eos_token, int):
            if not 0 <= self.eos_token < size:
                raise ValueError(
                    f"HFTokenizer: eos_token id {self.eos_token} is outside the vocabulary of "
                    f"{os.path.basename(self.path)} (ids 0..{size - 1}); pass a valid id or the "
                    "token's text"
                )
            return self.eos_token
        eos_id = self._model.token_to_id(self.eos_token)
        if eos_id is None and self.add_eos:
            special = sorted(t.content for t in self._model.get_added_tokens_decoder().values())
            raise ValueError(
                f"HFTokenizer: {os.path.basename(self.path)} has no token {self.eos_token!r} "
                f"to use as EOS (its added tokens: {special[:20]}); pass eos_token= one of "
                "them or an id, or add_eos=False"
            )
        return eos_id

    def _settings(self) -> str:
        return (
            f"add_eos={self.add_eos}, eos_id={self.eos_id}, "
            f"add_special_tokens={self.add_special_tokens}"
        )

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``, added tokens included."""
        return int(self._model.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str | bytes) -> np.ndarray:
        ids = self._model.encode(self._text(text), add_special_tokens=self.add_special_tokens).ids
        return _ids_array(ids, None, self.eos_id if self.add_eos else None)

    def encode_batch(self, texts: Sequence[Any]) -> list[np.ndarray]:
        encodings = self._batch(
            [self._text(t) for t in texts], add_special_tokens=self.add_special_tokens
        )
        tail = self.eos_id if self.add_eos else None
        return [_ids_array(e.ids, None, tail) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        return str(
            self._model.decode(np.asarray(ids).tolist(), skip_special_tokens=skip_special_tokens)
        )


class SentencePieceTokenizer(_FileTokenizer):
    """A sentencepiece model read from a ``.model`` file.

    Args:
        path: a local sentencepiece model (what ``SentencePieceTrainer`` writes).
        add_eos: append the EOS id to every document.
        eos_token: the EOS piece's text or its id; None: the model's own EOS id.
        add_bos: put the model's BOS id before every document.
    """

    _owner = "SentencePieceTokenizer"

    def __init__(
        self,
        path: PathArg,
        add_eos: bool = True,
        eos_token: str | int | None = None,
        add_bos: bool = False,
    ) -> None:
        self.add_eos = add_eos
        self.eos_token = eos_token
        self.add_bos = add_bos
        super().__init__(path)

    def _file_kind(self) -> str:
        return "sentencepiece .model file"

    def _load(self) -> None:
        try:
            import sentencepiece
        except ImportError as e:
            raise ImportError(
                "SentencePieceTokenizer needs the `sentencepiece` package; install it with "
                "`pip install zephon[sentencepiece]`"
            ) from e
        try:
            self._model = sentencepiece.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as e:
            raise ValueError(
                f"SentencePieceTokenizer: {self.path!r} is not a sentencepiece model ({e}); "
                "pass the .model file that SentencePieceTrainer wrote"
            ) from e
        self.eos_id = self._resolve_eos()
        self.bos_id: int | None = None
        if self.add_bos:
            bos = int(self._model.bos_id())
            if bos < 0:
                raise ValueError(
                    f"SentencePieceTokenizer: {os.path.basename(self.path)} has no BOS piece "
                    "(trained with bos_id=-1); pass add_bos=False"
                )
            self.bos_id = bos

    def _resolve_eos(self) -> int | None:
        name = os.path.basename(self.path)
        size = int(self._model.get_piece_size())
        token = self.eos_token
        if token is None:
            eos = int(self._model.eos_id())
            if eos >= 0:
                return eos
            if self.add_eos:
                raise ValueError(
                    f"SentencePieceTokenizer: {name} has no EOS piece (trained with "
                    "eos_id=-1); pass eos_token= a piece or an id, or add_eos=False"
                )
            return None
        if isinstance(token, bool) or not isinstance(token, int | str):
            raise TypeError(
                f"SentencePieceTokenizer: eos_token must be a piece's text, an id or None; got "
                f"{type(token).__name__} {token!r}"
            )
        if isinstance(token, int):
            if not 0 <= token < size:
                raise ValueError(
                    f"SentencePieceTokenizer: eos_token id {token} is outside the vocabulary of "
                    f"{name} (ids 0..{size - 1}); pass a valid id or the piece's text"
                )
            return token
        piece_id = int(self._model.piece_to_id(token))
        unk = int(self._model.unk_id())
        # piece_to_id answers the unknown id for a piece it does not have.
        if piece_id == unk and token != self._model.id_to_piece(unk):
            if self.add_eos:
                raise ValueError(
                    f"SentencePieceTokenizer: {name} has no piece {token!r} to use as EOS; pass "
                    "eos_token= another piece, an id or None (the model's EOS), or add_eos=False"
                )
            return None
        return piece_id

    def _settings(self) -> str:
        return f"add_eos={self.add_eos}, eos_id={self.eos_id}, add_bos={self.add_bos}"

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``."""
        return int(self._model.get_piece_size())

    def encode(self, text: str | bytes) -> np.ndarray:
        ids = self._model.encode(self._text(text), out_type=int)
        return _ids_array(ids, self.bos_id, self.eos_id if self.add_eos else None)

    def encode_batch(self, texts: Sequence[Any]) -> list[np.ndarray]:
        batch = self._model.encode([self._text(t) for t in texts], out_type=int)
        tail = self.eos_id if self.add_eos else None
        return [_ids_array(ids, self.bos_id, tail) for ids in batch]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return str(self._model.decode(np.asarray(ids).tolist()))
