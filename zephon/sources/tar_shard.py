"""Random access over WebDataset tar shards through a member-offset index.

The layout is WebDataset's: a shard is a tar file whose members are grouped into samples
by key. A member's key is its name up to the first dot of its base name, the rest is its
extension (``a/b.seg.png`` is key ``a/b``, extension ``seg.png``; WebDataset's
``base_plus_ext``); extensions are lower-cased; consecutive members with one key form a
sample. As in WebDataset, only regular files count, and names without a dot in their base
name or of the form ``__name__`` (metadata) are left out.

Each shard is scanned once; its index (per sample the data offset, size and extension of
each member, and the key) is kept as a memory-mapped cache by
:mod:`zephon.sources.index_cache`, like a JSONL file's line offsets, so that later starts
and every worker process map it instead of scanning.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Sequence
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
    read_ranges,
)
from zephon.sources.identity import files_sample
from zephon.sources.index_cache import FileIndexes, FileReader

_ON_ERROR = ("raise", "skip")
#: What ``on_error="skip"`` leaves out, by kind (the keys of
#: :meth:`TarShardSource.skipped_records`).
SKIP_KINDS = ("truncated", "corrupt", "duplicate_member", "missing_member")
_SKIP_WORDS = {
    "truncated": "cut short by the end of the file",
    "corrupt": "cut short by a corrupt tar header",
    "duplicate_member": "with a member twice",
    "missing_member": "without a member asked for",
}
_BLOCK = 512
_PROBLEMS_KEPT = 20  # problems described per shard (all are counted)
_INDEX_KIND = "tar-v1"


class TarShardSource:
    """Random access over the samples of WebDataset tar shards.

    A sample is a dict of extension to the member's bytes, plus ``"__key__"`` (the key,
    a str) and ``"__url__"`` (the shard's path), as WebDataset gives it::

        {"__key__": "000123", "__url__": "shards/train-0001.tar",
         "jpg": b"\\xff\\xd8...", "json": b'{"caption": ...}'}

    Members are grouped by key as WebDataset does (see :mod:`zephon.sources.tar_shard`).
    Each shard is scanned once (headers only are parsed; the whole file is read once) and
    its index is kept as a memory-mapped cache file, like :class:`~zephon.JsonlSource`'s:
    later starts and every worker process map it, never rescan. ``ds[i]`` then reads
    that sample's members with one range request (a sample's members lie together);
    ``read(indices)`` reads a batch's samples with coalesced range requests, concurrent
    on object storage. Paths with a protocol (``s3://``, ``memory://``) are opened with
    fsspec.

    Args:
        paths: a shard, a sequence of shards, or glob patterns (``data/train-*.tar``,
            ``s3://bucket/shards/*.tar``; each pattern's files in sorted order); samples
            are numbered across the shards in that order.
        members: if given, the extensions to read (``("jpg", "json")``): other members
            are not read, and a sample without one of these is an error when it is read
            (``KeyError`` naming the shard, key and member), or left out with
            ``on_error="skip"``.
        on_error: ``"raise"``: a shard that is truncated (it ends inside a member), holds a
            corrupt tar header, or holds a sample with one extension twice raises
            ``ValueError`` naming the shard, the key and the member when the source is
            built; ``"skip"`` leaves out the samples concerned (a truncated or corrupt
            shard keeps the samples before the damage), counts them by kind
            (:meth:`skipped_records`, also in ``Pipeline.stats()``) and warns once per
            shard that had any.
        storage_options: passed to fsspec for URLs (credentials, ``endpoint_url``, ...).
        timeout_s: how long one read of a URL may take, retries included.
    """

    def __init__(
        self,
        paths: PathsArg,
        members: Sequence[str] | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        *,
        storage_options: StorageOptions = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(
                f"TarShardSource: on_error must be one of {_ON_ERROR}; got {on_error!r}"
            )
        if members is not None:
            if isinstance(members, str):
                members = (members,)
            members = tuple(members)
            if not members or not all(isinstance(m, str) and m for m in members):
                raise ValueError(
                    "TarShardSource: members must be a non-empty sequence of extensions "
                    f"(e.g. ('jpg', 'json')); got {members!r}"
                )
            members = tuple(m.lower().lstrip(".") for m in members)
        self._members: tuple[str, ...] | None = members
        self._storage_options = None if storage_options is None else dict(storage_options)
        self._timeout_s = float(timeout_s)
        self._paths = expand_paths("TarShardSource", paths, self._storage_options)
        for path in self._paths:
            if is_url(path):
                filesystem("TarShardSource", path, self._storage_options)  # fsspec is there
        self._on_error = on_error
        self._index = FileIndexes(
            "TarShardSource",
            self._paths,
            _INDEX_KIND,
            index_tar,
            self._storage_options,
            self._timeout_s,
        )
        self._index.ensure()
        self._file_sizes = self._index.sizes
        self._skipped = dict.fromkeys(SKIP_KINDS, 0)
        self._extensions = [list(extra.get("extensions", [])) for extra in self._index.extras]
        for path, extra in zip(self._paths, self._index.extras, strict=True):
            self._check_problems(path, extra)
        # Samples kept of each shard: None means all of them (local sample = position).
        self._kept: list[np.ndarray | None] = [None] * len(self._paths)
        counts = [int(extra.get("samples", 0)) for extra in self._index.extras]
        if on_error == "skip" and members is not None:
            for f, path in enumerate(self._paths):
                self._kept[f], missing = self._with_members(f)
                if missing:
                    counts[f] = len(self._kept[f])  # type: ignore[arg-type]
                    self._skipped["missing_member"] += missing
                    warnings.warn(
                        f"TarShardSource: skipped {missing} of {missing + counts[f]} samples "
                        f"of {path}: {missing} {_SKIP_WORDS['missing_member']} "
                        f"({', '.join(members)}); on_error='raise' reports each one",
                        UserWarning,
                        stacklevel=2,
                    )
                else:
                    self._kept[f] = None
        # Sample i lives in shard f where _file_starts[f] <= i < _file_starts[f + 1].
        self._file_starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        #: Each shard's index parts, made once (a worker's copy makes its own).
        self._views = _Views()

    def __len__(self) -> int:
        return int(self._file_starts[-1])

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.read([check_index("TarShardSource", index, len(self))])[0]

    def read(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Samples at `indices`, in that order: their members read with one range request
        per neighbourhood (concurrent requests on object storage)."""
        n = len(self)
        checked = [check_index("TarShardSource", i, n) for i in indices]
        if not checked:
            return []
        at = np.asarray(checked, dtype=np.int64)
        file_of = (np.searchsorted(self._file_starts, at, side="right") - 1).tolist()
        local = (at - self._file_starts[file_of]).tolist()
        plans: list[tuple[int, str, list[tuple[str, int]]]] = []
        ranges: list[tuple[str, int, int]] = []
        for f, pos in zip(file_of, local, strict=True):
            kept = self._kept[f]
            s = int(kept[pos]) if kept is not None else pos
            view = self._view(f)
            key = view.key(s)
            names = self._extensions[f]
            wanted: list[tuple[str, int]] = []
            found = set()
            for m in range(view.member_start[s], view.member_start[s + 1]):
                ext = names[int(view.ext[m])]
                if self._members is not None and ext not in self._members:
                    continue
                found.add(ext)
                offset = int(view.offset[m])
                wanted.append((ext, len(ranges)))
                ranges.append((self._paths[f], offset, offset + int(view.size[m])))
            if self._members is not None and len(found) < len(self._members):
                missing = [m for m in self._members if m not in found]
                present = [
                    names[int(e)] for e in view.ext[view.member_start[s] : view.member_start[s + 1]]
                ]
                raise KeyError(
                    f"TarShardSource: sample {key!r} of {self._paths[f]} has no member "
                    f"{missing[0]!r} ({key}.{missing[0]}; found {sorted(present)}); fix the "
                    "shard, ask for other members, or pass on_error='skip'"
                )
            plans.append((f, key, wanted))
        raw = read_ranges("TarShardSource", ranges, self._storage_options, self._timeout_s)
        out = []
        for f, key, wanted in plans:
            sample: dict[str, Any] = {"__key__": key, "__url__": self._paths[f]}
            for ext, k in wanted:
                sample[ext] = raw[k]
            out.append(sample)
        return out

    def keys(self) -> Iterator[str]:
        """Every sample's key, in order (from the index: nothing of the shards is read)."""
        for f in range(len(self._paths)):
            view = _View(self._index.array(f), self._index.extras[f])
            kept = self._kept[f]
            for s in range(view.samples) if kept is None else kept.tolist():
                yield view.key(s)

    def skipped_records(self) -> dict[str, int]:
        """Samples that ``on_error="skip"`` left out, by kind (:data:`SKIP_KINDS`), summed
        over the shards. Known once the source is built, so every process holding the
        source reports the same counts."""
        return dict(self._skipped)

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: the shards' total size and
        a digest of their sizes and sample counts and of sampled blocks of up to
        ``SAMPLE_FILES`` shards spread over the set (see :mod:`zephon.sources.identity`),
        plus the members read. Not the paths: a copied dataset still matches."""
        total, sample = files_sample(
            "TarShardSource",
            self._paths,
            sizes=self._file_sizes.tolist(),
            counts=(np.diff(self._file_starts)).tolist(),
            storage_options=self._storage_options,
        )
        return {
            "kind": "tar",
            "files": len(self._paths),
            "bytes": total,
            "sample": sample,
            "members": None if self._members is None else list(self._members),
        }

    def __repr__(self) -> str:
        return (
            f"TarShardSource(paths={describe_paths(self._paths)}, members={self._members!r}, "
            f"on_error={self._on_error!r}, len={len(self)})"
        )

    # ------------------------------------------------------------------ internals
    def _view(self, f: int) -> _View:
        """Shard ``f``'s index parts, made once for each mapping of its index."""
        array = self._index.array(f)
        got = self._views.get(f)
        if got is None or got[0] is not array:
            got = self._views[f] = (array, _View(array, self._index.extras[f]))
        return got[1]

    def _check_problems(self, path: str, extra: dict[str, Any]) -> None:
        counts: dict[str, int] = extra.get("counts", {})
        if not any(counts.values()):
            return
        problems: list[dict[str, Any]] = extra.get("problems", [])
        if self._on_error == "raise":
            first = problems[0]
            raise ValueError(
                f"TarShardSource: {path}: {first['detail']}; re-write the shard, or pass "
                "on_error='skip' to leave out the samples concerned"
            )
        skipped = 0
        for kind, k in counts.items():
            self._skipped[kind] += k
            skipped += k
        detail = "; ".join(p["detail"] for p in problems[:3])
        warnings.warn(
            f"TarShardSource: skipped {skipped} of {skipped + int(extra.get('samples', 0))} "
            f"samples of {path}: {detail}; on_error='raise' reports each one",
            UserWarning,
            stacklevel=3,
        )

    def _with_members(self, f: int) -> tuple[np.ndarray, int]:
        """The samples of shard ``f`` holding every member asked for, and how many do not."""
        view = _View(self._index.array(f), self._index.extras[f])
        names = self._extensions[f]
        ok = np.ones(view.samples, dtype=bool)
        sample_of = np.repeat(np.arange(view.samples), np.diff(view.member_start))
        for member in self._members or ():
            has = np.zeros(view.samples, dtype=bool)
            if member in names:
                has[sample_of[np.asarray(view.ext) == names.index(member)]] = True
            ok &= has
        kept = np.flatnonzero(ok).astype(np.int64)
        return kept, view.samples - len(kept)


class _Views(dict[int, tuple[np.ndarray, "_View"]]):
    """Each shard's :class:`_View` by shard, with the index array it was made of; a copy
    (pickled into a worker) starts empty and makes its own."""

    def __reduce__(self) -> tuple[type[_Views], tuple[()]]:
        return _Views, ()


class _View:
    """The parts of one shard's index array (see :func:`index_tar` for the layout)."""

    __slots__ = ("samples", "member_start", "ext", "offset", "size", "key_start", "_blob")

    def __init__(self, array: np.ndarray, extra: dict[str, Any]) -> None:
        s, m = int(extra.get("samples", 0)), int(extra.get("members", 0))
        array = np.asarray(array)  # a plain view of the mapped cache: cheaper slicing
        self.samples = s
        at = 0
        self.member_start = array[at : at + s + 1]
        at += s + 1
        self.ext = array[at : at + m]
        at += m
        self.offset = array[at : at + m]
        at += m
        self.size = array[at : at + m]
        at += m
        self.key_start = array[at : at + s + 1]
        at += s + 1
        self._blob = array[at:].view(np.uint8) if len(array) > at else np.empty(0, np.uint8)

    def key(self, s: int) -> str:
        raw = self._blob[int(self.key_start[s]) : int(self.key_start[s + 1])].tobytes()
        return raw.decode("utf-8", "surrogateescape")


# ---------------------------------------------------------------------------- the scan


class _Stream:
    """Sequential reads and skips over a file given as blocks (the index builder's scan)."""

    def __init__(self, blocks: Iterator[bytes]) -> None:
        self._blocks = blocks
        self._block: memoryview = memoryview(b"")
        self._at = 0  # position inside the current block
        self.pos = 0  # absolute position in the file

    def _next_block(self) -> bool:
        for block in self._blocks:
            if len(block):
                self._block, self._at = memoryview(block), 0
                return True
        self._block, self._at = memoryview(b""), 0
        return False

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only at the end of the file)."""
        parts: list[bytes] = []
        while n > 0:
            if self._at >= len(self._block) and not self._next_block():
                break
            take = min(n, len(self._block) - self._at)
            parts.append(bytes(self._block[self._at : self._at + take]))
            self._at += take
            self.pos += take
            n -= take
        return b"".join(parts)

    def skip(self, n: int) -> int:
        """Skip up to ``n`` bytes; how many were skipped."""
        done = 0
        while n > done:
            if self._at >= len(self._block) and not self._next_block():
                break
            take = min(n - done, len(self._block) - self._at)
            self._at += take
            self.pos += take
            done += take
        return done

    def drain(self) -> None:
        self._block = memoryview(b"")
        for _ in self._blocks:
            pass


def _octal(field: bytes) -> int:
    """A numeric header field: octal text, or GNU's base-256 (high bit set)."""
    if field and field[0] & 0x80:
        if field[0] == 0xFF:
            raise ValueError("negative number")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.replace(b"\0", b" ").strip()
    return int(text, 8) if text else 0


def _checksum_ok(header: bytes) -> bool:
    try:
        stored = _octal(header[148:156])
    except ValueError:
        return False
    blank = header[:148] + b" " * 8 + header[156:]
    unsigned = sum(blank)
    signed = unsigned - 256 * sum(1 for b in blank if b > 127)
    return stored in (unsigned, signed)


def _pax_records(data: bytes) -> dict[str, str]:
    """``length key=value\\n`` records of a pax extended header."""
    out: dict[str, str] = {}
    at = 0
    while at < len(data):
        space = data.find(b" ", at)
        if space < 0:
            break
        length = int(data[at:space])
        if length <= 0:
            raise ValueError("bad pax record length")
        record = data[space + 1 : at + length - 1]
        key, _, value = record.partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return out


_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's, verbatim
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's skip_meta


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name as WebDataset's ``base_plus_ext`` splits it
    (the directory and the base name up to its first dot; the rest, lower-cased), or None
    for a name WebDataset leaves out: no dot in the base name, or metadata (``__x__``)."""
    if _META.match(name):
        return None
    match = _BASE_PLUS_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def index_tar(reader: FileReader) -> tuple[np.ndarray, dict[str, Any]]:
    """Scan one tar file: the index array and its extras.

    The array (int64) holds, for ``S`` samples of ``M`` members in all: ``member_start``
    (``S + 1``: sample ``s``'s members are ``member_start[s]:member_start[s + 1]``), then
    per member its extension's number, data offset and size (``M`` each), then
    ``key_start`` (``S + 1``) and the keys' UTF-8 bytes, padded to 8 bytes. The extras
    give ``samples``, ``members``, ``extensions`` (the names the numbers stand for) and
    the problems met: ``counts`` by kind and up to 20 described.
    """
    stream = _Stream(iter(reader.blocks()))
    extensions: dict[str, int] = {}
    member_start: list[int] = [0]
    ext_ids: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    keys: list[bytes] = []
    counts = dict.fromkeys(("truncated", "corrupt", "duplicate_member"), 0)
    problems: list[dict[str, Any]] = []
    # The sample being gathered: its key and members (ext, offset, size).
    current: str | None = None
    gathered: list[tuple[str, int, int]] = []
    broken = False  # the current sample had a problem: dropped when it ends
    last_name: str | None = None

    def problem(kind: str, detail: str, key: str | None, member: str | None) -> None:
        counts[kind] += 1
        if len(problems) < _PROBLEMS_KEPT:
            problems.append({"kind": kind, "detail": detail, "key": key, "member": member})

    def close_sample() -> None:
        nonlocal current, gathered, broken
        if current is not None and not broken and gathered:
            for ext, offset, size in gathered:
                ext_ids.append(extensions.setdefault(ext, len(extensions)))
                offsets.append(offset)
                sizes.append(size)
            member_start.append(len(ext_ids))
            keys.append(current.encode("utf-8", "surrogateescape"))
        current, gathered, broken = None, [], False

    def where() -> str:
        return f"after member {last_name!r}" if last_name is not None else "at its start"

    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header_at = stream.pos
        header = stream.read(_BLOCK)
        if not header:
            break  # the end of the file without an end-of-archive marker: accepted, as tar
        if header_at == 0 and (packer := _compressed(header)) is not None:
            problem(
                "corrupt",
                f"the file is {packer}-compressed; random access by member offsets needs an "
                "uncompressed tar: decompress the shard (WebDataset shards are usually plain "
                "tar)",
                None,
                None,
            )
            break
        if len(header) < _BLOCK:
            lacking = f" (sample {current!r} may lack members)" if current is not None else ""
            problem(
                "truncated",
                f"the file ends inside the tar header at byte {header_at} {where()}"
                f"{lacking}; the shard is truncated",
                current,
                None,
            )
            broken = True
            break
        if header == b"\0" * _BLOCK:
            break  # end-of-archive marker
        if not _checksum_ok(header):
            key = current
            problem(
                "corrupt",
                f"the tar header at byte {header_at} {where()} is corrupt (bad checksum); "
                f"nothing after it can be read"
                + (f" and sample {key!r} may lack members" if key is not None else ""),
                key,
                None,
            )
            broken = True
            break
        kind = header[156:157]
        try:
            size = _octal(header[124:136])
        except ValueError:
            problem(
                "corrupt",
                f"the tar header at byte {header_at} {where()} has an unreadable size field",
                current,
                None,
            )
            broken = True
            break
        data_at = stream.pos
        padded = -(-size // _BLOCK) * _BLOCK
        if kind in (b"L", b"x", b"g", b"K"):
            data = stream.read(size)
            stream.skip(padded - size)
            if len(data) < size:
                problem(
                    "truncated",
                    f"the file ends inside an extended tar header at byte {header_at} "
                    f"{where()}; the shard is truncated",
                    current,
                    None,
                )
                broken = True
                break
            if kind == b"L":
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind == b"x":
                try:
                    pax = _pax_records(data)
                except ValueError:
                    problem(
                        "corrupt",
                        f"the pax header at byte {header_at} {where()} is corrupt",
                        current,
                        None,
                    )
                    broken = True
                    break
            continue
        name = _header_name(header)
        if long_name is not None:
            name, long_name = long_name, None
        if "path" in pax:
            name = pax["path"]
        if "size" in pax:
            size = int(pax["size"])
            padded = -(-size // _BLOCK) * _BLOCK
        pax = {}
        got = stream.skip(size)
        if got < size:
            parts = split_name(name) if kind in (b"0", b"\0", b"7") else None
            key = parts[0] if parts else current
            if parts and parts[0] != current:
                close_sample()
                current = key
            problem(
                "truncated",
                f"the file ends inside member {name!r} (sample {key!r}) at byte "
                f"{data_at + got}, {size - got} of its {size} bytes missing; the shard is "
                "truncated",
                key,
                name,
            )
            broken = True
            break
        stream.skip(padded - size)
        last_name = name
        if kind not in (b"0", b"\0", b"7"):
            continue  # not a regular file: links, directories, devices (as WebDataset)
        parts = split_name(name)
        if parts is None:
            continue
        key, ext = parts
        if key != current:
            close_sample()
            current = key
        if any(e == ext for e, _, _ in gathered):
            if not broken:
                problem(
                    "duplicate_member",
                    f"sample {key!r} has the member {ext!r} twice (the second is {name!r} at "
                    f"byte {header_at})",
                    key,
                    name,
                )
            broken = True
            continue
        gathered.append((ext, data_at, size))
    close_sample()
    stream.drain()
    names = sorted(extensions, key=extensions.__getitem__)
    blob = b"".join(keys)
    key_start = np.zeros(len(keys) + 1, dtype=np.int64)
    key_start[1:] = np.cumsum([len(k) for k in keys], dtype=np.int64)
    padded_blob = blob + b"\0" * (-len(blob) % 8)
    array = np.concatenate(
        [
            np.asarray(member_start, dtype=np.int64),
            np.asarray(ext_ids, dtype=np.int64),
            np.asarray(offsets, dtype=np.int64),
            np.asarray(sizes, dtype=np.int64),
            key_start,
            np.frombuffer(padded_blob, dtype=np.int64),
        ]
    )
    extra = {
        "samples": len(keys),
        "members": len(ext_ids),
        "extensions": names,
        "counts": counts,
        "problems": problems,
    }
    return array, extra


_MAGICS = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}


def _compressed(head: bytes) -> str | None:
    """The compression a file's first bytes show, or None."""
    for magic, name in _MAGICS.items():
        if head.startswith(magic):
            return name
    return None


def _header_name(header: bytes) -> str:
    name = header[0:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0":  # POSIX ustar: a prefix may hold the directory
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")
