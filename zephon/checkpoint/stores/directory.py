"""The directory stores: every key one file under ``root/namespace``, laid out the same way
on a local path (:class:`~zephon.checkpoint.stores.local.LocalStore`) and over an fsspec URL
(:class:`~zephon.checkpoint.stores.fsspec_store.FsspecStore`). ``DirectoryStore(root)`` picks
one for ``root``, as ``pathlib.Path()`` picks a flavour: a path or a ``file://`` URL is
local, any other URL fsspec's.

**The layout** (this module, shared by both). A key is a file in a subdirectory named by the
key up to its last dot: ``j1.p2.s.r7.12`` is the file ``12`` in ``j1.p2.s.r7~`` (the ``~``,
which no key holds, tells a subdirectory from a key's file). A key without a dot inside it
is a file of the namespace itself. So listing a prefix reads the namespace's few
subdirectories and the ones that match, not every key of every round kept there: the leader
of a 1,024-rank round polls one subdirectory of its round's states, however many records of
the previous round wait beside it. Keys are plain file names: no separators, no leading dot
(temp files start with one), and nothing ending in ``.commit`` (the fsspec store's commit
markers); any other name under the namespace is not a key. A value is stored framed (see
:mod:`~zephon.checkpoint.stores.file_lease`), so a leased value carries its expiry.

Also shared: ``create``'s retries, the fence, the leases and the listing. What differs is
how a file is written atomically, which each store does its own way:

* :class:`~zephon.checkpoint.stores.local.LocalStore`: a temp file then a rename; ``create``
  a hard link (``O_EXCL`` where links are refused); optional fsyncs; subdirectories made
  ahead of a round (``make_room``) and removed once empty.
* :class:`~zephon.checkpoint.stores.fsspec_store.FsspecStore` (object storage has no
  rename): the data object, then a commit marker ``{file}.commit`` holding its length and
  sha256; ``create`` writes the marker first with ``mode="create"``.

A key the fsspec store wrote reads the same through a local store over the same files (the
markers are not keys). The other way round it reads as absent: a local write has no marker,
and without one an object store cannot tell a finished write from a torn one.

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

import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from zephon.checkpoint.stores.base import BaseStore, KeyHeldError, StaleRoundError
from zephon.checkpoint.stores.file_lease import FileLease, frame, unframe
from zephon.errors import AggregationError

__all__ = ["DirectoryStore"]

_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
COMMIT = ".commit"  # the fsspec store's commit markers end with it; no key does
BUCKET = "~"  # ends the name of a key group's subdirectory (no key holds it)


def check_namespace(namespace: str) -> str:
    """``namespace``, checked to be a plain directory name."""
    if not _KEY.fullmatch(namespace):
        raise ValueError(
            f"namespace must match {_KEY.pattern} (a plain directory name); got {namespace!r}"
        )
    return namespace


def is_url(root: str) -> bool:
    """Whether ``root`` is an fsspec URL (a ``file://`` URL is a local path)."""
    return "://" in root and not root.startswith("file://")


def entry_of(name: str) -> tuple[str, bool] | None:
    """(``name``, is a key group's subdirectory) for a name the layout can hold in the
    namespace or a subdirectory; None for anything else (temp files, commit markers)."""
    if name.endswith(COMMIT) or not _KEY.fullmatch(name.removesuffix(BUCKET)):
        return None
    return name, name.endswith(BUCKET)


def split_key(key: str) -> tuple[str | None, str]:
    """(the key's group, its file name): the parts before and after its last dot; no
    group for a key without a dot inside it (a file of the namespace itself)."""
    dot = key.rfind(".")
    if dot <= 0 or dot == len(key) - 1:
        return None, key
    return key[:dot], key[dot + 1 :]


class _Fence:
    """What ``announce`` returns: the key and the exact bytes it announced."""

    __slots__ = ("key", "value")

    def __init__(self, key: str, value: bytes) -> None:
        self.key = key
        self.value = value

    def __repr__(self) -> str:
        return f"_Fence(key={self.key!r}, {len(self.value)} bytes)"


class DirectoryStore(BaseStore):
    """Keys as files under ``root/namespace`` (see the module docstring): the layout and
    everything above the file operations, which each subclass supplies (``_open``,
    ``_join``, ``_write``, ``_create_file``, ``_read``, ``_unlink``, ``_entries``; not
    abstract methods, so that ``DirectoryStore(...)`` type-checks as the constructor it
    is).

    ``DirectoryStore(root, ...)`` itself makes the subclass for ``root``: a
    :class:`~zephon.checkpoint.stores.local.LocalStore` for a path or a ``file://`` URL,
    else a :class:`~zephon.checkpoint.stores.fsspec_store.FsspecStore`.

    Args:
        root: a local or shared-filesystem directory, or an fsspec URL (``s3://bucket/dir``,
            ``memory://name``); ``file://`` URLs are local paths.
        namespace: a subdirectory of ``root``; ranks of one job must agree on it.
        fsync: local paths only: also fsync each written file and the directory (see
            :class:`~zephon.checkpoint.stores.local.LocalStore`).

    Raises:
        ValueError: a namespace that is not a plain directory name, or ``fsync`` asked of
            an fsspec URL.
    """

    #: The subclass made for a local path and the one for an fsspec URL, by ``for_roots``
    #: (each registers itself: :mod:`zephon.checkpoint.stores` imports both).
    _made_for: dict[str, type[DirectoryStore]] = {}

    def __init_subclass__(cls, *, for_roots: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if for_roots is not None:
            DirectoryStore._made_for[for_roots] = cls

    def __new__(
        cls, root: str | os.PathLike[str], namespace: str = "zephon", *, fsync: bool = False
    ) -> DirectoryStore:
        if cls is DirectoryStore:
            cls = DirectoryStore._made_for["urls" if is_url(os.fspath(root)) else "paths"]
        return super().__new__(cls)

    def __init__(
        self, root: str | os.PathLike[str], namespace: str = "zephon", *, fsync: bool = False
    ) -> None:
        self._base = self._open(os.fspath(root), check_namespace(namespace), fsync)
        self._leases: list[FileLease] = []
        self._leases_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"

    def describe(self) -> str:
        return self._base

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
        """Write ``key`` only if absent; None when this call created it, else the value
        that was there first."""
        self._check_key(key)
        self._check_fence(key, fence)
        data = frame(value)
        for _ in range(3):
            if self._create_file(key, data):
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
        """The keys that start with ``prefix``, sorted.

        Reads the namespace's entries and the subdirectories whose keys can match."""
        keys: list[str] = []
        for name, is_bucket in self._entries(self._base):
            if not is_bucket:
                if name.startswith(prefix) and split_key(name)[0] is None:
                    keys.append(name)
                continue
            head = name[: -len(BUCKET)] + "."
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

    def delete_prefix(self, prefix: str, known: Sequence[str] = ()) -> None:
        """Remove every key that starts with ``prefix`` (listed: ``known`` is not needed)."""
        self._delete_listed(prefix)

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
            self._leases = [x for x in self._leases if not x.stopped]
            self._leases.append(lease)
        return lease

    def close(self) -> None:
        """Stop (and delete) every lease still held; the files of other keys stay."""
        with self._leases_lock:
            leases, self._leases = self._leases, []
        for lease in leases:
            lease.stop()

    # ------------------------------------------------------------------------ layout

    def _check_key(self, key: str) -> None:
        if not _KEY.fullmatch(key) or key.endswith(COMMIT):
            raise ValueError(
                f"store key must match {_KEY.pattern} and not end in {COMMIT!r}; got {key!r}"
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

    def _bucket(self, key: str) -> str | None:
        """The subdirectory that holds ``key`` (None: the namespace itself)."""
        group, _ = split_key(key)
        return None if group is None else self._join(self._base, group + BUCKET)

    def _prefix_bucket(self, prefix: str) -> str | None:
        """The subdirectory whose keys are exactly ``prefix`` + a name (None unless the
        prefix ends with a dot: ``"j.p.s.r1."`` is ``j.p.s.r1~``)."""
        return self._bucket(prefix + "x") if prefix.endswith(".") else None

    def _path(self, key: str) -> str:
        group, file = split_key(key)
        if group is None:
            return self._join(self._base, key)
        return self._join(self._base, group + BUCKET, file)

    def _delete_listed(self, prefix: str) -> list[str]:
        """Remove every key under ``prefix`` (leaving their subdirectories); the keys."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        keys = self.list_keys(prefix)
        for key in keys:
            self._unlink(key, tidy=False)
        return keys

    # ------------------------------------------------------------------ file operations

    def _open(self, root: str, namespace: str, fsync: bool) -> str:
        """Make the namespace's directory under ``root`` (where it is missing); its path."""
        raise NotImplementedError

    def _join(self, *parts: str) -> str:
        """The path of ``parts`` joined, as this store's file system spells it."""
        raise NotImplementedError

    def _write(self, key: str, data: bytes) -> None:
        """Write ``data`` (framed) at ``key``'s path, atomically: a reader sees the old
        bytes or the new ones."""
        raise NotImplementedError

    def _create_file(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key``'s path only if no file is there; whether it did."""
        raise NotImplementedError

    def _read(self, key: str) -> bytes | None:
        """The (framed) bytes at ``key``'s path; None when absent or not committed."""
        raise NotImplementedError

    def _unlink(self, key: str, tidy: bool = True) -> None:
        """Remove ``key``'s file (absent is fine); ``tidy``: and its subdirectory if that
        left it empty, where the store has directories."""
        raise NotImplementedError

    def _entries(self, path: str) -> list[tuple[str, bool]]:
        """(name, is a key group's subdirectory) of each committed entry of the directory
        ``path`` (see :func:`entry_of`); empty when there is none."""
        raise NotImplementedError
