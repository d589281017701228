"""Per-file indexes built once and kept as memory-mapped cache files.

A source that must scan a file to address its samples (the byte offset of every JSONL
record, the document ends of a token file split at an EOS id) keeps the scan's result in
a cache file and maps it in every later run, in the parent and in every worker process;
nobody rescans an unchanged file.

Where: next to the data file as a hidden sidecar, ``.<name>.<kind>.zephon-idx``, or, when
that directory is read-only (or the file is a URL: object storage is never written to),
in the cache directory: ``$ZEPHON_CACHE_DIR``, default ``$XDG_CACHE_HOME/zephon`` or
``~/.cache/zephon``, under ``indexes/``. ``memory://`` files are never cached. When no
location can be written the index stays in memory (and travels to workers in shared
memory), with a warning.

Validity: a cache is keyed by the data file's size, its version (local modification time
in ns, or an object's ETag) and a digest of its first and last 64 KiB. Size and version
are checked from metadata when the source is opened (nothing of the data file is read
then); the digest when a process first reads a sample of that file. A cache that fails
either check is rebuilt, never trusted; if a file whose size and version stayed the same
turns out to hold another number of samples the read fails with an error naming it (the
dataset's length was taken from the stale cache), and the next run rebuilds it.

File layout: ``MAGIC`` (8 bytes), the data offset and the header length (little-endian
uint64 each), a JSON header (the key, the dtype, the count, the builder's extras), zero
padding to a multiple of 64 bytes, then the array.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from zephon.sources._fs import (
    CACHE_SUFFIX,
    DEFAULT_TIMEOUT_S,
    StorageOptions,
    file_info,
    is_url,
    iter_blocks,
    read_ranges,
)

MAGIC = b"ZPHIDX01"
FORMAT = 1
ENDS_BYTES = 64 << 10
BLOCK_BYTES = 8 << 20
_ALIGN = 64
_HEADER_MAX = 1 << 20
#: Builds run on this many threads when several files need one.
BUILD_THREADS = min(8, os.cpu_count() or 1)


class FileReader:
    """What a builder reads one file through: ``blocks()`` streams it whole (a scan),
    ``path`` and ``size`` let it read what it needs otherwise (a footer)."""

    def __init__(
        self, owner: str, path: str, size: int, options: StorageOptions, timeout_s: float, bar: Any
    ) -> None:
        self.owner, self.path, self.size = owner, path, size
        self.storage_options, self.timeout_s = options, timeout_s
        self.first = b""
        self.tail = b""
        self.read = 0
        self._bar = bar

    def blocks(self) -> Iterator[bytes]:
        for block in iter_blocks(
            self.owner, self.path, self.size, BLOCK_BYTES, self.storage_options, self.timeout_s
        ):
            if self.read < ENDS_BYTES:
                self.first += bytes(block[: ENDS_BYTES - self.read])
            if len(block) >= ENDS_BYTES:
                self.tail = bytes(block[-ENDS_BYTES:])
            else:
                self.tail = (self.tail + bytes(block))[-ENDS_BYTES:]
            self.read += len(block)
            if self._bar is not None:
                self._bar.update(len(block))
            yield block


#: ``build(reader) -> (array, extra)``: the index of one file.
Builder = Callable[[FileReader], tuple[np.ndarray, dict[str, Any]]]

_warned_unwritable = False


def cache_dir() -> Path:
    """``$ZEPHON_CACHE_DIR``, else ``$XDG_CACHE_HOME/zephon``, else ``~/.cache/zephon``."""
    explicit = os.environ.get("ZEPHON_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zephon"


def locations(path: str, kind: str) -> list[str]:
    """Where the cache of ``path``'s ``kind`` index may be, in the order looked at."""
    if path.startswith("memory://"):
        return []
    if is_url(path):
        return [_shared_location(path, kind)]
    return [_sidecar_location(path, kind), _shared_location(path, kind)]


def _sidecar_location(path: str, kind: str) -> str:
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{kind}{CACHE_SUFFIX}")


def _shared_location(path: str, kind: str) -> str:
    name = os.path.basename(path.rstrip("/")) or "file"
    where = path if is_url(path) else os.path.abspath(path)
    digest = hashlib.blake2b(f"{where}\0{kind}".encode(), digest_size=8).hexdigest()
    return str(cache_dir() / "indexes" / f"{digest}-{name[:60]}{CACHE_SUFFIX}")


def ends_digest(first: bytes, last: bytes, size: int) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(size.to_bytes(8, "little"))
    h.update(first)
    h.update(last)
    return h.hexdigest()


def read_header(cache_file: str) -> dict[str, Any] | None:
    """The header of a cache file, or None when it is missing or not one."""
    try:
        with open(cache_file, "rb") as f:
            head = f.read(4096)
            if len(head) < 24 or head[:8] != MAGIC:
                return None
            data_offset = int.from_bytes(head[8:16], "little")
            length = int.from_bytes(head[16:24], "little")
            if length > _HEADER_MAX or data_offset < 24 + length:
                return None
            raw = head[24 : 24 + length]
            if len(raw) < length:
                raw += f.read(length - len(raw))
            header: dict[str, Any] = json.loads(raw)
    except (OSError, ValueError):
        return None
    header["data_offset"] = data_offset
    header["cache_file"] = cache_file
    return header


def map_array(header: dict[str, Any]) -> np.ndarray:
    """The cached array, memory-mapped read-only."""
    count = int(header["count"])
    dtype = np.dtype(header["dtype"])
    if count == 0:
        return np.empty(0, dtype)
    return np.memmap(
        header["cache_file"], dtype=dtype, mode="r", offset=header["data_offset"], shape=(count,)
    )


def write(
    path: str, kind: str, key: dict[str, Any], array: np.ndarray, extra: dict[str, Any]
) -> dict[str, Any] | None:
    """Write the cache at the first writable location; its header, or None (with a
    warning, once per process) when none is."""
    global _warned_unwritable
    array = np.ascontiguousarray(array)
    header = {
        **key,
        "format": FORMAT,
        "kind": kind,
        "dtype": array.dtype.str,
        "count": len(array),
        "extra": extra,
    }
    raw = json.dumps(header, sort_keys=True).encode()
    data_offset = -(-(24 + len(raw)) // _ALIGN) * _ALIGN
    prefix = MAGIC + data_offset.to_bytes(8, "little") + len(raw).to_bytes(8, "little") + raw
    prefix += b"\0" * (data_offset - len(prefix))
    errors = []
    for target in locations(path, kind):
        folder = os.path.dirname(target)
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=CACHE_SUFFIX)
        except OSError as e:
            errors.append(f"{folder}: {e.strerror or e}")
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(prefix)
                f.write(array.data)
            os.replace(tmp, target)
        except OSError as e:
            errors.append(f"{folder}: {e.strerror or e}")
            try:
                os.unlink(tmp)
            except OSError:
                pass
            continue
        return read_header(target)
    if errors and not _warned_unwritable:
        _warned_unwritable = True
        warnings.warn(
            f"zephon: could not write an index cache for {path} ({'; '.join(errors)}); the "
            "index is kept in memory and rebuilt at every start. Set ZEPHON_CACHE_DIR to a "
            "writable directory",
            UserWarning,
            stacklevel=4,
        )
    return None


class FileIndexes:
    """The ``kind`` index of each of ``paths``: counts known after :meth:`ensure` (from
    cache headers, or by building what is missing), arrays mapped on first use.

    Args:
        owner: the source's name, for messages.
        paths: the files.
        kind: names the index and how it was built (part of the cache's name and key).
        build: makes one file's index from its bytes.
        infos: ``(size, version)`` already known (from a listing), by path.
    """

    def __init__(
        self,
        owner: str,
        paths: Sequence[str],
        kind: str,
        build: Builder,
        storage_options: StorageOptions = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        infos: dict[str, tuple[int, str]] | None = None,
    ) -> None:
        self.owner = owner
        self.paths = list(paths)
        self.kind = kind
        self.build = build
        self.storage_options = storage_options
        self.timeout_s = timeout_s
        self._infos = dict(infos or {})
        self.ready = False
        self.counts = np.zeros(0, np.int64)
        self.sizes = np.zeros(0, np.int64)
        self.built = 0  # files indexed by a scan in this process (not from a cache)
        self._headers: list[dict[str, Any] | None] = []
        self._keys: list[dict[str, Any]] = []
        self._arrays: list[np.ndarray | None] = []
        self._verified: list[bool] = []
        self.extras: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- counts
    def ensure(self) -> None:
        """Sizes and counts of every file: each file's metadata, then its cache header
        when one matches, else a scan (on threads, with a progress bar past 2 s)."""
        if self.ready:
            return
        with self._lock:
            if self.ready:
                return
            n = len(self.paths)
            keys, headers = [], []
            for path in self.paths:
                size, version = self._infos.get(path) or file_info(
                    self.owner, path, self.storage_options, self.timeout_s
                )
                key = {"size": size, "version": version}
                keys.append(key)
                headers.append(self._find(path, key))
            self._keys, self._headers = keys, headers
            self._arrays = [None] * n
            self._verified = [False] * n
            self.extras = [{} if h is None else h.get("extra", {}) for h in headers]
            missing = [f for f in range(n) if headers[f] is None]
            if missing:
                self._build_many(missing)
            self.counts = np.array(
                [
                    len(a) if h is None else int(h["count"])  # type: ignore[arg-type]
                    for h, a in zip(self._headers, self._arrays, strict=True)
                ],
                dtype=np.int64,
            )
            self.sizes = np.array([k["size"] for k in keys], dtype=np.int64)
            self.ready = True

    def array(self, f: int) -> np.ndarray:
        """File ``f``'s index; the first call in a process maps the cache and checks the
        digest of the file's first and last bytes."""
        a = self._arrays[f]
        if a is not None and self._verified[f]:
            return a
        with self._lock:
            return self._load(f)

    def _load(self, f: int) -> np.ndarray:
        a = self._arrays[f]
        header = self._headers[f]
        if a is None and header is not None:
            again = read_header(header["cache_file"])
            if again is not None and self._matches(again, self._keys[f]):
                a = map_array(again)
        if a is not None and not self._verified[f] and header is not None:
            if self._ends(f) != header.get("ends"):
                a = None  # stale: the file changed though its size and version did not
        if a is None:
            expected = int(self.counts[f]) if self.ready else None
            self._build_one(f)
            a = self._arrays[f]
            assert a is not None
            if expected is not None and len(a) != expected:
                raise ValueError(
                    f"{self.owner}: {self.paths[f]} changed after the dataset was opened (or "
                    f"its index cache was stale): it now holds {len(a)} samples, not "
                    f"{expected}; its index is rebuilt, so start again (a pipeline's length "
                    "and checkpoints depend on it)"
                )
        self._arrays[f] = a
        self._verified[f] = True
        return a

    # ----------------------------------------------------------------- cache
    def _matches(self, header: dict[str, Any], key: dict[str, Any]) -> bool:
        return (
            header.get("format") == FORMAT
            and header.get("kind") == self.kind
            and header.get("size") == key["size"]
            and header.get("version") == key["version"]
        )

    def _find(self, path: str, key: dict[str, Any]) -> dict[str, Any] | None:
        if path.startswith("memory://"):
            return None
        # The sidecar first, without working out the shared location (10,000 files: 1 s).
        if not is_url(path):
            header = read_header(_sidecar_location(path, self.kind))
            if header is not None and self._matches(header, key):
                return header
        header = read_header(_shared_location(path, self.kind))
        if header is not None and self._matches(header, key):
            return header
        return None

    def _ends(self, f: int) -> str:
        size = int(self._keys[f]["size"])
        path = self.paths[f]
        first = (path, 0, min(size, ENDS_BYTES))
        last = (path, max(size - ENDS_BYTES, 0), size)
        head, tail = read_ranges(self.owner, [first, last], self.storage_options, self.timeout_s)
        return ends_digest(head, tail, size)

    # ----------------------------------------------------------------- build
    def _build_many(self, files: list[int]) -> None:
        from tqdm import tqdm

        total = sum(int(self._keys[f]["size"]) for f in files)
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            delay=2.0,
            leave=False,
            desc=f"{self.owner}: indexing {len(files)} file(s)",
        )
        try:
            if len(files) == 1 or BUILD_THREADS == 1:
                for f in files:
                    self._build_one(f, bar)
            else:
                with ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="zephon-index") as pool:
                    for future in [pool.submit(self._build_one, f, bar) for f in files]:
                        future.result()
        finally:
            bar.close()

    def _build_one(self, f: int, bar: Any = None) -> None:
        path, key = self.paths[f], self._keys[f]
        size = int(key["size"])
        reader = FileReader(self.owner, path, size, self.storage_options, self.timeout_s, bar)
        array, extra = self.build(reader)
        if reader.read == 0 and size:  # the builder read only what it needed
            ends = self._ends(f)
            if bar is not None:
                bar.update(size)
        elif reader.read != size:
            raise OSError(
                f"{self.owner}: {path} held {reader.read} bytes while it was indexed, not "
                f"the {size} its metadata gave; is it being written?"
            )
        else:
            ends = ends_digest(reader.first, reader.tail, size)
        self._arrays[f] = array
        self._verified[f] = True
        self.extras[f] = extra
        self.built += 1
        header = write(path, self.kind, {**key, "ends": ends}, array, extra)
        if header is not None:
            self._headers[f] = header
            self._arrays[f] = map_array(header)
        else:
            self._headers[f] = None

    # ---------------------------------------------------------------- pickle
    _PACKED = ("paths", "_infos", "_headers", "_keys", "_verified", "extras")

    def __getstate__(self) -> dict[str, Any]:
        # Mapped caches are mapped again by the receiver (workers never rebuild); arrays
        # held in memory (no cache could be written) travel with the object. The per-file
        # lists go as one msgpack blob: dill pickles 10,000 small dicts one by one (~1.7 s).
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", *self._PACKED)}
        state["_arrays"] = [
            None if h is not None else a for h, a in zip(self._headers, self._arrays, strict=True)
        ]
        state["_packed"] = msgpack.packb(
            {k: getattr(self, k) for k in self._PACKED}, use_bin_type=True
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        packed = msgpack.unpackb(state.pop("_packed"), raw=False, strict_map_key=False)
        self.__dict__.update(state)
        self.__dict__.update(packed)
        self._infos = {k: (int(v[0]), str(v[1])) for k, v in self._infos.items()}
        self.built = 0  # counts this process's scans
        self._lock = threading.Lock()
