"""The directory store over an fsspec URL (``s3://bucket/dir``, ``gs://...``,
``memory://name``): :class:`FsspecStore`.

The layout is :mod:`zephon.checkpoint.stores.directory`'s; object storage has no rename, no
hard links and no directories, so here:

* a put writes the data object first, then a small commit marker ``{file}.commit`` holding
  the data's length and sha256. ``get`` returns None unless the marker is there *and*
  matches the data, so a torn or in-progress write reads as absent;
* ``create`` is ``pipe_file(marker, mode="create")`` of the commit marker before the data:
  conditional where the backend supports it (local, memory, object stores with conditional
  writes), a check then a write where it does not. A loser waits briefly for the winner's
  data to land, then reads it;
* a key group's subdirectory is a prefix of its files' names: none is made, none is left
  behind. A listing asks the backend afresh every time (s3fs caches listings, which would
  hide other ranks' writes).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from zephon.checkpoint.stores.directory import COMMIT, DirectoryStore, entry_of

__all__ = ["FsspecStore"]

_CREATE_SETTLE_S = 1.0  # how long a loser of create waits for the winner's data to land


class FsspecStore(DirectoryStore, for_roots="urls"):
    """Keys as objects under ``url/namespace``.

    Args:
        url: an fsspec URL (``s3://bucket/dir``, ``memory://name``; ``file:///dir`` too,
            made this way rather than through ``DirectoryStore``); fsspec and the backend's
            package must be installed.
        namespace: a subdirectory of ``url``; ranks of one job must agree on it.
        fsync: must be False (the backend decides when a write is durable).
    """

    poll_interval_s = 0.05
    poll_max_interval_s = 5.0

    def _open(self, root: str, namespace: str, fsync: bool) -> str:
        if fsync:
            raise ValueError(
                f"fsync=True applies to local paths only; {root!r} is an fsspec URL, whose"
                " backend decides when a write is durable"
            )
        import fsspec

        self._fs: Any
        self._fs, path = fsspec.core.url_to_fs(root)
        base = f"{path.rstrip('/')}/{namespace}"
        self._fs.makedirs(base, exist_ok=True)
        return base

    def describe(self) -> str:
        protocol = self._fs.protocol
        protocol = protocol[0] if isinstance(protocol, tuple | list) else protocol
        return f"{protocol}://{self._base.lstrip('/')}"

    # ------------------------------------------------------------------ file operations

    def _join(self, *parts: str) -> str:
        return "/".join(parts)

    def _entries(self, path: str) -> list[tuple[str, bool]]:
        self.counters.add(requests=1)
        try:
            # refresh: a cached listing (s3fs keeps one) would hide other ranks' writes
            paths = self._fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        found = {p.rstrip("/").rsplit("/", 1)[-1] for p in paths}
        return [
            (name, is_bucket)
            for name, is_bucket in filter(None, map(entry_of, found))
            if is_bucket or name + COMMIT in found  # a data object counts once committed
        ]

    def _pipe(self, key: str, path: str, data: bytes, **kwargs: Any) -> None:
        """``pipe_file``; on a backend with real directories (sftp, ``file://``) the key's
        subdirectory is made where it is missing (object stores never miss one)."""
        try:
            self._fs.pipe_file(path, data, **kwargs)
        except FileNotFoundError:
            bucket = self._bucket(key)
            if bucket is None:
                raise
            self.counters.add(requests=1)
            self._fs.makedirs(bucket, exist_ok=True)
            self._fs.pipe_file(path, data, **kwargs)

    def _write(self, key: str, data: bytes) -> None:
        self.counters.add(requests=1, written=len(data))
        path = self._path(key)
        self._pipe(key, path, data)
        self._fs.pipe_file(path + COMMIT, _marker(data))

    def _create_file(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        self.counters.add(requests=2, written=len(data))
        try:
            # The marker claims the key; until the data matches it, readers see "absent".
            self._pipe(key, path + COMMIT, _marker(data), mode="create")
        except FileExistsError:
            deadline = time.monotonic() + _CREATE_SETTLE_S
            while self._read(key) is None and time.monotonic() < deadline:
                time.sleep(self.poll_interval_s)
            return False
        self._fs.pipe_file(path, data)
        return True

    def _read(self, key: str) -> bytes | None:
        path = self._path(key)
        self.counters.add(requests=1)
        # Marker first, then data: a value whose marker describes other bytes is a write in
        # progress (or one that died half way) and reads as absent.
        try:
            marker = self._fs.cat_file(path + COMMIT)
            data = self._fs.cat_file(path)
        except FileNotFoundError:
            return None
        self.counters.add(read=len(data))
        return bytes(data) if marker == _marker(data) else None

    def _unlink(self, key: str, tidy: bool = True) -> None:
        path = self._path(key)
        self.counters.add(requests=1)
        for p in (path + COMMIT, path):  # marker first: a reader never trusts stale data
            try:
                self._fs.rm_file(p)
            except FileNotFoundError:
                pass


def _marker(data: bytes) -> bytes:
    return b"%d:" % len(data) + hashlib.sha256(data).hexdigest().encode()
