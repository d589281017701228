"""Worker-process faults (issue 3): each becomes a clear error in time, and leaves nothing.

After every test no ``/dev/shm/zephon_*`` segment of this process (or of a parent process a
test started) and no child process remains: the autouse ``leaks`` fixture checks both.
"""

from __future__ import annotations

import gc
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import multiprocess
import multiprocess.resource_tracker
import numpy as np
import pytest
from corpus import lm_pipeline

import zephon as zp
from zephon.shm import sweep_stale_segments

pytestmark = pytest.mark.processes

HERE = Path(__file__).parent
SHM = Path("/dev/shm")
_OWNER = re.compile(r"zephon_([0-9]+)_")


# ----------------------------------------------------------------------------- helpers
def _segments() -> set[str]:
    return {p.name for p in SHM.glob("zephon_*")}


def _owner(segment: str) -> int | None:
    found = _OWNER.match(segment)
    return int(found[1]) if found else None


def _state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (R, S, T, Z, ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")  # a zombie has exited; its new parent reaps it


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _children() -> list[int]:
    """This process's children, less multiprocess's resource tracker: one helper per
    process that spawning starts once and that lives until this process exits."""
    me = os.getpid()
    tracker = multiprocess.resource_tracker._resource_tracker._pid
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == me and int(entry.name) != tracker:
            kids.append(int(entry.name))
    return kids


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


@pytest.fixture(autouse=True)
def leaks():
    """Yields the set of pids whose segments count as this test's; checks, after the test,
    that none of their new segments and no child process of this one remains."""
    owners = {os.getpid()}
    before = _segments()
    kids_before = set(_children())  # earlier tests' helpers (e.g. a resource tracker) are theirs
    yield owners
    deadline = time.monotonic() + 5
    while True:
        multiprocess.active_children()  # reaps workers that exited
        kids = [pid for pid in _children() if pid not in kids_before]
        left = sorted(s for s in _segments() - before if _owner(s) in owners)
        if (not kids and not left) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    described = [f"{pid} ({_state(pid)}): {_cmdline(pid)}" for pid in kids]
    for pid in kids:  # clean up, so one failure does not spill into the next test
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    for name in left:
        (SHM / name).unlink(missing_ok=True)
    assert not kids, f"child processes left behind: {described}"
    assert not left, f"shared-memory segments left behind: {left}"


def rows(x: int) -> dict[str, np.ndarray]:
    return {"x": np.full(16, x, dtype=np.int64)}


def small(*fns, workers: int = 2, n: int = 400, batch_size: int = 4, **kw) -> zp.Pipeline:
    """ints -> fns... -> batch, over 4 lanes, endless."""
    src = zp.StaticMixtureWorkSource(
        datasets={"a": zp.ArraySource(np.arange(n, dtype=np.int64))},
        weights={"a": 1.0},
        seed=0,
        chunk_size=8,
        num_epochs=None,
    )
    pipe = zp.Pipeline(src, canonical_replicas=4, workers=workers, prefetch=2, **kw).fetch()
    for fn in fns:
        pipe = pipe.map(fn)
    return pipe.batch(batch_size)


def drain_until_error(pipe: zp.Pipeline, timeout_s: float) -> tuple[BaseException, float]:
    """Iterates until an exception; returns it and the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s + 30:  # a hang fails here, not in CI's timeout
        try:
            next(pipe)
        except BaseException as e:  # noqa: BLE001 - the error under test
            return e, time.monotonic() - t0
    pytest.fail(f"no error within {timeout_s + 30} s")


def start_parent(mode: str, owners: set[int]) -> tuple[subprocess.Popen, dict]:
    """Runs ``_fault_parent.py MODE`` in its own session; returns it and its JSON report."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_fault_parent.py"), mode],
        cwd=HERE,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    owners.add(proc.pid)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=60)
    line = proc.stdout.readline() if ready else ""
    if not line:
        kill_group(proc)
        pytest.fail(f"_fault_parent.py {mode} did not report:\n{proc.stderr.read()}")
    return proc, json.loads(line)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILLs what is left of ``proc``'s process group, reaps ``proc``, closes its pipes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


# ------------------------------------------------------------------------------- faults
def test_sigkill_of_a_worker_is_a_worker_error_naming_it():
    pipe = lm_pipeline(seed=3, workers=2, num_epochs=None)
    for _ in range(3):
        next(pipe)
    victim = pipe.stats()["workers"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    err, elapsed = drain_until_error(pipe, 5)
    assert isinstance(err, zp.WorkerError), repr(err)
    assert elapsed < 5
    msg = str(err)
    assert f"worker {victim['id']} " in msg and f"pid {victim['pid']}" in msg
    assert "SIGKILL" in msg, msg
    for _ in range(2):  # later calls raise the same error
        with pytest.raises(zp.WorkerError) as again:
            next(pipe)
        assert str(again.value) == msg
    pipe.close()
    pipe.close()  # idempotent
    assert not _alive(victim["pid"])


def boom(x):
    if x == 42:
        raise ValueError("boom 42")
    return x


def test_user_exception_keeps_its_type_message_traceback_and_worker_id():
    pipe = small(boom, rows)
    with pipe:
        err, elapsed = drain_until_error(pipe, 5)
        workers = {w["id"]: w["pid"] for w in pipe.stats()["workers"]}
    assert isinstance(err, ValueError) and isinstance(err, zp.WorkerError), type(err).__mro__
    msg = str(err)
    assert msg.startswith("boom 42")
    found = re.search(r"worker (\d+) \(pid (\d+)\) raised ValueError", msg)
    assert found, msg
    assert workers[int(found[1])] == int(found[2])
    assert "Traceback (most recent call last)" in msg and 'raise ValueError("boom 42")' in msg
    assert elapsed < 5


def test_a_user_eof_error_is_an_error_not_a_clean_exit():
    # Workers used to take any EOFError for "the parent closed the pipe" and exit quietly.
    def eof(x):
        if x == 42:
            raise EOFError("truncated record 42")
        return x

    with small(eof, rows) as pipe:
        err, _ = drain_until_error(pipe, 5)
    assert isinstance(err, EOFError) and isinstance(err, zp.WorkerError), repr(err)
    assert "truncated record 42" in str(err)


def test_sys_exit_in_a_worker_reports_its_exit_code():
    code = 123

    def leave(x):  # a closure: shipped to the worker by value with dill
        if x == 42:
            sys.exit(code)
        return x

    with small(leave, rows) as pipe:
        err, elapsed = drain_until_error(pipe, 5)
        pids = [w["pid"] for w in pipe.stats()["workers"]]
    assert isinstance(err, zp.WorkerError), repr(err)
    msg = str(err)
    assert "exited with code 123" in msg and "sys.exit(123)" in msg, msg
    assert re.search(r"worker \d+ \(pid \d+\)", msg)
    assert elapsed < 5
    assert not [p for p in pids if _alive(p)]


def test_a_stopped_worker_trips_the_watchdog_and_close_still_cleans_up():
    pipe = lm_pipeline(seed=4, workers=2, num_epochs=None, worker_timeout_s=2)
    try:
        for _ in range(3):
            next(pipe)
        workers = pipe.stats()["workers"]
        victim = workers[0]
        os.kill(victim["pid"], signal.SIGSTOP)
        err, elapsed = drain_until_error(pipe, 2)
        assert isinstance(err, zp.WorkerError), repr(err)
        msg = str(err)
        assert f"worker {victim['id']} (pid {victim['pid']}" in msg, msg
        assert "worker_timeout_s=2" in msg and "stopped" in msg, msg
        assert 2 <= elapsed < 5, elapsed
        t0 = time.monotonic()
        pipe.close()
        assert time.monotonic() - t0 < 3
        assert not [w["pid"] for w in workers if _alive(w["pid"])]
    finally:
        for w in workers:
            if _alive(w["pid"]):
                os.kill(w["pid"], signal.SIGKILL)
        pipe.close()


def test_workers_exit_when_the_parent_is_killed(leaks):
    # The parent's workers block on full rings: only the parent-death signal stops them.
    proc, info = start_parent("idle", leaks)
    try:
        assert all(_alive(p) for p in info["pids"])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert not _wait_gone(info["pids"], 5), "workers outlived their parent by 5 s"
    finally:
        kill_group(proc)
    removed = sweep_stale_segments()  # its rings: the parent had no chance to unlink them
    assert set(info["rings"]) <= set(removed)


def test_sweeper_removes_dead_rings_and_leaves_live_segments(leaks):
    dead, info = start_parent("idle", leaks)
    live, seg = start_parent("segment", leaks)
    try:
        os.killpg(dead.pid, signal.SIGKILL)  # the whole process group: nobody unlinks
        dead.wait(5)
        assert not _wait_gone(info["pids"], 5)
        assert all((SHM / r).exists() for r in info["rings"])
        with small(rows, workers=1) as pipe:
            next(pipe)  # starting the workers sweeps /dev/shm
            assert not [r for r in info["rings"] if (SHM / r).exists()]
            assert (SHM / seg["segment"]).exists()
        live.stdin.close()  # the live owner unlinks its segment and exits
        assert live.wait(10) == 0
        assert not (SHM / seg["segment"]).exists()
    finally:
        kill_group(dead)
        kill_group(live)


def test_ctrl_c_raises_keyboard_interrupt_quickly_and_cleans_up(leaks):
    proc, info = start_parent("slow", leaks)
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
        _, stderr = proc.communicate(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        kill_group(proc)
    assert "KeyboardInterrupt" in stderr, stderr
    assert "Traceback" in stderr and "WorkerError" not in stderr, stderr
    assert elapsed < 2, elapsed
    assert not [p for p in info["pids"] if _alive(p)]
    assert not [r for r in info["rings"] if (SHM / r).exists()]


def test_a_pipeline_dropped_without_close_is_cleaned():
    pipe = small(rows)
    next(pipe)
    workers = pipe.stats()["workers"]
    del pipe
    gc.collect()
    assert not [w["ring"] for w in workers if (SHM / w["ring"]).exists()]
    assert not _wait_gone([w["pid"] for w in workers], 3)


NO_MAIN_GUARD = """
import zephon as zp
docs = [f"document {i} " * REPEAT for i in range(300)]
src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=0, chunk_size=16)
pipe = (zp.Pipeline(src, canonical_replicas=2, workers=1).fetch().tokenize(zp.ByteTokenizer())
        .split(max_len=128).pack(seq_len=128, num_bins=4).batch(4))
with pipe:
    next(pipe)
"""


# About 600 KB of documents, far more than a pipe holds, or 4 KB, which the pipe takes whole.
@pytest.mark.parametrize("repeat", [200, 1])
def test_a_worker_dying_while_it_starts_is_an_error_naming_the_main_guard(tmp_path, leaks, repeat):
    # No `if __name__ == "__main__":` guard: the spawned worker imports the script again and
    # dies when that copy starts a worker of its own. With the documents in its configuration
    # the parent used to block forever writing it to the dead worker's bootstrap pipe; with
    # a small configuration it blamed the worker for exiting "without reporting an error".
    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD.replace("REPEAT", str(repeat)))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    leaks.add(proc.pid)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail("the parent hung starting a worker that had died")
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("zephon.errors.WorkerError: worker 0 (pid "), last
    assert "exited with code 1 while starting, before it " in last
    if repeat > 1:
        assert "before it read its configuration" in last
    assert "worker_start_method='spawn'" in last
    assert "under `if __name__ == '__main__':`" in last


@pytest.mark.parametrize("fail_at", [0, 1])
def test_not_enough_shared_memory_is_a_clear_error(monkeypatch, fail_at):
    real = os.statvfs
    calls = []

    def statvfs(path):
        if str(path) != str(SHM):
            return real(path)
        calls.append(path)
        if len(calls) <= fail_at:
            return real(path)
        return SimpleNamespace(f_bavail=16, f_frsize=4096, f_bsize=4096)

    monkeypatch.setattr(os, "statvfs", statvfs)
    pipe = small(rows)
    with pytest.raises(zp.ShmError) as info:
        next(pipe)
    pipe.close()
    msg = str(info.value)
    needs = re.search(r"needs (\d+) bytes, (\d+) bytes free", msg)
    assert needs, msg
    assert int(needs[1]) > 4 * (4 << 20) and int(needs[2]) == 16 * 4096
    assert "ring_slot_bytes" in msg, msg


@pytest.mark.parametrize("as_dict", [True, False])
def test_a_batch_larger_than_a_slot_names_the_option_to_raise(as_dict):
    def big(x):
        row = np.full(2048, x, dtype=np.int32)
        return {"x": row} if as_dict else row

    with small(big, ring_slot_bytes=4096) as pipe:
        err, _ = drain_until_error(pipe, 5)
    assert isinstance(err, ValueError) and isinstance(err, zp.WorkerError), repr(err)
    msg = str(err)
    need = re.search(r"needs (\d+) bytes but a shared-memory ring slot holds 4096 bytes", msg)
    assert need, msg
    assert int(need[1]) >= 4 * 2048 * 4
    assert "Pipeline(..., ring_slot_bytes=" in msg


# ----------------------------------------------------------------- regressions found here
def test_array_batches_cross_the_ring():
    # Batches of plain arrays (not dicts) used to lose their data on the way back.
    def vec(x):
        return np.full(3, x, dtype=np.int64)

    with small(vec, workers=0) as pipe:
        ref = [next(pipe) for _ in range(12)]
    with small(vec, workers=2) as pipe:
        got = [next(pipe) for _ in range(12)]
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_first_batch_from_a_short_lived_thread_does_not_kill_the_workers():
    # PR_SET_PDEATHSIG follows the thread that forked a worker: starting workers from the
    # caller's thread killed them as soon as that thread ended.
    with small(rows) as pipe:
        t = threading.Thread(target=next, args=(pipe,))
        t.start()
        t.join()
        time.sleep(0.3)
        assert all(w["alive"] for w in pipe.stats()["workers"])
        for _ in range(20):
            next(pipe)
