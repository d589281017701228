"""Random access over the documents of a flat binary token file."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from zephon.sources._fs import PathArg, check_index
from zephon.sources.identity import files_sample

_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# Tokens compared per step when splitting at EOS: bounds the temporary bool array.
_SCAN_TOKENS = 1 << 24


class TokenFileSource:
    """Documents of a flat file of little-endian token ids (the nanoGPT/Megatron layout).

    The file is memory-mapped, and ``ds[i]`` returns ``{"tokens": int32 array}`` (a copy)
    so that documents flow straight into pack and split. Documents come from exactly one
    of:

    Args:
        path: the token file.
        dtype: ``"uint16"`` or ``"uint32"``, the width of one token.
        eos_id: split after every occurrence of this id; each document keeps its
            trailing EOS, consecutive EOS ids give one-token documents, and tokens after
            the last EOS form a final document.
        index_path: a file of ``N + 1`` little-endian int64 token offsets: document ``i``
            is ``tokens[index[i]:index[i + 1]]``, starting at 0 and ending at the token
            count.
    """

    def __init__(
        self,
        path: PathArg,
        dtype: Literal["uint16", "uint32"] = "uint16",
        eos_id: int | None = None,
        index_path: PathArg | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(
                f"TokenFileSource: dtype must be one of {sorted(_DTYPES)}; got {dtype!r}"
            )
        if (eos_id is None) == (index_path is None):
            raise ValueError(
                "TokenFileSource: pass exactly one of eos_id (split at an end-of-sequence id) "
                f"or index_path (document offsets); got eos_id={eos_id!r}, "
                f"index_path={index_path!r}"
            )
        self._path = os.fspath(path)
        self._dtype = _DTYPES[dtype]
        size_bytes = os.path.getsize(self._path)
        if size_bytes % self._dtype.itemsize:
            raise ValueError(
                f"TokenFileSource: {self._path} holds {size_bytes} bytes, not a multiple of "
                f"{self._dtype.itemsize} ({dtype}); check the dtype or the file"
            )
        self._num_tokens = size_bytes // self._dtype.itemsize
        self._tokens: np.ndarray | None = None
        self._eos_id = eos_id
        self._index_path = None if index_path is None else os.fspath(index_path)
        # Document i is tokens[_bounds[i]:_bounds[i + 1]].
        if self._index_path is not None:
            self._bounds = _load_index(self._index_path, self._num_tokens)
        elif eos_id is not None:
            self._bounds = self._split_at_eos(dtype, eos_id)

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        i = check_index("TokenFileSource", index, len(self))
        return {"tokens": np.array(self._mapped()[self._bounds[i] : self._bounds[i + 1]], np.int32)}

    def read(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Documents at `indices`, in that order."""
        return [self[i] for i in indices]

    def token_offsets(self) -> np.ndarray:
        """The ``N + 1`` token offsets of the documents (document ``i`` has ``o[i + 1] -
        o[i]`` tokens), for token-denominated mixture weights. Shared, not copied."""
        return self._bounds

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: the token file's size and a
        digest of sampled blocks (see :mod:`zephon.sources.identity`; at most 512 KiB
        read), the dtype and how documents are split (the EOS id, or the index file's size
        and sample). Not the paths: a copied dataset still matches."""
        total, sample = files_sample("TokenFileSource", [self._path])
        identity: dict[str, Any] = {
            "kind": "token_file",
            "bytes": total,
            "sample": sample,
            "dtype": self._dtype.name,
            "eos_id": self._eos_id,
        }
        if self._index_path is not None:
            identity["index_bytes"], identity["index_sample"] = files_sample(
                "TokenFileSource", [self._index_path]
            )
        return identity

    def __getstate__(self) -> dict[str, Any]:
        # A memmap would pickle as a full in-memory copy; the receiver maps the file again.
        return {**self.__dict__, "_tokens": None}

    def __repr__(self) -> str:
        split = (
            f"eos_id={self._eos_id}"
            if self._index_path is None
            else f"index_path={self._index_path!r}"
        )
        return (
            f"TokenFileSource({self._path!r}, dtype={self._dtype.name!r}, {split}, len={len(self)})"
        )

    def _mapped(self) -> np.ndarray:
        if self._tokens is None:
            # np.memmap refuses empty files; an empty array reads the same.
            self._tokens = (
                np.memmap(self._path, dtype=self._dtype, mode="r")
                if self._num_tokens
                else np.empty(0, self._dtype)
            )
        return self._tokens

    def _split_at_eos(self, dtype: str, eos_id: int) -> np.ndarray:
        limit = np.iinfo(self._dtype).max
        if not 0 <= eos_id <= limit:
            raise ValueError(
                f"TokenFileSource: eos_id {eos_id} does not fit {dtype} (0..{limit}); "
                "check eos_id or dtype"
            )
        tokens = self._mapped()
        ends = [
            np.flatnonzero(tokens[start : start + _SCAN_TOKENS] == eos_id) + (start + 1)
            for start in range(0, self._num_tokens, _SCAN_TOKENS)
        ]
        bounds = np.concatenate([[0], *ends]).astype(np.int64)
        if bounds[-1] != self._num_tokens:  # tokens after the last EOS form a document
            bounds = np.append(bounds, self._num_tokens)
        return bounds


def _load_index(index_path: str, num_tokens: int) -> np.ndarray:
    size_bytes = os.path.getsize(index_path)
    if size_bytes % 8 or size_bytes == 0:
        raise ValueError(
            f"TokenFileSource: index file {index_path} holds {size_bytes} bytes; it must hold "
            "N + 1 little-endian int64 offsets (a positive multiple of 8 bytes)"
        )
    bounds = np.fromfile(index_path, dtype="<i8").astype(np.int64)
    if bounds[0] != 0:
        raise ValueError(
            f"TokenFileSource: index file {index_path} must start at offset 0; "
            f"position 0 holds {bounds[0]}"
        )
    decreasing = np.flatnonzero(np.diff(bounds) < 0)
    if decreasing.size:
        bad = int(decreasing[0]) + 1
        raise ValueError(
            f"TokenFileSource: index file {index_path} must be non-decreasing; position {bad} "
            f"holds {bounds[bad]}, less than {bounds[bad - 1]} before it"
        )
    if bounds[-1] != num_tokens:
        raise ValueError(
            f"TokenFileSource: index file {index_path} must end at the token count "
            f"{num_tokens}; its last position {len(bounds) - 1} holds {bounds[-1]}; "
            "was it written for another token file or dtype?"
        )
    return bounds
