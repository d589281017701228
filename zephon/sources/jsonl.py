"""Random access over JSON-lines files through a byte-offset index."""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Sequence
from typing import IO, Any, Literal

import numpy as np

from zephon.sources._fs import PathsArg, check_index, describe_paths, normalize_paths, open_binary
from zephon.sources.identity import files_sample

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

    Construction scans every file once and keeps the byte offset of each record's line
    (8 bytes per record); ``ds[i]`` then reads and parses that one line. Blank lines are
    not records. Paths with a protocol (``s3://``, ``memory://``) are opened with fsspec.

    Args:
        paths: a file or a sequence of files; records are numbered across them in order.
        field: if given, ``ds[i]`` returns ``record[field]`` instead of the whole record.
        field_type: if given (with `field`), the field's value must be an instance of this
            type (or tuple of types), e.g. ``str`` for text a tokenizer reads. Note that
            ``bool`` is an ``int``.
        on_error: ``"raise"`` parses lazily and raises on a bad record when it is read;
            ``"skip"`` parses every line while indexing and leaves out every record that
            would fail: invalid JSON, bytes that are not UTF-8, a record without `field`
            (or not an object), a field value not of `field_type`. It counts them by kind
            (:meth:`skipped_records`, also in ``Pipeline.stats()``) and warns once per file
            that had any, with the counts.
    """

    def __init__(
        self,
        paths: PathsArg,
        field: str | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        field_type: type | tuple[type, ...] | None = None,
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
        self._paths = normalize_paths("JsonlSource", paths)
        self._field = field
        self._field_type = field_type
        self._on_error = on_error
        self._skipped = dict.fromkeys(SKIP_KINDS, 0)
        offsets: list[np.ndarray] = []
        sizes: list[int] = []
        for path in self._paths:
            with open_binary("JsonlSource", path) as f:
                if on_error == "skip":
                    file_offsets, size = self._index_valid_lines(path, f)
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

    def skipped_records(self) -> dict[str, int]:
        """Records that ``on_error="skip"`` left out, by kind (:data:`SKIP_KINDS`), summed
        over the files. Known once the source is built (skipping happens while indexing),
        so every process holding the source reports the same counts."""
        return dict(self._skipped)

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: the files' total size and a
        digest of each file's size and sampled blocks (see :mod:`zephon.sources.identity`;
        at most 512 KiB read per file), plus the field read. Not the paths: a copied
        dataset still matches."""
        total, sample = files_sample("JsonlSource", self._paths)
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

    def _problem(self, raw: bytes) -> tuple[str, str] | None:
        """``(kind, detail)`` of what reading this line would fail on, or None."""
        try:
            record = json.loads(raw)
        except UnicodeDecodeError as e:
            return "undecodable", _describe_json_error(e)
        except ValueError as e:
            return "invalid_json", _describe_json_error(e)
        if self._field is None:
            return None
        if not isinstance(record, dict) or self._field not in record:
            return "missing_field", _describe_found(record)
        if self._field_type is not None and not isinstance(record[self._field], self._field_type):
            return "wrong_type", type(record[self._field]).__name__
        return None

    def _index_valid_lines(self, path: str, f: IO[bytes]) -> tuple[np.ndarray, int]:
        """Offsets of the lines of `f` that read without error, and its size; counts and
        warns about the others."""
        found: list[int] = []
        counts = dict.fromkeys(SKIP_KINDS, 0)
        first: dict[str, int] = {}
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            if raw.strip(_JSON_WHITESPACE):
                problem = self._problem(raw)
                if problem is None:
                    found.append(offset)
                else:
                    counts[problem[0]] += 1
                    first.setdefault(problem[0], lineno)
            offset += len(raw)
        skipped = sum(counts.values())
        if skipped:
            for kind, n in counts.items():
                self._skipped[kind] += n
            detail = ", ".join(
                f"{n} {_SKIP_WORDS[kind]} (first: line {first[kind]})"
                for kind, n in counts.items()
                if n
            )
            wanted = "" if self._field is None else f" (field {self._field!r}"
            if wanted and self._field_type is not None:
                wanted += f" of type {_type_names(self._field_type)}"
            wanted += ")" if wanted else ""
            warnings.warn(
                f"JsonlSource: skipped {skipped} of {skipped + len(found)} records of {path}"
                f"{wanted}: {detail}; on_error='raise' reports each one",
                UserWarning,
                stacklevel=3,
            )
        return np.array(found, dtype=np.int64), offset

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
            raise KeyError(
                f"JsonlSource: field {self._field!r} is missing from the record at "
                f"{path}:{_line_number(path, start)} (found {_describe_found(record)}); fix "
                "the record, pass another field, or pass on_error='skip'"
            )
        value = record[self._field]
        if self._field_type is not None and not isinstance(value, self._field_type):
            raise TypeError(
                f"JsonlSource: field {self._field!r} of the record at "
                f"{path}:{_line_number(path, start)} is a {type(value).__name__} ({value!r:.60}), "
                f"not {_type_names(self._field_type)}; fix the record or pass on_error='skip'"
            )
        return value


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


def _describe_found(record: Any) -> str:
    if isinstance(record, dict):
        return f"keys {sorted(record)[:10]}"
    return f"a {type(record).__name__}, not an object"


def _type_names(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " | ".join(getattr(k, "__name__", repr(k)) for k in kinds)


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
