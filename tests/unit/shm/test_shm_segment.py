"""/dev/shm segments: creation checks, naming, and the stale-segment sweeper."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from zephon.errors import ShmError
from zephon.shm import attach_segment, create_segment, sweep_stale_segments
from zephon.shm import segment as segment_module
from zephon.shm.segment import SHM_DIR, new_segment_name, process_start_time


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_create_attach_share_memory_and_close_unlink_are_idempotent() -> None:
    segment = create_segment(10_000)
    try:
        assert segment.size == 10_000 and segment.owner
        assert stat.S_IMODE(os.stat(segment.path).st_mode) == 0o600
        other = attach_segment(segment.name)
        assert not other.owner and other.size == 10_000
        segment.mmap[100:105] = b"hello"
        assert other.mmap[100:105] == b"hello"
        other.close()
        other.close()
        assert other.closed
        with pytest.raises(ShmError, match="is closed"):
            other.mmap  # noqa: B018 - the property raises
    finally:
        segment.close()
        segment.unlink()
        segment.unlink()
    assert not os.path.exists(segment.path)


def test_names_carry_pid_and_start_time() -> None:
    name = new_segment_name()
    _, pid, start, token = name.split("_")
    assert int(pid) == os.getpid()
    assert int(start) == process_start_time(os.getpid())
    assert len(token) == 16 and int(token, 16) >= 0
    assert name != new_segment_name()


def test_bad_names_and_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="zephon_"):
        create_segment(4096, name="other_name")
    with pytest.raises(ValueError, match="zephon_"):
        attach_segment("zephon_../etc")
    with pytest.raises(ValueError, match="> 0 bytes"):
        create_segment(0)


def test_an_existing_name_is_a_shm_error() -> None:
    with create_segment(4096) as segment:
        with pytest.raises(ShmError) as info:
            create_segment(4096, name=segment.name)
        assert info.value.errno == errno.EEXIST


def test_too_little_free_space_is_a_shm_error_quoting_both_sizes(monkeypatch) -> None:
    real = os.statvfs(SHM_DIR)

    class Small:
        f_bavail = 10
        f_frsize = real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda path: Small)
    free = 10 * real.f_frsize
    name = new_segment_name()
    with pytest.raises(ShmError) as info:
        create_segment(free + 1, name=name)
    text = str(info.value)
    assert f"needs {free + 1} bytes" in text and f"{free} bytes free" in text
    assert "mount a bigger /dev/shm" in text and "lower the ring capacity" in text
    assert info.value.errno == errno.ENOSPC
    assert isinstance(info.value, OSError)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_failed_reservation_is_a_shm_error_and_leaves_no_file(monkeypatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_module.os, "posix_fallocate", full)
    name = new_segment_name()
    with pytest.raises(ShmError, match="reserving 8192 bytes") as info:
        create_segment(8192, name=name)
    assert isinstance(info.value.__cause__, OSError)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_sweeper_removes_dead_owners_only(tmp_path: Path) -> None:
    me = os.getpid()
    my_start = process_start_time(me)
    gone = dead_pid()
    names = {
        "dead": f"zephon_{gone}_123_00112233aabbccdd",
        "recycled": f"zephon_{me}_{my_start + 1}_00112233aabbccdd",
        "live": f"zephon_{me}_{my_start}_00112233aabbccdd",
        "unparseable": "zephon_notmine",
        "bad_hex": f"zephon_{gone}_123_XYZ",
        "foreign": f"psm_{gone}",
        "other": "zephonish_1_2_abcdef01",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    removed = sweep_stale_segments(shm_dir=str(tmp_path))
    assert sorted(removed) == sorted([names["dead"], names["recycled"]])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == set(names.values()) - set(removed)


def test_sweeper_in_dev_shm_removes_a_dead_owners_segment() -> None:
    stale = create_segment(4096, name=f"zephon_{dead_pid()}_1_feedfacefeedface")
    stale.close()
    unrelated = os.path.join(SHM_DIR, f"zephon_notmine_{os.getpid()}")
    with create_segment(4096) as mine, open(unrelated, "xb"):
        try:
            removed = sweep_stale_segments()
            assert stale.name in removed
            assert mine.name not in removed and os.path.exists(mine.path)
            assert os.path.exists(unrelated)
        finally:
            os.unlink(unrelated)
            stale.unlink()
    assert not os.path.exists(stale.path)


def test_process_start_time_of_a_missing_process_is_none() -> None:
    assert process_start_time(dead_pid()) is None
