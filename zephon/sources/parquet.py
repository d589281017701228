"""Random access over the rows of Parquet files, one row group at a time."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any, TypeVar

import numpy as np

from zephon.sources._fs import (
    DEFAULT_TIMEOUT_S,
    PathsArg,
    StorageOptions,
    check_index,
    describe_paths,
    expand_paths,
    is_url,
    open_binary,
    with_retries,
)
from zephon.sources.identity import files_sample
from zephon.sources.index_cache import FileIndexes, FileReader

if TYPE_CHECKING:
    import pyarrow as pa

_T = TypeVar("_T")

# Row groups kept decoded per thread: enough for a few interleaved readers of nearby
# rows without holding much of a file in memory.
_CACHED_ROW_GROUPS = 4
#: Row groups of files on object storage read at once by one ``read``.
_REMOTE_GROUPS_AT_ONCE = 8


def _import_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            "ParquetSource needs pyarrow; install it with `pip install zephon[parquet]`"
        ) from e
    return pq


class ParquetSource:
    """Random access by global row index over one or more Parquet files.

    Construction reads only file footers to count rows per row group, once: the counts
    and column names are cached like JSONL indexes (:mod:`zephon.sources.index_cache`), so
    a later start reads no footer. ``ds[i]`` decodes
    the row group holding row ``i`` (each thread keeps its last few decoded row groups)
    and returns the row as a dict of Python values. Paths with a protocol (``s3://``,
    ``memory://``) are opened with fsspec.

    Args:
        paths: a file, a sequence of files or glob patterns (each pattern's files in sorted
            order); rows are numbered across them in order.
        columns: the columns to read; all of them when None.
        field: if given, ``ds[i]`` returns just this column's value and only it is read.
        storage_options: passed to fsspec for URLs (credentials, ``endpoint_url``, ...).
        timeout_s: how long reading one footer of a URL may take, retries included.
    """

    def __init__(
        self,
        paths: PathsArg,
        columns: Sequence[str] | None = None,
        field: str | None = None,
        *,
        storage_options: StorageOptions = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        _import_parquet()
        self._storage_options = None if storage_options is None else dict(storage_options)
        self._timeout_s = float(timeout_s)
        self._paths = expand_paths("ParquetSource", paths, self._storage_options)
        if columns is not None and field is not None and field not in columns:
            raise ValueError(
                f"ParquetSource: field {field!r} is not among columns {list(columns)}; "
                "add it to columns or drop columns"
            )
        self._columns = None if columns is None else list(columns)
        self._field = field
        wanted = [field] if field is not None else self._columns
        # The footers' row counts and column names, cached: a later start reads no footer.
        index = FileIndexes(
            "ParquetSource",
            self._paths,
            "row-groups",
            functools.partial(_row_groups, self._storage_options),
            self._storage_options,
            self._timeout_s,
        )
        index.ensure()
        rows_per_group: list[np.ndarray] = []
        group_files: list[np.ndarray] = []
        group_locals: list[np.ndarray] = []
        for file_index, path in enumerate(self._paths):
            names = index.extras[file_index]["names"]
            missing = [c for c in wanted or () if c not in names]
            if missing:
                raise ValueError(
                    f"ParquetSource: {path} has no column(s) {missing}; its columns are {names}"
                )
            rows = np.asarray(index.array(file_index), dtype=np.int64)
            rows_per_group.append(rows)
            group_files.append(np.full(len(rows), file_index, dtype=np.int64))
            group_locals.append(np.arange(len(rows), dtype=np.int64))
        # Row group g holds global rows _group_starts[g] <= i < _group_starts[g + 1].
        self._group_starts = np.concatenate(([0], np.cumsum(np.concatenate(rows_per_group))))
        self._group_starts = self._group_starts.astype(np.int64)
        self._group_files = np.concatenate(group_files)
        self._group_locals = np.concatenate(group_locals)
        self._file_sizes = index.sizes.tolist()
        self._local = threading.local()

    def __len__(self) -> int:
        return int(self._group_starts[-1])

    def __getitem__(self, index: int) -> Any:
        i = check_index("ParquetSource", index, len(self))
        group = self._group_of(i)
        row = i - int(self._group_starts[group])
        table = self._row_group(group)
        if self._field is not None:
            return table.column(0)[row].as_py()
        return table.slice(row, 1).to_pylist()[0]

    def read(self, indices: Sequence[int]) -> list[Any]:
        """Rows at `indices`, in that order; decodes each row group once. Row groups of
        files on object storage that are not cached yet are read concurrently (up to
        :data:`_REMOTE_GROUPS_AT_ONCE` at a time)."""
        checked = np.array(
            [check_index("ParquetSource", i, len(self)) for i in indices], dtype=np.int64
        )
        out: list[Any] = [None] * len(checked)
        groups = np.searchsorted(self._group_starts, checked, side="right") - 1
        wanted = [int(g) for g in np.unique(groups)]
        tables = self._row_groups_at_once(wanted)
        for group in wanted:
            positions = np.flatnonzero(groups == group)
            rows = checked[positions] - self._group_starts[group]
            table = tables[group]
            if self._field is not None:
                values = table.column(0).take(rows).to_pylist()
            else:
                values = table.take(rows).to_pylist()
            for pos, value in zip(positions, values, strict=True):
                out[pos] = value
        return out

    def read_column(self, column: str) -> np.ndarray:
        """One column of every file, as a numpy array in row order (for a column of token
        counts: ``StaticMixtureWorkSource(..., lengths={name: column})``). Reads the whole
        column once.

        Raises:
            ValueError: a file has no such column.
        """
        pq = _import_parquet()
        parts = []
        for path in self._paths:

            def read(source: str | IO[bytes]) -> Any:
                return pq.read_table(source, columns=[column]).column(0)

            try:
                parts.append(_with_file(path, read, self._storage_options).to_numpy())
            except (KeyError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
                raise ValueError(f"ParquetSource: {path} has no column {column!r}") from e
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: the files' total size and a
        digest of each file's size and sampled blocks (see :mod:`zephon.sources.identity`;
        at most 512 KiB read per file; the last block holds the footer of most files), plus
        the columns read. Not the paths: a copied dataset still matches."""
        total, sample = files_sample(
            "ParquetSource",
            self._paths,
            sizes=self._file_sizes,
            counts=np.bincount(
                self._group_files,
                weights=np.diff(self._group_starts),
                minlength=len(self._paths),
            )
            .astype(np.int64)
            .tolist(),
            storage_options=self._storage_options,
        )
        return {
            "kind": "parquet",
            "files": len(self._paths),
            "bytes": total,
            "sample": sample,
            "columns": self._columns,
            "field": self._field,
        }

    def __getstate__(self) -> dict[str, Any]:
        # Decoded row groups are a per-process cache, not state; threading.local cannot
        # be pickled anyway.
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def __repr__(self) -> str:
        return (
            f"ParquetSource(paths={describe_paths(self._paths)}, columns={self._columns!r}, "
            f"field={self._field!r}, len={len(self)})"
        )

    def _group_of(self, i: int) -> int:
        # side="right" steps over empty row groups, whose start equals the next one's.
        return int(np.searchsorted(self._group_starts, i, side="right")) - 1

    def _cache(self) -> OrderedDict[int, pa.Table]:
        cache: OrderedDict[int, pa.Table] | None = getattr(self._local, "row_groups", None)
        if cache is None:
            cache = self._local.row_groups = OrderedDict()
        return cache

    def _row_group(self, group: int) -> pa.Table:
        return self._row_groups_at_once([group])[group]

    def _row_groups_at_once(self, groups: list[int]) -> dict[int, pa.Table]:
        """The decoded tables of ``groups``: from this thread's cache, else read (those of
        remote files on threads, all at once) and cached."""
        cache = self._cache()
        found: dict[int, pa.Table] = {}
        missing = []
        for group in groups:
            table = cache.get(group)
            if table is None:
                missing.append(group)
            else:
                cache.move_to_end(group)
                found[group] = table
        remote = [g for g in missing if is_url(self._paths[int(self._group_files[g])])]
        if len(remote) > 1:
            with ThreadPoolExecutor(min(len(remote), _REMOTE_GROUPS_AT_ONCE)) as pool:
                found.update(zip(remote, pool.map(self._read_group, remote), strict=True))
        for group in missing:
            if group not in found:
                found[group] = self._read_group(group)
        for group in missing:
            cache[group] = found[group]
            if len(cache) > _CACHED_ROW_GROUPS:
                cache.popitem(last=False)
        return found

    def _read_group(self, group: int) -> pa.Table:
        """Row group ``group`` read from its file (no cache)."""
        pq = _import_parquet()
        path = self._paths[int(self._group_files[group])]
        columns = [self._field] if self._field is not None else self._columns
        local = int(self._group_locals[group])

        def read_group(source: str | IO[bytes]) -> pa.Table:
            with pq.ParquetFile(source) as parquet_file:
                return parquet_file.read_row_group(local, columns=columns)

        return _with_file(path, read_group, self._storage_options)


def _with_file(
    path: str, use: Callable[[str | IO[bytes]], _T], storage_options: StorageOptions
) -> _T:
    """Call ``use`` on `path` itself if local (pyarrow opens it natively) or on an open
    fsspec file."""
    if not is_url(path):
        return use(path)
    with open_binary("ParquetSource", path, storage_options) as f:
        return use(f)


def _row_groups(
    storage_options: StorageOptions, reader: FileReader
) -> tuple[np.ndarray, dict[str, Any]]:
    """Rows per row group and the column names, from the footer of one file."""
    pq = _import_parquet()
    metadata = with_retries(
        "ParquetSource",
        reader.path,
        reader.timeout_s,
        lambda: _with_file(reader.path, pq.read_metadata, storage_options),
    )
    rows = [metadata.row_group(k).num_rows for k in range(metadata.num_row_groups)]
    names = metadata.schema.to_arrow_schema().names
    return np.array(rows, dtype=np.int64), {"names": list(names)}
