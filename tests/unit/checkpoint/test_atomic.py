"""Atomic writes: the target holds the old bytes or the new ones, never a mix, and no temp
file outlives a failure."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest

from zephon.checkpoint.atomic import atomic_write_bytes, fsync_dir, temp_path


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_writes_new_file_and_returns_length(tmp_path: Path) -> None:
    target = tmp_path / "ck.bin"
    assert atomic_write_bytes(target, b"hello") == 5
    assert target.read_bytes() == b"hello"
    assert _leftovers(tmp_path) == []


def test_overwrites_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "ck.bin"
    target.write_bytes(b"old contents that are longer")
    atomic_write_bytes(str(target), memoryview(b"new"))
    assert target.read_bytes() == b"new"
    assert _leftovers(tmp_path) == []


def test_failed_replace_leaves_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ck.bin"
    target.write_bytes(b"old")

    def boom(src: str, dst: str) -> None:
        assert Path(src).exists(), "the temp file is complete when replace is attempted"
        raise OSError(errno.EIO, "simulated rename failure")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated rename failure"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "disk full"), KeyboardInterrupt()])
def test_failed_write_leaves_no_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    target = tmp_path / "ck.bin"

    def fail(fd: int) -> None:
        raise exc

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(type(exc)):
        atomic_write_bytes(target, b"new")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_fsyncs_file_before_rename_and_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ck.bin"
    events: list[tuple[str, int]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync-dir" if stat.S_ISDIR(st.st_mode) else "fsync-file", st.st_ino))
        real_fsync(fd)

    def recording_replace(src: str, dst: str) -> None:
        events.append(("replace", 0))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    atomic_write_bytes(target, b"data")

    assert [kind for kind, _ in events] == ["fsync-file", "replace", "fsync-dir"]
    # rename keeps the inode: the synced file is the one now at target
    assert events[0][1] == target.stat().st_ino
    assert events[2][1] == tmp_path.stat().st_ino


def test_target_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "d", b"x")
    assert _leftovers(tmp_path) == []
    assert (tmp_path / "d").is_dir()


def test_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "nope" / "ck.bin", b"x")


def test_mode_follows_umask_like_open(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "ck.bin", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "ck.bin").stat().st_mode) == 0o640


def test_concurrent_writers_never_mix(tmp_path: Path) -> None:
    target = tmp_path / "ck.bin"
    payloads = [bytes([i]) * 65536 for i in range(8)]
    errors: list[BaseException] = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(10):
                atomic_write_bytes(target, data)
        except BaseException as e:  # surfaced below; a thread cannot fail the test itself
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_bytes() in payloads
    assert _leftovers(tmp_path) == []


def test_temp_path_is_hidden_unique_and_beside_target(tmp_path: Path) -> None:
    target = tmp_path / "ck.bin"
    names = {temp_path(target) for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert Path(name).parent == tmp_path
        assert Path(name).name.startswith(f".ck.bin.tmp-{os.getpid()}-")


def test_temp_path_rejects_a_path_without_a_name() -> None:
    with pytest.raises(ValueError, match="names no file"):
        temp_path("/")


def test_fsync_dir_syncs_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    fsync_dir(tmp_path)
    assert synced == [tmp_path.stat().st_ino]


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_fsync_dir_tolerates_filesystems_without_dir_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def refuse(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", refuse)
    fsync_dir(tmp_path)  # no error


def test_fsync_dir_propagates_real_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def io_error(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", io_error)
    with pytest.raises(OSError, match="I/O error"):
        fsync_dir(tmp_path)


def test_fsync_dir_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "nope")


@pytest.mark.parametrize("step", ["fsync", "replace", "open"])
def test_every_failure_names_the_target_not_the_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    target = tmp_path / "ck.bin"
    real_open = os.open

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def fail_open(path: str, *args: object, **kwargs: object) -> int:
        if ".tmp-" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, step, fail_open if step == "open" else fail)
    with pytest.raises(OSError) as e:
        atomic_write_bytes(target, b"x")
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(target)
    assert str(e.value) == f"[Errno {errno.ENOSPC}] No space left on device: '{target}'"
    monkeypatch.undo()
    assert _leftovers(tmp_path) == []


def test_missing_directory_names_the_target_and_make_parents_creates_it(tmp_path: Path) -> None:
    target = tmp_path / "nope" / "deeper" / "ck.bin"
    with pytest.raises(FileNotFoundError) as e:
        atomic_write_bytes(target, b"x")
    assert e.value.filename == str(target)
    assert atomic_write_bytes(target, b"x", make_parents=True) == 1
    assert target.read_bytes() == b"x"
