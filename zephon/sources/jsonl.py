"""Random access over JSON-lines files through a byte-offset index."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from typing import IO, Any, Literal

import numpy as np

from zephon.sources._fs import PathsArg, check_index, describe_paths, normalize_paths, open_binary

logger = logging.getLogger(__name__)

_ON_ERROR = ("raise", "skip")
_BLOCK_BYTES = 8 << 20
# JSON's whitespace: a line holding only these bytes is blank, not a record.
_IS_CONTENT = np.ones(256, dtype=bool)
_IS_CONTENT[[0x09, 0x0A, 0x0D, 0x20]] = False
_JSON_WHITESPACE = b" \t\r\n"


class JsonlSource:
    """Random access over the records of one or more JSON-lines files.

    Construction scans every file once and keeps the byte offset of each record's line
    (8 bytes per record); ``ds[i]`` then reads and parses that one line. Blank lines are
    not records. Paths with a protocol (``s3://``, ``memory://``) are opened with fsspec.

    Args:
        paths: a file or a sequence of files; records are numbered across them in order.
        field: if given, ``ds[i]`` returns ``record[field]`` instead of the whole record.
        on_error: ``"raise"`` parses lazily and raises on a bad line when it is read;
            ``"skip"`` parses every line while indexing and leaves bad ones out.
    """

    def __init__(
        self,
        paths: PathsArg,
        field: str | None = None,
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(f"JsonlSource: on_error must be one of {_ON_ERROR}; got {on_error!r}")
        self._paths = normalize_paths("JsonlSource", paths)
        self._field = field
        self._on_error = on_error
        offsets: list[np.ndarray] = []
        sizes: list[int] = []
        for path in self._paths:
            with open_binary("JsonlSource", path) as f:
                if on_error == "skip":
                    file_offsets, size = _index_valid_lines(path, f)
                else:
                    file_offsets, size = _index_lines(f)
            offsets.append(file_offsets)
            sizes.append(size)
        self._offsets = np.concatenate(offsets)
        # Record i lives in file f where _file_starts[f] <= i < _file_starts[f + 1].
        self._file_starts = np.cumsum([0, *(len(o) for o in offsets)], dtype=np.int64)
        self._file_sizes = np.array(sizes, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> Any:
        i = check_index("JsonlSource", index, len(self._offsets))
        file_index = self._file_of(i)
        # Opening per call keeps the source safe across threads and after fork without
        # per-thread handle bookkeeping; read() amortises the open over a batch.
        with open_binary("JsonlSource", self._paths[file_index]) as f:
            return self._read_record(f, file_index, i)

    def read(self, indices: Sequence[int]) -> list[Any]:
        """Records at `indices`, in that order; opens each file once and reads it in
        offset order."""
        checked = np.array(
            [check_index("JsonlSource", i, len(self._offsets)) for i in indices], dtype=np.int64
        )
        out: list[Any] = [None] * len(checked)
        # Global record order is (file, offset) order, so one sort also groups by file.
        order = np.argsort(checked, kind="stable")
        file_of = np.searchsorted(self._file_starts, checked, side="right") - 1
        for file_index, positions in itertools.groupby(order, key=lambda p: int(file_of[p])):
            with open_binary("JsonlSource", self._paths[file_index]) as f:
                for pos in positions:
                    out[pos] = self._read_record(f, file_index, int(checked[pos]))
        return out

    def __repr__(self) -> str:
        return (
            f"JsonlSource(paths={describe_paths(self._paths)}, field={self._field!r}, "
            f"on_error={self._on_error!r}, len={len(self)})"
        )

    def _file_of(self, i: int) -> int:
        # side="right" steps over empty files, whose start equals the next file's.
        return int(np.searchsorted(self._file_starts, i, side="right")) - 1

    def _read_record(self, f: IO[bytes], file_index: int, i: int) -> Any:
        start = int(self._offsets[i])
        last_in_file = i + 1 == self._file_starts[file_index + 1]
        end = int(self._file_sizes[file_index] if last_in_file else self._offsets[i + 1])
        f.seek(start)
        # The span up to the next record may hold blank (or skipped) lines after this one.
        line = f.read(end - start).split(b"\n", 1)[0]
        path = self._paths[file_index]
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(
                f"JsonlSource: {path}:{_line_number(path, start)} is not valid JSON "
                f"({_describe_json_error(e)}); fix the line or pass on_error='skip'"
            ) from e
        if self._field is None:
            return record
        if not isinstance(record, dict) or self._field not in record:
            found = (
                f"keys {sorted(record)[:10]}"
                if isinstance(record, dict)
                else f"a {type(record).__name__}, not an object"
            )
            raise KeyError(
                f"JsonlSource: field {self._field!r} is missing from the record at "
                f"{path}:{_line_number(path, start)} (found {found}); fix the record or pass "
                "another field"
            )
        return record[self._field]


def _index_lines(f: IO[bytes]) -> tuple[np.ndarray, int]:
    """Offsets of the non-blank lines of `f` and its size, scanned in large blocks."""
    found: list[np.ndarray] = []
    line_start = 0  # absolute offset of the line that the scan is inside
    line_has_content = False  # whether that line has a non-whitespace byte so far
    size = 0
    while block := f.read(_BLOCK_BYTES):
        data = np.frombuffer(block, dtype=np.uint8)
        content = _IS_CONTENT[data]
        newlines = np.flatnonzero(data == 0x0A)
        if newlines.size:
            # Segment k runs from starts[k] through newlines[k]; the first one continues
            # the line carried over from the previous block.
            starts = np.concatenate(([0], newlines[:-1] + 1))
            has_content = np.logical_or.reduceat(content[: newlines[-1] + 1], starts)
            has_content[0] |= line_has_content
            absolute = starts + size
            absolute[0] = line_start
            found.append(absolute[has_content])
            line_start = size + int(newlines[-1]) + 1
            line_has_content = bool(content[newlines[-1] + 1 :].any())
        else:
            line_has_content = line_has_content or bool(content.any())
        size += len(block)
    if line_has_content:  # a last line without a trailing newline
        found.append(np.array([line_start]))
    offsets = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
    return offsets.astype(np.int64, copy=False), size


def _index_valid_lines(path: str, f: IO[bytes]) -> tuple[np.ndarray, int]:
    """Offsets of the lines of `f` that parse as JSON, and its size; logs what it skips."""
    found: list[int] = []
    skipped = first_bad = 0
    offset = 0
    for lineno, raw in enumerate(f, start=1):
        if raw.strip(_JSON_WHITESPACE):
            try:
                json.loads(raw)
            except ValueError:
                skipped += 1
                first_bad = first_bad or lineno
            else:
                found.append(offset)
        offset += len(raw)
    if skipped:
        logger.warning(
            "JsonlSource: skipped %d line(s) of %s that are not valid JSON (first: line %d)",
            skipped,
            path,
            first_bad,
        )
    return np.array(found, dtype=np.int64), offset


def _line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at `offset`; only called to word an error."""
    newlines = 0
    with open_binary("JsonlSource", path) as f:
        while offset > 0 and (block := f.read(min(_BLOCK_BYTES, offset))):
            newlines += block.count(b"\n")
            offset -= len(block)
    return newlines + 1


def _describe_json_error(e: ValueError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    return str(e)  # e.g. a UnicodeDecodeError
