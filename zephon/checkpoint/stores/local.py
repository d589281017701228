"""The directory store on a local (or network-mounted) path: :class:`LocalStore`.

The layout is :mod:`zephon.checkpoint.stores.directory`'s; here is what a file system with
rename, hard links and directories adds:

* a put is a temp file in the same directory, then a rename, so a reader sees the old value
  or the new one, never a prefix (``fsync=True`` adds the fsyncs of
  :func:`~zephon.checkpoint.atomic.atomic_write_bytes`);
* ``create`` (write only if absent) is a hard link of a fully written temp file onto the key
  (``link`` fails with EEXIST when the key exists: atomic on local filesystems and NFS), so
  exactly one of several racing writers wins and the others read its value; where the
  filesystem refuses links (FAT, some FUSE and SMB mounts), an ``O_EXCL`` create. An empty
  value needs no data block, so a rank can still create an (empty) notice on a full disk;
* a key group's subdirectory is made when its first key is written (or ahead of a round, by
  ``make_room``) and removed when it is left empty (a writer that loses that race to the
  removal makes it again).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from zephon.checkpoint.atomic import atomic_write_bytes, fsync_dir, temp_path
from zephon.checkpoint.stores.directory import DirectoryStore, entry_of, is_url

__all__ = ["LocalStore"]

_T = TypeVar("_T")
_MAKE_TRIES = 10  # a write whose subdirectory keeps being removed under it gives up then
# link() refused by the filesystem (FAT, some FUSE and SMB mounts): fall back to O_EXCL
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


class LocalStore(DirectoryStore, for_roots="paths"):
    """Keys as files under ``path/namespace`` on a local or shared file system.

    Args:
        path: a local or shared-filesystem directory, or a ``file://`` URL.
        namespace: a subdirectory of ``path``; ranks of one job must agree on it.
        fsync: also fsync each written file and the directory, making every key durable
            against a power cut. Off by default: coordination keys only need the rename's
            atomicity (a round does not survive a reboot, and what one leaves behind reads
            as stale or unreadable and is ignored), and the fsyncs would triple a round's
            latency. The merged state a round returns is saved durably by the caller
            (``zephon.save``).
    """

    poll_interval_s = 0.001
    poll_max_interval_s = 0.005

    def _open(self, root: str, namespace: str, fsync: bool) -> str:
        if is_url(root):
            raise ValueError(
                f"LocalStore takes a path or a file:// URL; got {root!r} (DirectoryStore()"
                " picks the store for a URL)"
            )
        self._fsync = fsync
        base = os.path.join(os.path.abspath(root.removeprefix("file://")), namespace)
        os.makedirs(base, exist_ok=True)
        return base

    def make_room(self, prefixes: list[str]) -> None:
        """Make the subdirectories of the keys under ``prefixes`` (each ending with a dot:
        a round's states, its acknowledgements) before many ranks write there at once;
        without it each of them would find it missing, fail a write and race to make it.
        One that stays empty is removed with the next deletion under it (or stays, empty,
        if none comes: a listing ignores it)."""
        for prefix in prefixes:
            bucket = self._prefix_bucket(prefix)
            if bucket is not None:
                self.counters.add(requests=1)
                os.makedirs(bucket, exist_ok=True)

    def delete_prefix(self, prefix: str, known: Sequence[str] = ()) -> None:
        """Remove every key that starts with ``prefix``, and the subdirectories it empties."""
        keys = self._delete_listed(prefix)
        # Each emptied subdirectory goes once (not after every key), and the one of the
        # prefix itself even when it held nothing (made by make_room, never written).
        buckets = {self._bucket(key) for key in keys} | {self._prefix_bucket(prefix)}
        for bucket in buckets - {None}:
            with contextlib.suppress(OSError):  # not empty (or gone): it stays
                os.rmdir(bucket)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ file operations

    def _join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def _entries(self, path: str) -> list[tuple[str, bool]]:
        self.counters.add(requests=1)
        try:
            with os.scandir(path) as it:
                names = [e.name for e in it]
        except FileNotFoundError:
            return []
        return [entry for entry in map(entry_of, names) if entry is not None]

    def _in_bucket(self, key: str, write: Callable[[str], _T]) -> _T:
        """``write(path)`` for ``key``; where its subdirectory is missing (the first key of
        its group, or another rank removed it empty in between), make it and write again."""
        path = self._path(key)
        bucket = self._bucket(key)
        for _ in range(_MAKE_TRIES):
            try:
                return write(path)
            except FileNotFoundError:
                if bucket is None:
                    raise
            self.counters.add(requests=1)
            try:
                os.mkdir(bucket)
            except FileExistsError:
                pass  # another writer made it (and one may remove it again: the next try tells)
            except FileNotFoundError:
                os.makedirs(bucket, exist_ok=True)  # the namespace was removed too
            if self._fsync:
                fsync_dir(self._base)
        return write(path)

    def _write(self, key: str, data: bytes) -> None:
        self.counters.add(requests=1, written=len(data))
        self._in_bucket(key, lambda path: self._replace(path, data))

    def _replace(self, path: str, data: bytes) -> None:
        if self._fsync:
            atomic_write_bytes(path, data)
            return
        tmp = temp_path(path)
        try:
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _create_file(self, key: str, data: bytes) -> bool:
        self.counters.add(requests=1, written=len(data))
        return self._in_bucket(key, lambda path: self._link(path, data))

    def _link(self, path: str, data: bytes) -> bool:
        tmp = temp_path(path)
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in _NO_LINK:
                    raise
                return self._create_exclusive(path, data)  # a filesystem without hard links
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def _read(self, key: str) -> bytes | None:
        self.counters.add(requests=1)
        try:
            with open(self._path(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        self.counters.add(read=len(data))
        return data

    def _unlink(self, key: str, tidy: bool = True) -> None:
        self.counters.add(requests=1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))
        bucket = self._bucket(key) if tidy else None
        if bucket is not None:
            with contextlib.suppress(OSError):  # not empty (or gone): it stays
                os.rmdir(bucket)
