"""Shared-memory segments (anonymous memfds) and passing their descriptors between processes."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import multiprocess
import numpy as np
import pytest

from zephon.errors import ShmError
from zephon.shm import attach_segment, available_memory_bytes, create_segment, recv_fds, send_fds
from zephon.shm import segment as segment_module


def test_create_attach_share_memory_and_close_is_idempotent() -> None:
    segment = create_segment(10_000, name="zephon-test")
    fd = segment.fileno()
    other = attach_segment(os.dup(fd))
    assert segment.size_bytes == other.size_bytes == 10_000
    assert other.name == "zephon-test" and other.writable
    segment.mmap[100:105] = b"hello"
    assert other.mmap[100:105] == b"hello"
    other.close()
    other.close()
    assert other.closed
    with pytest.raises(ShmError, match="is closed"):
        other.mmap  # noqa: B018 - the property raises
    with pytest.raises(ShmError, match="is closed"):
        other.fileno()
    segment.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # close() closed the descriptor too


def test_a_segment_is_a_sealed_memfd_with_no_name_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    with create_segment(8192, name="zephon-sealed") as segment:
        target = os.readlink(f"/proc/self/fd/{segment.fileno()}")
        assert target == "/memfd:zephon-sealed (deleted)"
        assert not [n for n in set(os.listdir("/dev/shm")) - before if "sealed" in n]
        assert not os.get_inheritable(segment.fileno())  # close-on-exec
        for size in (4096, 16384):  # nobody can shrink it under a mapping, or grow it
            with pytest.raises(PermissionError):
                os.ftruncate(segment.fileno(), size)
        assert os.fstat(segment.fileno()).st_blocks * 512 >= 8192  # reserved, not sparse


def test_a_read_only_attach_cannot_write() -> None:
    with create_segment(4096) as segment:
        segment.mmap[:3] = b"abc"
        with attach_segment(os.dup(segment.fileno()), writable=False) as view:
            assert not view.writable and view.mmap[:3] == b"abc"
            with pytest.raises(TypeError):
                view.mmap[:3] = b"xyz"
            array = np.frombuffer(view.mmap, np.uint8)
            assert not array.flags.writeable
            del array


def test_a_segment_created_with_its_contents_is_sealed_read_only() -> None:
    payload = np.arange(3000, dtype=np.int64)
    with create_segment(40_000, contents=[(0, b"head"), (8192, payload.data)]) as segment:
        assert not segment.writable
        assert segment.mmap[:4] == b"head" and segment.mmap[4:8192] == bytes(8188)
        got = np.frombuffer(segment.mmap, np.int64, count=3000, offset=8192)
        np.testing.assert_array_equal(got, payload)
        del got
        with pytest.raises(PermissionError):  # F_SEAL_WRITE: not even its creator may write
            os.pwrite(segment.fileno(), b"x", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(segment.fileno(), 40_000)  # nor map it writable
        with attach_segment(os.dup(segment.fileno()), writable=False) as view:
            assert view.mmap[:4] == b"head"
    with pytest.raises(ValueError, match="4 bytes at offset 39998 do not fit segment"):
        create_segment(40_000, contents=[(39_998, b"tail")])


def test_a_failed_write_of_the_contents_is_a_shm_error(monkeypatch) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(segment_module.os, "pwrite", full)
    with pytest.raises(ShmError, match="writing 5 bytes at offset 0 of .* failed") as info:
        create_segment(4096, name="zephon-data", contents=[(0, b"hello")])
    assert info.value.errno == errno.ENOMEM


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0 bytes; got 0"):
        create_segment(0)


def test_too_little_memory_is_a_shm_error_quoting_both_sizes(monkeypatch) -> None:
    monkeypatch.setattr(segment_module, "available_memory_bytes", lambda: 40_960)
    with pytest.raises(ShmError) as info:
        create_segment(40_961, name="zephon-big")
    text = str(info.value)
    assert "'zephon-big': needs 40961 bytes, 40960 bytes available" in text, text
    assert "free memory or ask for less" in text
    assert info.value.errno == errno.ENOMEM and isinstance(info.value, OSError)
    with create_segment(40_960):  # exactly what is available is fine
        pass


def test_a_failed_reservation_is_a_shm_error_and_leaves_no_descriptor(monkeypatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_module.os, "posix_fallocate", full)
    with pytest.raises(ShmError, match="reserving 8192 bytes .* failed") as info:
        create_segment(8192)
    assert info.value.errno == errno.ENOSPC
    assert isinstance(info.value.__cause__, OSError)
    # the autouse fixture checks that no memfd descriptor was left open


def test_without_memfd_the_error_says_to_run_without_workers(monkeypatch) -> None:
    monkeypatch.delattr(segment_module.os, "memfd_create")
    with pytest.raises(ShmError, match=r"Linux memfds.*use Pipeline\(workers=0\)"):
        create_segment(4096)


def test_attach_of_an_empty_file_is_a_shm_error() -> None:
    fd = os.memfd_create("zephon-empty", os.MFD_CLOEXEC)
    with pytest.raises(ShmError, match="'zephon-empty' .* it is empty"):
        attach_segment(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # attach took the descriptor over, and closed it on failure


def test_available_memory_is_mem_available_lowered_to_the_cgroup_headroom(
    monkeypatch, tmp_path: Path
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4000 kB\nMemAvailable: 1000 kB\n")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(segment_module, "_MEMINFO", str(meminfo))
    monkeypatch.setattr(segment_module, "_CGROUP_FILES", ((str(limit), str(usage)),))
    assert available_memory_bytes() == 1_024_000  # no cgroup files
    limit.write_text("max\n")
    usage.write_text("5000\n")
    assert available_memory_bytes() == 1_024_000  # no limit
    limit.write_text("105000\n")
    assert available_memory_bytes() == 100_000  # the cgroup leaves less
    usage.write_text("999999\n")
    assert available_memory_bytes() == 0


def test_available_memory_of_this_machine_is_known() -> None:
    available = available_memory_bytes()
    assert available is not None and 0 < available


def test_descriptors_travel_over_a_pipe_and_arrive_close_on_exec() -> None:
    parent_end, child_end = multiprocess.Pipe(duplex=True)
    with create_segment(4096) as a, create_segment(8192) as b:
        parent_end.send_bytes(b"before")
        send_fds(parent_end, [a.fileno(), b.fileno()])
        parent_end.send_bytes(b"after")
        assert child_end.recv_bytes() == b"before"
        got = recv_fds(child_end)
        assert child_end.recv_bytes() == b"after"  # the stream stays in step
        try:
            assert [os.fstat(fd).st_ino for fd in got] == [
                os.fstat(a.fileno()).st_ino,
                os.fstat(b.fileno()).st_ino,
            ]
            assert not any(os.get_inheritable(fd) for fd in got)
        finally:
            for fd in got:
                os.close(fd)
    with pytest.raises(ValueError, match="1 to 253 descriptors"):
        send_fds(parent_end, [])
    parent_end.send_bytes(b"not descriptors")
    with pytest.raises(ShmError, match="expected a message of descriptors"):
        recv_fds(child_end)
    parent_end.close()
    child_end.close()


def test_receiving_from_a_closed_pipe_is_an_eof_error() -> None:
    parent_end, child_end = multiprocess.Pipe(duplex=True)
    parent_end.close()
    with pytest.raises(EOFError, match="closed the connection before sending descriptors"):
        recv_fds(child_end)
    child_end.close()


def test_a_mapping_outlives_the_descriptor() -> None:
    # A worker may close its descriptor once mapped: the memory stays until unmapped.
    with create_segment(4096) as segment:
        segment.mmap[:2] = b"ok"
        fd = os.dup(segment.fileno())
        mm = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fd)
        assert mm[:2] == b"ok"
        mm.close()
