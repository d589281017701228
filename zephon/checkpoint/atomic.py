"""Atomic file writes: a temp file in the target's directory, fsync, rename, fsync the directory.

A reader sees either the old file or the complete new one, never a prefix, and after
:func:`atomic_write_bytes` returns the new file survives a power cut (on filesystems that
honour ``fsync``). Multi-host checkpoint rounds reuse :func:`temp_path` and :func:`fsync_dir`
for their own temp-then-rename steps.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import socket

__all__ = ["atomic_write_bytes", "fsync_dir", "naming_target", "remove_stale_temps", "temp_path"]

# fsync on a directory fd is refused by some filesystems (and by Windows, where a directory
# cannot be opened at all). The rename has happened by then; there is nothing better to do.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}


#: This host in temp names (8 hex of its name's hash): whose temp files are whose.
_HOST_TAG = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
_TEMP = re.compile(r"\..+\.tmp-([0-9]+)-([0-9a-f]{8})[0-9a-f]{16}")


def temp_path(path: str | os.PathLike[str]) -> str:
    """A unique, hidden temp name next to ``path``:
    ``dir/.{name}.tmp-{pid}-{host}{random}``.

    Same directory, so the final ``os.replace`` is a rename within one filesystem (atomic);
    pid, host and 64 random bits, so concurrent writers (threads, processes, hosts sharing
    a filesystem) never collide, and a temp file whose writer died can be told
    (:func:`remove_stale_temps`).
    """
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    if not name:
        raise ValueError(f"cannot write atomically to {os.fspath(path)!r}: it names no file")
    return os.path.join(directory, f".{name}.tmp-{os.getpid()}-{_HOST_TAG}{secrets.token_hex(8)}")


def remove_stale_temps(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temp files of :func:`temp_path` in ``directory`` whose writer is gone: a
    process of this host that no longer runs (a save killed midway leaves its temp file;
    another host's are left to that host). Never raises; returns what it removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.fullmatch(entry.name) if entry.name.startswith(".") else None
        if m is None or m.group(2) != _HOST_TAG:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _running(pid):
            continue
        try:
            os.unlink(entry.path)
            removed.append(entry.path)
        except OSError:
            pass
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename, a new file) to stable storage.

    Args:
        path: the directory.

    Raises:
        OSError: the directory cannot be opened or synced (filesystems that do not support
            syncing a directory are tolerated).
    """
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview,
    *,
    make_parents: bool = False,
) -> int:
    """Replace ``path`` with ``data`` atomically and durably.

    Writes a temp file in the same directory (see :func:`temp_path`), flushes and fsyncs it,
    ``os.replace``-s it onto ``path`` and fsyncs the directory. If anything fails before the
    rename (including ``KeyboardInterrupt``), the temp file is removed and ``path`` is
    untouched. If syncing the directory fails after the rename, ``path`` already holds the new
    data and the error propagates.

    The file is created with mode ``0o666`` less the umask, like ``open(path, "wb")``. If
    ``path`` is a symlink, the link itself is replaced, not its target.

    Args:
        path: the file to write.
        data: the complete new contents.
        make_parents: create missing parent directories first (each one synced into its
            own parent, so that the new file's path survives a power cut too).

    Returns:
        The number of bytes written.

    Raises:
        OSError: a parent directory cannot be created, the temp file cannot be created,
            written or synced, or the rename fails. Of the type and errno of the failure,
            with ``filename`` the absolute target path (never the temp file's), so that
            ``str(e)`` reads like ``[Errno 28] No space left on device: '/abs/ck.zph'``.
    """
    target = os.path.abspath(os.fspath(path))
    tmp = temp_path(target)
    # O_EXCL: never write through a file (or symlink) someone else put at the temp name.
    # Python makes the fd non-inheritable itself (PEP 446).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileNotFoundError:
            if not make_parents:
                raise
            _make_dirs(os.path.dirname(target), target)
            fd = os.open(tmp, flags, 0o666)
    except NotADirectoryError as e:
        raise naming_target(e, target, _file_in_the_way(target)) from e
    except OSError as e:
        raise naming_target(e, target) from e
    try:
        try:
            f = open(fd, "wb")  # the file object owns fd from here on
        except BaseException:
            os.close(fd)
            raise
        with f:
            written = f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise naming_target(e, target) from e
        raise
    try:
        fsync_dir(os.path.dirname(target))
    except OSError as e:
        raise naming_target(e, target, "syncing its directory after the rename") from e
    return written


def naming_target(error: OSError, target: str, doing: str = "") -> OSError:
    """``error`` again (same type and errno) with ``target`` as its filename: what failed
    is named by the file the caller asked for, not by a temp file or a directory."""
    detail = error.strerror or str(error) or type(error).__name__
    if doing:
        detail = f"{detail} ({doing})"
    if error.errno is None:
        return type(error)(f"{detail}: {target!r}")
    return OSError(error.errno, detail, target)  # OSError picks the subclass from errno


def _file_in_the_way(target: str) -> str:
    """Which ancestor of ``target`` is not a directory, in words ("" if none is found)."""
    parent = os.path.dirname(target)
    while os.path.dirname(parent) != parent:
        if os.path.lexists(parent) and not os.path.isdir(parent):
            return f"{parent} is not a directory"
        parent = os.path.dirname(parent)
    return ""


def _make_dirs(directory: str, target: str) -> None:
    """Create ``directory`` and its missing parents, each synced into its parent; only what
    is missing is touched (an ancestor that cannot even be looked at is never created)."""
    parent = os.path.dirname(directory)
    try:
        try:
            os.mkdir(directory)
        except FileNotFoundError:
            if parent == directory:
                raise
            _make_dirs(parent, target)
            os.mkdir(directory)
    except FileExistsError:
        if os.path.isdir(directory):
            return  # another writer made it meanwhile
        # A file stands where a directory must go.
        raise naming_target(
            NotADirectoryError(errno.ENOTDIR, f"{directory} is not a directory"), target
        ) from None
    except OSError as e:
        if e.filename == target:  # from a deeper call: already named
            raise
        raise naming_target(e, target, f"creating the directory {directory}") from e
    try:
        fsync_dir(parent)
    except OSError as e:
        raise naming_target(e, target, f"syncing {parent}") from e
