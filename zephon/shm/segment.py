"""Shared memory without a name: an anonymous Linux memfd, shared by passing its fd.

A segment is created with ``memfd_create`` and reaches another process as a file
descriptor (``zephon.shm.fds`` sends it over a Unix socket). Nothing is ever created in
``/dev/shm`` and nothing has a name to leak: the kernel frees the memory when the last
process that holds the fd or a mapping of it exits, however it exits (SIGKILL included).
No sweeper has to guess which owner is still alive.

The memory is reserved with ``posix_fallocate`` at creation (or written at once, for a
segment created with its contents), so a full memory is an error here, not a SIGBUS on
first touch; the size is sealed (``F_SEAL_SHRINK`` and ``F_SEAL_GROW``), so no holder can
truncate the segment under another's mapping. A
memfd is charged to the memory cgroup of its creator and is not bounded by the size of
``/dev/shm`` (a container's 64 MB ``/dev/shm`` does not matter); since the kernel's OOM
killer rather than an error answers a reservation larger than memory, the size is first
checked against the memory available.

Linux only: elsewhere ``create_segment`` raises a ShmError that says to use
``Pipeline(workers=0)``.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys
from collections.abc import Iterable

from zephon.errors import ShmError

BytesLike = bytes | bytearray | memoryview
_MEMINFO = "/proc/meminfo"
# Memory cgroup limit and usage files, v2 then v1, as a container sees its own cgroup.
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # absent, or "max" (no limit)


def available_memory_bytes() -> int | None:
    """Bytes a new segment may take: ``MemAvailable``, lowered to the headroom of this
    container's memory cgroup (limit less usage) when it has a limit. None when unknown."""
    available = None
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in _CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1: 2**63 - 4096
            headroom = max(0, limit - usage)
            available = headroom if available is None else min(available, headroom)
            break
    return available


class Segment:
    """A mapped memfd. ``close()`` unmaps it and closes the fd (idempotent); the memory
    goes once no process holds the fd or a mapping. Use ``create_segment`` or
    ``attach_segment`` to get one.

    Attributes:
        name: the memfd's label (``/proc/<pid>/fd`` shows it as ``/memfd:<name>``).
        size_bytes: the segment's size.
        writable: whether this mapping may be written.
    """

    def __init__(self, fd: int, mm: mmap.mmap, name: str, *, writable: bool) -> None:
        self.name = name
        self.size_bytes = len(mm)
        self.writable = writable
        self._fd = fd
        self._mmap: mmap.mmap | None = mm

    @property
    def mmap(self) -> mmap.mmap:
        """The shared mapping; raises ShmError once closed."""
        if self._mmap is None:
            raise ShmError(f"shared-memory segment {self.name!r} is closed")
        return self._mmap

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def fileno(self) -> int:
        """The memfd, to pass to another process (``zephon.shm.send_fds``)."""
        if self._mmap is None:
            raise ShmError(f"shared-memory segment {self.name!r} is closed")
        return self._fd

    def close(self) -> None:
        """Unmaps the segment and closes its fd. While numpy views or buffers of it are
        alive the mapping stays valid and is unmapped when the last one is dropped."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            pass  # exported views pin the mapping; mmap unmaps on deallocation
        os.close(self._fd)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd {self._fd}"
        mode = "read-write" if self.writable else "read-only"
        return f"Segment(name={self.name!r}, size_bytes={self.size_bytes}, {mode}, {state})"


def create_segment(
    size_bytes: int,
    *,
    name: str = "zephon",
    contents: Iterable[tuple[int, BytesLike]] | None = None,
) -> Segment:
    """Creates a new memfd of ``size_bytes``: reserved, sealed against resizing and mapped
    read-write; or, given ``contents``, written once and sealed read-only.

    Args:
        size_bytes: the segment's size.
        name: its label, in error messages and ``/proc/<pid>/fd``.
        contents: ``(offset, bytes-like)`` pairs to write (what is not written reads as
            zeros). The segment is then sealed against writes too (``F_SEAL_WRITE``) and
            mapped read-only, its pages mapped at once: what the workers' shared datasets
            use. Writing with ``pwrite`` allocates each page as it fills it, once, where
            reserving then copying through a mapping touches each page twice.

    Raises:
        ShmError: not Linux, not enough memory (checked first, then reserved or written),
            or the memory cannot be mapped. The message quotes the sizes.
    """
    if size_bytes <= 0:
        raise ValueError(f"segment size must be > 0 bytes; got {size_bytes}")
    if not hasattr(os, "memfd_create"):
        raise ShmError(
            errno.ENOSYS,
            f"worker processes share memory through Linux memfds, which {sys.platform} lacks; "
            "use Pipeline(workers=0) here",
        )
    available = available_memory_bytes()
    if available is not None and size_bytes > available:
        raise ShmError(
            errno.ENOMEM,
            f"not enough memory for shared-memory segment {name!r}: needs {size_bytes} "
            f"bytes, {available} bytes available (MemAvailable, or what the memory cgroup's "
            "limit leaves); free memory or ask for less",
        )
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        if contents is None:
            _reserve(fd, size_bytes, name)
            prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
        else:
            os.ftruncate(fd, size_bytes)
            _write(fd, size_bytes, contents, name)
            seals |= fcntl.F_SEAL_WRITE
            prot, flags = mmap.PROT_READ, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        mm = mmap.mmap(fd, size_bytes, flags=flags, prot=prot)
    except BaseException:
        os.close(fd)
        raise
    return Segment(fd, mm, name, writable=contents is None)


def _reserve(fd: int, size_bytes: int, name: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as e:
        raise ShmError(
            e.errno,
            f"reserving {size_bytes} bytes for shared-memory segment {name!r} failed "
            f"({e.strerror}); free memory or ask for less",
        ) from e


_WRITE_BYTES = 64 << 20  # per pwrite call


def _write(fd: int, size_bytes: int, contents: Iterable[tuple[int, BytesLike]], name: str) -> None:
    for offset, data in contents:
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > size_bytes:
            raise ValueError(
                f"{view.nbytes} bytes at offset {offset} do not fit segment {name!r} of "
                f"{size_bytes} bytes"
            )
        done = 0
        try:
            while done < view.nbytes:
                done += os.pwrite(fd, view[done : done + _WRITE_BYTES], offset + done)
        except OSError as e:
            raise ShmError(
                e.errno,
                f"writing {view.nbytes} bytes at offset {offset} of shared-memory segment "
                f"{name!r} ({size_bytes} bytes) failed ({e.strerror}); free memory or ask "
                "for less",
            ) from e


def attach_segment(fd: int, *, writable: bool = True) -> Segment:
    """Maps the segment behind ``fd`` (received from its creator) and takes over the fd:
    ``close()`` closes it, and so does a failure here.

    Raises:
        ShmError: ``fd`` is not an open, non-empty file that can be mapped.
    """
    try:
        name = _label(fd)
        try:
            size_bytes = os.fstat(fd).st_size
        except OSError as e:
            raise ShmError(e.errno, f"cannot attach fd {fd}: {e.strerror}") from e
        if size_bytes == 0:
            raise ShmError(errno.EINVAL, f"cannot attach {name!r} (fd {fd}): it is empty")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as e:
            raise ShmError(e.errno, f"cannot map {name!r} (fd {fd}): {e.strerror}") from e
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    return Segment(fd, mm, name, writable=writable)


def _label(fd: int) -> str:
    """The memfd's name from ``/proc/self/fd``, else ``fd N``."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
    if target.startswith("/memfd:"):
        return target[len("/memfd:") :].removesuffix(" (deleted)")
    return target
