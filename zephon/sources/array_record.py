"""Random access over the records of ArrayRecord files (Grain's and MaxText's format)."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon.sources._fs import (
    CACHE_SUFFIX,
    DEFAULT_TIMEOUT_S,
    PathsArg,
    StorageOptions,
    _call,
    check_index,
    describe_paths,
    expand_paths,
    filesystem,
    is_url,
    with_retries,
)
from zephon.sources.identity import files_sample
from zephon.sources.index_cache import FileIndexes, FileReader, cache_dir

# Random access: no read-ahead (array-record's own advice for it).
_READER_OPTIONS = "readahead_buffer_size:0"


def _import_reader() -> Any:
    try:
        from array_record.python import array_record_module
    except ImportError as e:
        raise ImportError(
            "ArrayRecordSource needs the array-record package; install it with "
            "`pip install zephon[array_record]`"
        ) from e
    return array_record_module


class ArrayRecordSource:
    """Random access by global record index over one or more ArrayRecord files.

    Records are bytes; ``decode`` (e.g. ``msgpack.unpackb``, ``json.loads``, a
    ``tf.train.Example`` parser) turns each into the sample. The record count of each file
    comes from its footer once and is cached (:mod:`zephon.sources.index_cache`); a
    later start opens no file until a record in it is read. ``read(indices)`` reads each
    file's records in one call (array-record reads them in parallel).

    array-record reads local files only: a URL (``s3://``) is copied whole into the cache
    directory (``$ZEPHON_CACHE_DIR/objects``) the first time it is needed, keyed by its
    size and ETag, and read from there.

    Args:
        paths: a file, a list of files or glob patterns (each pattern's files in sorted
            order); records are numbered across the files in that order.
        decode: applied to each record's bytes; None returns the bytes.
        storage_options: passed to fsspec for URLs (credentials, ``endpoint_url``, ...).
        timeout_s: how long one request for a URL may take, retries included.
    """

    def __init__(
        self,
        paths: PathsArg,
        decode: Callable[[bytes], Any] | None = None,
        *,
        storage_options: StorageOptions = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        _import_reader()
        if decode is not None and not callable(decode):
            raise TypeError(
                f"ArrayRecordSource: decode must be a function of a record's bytes or None; "
                f"got {decode!r}"
            )
        self._decode = decode
        self._storage_options = None if storage_options is None else dict(storage_options)
        self._timeout_s = float(timeout_s)
        self._paths = expand_paths("ArrayRecordSource", paths, self._storage_options)
        self._index = FileIndexes(
            "ArrayRecordSource",
            self._paths,
            "records",
            functools.partial(_count_records, self._storage_options),
            self._storage_options,
            self._timeout_s,
        )
        self._index.ensure()
        counts = [int(self._index.array(f)[0]) for f in range(len(self._paths))]
        self._counts = np.array(counts, dtype=np.int64)
        # Record i lives in file f where _file_starts[f] <= i < _file_starts[f + 1].
        self._file_starts = np.concatenate(([0], np.cumsum(self._counts))).astype(np.int64)
        self._readers: dict[int, Any] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._file_starts[-1])

    def __getitem__(self, index: int) -> Any:
        return self.read([check_index("ArrayRecordSource", index, len(self))])[0]

    def read(self, indices: Sequence[int]) -> list[Any]:
        """Records at `indices`, in that order; one reader call per file."""
        n = len(self)
        checked = np.array(
            [check_index("ArrayRecordSource", i, n) for i in indices], dtype=np.int64
        )
        out: list[Any] = [None] * len(checked)
        if not len(checked):
            return out
        file_of = np.searchsorted(self._file_starts, checked, side="right") - 1
        for f in np.unique(file_of):
            positions = np.flatnonzero(file_of == f)
            local = (checked[positions] - self._file_starts[f]).tolist()
            records = self._reader(int(f)).read(local)
            for pos, record in zip(positions.tolist(), records, strict=True):
                out[pos] = record if self._decode is None else self._decode(record)
        return out

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: the files' total size, a
        digest of sampled blocks (of up to 8 files of a larger set, whose sizes and record
        counts are digested instead; see :mod:`zephon.sources.identity`) and the decode
        function's name. Not the paths: a copied dataset still matches."""
        total, sample = files_sample(
            "ArrayRecordSource",
            self._paths,
            sizes=self._index.sizes.tolist(),
            counts=self._counts.tolist(),
            storage_options=self._storage_options,
        )
        decode = None
        if self._decode is not None:
            decode = getattr(self._decode, "__qualname__", type(self._decode).__qualname__)
        return {
            "kind": "array_record",
            "files": len(self._paths),
            "bytes": total,
            "sample": sample,
            "decode": decode,
        }

    def __getstate__(self) -> dict[str, Any]:
        # Readers hold open files and threads: each process opens its own.
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._readers = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"ArrayRecordSource(paths={describe_paths(self._paths)}, len={len(self)})"

    def _reader(self, f: int) -> Any:
        if self._pid != os.getpid():  # forked: the parent's readers are not ours
            self._readers, self._pid = {}, os.getpid()
        reader = self._readers.get(f)
        if reader is None:
            with self._lock:
                reader = self._readers.get(f)
                if reader is None:
                    path = self._paths[f]
                    size = int(self._index.sizes[f])
                    local = _local_copy(path, size, self._storage_options, self._timeout_s)
                    reader = _import_reader().ArrayRecordReader(local, _READER_OPTIONS)
                    self._readers[f] = reader
        return reader


def _count_records(
    storage_options: StorageOptions, reader: FileReader
) -> tuple[np.ndarray, dict[str, Any]]:
    local = _local_copy(reader.path, reader.size, storage_options, reader.timeout_s)
    ar = _import_reader().ArrayRecordReader(local, _READER_OPTIONS)
    try:
        return np.array([ar.num_records()], dtype=np.int64), {}
    finally:
        ar.close()


def _local_copy(path: str, size: int, storage_options: StorageOptions, timeout_s: float) -> str:
    """``path`` itself if local, else a copy of the object in the cache directory."""
    if not is_url(path):
        return path
    fs, stripped = filesystem("ArrayRecordSource", path, storage_options)
    info = with_retries(
        "ArrayRecordSource", path, timeout_s, lambda: _call(fs, "info", timeout_s, stripped)
    )
    version = str(info.get("ETag") or info.get("mtime") or info.get("LastModified"))
    digest = hashlib.blake2b(f"{path}\0{size}\0{version}".encode(), digest_size=8).hexdigest()
    folder = cache_dir() / "objects"
    target = folder / f"{digest}-{os.path.basename(stripped)[:60]}"
    if target.exists() and target.stat().st_size == size:
        return str(target)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=CACHE_SUFFIX)
    os.close(fd)
    try:
        with_retries(
            "ArrayRecordSource",
            path,
            timeout_s,
            lambda: _call(fs, "get_file", timeout_s, stripped, tmp),
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(target)
