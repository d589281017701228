"""POSIX shared-memory segments in ``/dev/shm``, created and mapped by hand.

``multiprocessing.shared_memory`` is avoided on purpose: its resource tracker
warns about and unlinks segments behind the owner's back when another process
attaches. Here the creator owns the name and unlinks it; a crash leaves a file
whose name says who owned it, and ``sweep_stale_segments`` removes it later.

Names are ``zephon_<pid>_<starttime>_<hex>``: ``starttime`` is field 22 of
``/proc/<pid>/stat`` (clock ticks since boot), so a recycled pid does not make a
dead owner look alive.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from pathlib import Path

from zephon.errors import ShmError

SHM_DIR = "/dev/shm"
PREFIX = "zephon_"
_NAME_RE = re.compile(r"zephon_([1-9][0-9]*)_([0-9]+)_([0-9a-f]{8,32})")
_ANY_NAME_RE = re.compile(r"zephon_[A-Za-z0-9_]{1,200}")


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``, or None when the process does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces and ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[22 - 3])


def new_segment_name() -> str:
    """A fresh ``zephon_<pid>_<starttime>_<hex>`` name owned by this process."""
    pid = os.getpid()
    return f"{PREFIX}{pid}_{process_start_time(pid)}_{secrets.token_hex(8)}"


def _check_name(name: str) -> None:
    if not _ANY_NAME_RE.fullmatch(name):
        raise ValueError(
            f"shared-memory segment names must look like 'zephon_<letters, digits, _>' "
            f"(at most 207 characters, no '/'); got {name!r}"
        )


class Segment:
    """A mapped ``/dev/shm`` file. ``close()`` unmaps, ``unlink()`` removes the name;
    both are idempotent. Use ``create_segment`` / ``attach_segment`` to get one."""

    def __init__(self, name: str, mm: mmap.mmap, *, owner: bool, shm_dir: str = SHM_DIR) -> None:
        self.name = name
        self.size = len(mm)
        self.owner = owner
        self._path = os.path.join(shm_dir, name)
        self._mmap: mmap.mmap | None = mm
        self._unlinked = False

    @property
    def mmap(self) -> mmap.mmap:
        """The shared mapping; raises ShmError once closed."""
        if self._mmap is None:
            raise ShmError(f"shared-memory segment {self.name!r} is closed")
        return self._mmap

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def path(self) -> str:
        return self._path

    def close(self) -> None:
        """Unmaps the segment. While numpy views or buffers of it are alive the
        mapping stays valid and is unmapped when the last one is dropped."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            pass  # exported views pin the mapping; mmap unmaps on deallocation

    def unlink(self) -> None:
        """Removes the name from /dev/shm (mappings stay valid until closed)."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Segment(name={self.name!r}, size={self.size}, owner={self.owner}, {state})"


def create_segment(size: int, name: str | None = None, *, shm_dir: str = SHM_DIR) -> Segment:
    """Creates, reserves and maps a new segment of ``size`` bytes.

    The free space of the tmpfs is checked first and the memory is reserved with
    ``posix_fallocate``, so a full ``/dev/shm`` fails here with a ShmError rather
    than with a SIGBUS on first touch.

    Raises:
        ShmError: not enough space, the name exists, or the file cannot be mapped.
    """
    if size <= 0:
        raise ValueError(f"segment size must be > 0 bytes; got {size}")
    name = new_segment_name() if name is None else name
    _check_name(name)
    stat = os.statvfs(shm_dir)
    free = stat.f_bavail * stat.f_frsize
    if size > free:
        raise ShmError(
            errno.ENOSPC,
            f"not enough shared memory for segment {name!r}: needs {size} bytes, "
            f"{free} bytes free in {shm_dir}; mount a bigger {shm_dir} (docker: --shm-size) "
            f"or lower the ring capacity (nslots * slot_bytes)",
        )
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        raise ShmError(e.errno, f"cannot create shared-memory segment {path}: {e.strerror}") from e
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ShmError(
                    errno.ENOSPC,
                    f"not enough shared memory for segment {name!r}: reserving {size} bytes "
                    f"in {shm_dir} failed (another process took the space); mount a bigger "
                    f"{shm_dir} or lower the ring capacity (nslots * slot_bytes)",
                ) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise ShmError(e.errno, f"cannot reserve {size} bytes for {path}: {e}") from e
            os.ftruncate(fd, size)  # a filesystem without fallocate: best effort
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    os.close(fd)
    return Segment(name, mm, owner=True, shm_dir=shm_dir)


def attach_segment(name: str, *, shm_dir: str = SHM_DIR) -> Segment:
    """Maps an existing segment by name (not the owner: ``unlink`` is up to the creator)."""
    _check_name(name)
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise ShmError(e.errno, f"cannot open shared-memory segment {path}: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ShmError(errno.EINVAL, f"shared-memory segment {path} is empty")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return Segment(name, mm, owner=False, shm_dir=shm_dir)


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks ``zephon_<pid>_<starttime>_<hex>`` segments whose owner is dead.

    The owner is dead when ``/proc/<pid>`` is gone or its start time differs (the
    pid was recycled). Names that do not parse, and every other file, are left
    alone. Returns the names removed.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for entry in sorted(entries):
        match = _NAME_RE.fullmatch(entry)
        if match is None:
            continue
        pid, start = int(match.group(1)), int(match.group(2))
        if process_start_time(pid) == start:
            continue
        try:
            os.unlink(os.path.join(shm_dir, entry))
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(entry)
    return removed
