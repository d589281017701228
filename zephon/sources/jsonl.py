"""Random access over JSON-lines files through a byte-offset index."""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np

from zephon.sources._fs import (
    DEFAULT_TIMEOUT_S,
    PathsArg,
    StorageOptions,
    check_index,
    describe_paths,
    expand_paths,
    filesystem,
    is_url,
    open_binary,
    read_ranges,
)
from zephon.sources.identity import files_sample, short_digest
from zephon.sources.index_cache import FileIndexes, FileReader

_ON_ERROR = ("raise", "skip")
#: What ``on_error="skip"`` leaves out, by kind (the keys of :meth:`JsonlSource.skipped_records`).
SKIP_KINDS = ("invalid_json", "undecodable", "missing_field", "wrong_type")
_SKIP_WORDS = {
    "invalid_json": "not valid JSON",
    "undecodable": "not UTF-8",
    "missing_field": "without the field",
    "wrong_type": "with a field of another type",
}
_BLOCK_BYTES = 8 << 20
# JSON's whitespace: a line holding only these bytes is blank, not a record.
_IS_CONTENT = np.ones(256, dtype=bool)
_IS_CONTENT[[0x09, 0x0A, 0x0D, 0x20]] = False
_JSON_WHITESPACE = b" \t\r\n"


class JsonlSource:
    """Random access over the records of one or more JSON-lines files.

    Each file's index (the byte offset of each record's line, 8 bytes per record) is built
    once by a vectorised newline scan and kept as a memory-mapped cache file (see
    :mod:`zephon.sources.index_cache`): a later start, and every worker process, maps it
    instead of scanning, and reads nothing of the data files until a sample is read.
    ``ds[i]`` then reads and parses that one line; ``read(indices)`` reads a batch's lines
    with one coalesced range request per neighbourhood, concurrently on object storage.
    Blank lines are not records. Paths with a protocol (``s3://``, ``memory://``) are
    opened with fsspec.

    Args:
        paths: a file, a sequence of files, or glob patterns (``data/*.jsonl``,
            ``s3://bucket/shards/*.jsonl``; each pattern's files in sorted order); records
            are numbered across the files in that order.
        field: if given, ``ds[i]`` returns ``record[field]`` instead of the whole record.
        field_type: if given (with `field`), the field's value must be an instance of this
            type (or tuple of types), e.g. ``str`` for text a tokenizer reads. Note that
            ``bool`` is an ``int``.
        on_error: ``"raise"`` parses lazily and raises on a bad record when it is read;
            ``"skip"`` parses every line while indexing and leaves out every record that
            would fail: invalid JSON, bytes that are not UTF-8, a record without `field`
            (or not an object), a field value not of `field_type`. It counts them by kind
            (:meth:`skipped_records`, also in ``Pipeline.stats()``) and warns once per file
            that had any, with the counts (the index, cached like the other, remembers
            them).
        storage_options: passed to fsspec for URLs (credentials, ``endpoint_url``, ...).
        timeout_s: how long one read of a URL may take, retries included.
    """

    def __init__(
        self,
        paths: PathsArg,
        field: str | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        field_type: type | tuple[type, ...] | None = None,
        *,
        storage_options: StorageOptions = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(f"JsonlSource: on_error must be one of {_ON_ERROR}; got {on_error!r}")
        if field_type is not None:
            if field is None:
                raise ValueError(
                    f"JsonlSource: field_type={_type_names(field_type)} needs a field; pass "
                    "field= too, or drop field_type"
                )
            kinds = field_type if isinstance(field_type, tuple) else (field_type,)
            if not kinds or not all(isinstance(k, type) for k in kinds):
                raise TypeError(
                    f"JsonlSource: field_type must be a type or a tuple of types; got "
                    f"{field_type!r}"
                )
        self._storage_options = None if storage_options is None else dict(storage_options)
        self._timeout_s = float(timeout_s)
        self._paths = expand_paths("JsonlSource", paths, self._storage_options)
        for path in self._paths:
            if is_url(path):
                filesystem("JsonlSource", path, self._storage_options)  # fsspec is there
        self._field = field
        self._field_type = field_type
        self._on_error = on_error
        if on_error == "skip":
            wanted = f"{field}\0{None if field_type is None else _type_names(field_type)}"
            kind = f"valid-{short_digest(wanted)}"
            build: Any = functools.partial(_index_valid_lines, field, field_type)
        else:
            kind, build = "lines", _index_lines_reader
        self._index = FileIndexes(
            "JsonlSource", self._paths, kind, build, self._storage_options, self._timeout_s
        )
        self._index.ensure()
        # Record i lives in file f where _file_starts[f] <= i < _file_starts[f + 1].
        self._file_starts = np.concatenate(([0], np.cumsum(self._index.counts))).astype(np.int64)
        self._file_sizes = self._index.sizes
        self._skipped = dict.fromkeys(SKIP_KINDS, 0)
        if on_error == "skip":
            for path, extra in zip(self._paths, self._index.extras, strict=True):
                self._report_skipped(path, extra)

    def __len__(self) -> int:
        return int(self._file_starts[-1])

    def __getitem__(self, index: int) -> Any:
        return self.read([check_index("JsonlSource", index, len(self))])[0]

    def read(self, indices: Sequence[int]) -> list[Any]:
        """Records at `indices`, in that order: one range read per neighbourhood of lines
        (concurrent requests on object storage), then parsed."""
        n = len(self)
        checked = np.array([check_index("JsonlSource", i, n) for i in indices], dtype=np.int64)
        if not len(checked):
            return []
        file_of = np.searchsorted(self._file_starts, checked, side="right") - 1
        starts = np.empty(len(checked), np.int64)
        ends = np.empty(len(checked), np.int64)
        for f in np.unique(file_of):
            positions = np.flatnonzero(file_of == f)
            local = checked[positions] - self._file_starts[f]
            offsets = self._index.array(int(f))
            starts[positions] = offsets[local]
            # The span up to the next record may hold blank (or skipped) lines after this one.
            following = local + 1
            last = following >= len(offsets)
            nxt = offsets[np.minimum(following, len(offsets) - 1)]
            ends[positions] = np.where(last, self._file_sizes[f], nxt)
        ranges = [
            (self._paths[f], s, e)
            for f, s, e in zip(file_of.tolist(), starts.tolist(), ends.tolist(), strict=True)
        ]
        raw = read_ranges("JsonlSource", ranges, self._storage_options, self._timeout_s)
        return [
            self._parse(data.split(b"\n", 1)[0], f, s)
            for data, f, s in zip(raw, file_of.tolist(), starts.tolist(), strict=True)
        ]

    def skipped_records(self) -> dict[str, int]:
        """Records that ``on_error="skip"`` left out, by kind (:data:`SKIP_KINDS`), summed
        over the files. Known once the source is built (skipping happens while indexing),
        so every process holding the source reports the same counts."""
        return dict(self._skipped)

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: the files' total size and a
        digest of the files' sizes and record counts and of sampled blocks of up to
        ``SAMPLE_FILES`` files spread over the set (see :mod:`zephon.sources.identity`; at
        most 512 KiB read per sampled file, nothing more however many files), plus the
        field read. Not the paths: a copied dataset still matches."""
        total, sample = files_sample(
            "JsonlSource",
            self._paths,
            sizes=self._file_sizes.tolist(),
            counts=self._index.counts.tolist(),
            storage_options=self._storage_options,
        )
        return {
            "kind": "jsonl",
            "files": len(self._paths),
            "bytes": total,
            "sample": sample,
            "field": self._field,
            "field_type": None if self._field_type is None else _type_names(self._field_type),
        }

    def __repr__(self) -> str:
        return (
            f"JsonlSource(paths={describe_paths(self._paths)}, field={self._field!r}, "
            f"on_error={self._on_error!r}, len={len(self)})"
        )

    def _report_skipped(self, path: str, extra: dict[str, Any]) -> None:
        counts: dict[str, int] = extra.get("counts", {})
        first: dict[str, int] = extra.get("first", {})
        skipped = sum(counts.values())
        if not skipped:
            return
        for kind, k in counts.items():
            self._skipped[kind] += k
        detail = ", ".join(
            f"{k} {_SKIP_WORDS[kind]} (first: line {first[kind]})"
            for kind, k in counts.items()
            if k
        )
        wanted = "" if self._field is None else f" (field {self._field!r}"
        if wanted and self._field_type is not None:
            wanted += f" of type {_type_names(self._field_type)}"
        wanted += ")" if wanted else ""
        kept = int(extra.get("kept", 0))
        warnings.warn(
            f"JsonlSource: skipped {skipped} of {skipped + kept} records of {path}"
            f"{wanted}: {detail}; on_error='raise' reports each one",
            UserWarning,
            stacklevel=3,
        )

    def _parse(self, line: bytes, file_index: int, start: int) -> Any:
        path = self._paths[file_index]
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(
                f"JsonlSource: {path}:{self._line_number(path, start)} is not valid JSON "
                f"({_describe_json_error(e)}); fix the line or pass on_error='skip'"
            ) from e
        if self._field is None:
            return record
        if not isinstance(record, dict) or self._field not in record:
            raise KeyError(
                f"JsonlSource: field {self._field!r} is missing from the record at "
                f"{path}:{self._line_number(path, start)} (found {_describe_found(record)}); "
                "fix the record, pass another field, or pass on_error='skip'"
            )
        value = record[self._field]
        if self._field_type is not None and not isinstance(value, self._field_type):
            raise TypeError(
                f"JsonlSource: field {self._field!r} of the record at "
                f"{path}:{self._line_number(path, start)} is a {type(value).__name__} "
                f"({value!r:.60}), not {_type_names(self._field_type)}; fix the record or pass "
                "on_error='skip'"
            )
        return value

    def _line_number(self, path: str, offset: int) -> int:
        """1-based number of the line starting at `offset`; only called to word an error."""
        newlines = 0
        with open_binary("JsonlSource", path, self._storage_options) as f:
            while offset > 0 and (block := f.read(min(_BLOCK_BYTES, offset))):
                newlines += block.count(b"\n")
                offset -= len(block)
        return newlines + 1


def _index_lines_reader(reader: FileReader) -> tuple[np.ndarray, dict[str, Any]]:
    return index_lines(reader.blocks()), {}


def index_lines(blocks: Iterable[bytes]) -> np.ndarray:
    """Offsets of the non-blank lines of a file given as consecutive blocks.

    Vectorised: one comparison finds the newlines of a block; a line counts as content
    when its first byte is not JSON whitespace, and only the few lines that start with
    whitespace are looked at further (every byte of the block when there are many).
    """
    found: list[np.ndarray] = []
    line_start = 0  # absolute offset of the line that the scan is inside
    line_has_content = False  # whether that line has a non-whitespace byte so far
    size = 0
    for block in blocks:
        data = np.frombuffer(block, dtype=np.uint8)
        newlines = np.flatnonzero(data == 0x0A)
        if newlines.size:
            # Segment k runs from starts[k] up to newlines[k]; the first one continues the
            # line carried over from the previous block.
            starts = np.empty(newlines.size, np.int64)
            starts[0] = 0
            starts[1:] = newlines[:-1] + 1
            nonempty = newlines > starts
            has_content = nonempty & _IS_CONTENT[data[np.minimum(starts, data.size - 1)]]
            doubt = np.flatnonzero(nonempty & ~has_content)
            if doubt.size > 256:  # many lines start with whitespace: look at every byte
                content = _IS_CONTENT[data[: newlines[-1] + 1]]
                has_content = np.logical_or.reduceat(content, starts)
            else:
                for k in doubt.tolist():
                    has_content[k] = bool(_IS_CONTENT[data[starts[k] : newlines[k]]].any())
            has_content[0] |= line_has_content
            absolute = starts + size
            absolute[0] = line_start
            found.append(absolute[has_content])
            line_start = size + int(newlines[-1]) + 1
            line_has_content = bool(_IS_CONTENT[data[newlines[-1] + 1 :]].any())
        else:
            line_has_content = line_has_content or bool(_IS_CONTENT[data].any())
        size += len(block)
    if line_has_content:  # a last line without a trailing newline
        found.append(np.array([line_start], dtype=np.int64))
    offsets = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
    return offsets.astype(np.int64, copy=False)


def _lines(blocks: Iterable[bytes]) -> Iterable[bytes]:
    """The lines of a file given as blocks, each with its newline (the last maybe without)."""
    carry = b""
    for block in blocks:
        parts = (carry + block).split(b"\n")
        carry = parts.pop()
        for part in parts:
            yield part + b"\n"
    if carry:
        yield carry


def _problem(
    field: str | None, field_type: type | tuple[type, ...] | None, raw: bytes
) -> tuple[str, str] | None:
    """``(kind, detail)`` of what reading this line would fail on, or None."""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as e:
        return "undecodable", _describe_json_error(e)
    except ValueError as e:
        return "invalid_json", _describe_json_error(e)
    if field is None:
        return None
    if not isinstance(record, dict) or field not in record:
        return "missing_field", _describe_found(record)
    if field_type is not None and not isinstance(record[field], field_type):
        return "wrong_type", type(record[field]).__name__
    return None


def _index_valid_lines(
    field: str | None, field_type: type | tuple[type, ...] | None, reader: FileReader
) -> tuple[np.ndarray, dict[str, Any]]:
    """Offsets of the lines that read without error; the others counted by kind, with the
    first line of each kind, in the extras (for the warning)."""
    found: list[int] = []
    counts = dict.fromkeys(SKIP_KINDS, 0)
    first: dict[str, int] = {}
    offset = 0
    for lineno, raw in enumerate(_lines(reader.blocks()), start=1):
        if raw.strip(_JSON_WHITESPACE):
            problem = _problem(field, field_type, raw)
            if problem is None:
                found.append(offset)
            else:
                counts[problem[0]] += 1
                first.setdefault(problem[0], lineno)
        offset += len(raw)
    extra = {"counts": counts, "first": first, "kept": len(found)}
    return np.array(found, dtype=np.int64), extra


def _describe_found(record: Any) -> str:
    if isinstance(record, dict):
        return f"keys {sorted(record)[:10]}"
    return f"a {type(record).__name__}, not an object"


def _type_names(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " | ".join(getattr(k, "__name__", repr(k)) for k in kinds)


def _describe_json_error(e: ValueError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    return str(e)  # e.g. a UnicodeDecodeError
