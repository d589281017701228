"""Token counts per sample, for token-denominated mixture weights.

A component's lengths come from the dataset when it knows them, or from a *length index*:
one uint32 per sample, counted once with the pipeline's tokenizer and stored beside the data,
or in the cache directory where the data's directory is read-only or the data is a URL
(``zephon lengths DATA --tokenizer ...``, or :func:`build_length_index`; see
:func:`index_locations`).

* ``TokenFileSource``: its document offsets (``token_offsets()``), nothing to count;
* ``ArraySource`` of token arrays (or of dicts with a ``"tokens"`` array): the arrays'
  lengths (``token_lengths()``);
* ``ParquetSource`` with a column of token counts: name the column,
  ``lengths={"web": "num_tokens"}`` (read once with ``read_column``);
* anything else (text): ``lengths={"web": zp.open_length_index(web, tokenizer)}``; or any
  1-D integer array of ``len(dataset)`` counts.

The lengths are shared by every lane (never copied per lane); a length index is
memory-mapped.

Length index file: 8 bytes magic ``ZPHLEN1\\n``, a 4-byte little-endian header size, a JSON
header (the dataset's content identity and length, the tokenizer's ``repr``, the field,
padded with spaces to a multiple of 8 bytes), then one little-endian uint32 per sample. An
interrupted build leaves ``PATH.partial`` with the header and the counts made so far; the
next build with the same dataset and tokenizer continues from there.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import LengthIndexError
from zephon.sources._fs import is_url
from zephon.sources.identity import array_sample, dataset_identity, short_digest
from zephon.sources.index_cache import cache_dir
from zephon.sources.reading import read_many
from zephon.tokenizers.base import ByteTokenizer

__all__ = [
    "ComponentLengths",
    "build_length_index",
    "default_index_path",
    "index_locations",
    "open_length_index",
    "resolve_lengths",
]

MAGIC = b"ZPHLEN1\n"
FORMAT = "zephon.lengths"
VERSION = 1
SUFFIX = ".zlen"
PARTIAL = ".partial"
_DTYPE = np.dtype("<u4")
_BLOCK = 1024  # samples counted per read
_SCAN = 1 << 16  # counts looked at a time for a non-zero one


@dataclass(frozen=True)
class ComponentLengths:
    """One component's token counts: ``array[i]`` (or ``array[i + 1] - array[i]`` when
    ``offsets``), and a short description for the pipeline fingerprint."""

    array: np.ndarray
    offsets: bool
    description: str

    def total(self) -> int:
        """Tokens in the whole dataset (reads every count unless they are offsets)."""
        if self.offsets:
            return int(self.array[-1] - self.array[0])
        return int(self.array.sum(dtype=np.int64))

    def any_tokens(self) -> bool:
        """Whether any sample has a token: at once for offsets, else a scan that stops at
        the first block holding one (the first, unless the counts begin with zeros)."""
        a = self.array
        if self.offsets:
            return bool(a.size) and int(a[-1]) > int(a[0])
        for lo in range(0, a.size, _SCAN):
            if a[lo : lo + _SCAN].any():
                return True
        return False

    def at(self, index: int) -> int:
        if self.offsets:
            return int(self.array[index + 1] - self.array[index])
        return int(self.array[index])


def _checked_array(name: str, c: int, n: int, values: Any, offsets: bool, how: str) -> np.ndarray:
    what = f"lengths of dataset {name!r} (component {c}, {how})"
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be a 1-D array of ints; got {type(values).__name__}") from e
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(
            f"{what} must be a 1-D array of ints; got {array.dtype} of shape {array.shape}"
        )
    expected = n + 1 if offsets else n
    if array.shape[0] != expected:
        raise ValueError(
            f"{what} has {array.shape[0]} entries but the dataset has {n} samples"
            + (" (offsets: N + 1 expected)" if offsets else "")
            + "; the lengths belong to another dataset"
        )
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    array = np.ascontiguousarray(array)
    if offsets:
        if array.dtype != np.int64:
            array = array.astype(np.int64)
        if array.size and np.any(np.diff(array) < 0):
            raise ValueError(f"{what}: offsets must not decrease")
    elif array.dtype.kind == "i" and array.size and int(array.min()) < 0:
        at = int(np.argmin(array))
        raise ValueError(f"{what}: sample {at} has a negative length {int(array[at])}")
    return array


def resolve_lengths(name: str, c: int, dataset: Any, spec: Any) -> ComponentLengths:
    """A component's lengths from ``spec``: None (ask the dataset), a column name (of a
    dataset with ``read_column``), or an array of counts.

    Raises:
        ValueError: the dataset cannot say, the counts do not fit the dataset; the message
            names the dataset and how to give lengths.
        TypeError: ``spec`` is none of the above.
    """
    n = len(dataset)
    if spec is None:
        offsets = getattr(dataset, "token_offsets", None)
        if callable(offsets):
            array = _checked_array(name, c, n, offsets(), True, "its token_offsets()")
            return ComponentLengths(array, True, f"offsets:{array_sample(array)}")
        lengths = getattr(dataset, "token_lengths", None)
        if callable(lengths):
            try:
                values = lengths()
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"dataset {name!r} (component {c}) cannot give its token lengths: {e}"
                ) from e
            array = _checked_array(name, c, n, values, False, "its token_lengths()")
            return ComponentLengths(array, False, f"lengths:{array_sample(array)}")
        raise ValueError(
            f"weight_unit='tokens' needs the token count of every sample, and dataset "
            f"{name!r} (component {c}, {type(dataset).__name__}) does not know them; build a "
            f"length index with `zephon lengths DATA --tokenizer ...` and pass "
            f"lengths={{{name!r}: zp.open_length_index(dataset, tokenizer)}} (or any array of "
            f"{n} counts)"
        )
    if isinstance(spec, str):
        read = getattr(dataset, "read_column", None)
        if not callable(read):
            raise TypeError(
                f"lengths of dataset {name!r} (component {c}) name a column ({spec!r}), but a "
                f"{type(dataset).__name__} has no columns (read_column); give an array of "
                "counts or a length index"
            )
        array = _checked_array(name, c, n, read(spec), False, f"column {spec!r}")
        return ComponentLengths(array, False, f"column:{spec}:{array_sample(array)}")
    if isinstance(spec, np.ndarray | Sequence) and not isinstance(spec, bytes):
        how = "a length index" if isinstance(spec, np.memmap) else "given"
        array = _checked_array(name, c, n, spec, False, how)
        return ComponentLengths(array, False, f"lengths:{array_sample(array)}")
    raise TypeError(
        f"lengths of dataset {name!r} (component {c}) must be None (the dataset's own), a "
        f"column name or an array of counts; got {type(spec).__name__}"
    )


# ------------------------------------------------------------------ the index file


def data_paths(dataset: Any) -> list[str] | None:
    """The files a dataset reads (a file source's ``paths``), or None."""
    paths = getattr(dataset, "paths", None) or getattr(dataset, "_paths", None)
    if isinstance(paths, str):
        return [paths]
    if isinstance(paths, Sequence) and paths and all(isinstance(p, str) for p in paths):
        return list(paths)
    return None


#: Files a message lists before saying how many more there are.
SHOWN_PATHS = 3


def shown_paths(paths: Sequence[str], sep: str = ", ") -> str:
    """``paths`` for a message: the first :data:`SHOWN_PATHS`, then ``… and N more``
    (a dataset of 41 shards would otherwise fill the screen)."""
    shown = sep.join(paths[:SHOWN_PATHS])
    if len(paths) > SHOWN_PATHS:
        shown += f"{sep}… and {len(paths) - SHOWN_PATHS} more"
    return shown


def _tokenizer_text(tokenizer: Any, field: str | None) -> str:
    return f"{tokenizer!r}" + ("" if field is None else f" field={field!r}")


def index_locations(dataset: Any, tokenizer: Any, field: str | None = None) -> list[str]:
    """Where the length index of ``dataset`` under ``tokenizer`` may be, in the order looked
    at: beside the first data file (``<file>.lengths-<8 hex of the tokenizer>.zlen``), then
    in the cache directory (``$ZEPHON_CACHE_DIR/lengths/``, see
    :func:`~zephon.sources.index_cache.cache_dir`), where an index goes when the data's
    directory is read-only or the data is a URL (nothing is ever written to a bucket).

    Raises:
        ValueError: the dataset has no files to key an index by (pass a path).
    """
    paths = data_paths(dataset)
    if paths is None:
        raise ValueError(
            f"a {type(dataset).__name__} has no data files to keep a length index beside; "
            "pass path= to say where it goes"
        )
    tag = short_digest(_tokenizer_text(tokenizer, field))[:8]
    first = paths[0]
    where = [p if is_url(p) else os.path.abspath(p) for p in paths]
    key = short_digest("\0".join(where))[:16]
    name = os.path.basename(first.rstrip("/"))[:60] or "data"
    shared = str(cache_dir() / "lengths" / f"{key}-{name}.lengths-{tag}{SUFFIX}")
    if is_url(first):
        return [shared]
    return [f"{first}.lengths-{tag}{SUFFIX}", shared]


def default_index_path(dataset: Any, tokenizer: Any, field: str | None = None) -> str:
    """Where the index is looked for and, when not told, built: the first of
    :func:`index_locations` that holds one (or an unfinished build), else the first whose
    directory can be written (beside the data, unless that directory is read-only).

    Raises:
        ValueError: the dataset has no files to key an index by (pass a path).
    """
    places = index_locations(dataset, tokenizer, field)
    for place in places:
        if os.path.exists(place) or os.path.exists(place + PARTIAL):
            return place
    for place in places[:-1]:
        try:
            with tempfile.TemporaryFile(dir=os.path.dirname(place) or "."):
                return place
        except OSError:
            continue
    return places[-1]


def _writable(places: list[str]) -> str:
    """The first of ``places`` where an unfinished index (``PATH.partial``) can be opened."""
    errors = []
    for target in places:
        try:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            with open(target + PARTIAL, "ab"):
                return target
        except OSError as e:
            errors.append(f"{target}{PARTIAL}: {e.strerror or e}")
    raise OSError(
        f"no place to write the length index ({'; '.join(errors)}); set ZEPHON_CACHE_DIR to "
        "a writable directory or pass path="
    )


def _header(dataset: Any, tokenizer: Any, field: str | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "count": len(dataset),
        "dataset": dataset_identity(dataset),
        "dataset_type": type(dataset).__name__,
        "tokenizer": repr(tokenizer),
        "field": field,
    }


def _encode_header(header: dict[str, Any]) -> bytes:
    text = json.dumps(header, sort_keys=True).encode()
    pad = (-(len(MAGIC) + 4 + len(text))) % 8
    text += b" " * pad
    return MAGIC + struct.pack("<I", len(text)) + text


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """The header of an index (or partial) file and where its counts start."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
            raise LengthIndexError(
                f"{path} is not a Zephon length index (no {MAGIC!r} magic); delete it and "
                "build it again with `zephon lengths`"
            )
        (size,) = struct.unpack("<I", head[len(MAGIC) :])
        text = f.read(size)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LengthIndexError(f"{path}: the length index header is corrupt ({e})") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise LengthIndexError(f"{path}: not a Zephon length index header: {header!r:.120}")
    if header.get("version") != VERSION:
        raise LengthIndexError(
            f"{path}: length index version {header.get('version')!r}; this Zephon reads "
            f"version {VERSION}: build it again with `zephon lengths`"
        )
    return header, len(MAGIC) + 4 + size


def _mismatch(header: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    out = []
    if header.get("count") != expected["count"]:
        out.append(f"{header.get('count')} samples then, {expected['count']} now")
    if header.get("dataset") != expected["dataset"]:
        then, now = header.get("dataset") or {}, expected["dataset"]
        keys = [k for k in {**then, **now} if then.get(k) != now.get(k)]
        out.append(
            "content identity "
            + ", ".join(f"{k} {then.get(k)!r} then, {now.get(k)!r} now" for k in keys)
        )
    if header.get("tokenizer") != expected["tokenizer"]:
        out.append(f"tokenizer {header.get('tokenizer')} then, {expected['tokenizer']} now")
    if header.get("field") != expected["field"]:
        out.append(f"field {header.get('field')!r} then, {expected['field']!r} now")
    return out


def open_length_index(
    dataset: Any,
    tokenizer: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    field: str | None = None,
) -> np.ndarray:
    """The token counts of ``dataset`` under ``tokenizer``, memory-mapped from its index.

    Args:
        dataset: the dataset, built as the pipeline builds it (its content identity must be
            the one the index was built for).
        tokenizer: the pipeline's tokenizer (its ``repr`` must match the index's).
        path: the index (default: :func:`default_index_path`).
        field: what ``tokenize(field=...)`` reads of each sample, if anything.

    Returns:
        A read-only uint32 array of ``len(dataset)`` counts.

    Example::

        web = zp.JsonlSource("web.jsonl", field="text")
        tok = zp.ByteTokenizer()
        # once: zephon lengths web.jsonl --field text --tokenizer byte
        src = zp.StaticMixtureWorkSource({"web": web, "code": code}, {"web": 0.7, "code": 0.3},
                                         weight_unit="tokens",
                                         lengths={"web": zp.open_length_index(web, tok)})

    Raises:
        LengthIndexError: no index (the message says how to build it), an unfinished one,
            or one that no longer matches the dataset or the tokenizer (the message names
            the index and the dataset, and what differs).
    """
    target = os.fspath(path) if path is not None else default_index_path(dataset, tokenizer, field)
    if not os.path.exists(target):
        partial = os.path.exists(target + PARTIAL)
        looked = [target] if path is not None else index_locations(dataset, tokenizer, field)
        raise LengthIndexError(
            f"no length index at {' or '.join(looked)}"
            + (
                " (an interrupted build left its .partial: run it again to finish)"
                if partial
                else ""
            )
            + f"; build it {_build_hint(dataset, tokenizer, field)}"
        )
    header, start = _read_header(target)
    expected = _header(dataset, tokenizer, field)
    differs = _mismatch(header, expected)
    if differs:
        raise LengthIndexError(
            f"length index {target} does not match dataset {_describe(dataset)} ("
            + "; ".join(differs)
            + f"): it was built for {header.get('dataset_type')} data that has changed since, "
            f"or for another dataset or tokenizer; rebuild it "
            f"{_build_hint(dataset, tokenizer, field)}"
        )
    n = int(header["count"])
    size = os.path.getsize(target)
    if size != start + n * _DTYPE.itemsize:
        raise LengthIndexError(
            f"length index {target} holds {(size - start) // _DTYPE.itemsize} counts for "
            f"{n} samples of {_describe(dataset)}; it is truncated: rebuild it"
        )
    if n == 0:
        return np.zeros(0, dtype=_DTYPE)
    return np.memmap(target, dtype=_DTYPE, mode="r", offset=start, shape=(n,))


def _describe(dataset: Any) -> str:
    paths = data_paths(dataset)
    return repr(dataset) if paths is None else f"{type(dataset).__name__}({shown_paths(paths)})"


#: The datasets ``zephon lengths`` reads (its ``--format``).
_CLI_SOURCES = ("JsonlSource", "ParquetSource")


def _build_hint(dataset: Any, tokenizer: Any, field: str | None) -> str:
    """How to build the index of ``dataset`` under ``tokenizer``: the ``zephon lengths``
    command that builds exactly it where the command can (its data files, a few then how
    many more; ``--tokenizer`` as the tokenizer in use), and the Python call, which always
    can."""
    data_field = getattr(dataset, "_field", None)  # JsonlSource / ParquetSource(field=...)
    call = "zp.build_length_index(dataset, tokenizer" + (
        f", field={field!r})" if field is not None else ")"
    )
    paths = data_paths(dataset)
    arg = _tokenizer_arg(tokenizer)
    if (
        paths is None
        or arg is None
        or field is not None
        or type(dataset).__name__ not in _CLI_SOURCES
    ):
        return (
            f"in Python with {call} (`zephon lengths` builds only a JsonlSource or "
            "ParquetSource of text under 'byte' or a tokenizer file with its default settings)"
        )
    command = f"zephon lengths {shown_paths(paths, ' ')}"
    if isinstance(data_field, str):
        command += f" --field {data_field}"
    return f"with `{command} --tokenizer {arg}` (or in Python: {call})"


def _tokenizer_arg(tokenizer: Any) -> str | None:
    """What ``zephon lengths --tokenizer`` takes to build ``tokenizer`` (``byte``, or its
    tokenizer file), or None where the command's default settings would make another."""
    if type(tokenizer) is ByteTokenizer:
        return "byte" if repr(tokenizer) == repr(ByteTokenizer()) else None
    path = getattr(tokenizer, "path", None)
    if type(tokenizer).__name__ not in ("HFTokenizer", "SentencePieceTokenizer") or not isinstance(
        path, str
    ):
        return None
    try:  # the CLI builds it with its defaults: only the same repr makes the same index
        same = repr(type(tokenizer)(path)) == repr(tokenizer)
    except Exception:  # noqa: BLE001 - any failure: do not offer the command
        return None
    return path if same else None


def _counter(tokenizer: Any) -> Callable[[list[Any]], list[int]]:
    count = getattr(tokenizer, "count_tokens", None)
    if callable(count):
        return lambda texts: [int(x) for x in count(texts)]
    batch = getattr(tokenizer, "encode_batch", None)
    if callable(batch):
        return lambda texts: [len(ids) for ids in batch(texts)]
    return lambda texts: [len(tokenizer.encode(t)) for t in texts]


def build_length_index(
    dataset: Any,
    tokenizer: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    field: str | None = None,
    progress: bool = True,
    block: int = _BLOCK,
) -> str:
    """Count every sample's tokens once and store them beside the data.

    Resumable: an interrupted build leaves ``PATH.partial``; the next call with the same
    dataset, tokenizer and field continues where it stopped (another dataset or tokenizer
    starts over). An index that already matches is left alone; one that no longer matches
    is rebuilt.

    Args:
        dataset: a random-access dataset (``ds[i]`` is the text, or a dict with ``field``).
        tokenizer: anything with ``encode`` (``count_tokens`` or ``encode_batch`` used when
            present): the pipeline's tokenizer.
        path: where the index goes (default: :func:`default_index_path`, and the cache
            directory when that cannot be written).
        field: tokenize ``ds[i][field]`` instead of ``ds[i]`` (what ``tokenize(field=...)``
            does).
        progress: show a tqdm progress bar on stderr.
        block: samples read and counted at a time.

    Returns:
        The index's path.

    Example::

        zp.build_length_index(zp.JsonlSource("web.jsonl", field="text"), zp.ByteTokenizer())

    Raises:
        ValueError: a count does not fit in 32 bits.
        OSError: no location can be written (the message names each and why).
    """
    from tqdm import tqdm

    if path is not None:
        places = [os.fspath(path)]
    else:
        first = default_index_path(dataset, tokenizer, field)
        places = [first] + [p for p in index_locations(dataset, tokenizer, field) if p != first]
    expected = _header(dataset, tokenizer, field)
    if os.path.exists(places[0]):
        try:
            open_length_index(dataset, tokenizer, places[0], field=field)
            return places[0]  # up to date
        except LengthIndexError:
            pass  # stale: build it again
    target = _writable(places)
    partial = target + PARTIAL
    n = expected["count"]
    done = 0
    if os.path.exists(partial):
        try:
            header, start = _read_header(partial)
            if not _mismatch(header, expected):
                done = min(n, (os.path.getsize(partial) - start) // _DTYPE.itemsize)
            else:
                os.remove(partial)
        except LengthIndexError:
            os.remove(partial)
    count = _counter(tokenizer)
    mode = "r+b" if done else "wb"
    with open(partial, mode) as f:
        if done:
            _, start = _read_header(partial)
            f.seek(start + done * _DTYPE.itemsize)
            f.truncate()
        else:
            f.write(_encode_header(expected))
        with tqdm(
            total=n, initial=done, unit="doc", desc=os.path.basename(target), disable=not progress
        ) as bar:
            for lo in range(done, n, block):
                hi = min(n, lo + block)
                items = read_many(dataset, list(range(lo, hi)))
                texts = items if field is None else [item[field] for item in items]
                counts = np.asarray(count(texts), dtype=np.int64)
                if counts.size and (counts.min() < 0 or counts.max() > np.iinfo(_DTYPE).max):
                    raise ValueError(
                        f"a token count in samples {lo}..{hi - 1} does not fit a uint32 "
                        f"({int(counts.max())})"
                    )
                f.write(counts.astype(_DTYPE).tobytes())
                f.flush()
                bar.update(hi - lo)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)
    return target
