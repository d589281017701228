"""Random access over the documents of flat binary token files."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from zephon._native import load
from zephon.sources._fs import (
    DEFAULT_TIMEOUT_S,
    PathArg,
    PathsArg,
    StorageOptions,
    check_index,
    describe_paths,
    expand_paths,
    file_info,
    is_url,
    read_ranges,
)
from zephon.sources.identity import files_sample
from zephon.sources.index_cache import FileIndexes, FileReader
from zephon.sources.token_span import spans

_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# Tokens compared per step when splitting at EOS: bounds the temporary bool array.
_SCAN_TOKENS = 1 << 24
# A read's documents made out of a mapped file in one C call (the files are
# little-endian: the mapping is read as it is only on a little-endian host).
_NATIVE = load("_tokens") if sys.byteorder == "little" else None


class TokenFileSource:
    """Documents of flat files of little-endian token ids (the nanoGPT/Megatron layout).

    Local files are memory-mapped; URLs (``s3://``) are read by byte ranges, a batch's
    documents concurrently. ``ds[i]`` returns ``{"tokens": int32 array}`` (a copy) so that
    documents flow straight into pack and split. Several files (a list, or glob patterns)
    are one dataset, documents numbered across them in order; a document never spans two
    files. Documents come from exactly one of:

    Args:
        paths: a token file, a list of them, or glob patterns (each pattern's files in
            sorted order).
        dtype: ``"uint16"`` or ``"uint32"``, the width of one token.
        eos_id: split after every occurrence of this id; each document keeps its
            trailing EOS, consecutive EOS ids give one-token documents, and tokens after
            the last EOS form a final document. The scan runs once per file: its result
            is cached and memory-mapped like JSONL indexes
            (:mod:`zephon.sources.index_cache`).
        index_path: (one token file only) a file of ``N + 1`` little-endian int64 token
            offsets: document ``i`` is ``tokens[index[i]:index[i + 1]]``, starting at 0 and
            ending at the token count.
        storage_options: passed to fsspec for URLs (credentials, ``endpoint_url``, ...).
        timeout_s: how long one read of a URL may take, retries included.
    """

    def __init__(
        self,
        paths: PathsArg,
        dtype: Literal["uint16", "uint32"] = "uint16",
        eos_id: int | None = None,
        index_path: PathArg | None = None,
        *,
        storage_options: StorageOptions = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
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
        self._dtype = _DTYPES[dtype]
        self._storage_options = None if storage_options is None else dict(storage_options)
        self._timeout_s = float(timeout_s)
        self._paths = expand_paths("TokenFileSource", paths, self._storage_options)
        self._eos_id = eos_id
        self._index_path = None if index_path is None else os.fspath(index_path)
        if self._index_path is not None and len(self._paths) != 1:
            raise ValueError(
                f"TokenFileSource: index_path goes with one token file; got {len(self._paths)} "
                f"files ({describe_paths(self._paths)}); split them at eos_id instead, or make "
                "one source per file"
            )
        if eos_id is not None:
            limit = np.iinfo(self._dtype).max
            if not 0 <= eos_id <= limit:
                raise ValueError(
                    f"TokenFileSource: eos_id {eos_id} does not fit {dtype} (0..{limit}); "
                    "check eos_id or dtype"
                )
        self._index = FileIndexes(
            "TokenFileSource",
            self._paths,
            f"eos-{self._dtype.str[1:]}-{eos_id}",
            functools.partial(_split_at_eos, self._dtype, eos_id),
            self._storage_options,
            self._timeout_s,
        )
        sizes = []
        for path in self._paths:
            size_bytes, _ = file_info("TokenFileSource", path, self._storage_options, timeout_s)
            if size_bytes % self._dtype.itemsize:
                raise ValueError(
                    f"TokenFileSource: {path} holds {size_bytes} bytes, not a multiple of "
                    f"{self._dtype.itemsize} ({dtype}); check the dtype or the file"
                )
            sizes.append(size_bytes)
        self._file_tokens = np.array(sizes, dtype=np.int64) // self._dtype.itemsize
        self._num_tokens = int(self._file_tokens.sum())
        self._tokens: list[np.ndarray | None] = [None] * len(self._paths)
        self._bounds_one: np.ndarray | None = None
        if self._index_path is not None:
            self._bounds_one = _load_index(self._index_path, self._num_tokens)
            docs = np.array([len(self._bounds_one) - 1], dtype=np.int64)
        else:
            self._index.ensure()
            docs = self._index.counts - 1
        # Document i lives in file f where _file_starts[f] <= i < _file_starts[f + 1].
        self._file_starts = np.concatenate(([0], np.cumsum(docs))).astype(np.int64)
        self._offsets: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self._file_starts[-1])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.read([check_index("TokenFileSource", index, len(self))])[0]

    def read(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Documents at `indices`, in that order (a URL's as concurrent range reads)."""
        if len(self._paths) == 1 and not is_url(self._paths[0]):  # one local file
            got = self._local(0, indices)
            if got is not None:
                return got
        files, lo, hi = self._spans(indices)  # (names an index that is not one)
        if len(self._paths) == 1 and not is_url(self._paths[0]):
            return self._copied(0, lo.tolist(), hi.tolist())
        out: list[dict[str, np.ndarray]] = [{} for _ in range(len(files))]
        remote: list[int] = []
        for f in np.unique(files).tolist():
            where: list[int] = np.flatnonzero(files == f).tolist()
            if is_url(self._paths[f]):
                remote.extend(where)
                continue
            local = (np.asarray(indices)[where] - self._file_starts[f]).tolist()
            got = self._local(f, local)
            if got is None:
                got = self._copied(f, lo[where].tolist(), hi[where].tolist())
            for k, doc in zip(where, got, strict=True):
                out[k] = doc
        if remote:
            remote.sort()
            size = self._dtype.itemsize
            paths = self._paths
            ranges = [(paths[files[k]], int(lo[k]) * size, int(hi[k]) * size) for k in remote]
            raw = read_ranges("TokenFileSource", ranges, self._storage_options, self._timeout_s)
            for k, data in zip(remote, raw, strict=True):
                out[k] = {"tokens": np.frombuffer(data, self._dtype).astype(np.int32)}
        return out

    def token_spans(self, indices: Sequence[int]) -> list[Any] | None:
        """Documents at ``indices`` as :data:`~zephon.sources.token_span.Span` spans of the
        mapped files (no copy: the tokens are copied once, into their packed row, by a
        pipeline whose plan reads spans); None for files behind URLs, which are read.
        An index that is not one gets the same error as :meth:`read`."""
        if any(is_url(p) for p in self._paths):
            return None
        if len(self._paths) == 1:
            got = spans(self._mapped(0), np.asarray(self._bounds(0), np.int64), indices)
            if got is not None:
                return got  # type: ignore[no-any-return]
        files, lo, hi = self._spans(indices)  # (names an index that is not one)
        out: list[Any] = [None] * len(files)
        for f in np.unique(files).tolist():
            where: list[int] = np.flatnonzero(files == f).tolist()
            local = (np.asarray(indices)[where] - self._file_starts[f]).tolist()
            got = spans(self._mapped(f), np.asarray(self._bounds(f), np.int64), local)
            assert got is not None  # (checked above)
            for k, span in zip(where, got, strict=True):
                out[k] = span
        return out

    def token_offsets(self) -> np.ndarray:
        """The ``N + 1`` token offsets of the documents across the files (document ``i``
        has ``o[i + 1] - o[i]`` tokens), for token-denominated mixture weights. Shared, not
        copied, for one file."""
        if self._offsets is None:
            if len(self._paths) == 1:
                self._offsets = self._bounds(0)
            else:
                bases = np.concatenate(([0], np.cumsum(self._file_tokens)))
                parts = [self._bounds(f)[:-1] + bases[f] for f in range(len(self._paths))]
                self._offsets = np.concatenate([*parts, [self._num_tokens]]).astype(np.int64)
        return self._offsets

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: the token files' total
        size and a digest of sampled blocks (see :mod:`zephon.sources.identity`; at most
        512 KiB read per file, of up to 8 files of a larger set, whose sizes and document
        counts are digested instead), the dtype and how documents are split (the EOS id,
        or the index file's size and sample). Not the paths: a copied dataset still
        matches."""
        counts = np.diff(self._file_starts).tolist()
        total, sample = files_sample(
            "TokenFileSource",
            self._paths,
            sizes=(self._file_tokens * self._dtype.itemsize).tolist(),
            counts=counts,
            storage_options=self._storage_options,
        )
        identity: dict[str, Any] = {
            "kind": "token_file",
            "bytes": total,
            "sample": sample,
            "dtype": self._dtype.name,
            "eos_id": self._eos_id,
        }
        if len(self._paths) > 1:
            identity["files"] = len(self._paths)
        if self._index_path is not None:
            identity["index_bytes"], identity["index_sample"] = files_sample(
                "TokenFileSource", [self._index_path]
            )
        return identity

    def __getstate__(self) -> dict[str, Any]:
        # A memmap would pickle as a full in-memory copy; the receiver maps the file again.
        return {
            **self.__dict__,
            "_tokens": [None] * len(self._paths),
            "_offsets": None if len(self._paths) > 1 else self._offsets,
        }

    def __repr__(self) -> str:
        split = (
            f"eos_id={self._eos_id}"
            if self._index_path is None
            else f"index_path={self._index_path!r}"
        )
        where = repr(self._paths[0]) if len(self._paths) == 1 else describe_paths(self._paths)
        return f"TokenFileSource({where}, dtype={self._dtype.name!r}, {split}, len={len(self)})"

    def _bounds(self, f: int) -> np.ndarray:
        if self._bounds_one is not None:
            return self._bounds_one
        return self._index.array(f)

    def _spans(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(file, first token, end token)`` of each of documents ``indices``, as arrays."""
        n = len(self)
        idx = np.asarray(indices)
        if (
            idx.dtype.kind not in "iu"
            or idx.ndim != 1
            or (idx.size and not 0 <= idx.min() <= idx.max() < n)
        ):
            # Something not a flat list of ints in range: say which, one at a time.
            idx = np.array([check_index("TokenFileSource", i, n) for i in indices], np.int64)
        idx = idx.astype(np.int64, copy=False)
        if len(self._paths) == 1:
            # A plain ndarray over the mapping: indexing a np.memmap runs its
            # __array_finalize__ (in Python) for every result.
            bounds = self._bounds(0).view(np.ndarray)
            return np.zeros(len(idx), np.int64), bounds[idx], bounds[idx + 1]
        files = np.searchsorted(self._file_starts, idx, side="right") - 1
        j = idx - self._file_starts[files]
        lo, hi = np.empty_like(idx), np.empty_like(idx)
        for f in np.unique(files).tolist():
            at = files == f
            bounds = self._bounds(f).view(np.ndarray)
            lo[at], hi[at] = bounds[j[at]], bounds[j[at] + 1]
        return files, lo, hi

    def _local(self, f: int, local: Sequence[int]) -> list[dict[str, np.ndarray]] | None:
        """Documents ``local`` (numbered within local file ``f``), each ``{"tokens": its own
        int32 array}`` (a document must not keep the others of its read alive), in one C
        call where ``zephon._tokens`` is built: an array, a conversion and a dict per
        document in Python cost four times as much. None where it is not built, or where an
        index is not an int in range (the caller's check names it)."""
        if _NATIVE is None:
            return None
        bounds = self._bounds(f)
        if bounds.dtype != np.int64:  # (an index cache always holds int64)
            return None
        tokens = self._mapped(f)
        got: list[dict[str, np.ndarray]] | None = _NATIVE.documents(
            tokens, tokens.itemsize, bounds, local, "tokens"
        )
        return got

    def _copied(self, f: int, los: list[int], his: list[int]) -> list[dict[str, np.ndarray]]:
        """:meth:`_local` in numpy: tokens ``los[k]:his[k]`` of local file ``f``."""
        tokens = self._mapped(f)
        return [{"tokens": tokens[a:b].astype(np.int32)} for a, b in zip(los, his, strict=True)]

    def _mapped(self, f: int) -> np.ndarray:
        tokens = self._tokens[f]
        if tokens is None:
            # np.memmap refuses empty files; an empty array reads the same.
            # A plain ndarray over the mapping: slicing a np.memmap costs twice as much
            # (its __array_finalize__ runs for every document).
            tokens = self._tokens[f] = (
                np.memmap(self._paths[f], dtype=self._dtype, mode="r").view(np.ndarray)
                if self._file_tokens[f]
                else np.empty(0, self._dtype)
            )
        return tokens


def _split_at_eos(
    dtype: np.dtype[Any], eos_id: int | None, reader: FileReader
) -> tuple[np.ndarray, dict[str, Any]]:
    """The ``N + 1`` document bounds (in tokens) of one file split after each EOS id."""
    assert eos_id is not None  # the index of a source with index_path is never built
    ends = []
    done = 0  # tokens before this block
    for block in reader.blocks():
        tokens = np.frombuffer(block, dtype=dtype)
        for start in range(0, len(tokens), _SCAN_TOKENS):
            hits = np.flatnonzero(tokens[start : start + _SCAN_TOKENS] == eos_id)
            ends.append(hits + (done + start + 1))
        done += len(tokens)
    bounds = np.concatenate([[0], *ends]).astype(np.int64)
    if bounds[-1] != done:  # tokens after the last EOS form a document
        bounds = np.append(bounds, done)
    return bounds, {}


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
