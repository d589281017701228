"""A :class:`~zephon.checkpoint.stores.base.Store` over a shared directory or an fsspec URL.

Every key is one file under ``root/namespace``, in a subdirectory named by the key up to
its last dot: ``j1.p2.s.r7.12`` is the file ``12`` in ``j1.p2.s.r7~`` (the ``~``, which no
key holds, tells a subdirectory from a key's file). A key without a dot inside it is a file
of the namespace itself. So listing a prefix reads the namespace's few subdirectories and
the ones that match, not every key of every round kept there: the leader of a 1,024-rank
round polls one subdirectory of its round's states, however many records of the previous
round wait beside it. A subdirectory left empty is removed (a writer that loses that race
to the removal makes it again).

Two ways to make a put atomic:

* a local (or network-mounted) path: a temp file in the same directory, then a rename, so
  a reader sees the old value or the new one, never a prefix (``fsync=True`` adds the
  fsyncs of :func:`atomic_write_bytes`);
* an fsspec URL (object storage has no rename): the data object first, then a small commit
  marker ``{key}.commit`` holding the data's length and sha256. ``get`` returns None unless
  the marker is there *and* matches the data, so a torn or in-progress write reads as absent.

``create`` (write only if absent) is a hard link of a fully written temp file onto the key
(``link`` fails with EEXIST when the key exists: atomic on local filesystems and NFS), so
exactly one of several racing writers wins and the others read its value. An empty value
needs no data block, so a rank can still create an (empty) notice on a full disk. Over
fsspec it is ``pipe_file(marker, mode="create")`` of the commit marker before the data:
conditional where the backend supports it (local, memory, object stores with conditional
writes), a check then a write where it does not.

Fencing is best effort: ``announce`` returns the announced bytes as the token and a fenced
write re-reads the key and compares, which leaves a window between the check and the write.
Where two writers race for one decision, ``create`` (not the fence) settles it.

Leases are emulated: ``keep_alive`` writes the value framed with an expiry (wall clock) and a
background thread rewrites it every ``ttl_s / 3``; ``get`` reads an expired value as absent.
A SIGKILLed holder therefore disappears ``ttl_s`` later, provided the hosts sharing the
directory agree on the time to well within ``ttl_s`` (NTP). ``lost`` is computed from the
clock, so a holder that was paused past its expiry knows, even before its thread runs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import threading
import time
from typing import Any

from zephon.checkpoint.atomic import atomic_write_bytes, fsync_dir, temp_path
from zephon.checkpoint.stores.base import KeyHeldError, StaleRoundError, StoreCounters
from zephon.checkpoint.stores.file_lease import FileLease, frame, unframe
from zephon.errors import AggregationError

__all__ = ["DirectoryStore"]

# Keys are plain file names: no separators, no leading dot (temp files start with one), and
# nothing ending in the commit marker's suffix.
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
_COMMIT = ".commit"
_BUCKET = "~"  # ends the name of a key group's subdirectory (no key holds it)
_MAKE_TRIES = 10  # a write whose subdirectory keeps being removed under it gives up then
_CREATE_SETTLE_S = 1.0  # fsspec: how long a loser waits for the winner's data to land


class _Fence:
    """What ``announce`` returns: the key and the exact bytes it announced."""

    __slots__ = ("key", "value")

    def __init__(self, key: str, value: bytes) -> None:
        self.key = key
        self.value = value

    def __repr__(self) -> str:
        return f"_Fence(key={self.key!r}, {len(self.value)} bytes)"


class DirectoryStore:
    """Keys as files under ``root/namespace``; ``root`` is a path or an fsspec URL.

    Args:
        root: a local or shared-filesystem directory, or an fsspec URL (``s3://bucket/dir``,
            ``memory://name``); ``file://`` URLs are treated as local paths.
        namespace: a subdirectory of ``root``; ranks of one job must agree on it.
        fsync: local paths only: also fsync each written file and the directory, making
            every key durable against a power cut. Off by default: coordination keys only
            need the rename's atomicity (a round does not survive a reboot, and what one
            leaves behind reads as stale or unreadable and is ignored), and the fsyncs
            would triple a round's latency. The merged state a round returns is saved
            durably by the caller (``zephon.save``).
    """

    def __init__(
        self, root: str | os.PathLike[str], namespace: str = "zephon", *, fsync: bool = False
    ) -> None:
        root = os.fspath(root)
        if not _KEY.fullmatch(namespace):
            raise ValueError(
                f"namespace must match {_KEY.pattern} (a plain directory name); got {namespace!r}"
            )
        if root.startswith("file://"):
            root = root[len("file://") :]
        self._root = root
        self._namespace = namespace
        self._fsync = fsync
        self._fs: Any = None
        self.counters = StoreCounters()
        self.log_prefix = ""  # the round sets "[rank=N] " so the lease's warnings name it
        if "://" in root:
            import fsspec

            self._fs, base = fsspec.core.url_to_fs(root)
            self._base = f"{base.rstrip('/')}/{namespace}"
            self._fs.makedirs(self._base, exist_ok=True)
            self.poll_interval_s = 0.05
            self.poll_max_interval_s = 5.0
        else:
            self._base = os.path.join(os.path.abspath(root), namespace)
            os.makedirs(self._base, exist_ok=True)
            self.poll_interval_s = 0.001
            self.poll_max_interval_s = 0.005
        self._leases: list[FileLease] = []
        self._leases_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DirectoryStore({self.describe()!r})"

    # ------------------------------------------------------------------------- Store

    def put(self, key: str, value: bytes, *, fence: Any = None) -> None:
        """Atomically create or replace ``key``.

        Raises:
            StaleRoundError: ``fence`` is given and its key no longer holds the value that
                ``announce`` wrote (a newer round was announced).
        """
        self._check_key(key)
        self._check_fence(key, fence)
        self._write(key, frame(value))

    def create(self, key: str, value: bytes, *, fence: Any = None) -> bytes | None:
        """Write ``key`` only if absent (see the module docstring); None when this call
        created it, else the value that was there first."""
        self._check_key(key)
        self._check_fence(key, fence)
        data = frame(value)
        for _ in range(3):
            if self._fs is None:
                won = self._create_local(key, data)
            else:
                won = self._create_fsspec(key, data)
            if won:
                return None
            existing = self.get(key)
            if existing is not None:
                return existing
            # deleted between our attempt and our read: try again
        raise AggregationError(
            f"could not create {key!r} in {self.describe()}: it was created and removed"
            " three times while this rank tried; is another job using this namespace?"
        )

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent (an uncommitted or expired one counts as absent)."""
        self._check_key(key)
        data = self._read(key)
        return None if data is None else unframe(data)

    def delete(self, key: str) -> None:
        """Remove ``key``; absent is fine."""
        self._check_key(key)
        self._unlink(key)

    def list_keys(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix`` (committed ones, over fsspec), sorted.

        Reads the namespace's entries and the subdirectories whose keys can match."""
        keys: list[str] = []
        for name, is_bucket in self._entries(self._base):
            if not is_bucket:
                if name.startswith(prefix) and _split(name)[0] is None:
                    keys.append(name)
                continue
            head = name[: -len(_BUCKET)] + "."
            if len(prefix) <= len(head):
                if not head.startswith(prefix):
                    continue
                rest = ""
            elif prefix.startswith(head):
                rest = prefix[len(head) :]
            else:
                continue
            keys.extend(
                head + file
                for file, sub in self._entries(self._join(self._base, name))
                if not sub and file.startswith(rest)
            )
        return sorted(keys)

    def _entries(self, path: str) -> list[tuple[str, bool]]:
        """(name, is a key group's subdirectory) of each committed entry of ``path``."""
        self.counters.add(requests=1)
        if self._fs is None:
            try:
                with os.scandir(path) as it:
                    names = [e.name for e in it]
            except FileNotFoundError:
                return []
            return [
                (n, n.endswith(_BUCKET)) for n in names if _KEY.fullmatch(n.removesuffix(_BUCKET))
            ]
        try:
            # refresh: a cached listing (s3fs keeps one) would hide other ranks' writes
            paths = self._fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        found = {p.rstrip("/").rsplit("/", 1)[-1] for p in paths}
        return [
            (n, n.endswith(_BUCKET))
            for n in found
            if _KEY.fullmatch(n.removesuffix(_BUCKET))
            and (n.endswith(_BUCKET) or (not n.endswith(_COMMIT) and n + _COMMIT in found))
        ]

    def make_room(self, prefixes: list[str]) -> None:
        """Make the subdirectories of the keys under ``prefixes`` (each ending with a dot:
        a round's states, its acknowledgements) before many ranks write there at once;
        without it each of them would find it missing, fail a write and race to make it.
        One that stays empty is removed with the next deletion under it (or stays, empty,
        if none comes: a listing ignores it)."""
        if self._fs is not None:
            return
        for prefix in prefixes:
            bucket = self._prefix_bucket(prefix)
            if bucket is not None:
                self.counters.add(requests=1)
                os.makedirs(bucket, exist_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key that starts with ``prefix``."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        keys = self.list_keys(prefix)
        for key in keys:
            self._unlink(key, tidy=False)
        if self._fs is None:
            # Each emptied subdirectory goes once (not after every key), and the one of the
            # prefix itself even when it held nothing (made by make_room, never written).
            buckets = {self._bucket(key) for key in keys} | {self._prefix_bucket(prefix)}
            for bucket in buckets - {None}:
                with contextlib.suppress(OSError):  # not empty (or gone): it stays
                    os.rmdir(bucket)  # type: ignore[arg-type]

    def announce(self, key: str, value: bytes) -> _Fence:
        """Put ``key``; the returned fence lets ``put`` check that it is still current.

        ``value`` must be unique per announcement (a round id is).
        """
        self.put(key, value)
        return _Fence(key, bytes(value))

    def keep_alive(
        self, key: str, value: bytes, ttl_s: float, *, exclusive: bool = False
    ) -> FileLease:
        """Put ``key`` and refresh it every ``ttl_s / 3`` until the handle's ``stop()``.

        After ``stop()`` the key is gone; after the holder's death it reads as absent
        ``ttl_s`` later.

        Raises:
            KeyHeldError: ``exclusive`` and the key holds a live value (checked, then put:
                two holders starting within the same moment are not told apart).
        """
        self._check_key(key)
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0; got {ttl_s!r}")
        if exclusive:
            held = self.get(key)
            if held is not None:
                raise KeyHeldError(key, held, self.describe())
        lease = FileLease(self, self._write, key, bytes(value), float(ttl_s))
        with self._leases_lock:
            self._leases = [x for x in self._leases if not x._stopped.is_set()]
            self._leases.append(lease)
        return lease

    def describe(self) -> str:
        if self._fs is None:
            return self._base
        protocol = self._fs.protocol
        protocol = protocol[0] if isinstance(protocol, tuple | list) else protocol
        return f"{protocol}://{self._base.lstrip('/')}"

    def close(self) -> None:
        """Stop (and delete) every lease still held; the files of other keys stay."""
        with self._leases_lock:
            leases, self._leases = self._leases, []
        for lease in leases:
            lease.stop()

    # ------------------------------------------------------------------------- files

    def _check_key(self, key: str) -> None:
        if not _KEY.fullmatch(key) or key.endswith(_COMMIT):
            raise ValueError(
                f"store key must match {_KEY.pattern} and not end in {_COMMIT!r}; got {key!r}"
            )

    def _check_fence(self, key: str, fence: Any) -> None:
        if fence is None:
            return
        if not isinstance(fence, _Fence):
            raise TypeError(f"fence must come from this store's announce(); got {fence!r}")
        current = self.get(fence.key)
        if current != fence.value:
            raise StaleRoundError(
                f"fenced write of {key!r} refused: {fence.key!r} in {self.describe()} was"
                " announced again (or removed) since this round announced it"
            )

    def _join(self, *parts: str) -> str:
        return os.path.join(*parts) if self._fs is None else "/".join(parts)

    def _bucket(self, key: str) -> str | None:
        """The subdirectory that holds ``key`` (None: the namespace itself)."""
        group, _ = _split(key)
        return None if group is None else self._join(self._base, group + _BUCKET)

    def _prefix_bucket(self, prefix: str) -> str | None:
        """The subdirectory whose keys are exactly ``prefix`` + a name (None unless the
        prefix ends with a dot: ``"j.p.s.r1."`` is ``j.p.s.r1~``)."""
        return self._bucket(prefix + "x") if prefix.endswith(".") else None

    def _path(self, key: str) -> str:
        group, file = _split(key)
        if group is None:
            return self._join(self._base, key)
        return self._join(self._base, group + _BUCKET, file)

    def _local(self, key: str, write: Any) -> Any:
        """``write(path)`` for a local key; where its subdirectory is missing (the first key
        of its group, or another rank removed it empty in between), make it and write
        again."""
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
        if self._fs is None:
            self._local(key, lambda path: self._replace(path, data))
            return
        path = self._path(key)
        self._fs.pipe_file(path, data)
        self._fs.pipe_file(path + _COMMIT, _marker(data))

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

    def _create_local(self, key: str, data: bytes) -> bool:
        self.counters.add(requests=1, written=len(data))
        won: bool = self._local(key, lambda path: self._link(path, data))
        return won

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

    def _create_fsspec(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        self.counters.add(requests=2, written=len(data))
        try:
            # The marker claims the key; until the data matches it, readers see "absent".
            self._fs.pipe_file(path + _COMMIT, _marker(data), mode="create")
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
        if self._fs is None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return None
            self.counters.add(read=len(data))
            return data
        # Marker first, then data: a value whose marker describes other bytes is a write in
        # progress (or one that died half way) and reads as absent.
        try:
            marker = self._fs.cat_file(path + _COMMIT)
            data = self._fs.cat_file(path)
        except FileNotFoundError:
            return None
        self.counters.add(read=len(data))
        return bytes(data) if marker == _marker(data) else None

    def _unlink(self, key: str, tidy: bool = True) -> None:
        """Remove ``key``'s file; ``tidy``: and its subdirectory if that left it empty."""
        path = self._path(key)
        self.counters.add(requests=1)
        if self._fs is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            bucket = self._bucket(key) if tidy else None
            if bucket is not None:
                with contextlib.suppress(OSError):  # not empty (or gone): it stays
                    os.rmdir(bucket)
            return
        # Over fsspec a subdirectory is a prefix of its files' names: none is made, none
        # is left behind.
        for p in (path + _COMMIT, path):  # marker first: a reader never trusts stale data
            try:
                self._fs.rm_file(p)
            except FileNotFoundError:
                pass


# link() refused by the filesystem (FAT, some FUSE and SMB mounts): fall back to O_EXCL
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def _split(key: str) -> tuple[str | None, str]:
    """(the key's group, its file name): the parts before and after its last dot; no
    group for a key without a dot inside it (a file of the namespace itself)."""
    dot = key.rfind(".")
    if dot <= 0 or dot == len(key) - 1:
        return None, key
    return key[:dot], key[dot + 1 :]


def _marker(data: bytes) -> bytes:
    return b"%d:" % len(data) + hashlib.sha256(data).hexdigest().encode()
