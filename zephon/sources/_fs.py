"""Helpers shared by the file-backed sources: path arguments and glob patterns, opening
local paths or fsspec URLs, byte-range reads (coalesced, concurrent on object storage,
retried with backoff), and index checks.

Object storage: a path with a protocol (``s3://bucket/key``, ``gs://``, ``memory://``) is
read through fsspec with the source's ``storage_options`` (credentials, endpoint: see the
README's "Object storage" section). For ``s3://`` Zephon turns off s3fs's and botocore's own
retries unless the options set them, so that every retry is Zephon's: bounded by the
source's ``timeout_s`` for each read, with exponential backoff, and counted
(:func:`io_retries`, ``Pipeline.stats()["io_retries"]``).

Every range read is counted on the thread that makes it (:func:`thread_reads`): the bytes
it returned, the requests it sent to storage (a ``pread`` call on a local file, a ranged
GET on object storage, each retry's included) and the retries. The fetch operator counts
the difference around each dataset's read, per lane and source (``stats()["reads"]``).
Reads made while a source is built (scans that index it) are not counted there; those a
source makes inside a read (checking an index cache on first use) are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import glob as _glob
import mmap
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, TypeVar

PathArg = str | os.PathLike[str]
PathsArg = PathArg | Sequence[PathArg]
StorageOptions = Mapping[str, Any] | None
_T = TypeVar("_T")

#: Neighbouring ranges of one file closer than this are read as one request.
COALESCE_GAP_BYTES = 64 << 10
#: Index caches end with this; glob patterns never match them.
CACHE_SUFFIX = ".zephon-idx"
DEFAULT_TIMEOUT_S = 60.0
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
_GLOB_CHARS = frozenset("*?[")
# Errors that a retry may cure, by class name anywhere in the exception's MRO (the client
# libraries' classes are not imported here: aiohttp, botocore and requests name them so).
_TRANSIENT_NAMES = frozenset(
    {
        "TimeoutError",
        "FSTimeoutError",
        "ConnectionError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "IncompleteRead",
        "HTTPClientError",
        "ResponseParserError",
    }
)
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE}

_retries_lock = threading.Lock()
_retries_total = 0


class _ThreadCounts(threading.local):
    # (class defaults: no AttributeError raised and caught on every read)
    retries = 0
    bytes = 0
    requests = 0


_local = _ThreadCounts()


def io_retries() -> int:
    """Reads retried after a transient failure, in this process, since it started."""
    return _retries_total


def thread_reads() -> tuple[int, int, int]:
    """``(bytes, requests, retries)`` of the range reads made on this thread (see the
    module), since it started."""
    c = _local
    return c.bytes, c.requests, c.retries


def _count_retry() -> None:
    global _retries_total
    with _retries_lock:
        _retries_total += 1
    _local.retries += 1


def normalize_paths(owner: str, paths: PathsArg) -> list[str]:
    """Turn one path or a sequence of paths into a non-empty list of strings."""
    if isinstance(paths, str | os.PathLike):
        return [os.fspath(paths)]
    result = [os.fspath(p) for p in paths]
    if not result:
        raise ValueError(f"{owner}: paths is empty; pass at least one file")
    return result


def reads_remote(dataset: Any) -> bool:
    """Whether ``dataset`` is a built-in file source over object storage (any of its files
    a URL): its reads wait on the network, so reading a chunk ahead pays."""
    paths = getattr(dataset, "_paths", None)
    return isinstance(paths, (list, tuple)) and any(isinstance(p, str) and is_url(p) for p in paths)


def is_url(path: str) -> bool:
    """Whether `path` names a protocol (``s3://``, ``memory://``) that fsspec must open."""
    return "://" in path


def is_pattern(path: str) -> bool:
    return not _GLOB_CHARS.isdisjoint(path)


def expand_paths(owner: str, paths: PathsArg, storage_options: StorageOptions = None) -> list[str]:
    """One path, a list of paths, or glob patterns (``data/*.jsonl``, ``s3://b/p/**/*.bin``)
    as a non-empty list of files: each pattern replaced by the files it matches in sorted
    order, other paths kept where they are. A path that exists is never a pattern, even
    with ``*?[`` in its name; index caches (``*.zephon-idx``) never match.

    Raises:
        FileNotFoundError: a pattern matches no file; the message names it.
    """
    out: list[str] = []
    for path in normalize_paths(owner, paths):
        if not is_pattern(path):
            out.append(path)
            continue
        if is_url(path):
            fs, stripped = filesystem(owner, path, storage_options)
            if fs.exists(stripped) and fs.isfile(stripped):
                out.append(path)
                continue
            found = fs.glob(stripped, detail=True)
            matches = sorted(
                fs.unstrip_protocol(name)
                for name, info in found.items()
                if info.get("type") == "file"
            )
        else:
            if os.path.isfile(path):
                out.append(path)
                continue
            matches = sorted(p for p in _glob.glob(path, recursive=True) if os.path.isfile(p))
        matches = [m for m in matches if not m.endswith(CACHE_SUFFIX)]
        if not matches:
            raise FileNotFoundError(
                f"{owner}: the pattern {path!r} matches no file; check the directory and the "
                "pattern (`*` stays within a directory, `**/` spans directories)"
            )
        out.extend(matches)
    return out


def filesystem(owner: str, url: str, storage_options: StorageOptions = None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path within it."""
    try:
        import fsspec.core
    except ImportError as e:
        raise ImportError(
            f"{owner}: reading {url!r} needs fsspec; install it with `pip install zephon[fsspec]` "
            "(`zephon[s3]` for s3://)"
        ) from e
    options = dict(storage_options or {})
    protocol = url.split("://", 1)[0]
    s3 = protocol in ("s3", "s3a")
    retries = options.pop("retries", 1) if s3 else None
    if s3:
        options = _s3_defaults(options)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise ImportError(
            f"{owner}: reading {url!r} needs the filesystem package for {protocol}:// "
            f"({e}); for s3:// install `zephon[s3]`"
        ) from e
    if retries is not None:
        fs.retries = retries  # s3fs's own attempts per call (its class default is 5)
    return fs, path


def _s3_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs and botocore retry on their own, unbounded by our timeout and uncounted: off
    unless the caller set them (``retries`` for s3fs, ``config_kwargs["retries"]``)."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 1})
    config.setdefault("connect_timeout", 5)
    options["config_kwargs"] = config
    return options


def open_binary(owner: str, path: str, storage_options: StorageOptions = None) -> IO[bytes]:
    """Open a local path or an fsspec URL for binary reading; the caller closes it."""
    if not is_url(path):
        return open(path, "rb")
    fs, stripped = filesystem(owner, path, storage_options)
    return fs.open(stripped, "rb")  # type: ignore[no-any-return]


def file_info(
    owner: str,
    path: str,
    storage_options: StorageOptions = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[int, str]:
    """``(size, version)`` of a file from its metadata only: the version is the local
    modification time in ns, or an object's ETag (else its modification time).

    Raises:
        FileNotFoundError: there is no such file; the message names it.
    """
    if not is_url(path):
        try:
            st = os.stat(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{owner}: {path} does not exist ({e.strerror})") from e
        return st.st_size, str(st.st_mtime_ns)
    fs, stripped = filesystem(owner, path, storage_options)
    info = with_retries(owner, path, timeout_s, lambda: _call(fs, "info", timeout_s, stripped))
    if info.get("type") == "directory":
        raise IsADirectoryError(f"{owner}: {path} is a directory, not a file")
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
    return int(info["size"]), str(version)


def read_ranges(
    owner: str,
    ranges: Sequence[tuple[str, int, int]],
    storage_options: StorageOptions = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[bytes]:
    """The bytes ``[start, end)`` of each ``(path, start, end)``, in that order.

    Neighbouring ranges of one file (closer than :data:`COALESCE_GAP_BYTES`) are read as one;
    on object storage the requests go out concurrently (fsspec's ``cat_ranges``), and
    those that fail transiently are retried with backoff within ``timeout_s``.
    """
    if not ranges:
        return []
    groups = _coalesce(ranges)  # (path, start, end, [(index, start, end), ...])
    out: list[bytes] = [b""] * len(ranges)
    local = [g for g in groups if not is_url(g[0])]
    remote = [g for g in groups if is_url(g[0])]
    for path, start, end, members in local:
        _split(out, _pread(owner, path, start, end), start, members)
    if remote:
        for (_, start, _, members), data in zip(
            remote, _cat_ranges(owner, remote, storage_options, timeout_s), strict=True
        ):
            _split(out, data, start, members)
    return out


def iter_blocks(
    owner: str,
    path: str,
    size: int,
    block_bytes: int,
    storage_options: StorageOptions = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Iterator[bytes]:
    """The file's bytes in blocks of ``block_bytes`` (the last one shorter), for scans;
    on object storage a few blocks are requested at once."""
    if not is_url(path):
        if size == 0:
            return
        # Slices of a mapping: the scan reads the page cache in place, without a copy.
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(mapped)
        end = min(size, len(mapped))
        try:
            for start in range(0, end, block_bytes):
                yield view[start : min(start + block_bytes, end)]  # type: ignore[misc]
        finally:
            try:
                view.release()
                mapped.close()
            except BufferError:  # a caller still holds a block: the mapping goes with it
                pass
        return
    ahead = 4
    starts = list(range(0, size, block_bytes))
    for k in range(0, len(starts), ahead):
        batch = [(path, s, min(s + block_bytes, size)) for s in starts[k : k + ahead]]
        yield from read_ranges(owner, batch, storage_options, timeout_s)


def with_retries(owner: str, url: str, timeout_s: float, attempt: Callable[[], _T]) -> _T:
    """``attempt()``, retried with exponential backoff after transient failures until
    ``timeout_s`` has passed; errors reworded to name ``url`` and the fix.

    Raises:
        FileNotFoundError: the object does not exist.
        PermissionError: access was refused (credentials).
        TimeoutError: no success within ``timeout_s``; names the last error.
    """
    deadline = time.monotonic() + timeout_s
    delay = _BACKOFF_FIRST_S
    attempts = 0
    while True:
        attempts += 1
        try:
            return attempt()
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{owner}: {url} does not exist ({_describe(e)}); check the bucket and key, "
                "or the pattern that listed it"
            ) from e
        except PermissionError as e:
            raise PermissionError(
                f"{owner}: access to {url} was refused ({_describe(e)}); check the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options="
                "{'key': ..., 'secret': ...})"
            ) from e
        except Exception as e:
            if not is_transient(e):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{owner}: no answer for {url} within timeout_s={timeout_s:g} ({attempts} "
                    f"attempt(s); last error: {_describe(e)}); check the endpoint "
                    "(AWS_ENDPOINT_URL, or storage_options={'endpoint_url': ...}) and the "
                    "network, or raise timeout_s"
                ) from e
            _count_retry()
            time.sleep(min(delay, left))
            delay = min(delay * 2, _BACKOFF_MAX_S)


def is_transient(error: BaseException) -> bool:
    """Whether a retry may cure ``error``: time-outs, refused or dropped connections, a
    server's 5xx or throttling answer."""
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & _TRANSIENT_NAMES or isinstance(error, concurrent.futures.TimeoutError):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(error)
    return any(
        word in text
        for word in ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500 ", "502")
    )


def check_index(owner: str, index: int, length: int) -> int:
    """Return `index` as an int in ``[0, length)``.

    Negative indices are rejected rather than wrapped: an index that came out of a
    permutation or a checkpoint should never be negative, so one is a bug upstream.
    """
    i = operator.index(index)
    if not 0 <= i < length:
        raise IndexError(
            f"{owner}: index {i} is out of range for length {length}; indices must be in [0, {length})"
        )
    return i


def describe_paths(paths: Sequence[str]) -> str:
    """A short repr of a path list, so that reprs of sources over many files stay readable."""
    if len(paths) <= 3:
        return repr(list(paths))
    return f"[{paths[0]!r}, ... {len(paths)} files]"


# ------------------------------------------------------------------------- internals
def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text


def _coalesce(
    ranges: Sequence[tuple[str, int, int]],
) -> list[tuple[str, int, int, list[tuple[int, int, int]]]]:
    order = sorted(range(len(ranges)), key=lambda k: (ranges[k][0], ranges[k][1]))
    groups: list[tuple[str, int, int, list[tuple[int, int, int]]]] = []
    for k in order:
        path, start, end = ranges[k]
        if groups:
            g_path, g_start, g_end, members = groups[-1]
            if g_path == path and start <= g_end + COALESCE_GAP_BYTES:
                members.append((k, start, end))
                groups[-1] = (g_path, g_start, max(g_end, end), members)
                continue
        groups.append((path, start, end, [(k, start, end)]))
    return groups


def _split(out: list[bytes], data: bytes, base: int, members: list[tuple[int, int, int]]) -> None:
    view = memoryview(data)
    for k, start, end in members:
        out[k] = bytes(view[start - base : end - base])


def _pread(owner: str, path: str, start: int, end: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    counts = _local
    data = b""
    try:
        data = os.pread(fd, end - start, start)
        counts.requests += 1
        while len(data) < end - start:  # pread may return less than asked
            more = os.pread(fd, end - start - len(data), start + len(data))
            counts.requests += 1
            if not more:
                raise OSError(
                    f"{owner}: {path} ended at {start + len(data)} bytes, before {end}; was it "
                    "truncated after it was indexed?"
                )
            data += more
        return data
    finally:
        counts.bytes += len(data)
        os.close(fd)


def _call(fs: Any, name: str, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """``fs.name(*args)``, on an async filesystem awaited with a hard time limit."""
    if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
        coroutine = getattr(fs, f"_{name}")(*args, **kwargs)
        future = asyncio.run_coroutine_threadsafe(coroutine, fs.loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise
    return getattr(fs, name)(*args, **kwargs)


def _cat_ranges(
    owner: str,
    groups: list[tuple[str, int, int, list[tuple[int, int, int]]]],
    storage_options: StorageOptions,
    timeout_s: float,
) -> list[bytes]:
    fs, _ = filesystem(owner, groups[0][0], storage_options)
    stripped = [fs._strip_protocol(g[0]) for g in groups]
    out: list[bytes | None] = [None] * len(groups)
    pending = list(range(len(groups)))
    deadline = time.monotonic() + timeout_s

    def attempt() -> None:
        nonlocal pending
        left = max(deadline - time.monotonic(), 0.001)
        _local.requests += len(pending)  # one GET a range, the retried ones again
        got = _call(
            fs,
            "cat_ranges",
            left,
            [stripped[k] for k in pending],
            [groups[k][1] for k in pending],
            [groups[k][2] for k in pending],
            on_error="return",
        )
        failed = []
        error: BaseException | None = None
        for k, data in zip(pending, got, strict=True):
            if isinstance(data, BaseException):
                failed.append(k)
                error = error or data
            else:
                out[k] = data
                _local.bytes += len(data)
        if error is not None:
            pending = failed
            raise error

    url = groups[0][0] if len(groups) == 1 else f"{groups[0][0]} (and {len(groups) - 1} more)"
    try:
        with_retries(owner, url, timeout_s, attempt)
    except (FileNotFoundError, PermissionError, TimeoutError) as e:
        if len(groups) > 1 and pending:
            first = groups[pending[0]][0]
            raise type(e)(str(e).replace(url, first)) from e.__cause__
        raise
    result: list[bytes] = []
    for k, data in enumerate(out):
        assert data is not None
        want = groups[k][2] - groups[k][1]
        if len(data) != want:
            raise OSError(
                f"{owner}: {groups[k][0]} returned {len(data)} bytes for the range "
                f"{groups[k][1]}..{groups[k][2]}; was it overwritten after it was indexed?"
            )
        result.append(bytes(data))
    return result
