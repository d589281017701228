"""Worker-process faults (issues 3 and 14): each becomes a clear error in time, and leaves
nothing.

After every test no child process of this one, no shared-memory segment this process opened
(a memfd descriptor) and no process of a parent process a test started remains: the autouse
``leaks`` fixture checks all three. Zephon's shared memory has no name anywhere: the tests
that kill a parent also check that its processes never held a file in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import multiprocess
import multiprocess.resource_tracker
import numpy as np
import pytest

import zephon as zp
from tests.integration.corpus import lm_pipeline
from zephon.runners.chain import WHERE
from zephon.runners.options import AUTO_FIRST_SLOT_BYTES

pytestmark = [pytest.mark.processes, pytest.mark.faults]

HERE = Path(__file__).parent
REPO = Path(zp.__file__).resolve().parents[1]
SHM = Path("/dev/shm")


# ----------------------------------------------------------------------------- helpers
def _env() -> dict[str, str]:
    """The environment for a Python subprocess: it imports this checkout's Zephon."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` from field 3 (the state) on, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def _state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (R, S, T, Z, ...), None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[0].decode()


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


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid``: a parent started with ``start_new_session``
    and everything it started (its workers, a forkserver, a resource tracker), wherever
    they were reparented to."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[3]) == sid and fields[0] != b"Z":
                members.append(int(entry.name))
    return members


def _wait_session_gone(sid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def _held(pids: list[int]) -> tuple[set[str], set[str]]:
    """What ``pids`` hold open or mapped: (files in /dev/shm, memfd names)."""
    shm: set[str] = set()
    memfds: set[str] = set()
    for pid in pids:
        targets = []
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            targets += [line.split(None, 5)[5] for line in _maps(pid) if line.count(" ") >= 5]
        except OSError:
            continue  # exited meanwhile
        for target in targets:
            if target.startswith("/dev/shm/"):
                shm.add(target)
            elif target.startswith("/memfd:"):
                memfds.add(target)
    return shm, memfds


def _maps(pid: int) -> list[str]:
    return [line.strip() for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]


def _memfds() -> set[str]:
    """This process's open memfd descriptors (``fd -> name``): every segment it holds."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:zephon"):
            held.add(f"{fd} -> {target}")
    return held


@pytest.fixture(autouse=True)
def leaks():
    """Yields the set of parent processes a test starts (each leads its own session); checks,
    after the test, that no child process of this one, no segment this process opened and
    no process of those sessions remains."""
    parents: set[int] = set()
    memfds_before = _memfds()
    kids_before = set(_children())  # earlier tests' helpers (e.g. a resource tracker) are theirs
    yield parents
    deadline = time.monotonic() + 5
    while True:
        multiprocess.active_children()  # reaps workers that exited
        gc.collect()  # a pipeline only dropped closes when collected
        kids = [pid for pid in _children() if pid not in kids_before]
        memfds = _memfds() - memfds_before
        strays = [pid for sid in parents for pid in _session(sid)]
        if (not kids and not memfds and not strays) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    described = [f"{pid} ({_state(pid)}): {_cmdline(pid)}" for pid in kids + strays]
    for pid in kids + strays:  # clean up, so one failure does not spill into the next test
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    for entry in memfds:
        os.close(int(entry.split(" ", 1)[0]))
    assert not kids, f"child processes left behind: {described}"
    assert not strays, f"processes of a started parent left behind: {described}"
    assert not memfds, f"shared-memory segments left open: {sorted(memfds)}"


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


def start_parent(mode: str, parents: set[int], *args: str) -> tuple[subprocess.Popen, dict]:
    """Runs ``_fault_parent.py MODE ARGS`` in its own session; returns it and its first JSON
    report."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_fault_parent.py"), mode, *args],
        cwd=HERE,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    parents.add(proc.pid)
    return proc, read_report(proc, mode)


def communicate_or_show_stacks(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """``proc.communicate(timeout=timeout_s)``; a parent still running then fails the test
    with every thread's stack (SIGUSR1: see ``_fault_parent.py``) and what it wrote."""
    try:
        return proc.communicate(timeout=timeout_s)  # type: ignore[no-any-return]
    except subprocess.TimeoutExpired:
        with open(f"/proc/{proc.pid}/status") as f:  # the signals it blocks, ignores, has
            signals = "".join(line for line in f if line.startswith(("Sig", "ShdPnd")))
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"the parent (pid {proc.pid}) was still running after {timeout_s:g} s; its "
            f"signals:\n{signals}its stdout:\n{out[-2000:]}\nits stderr, with its threads' "
            f"stacks at that moment:\n{err[-12000:]}"
        ) from None


def read_report(proc: subprocess.Popen, mode: str, timeout_s: float = 60) -> dict:
    """The next JSON line ``proc`` prints, read a byte at a time: a buffered readline takes
    later lines too, and select() then waits for output that already came."""
    fd = proc.stdout.fileno()
    line = b""
    deadline = time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(fd, 1) if ready else b""
        if not byte:
            kill_group(proc)
            pytest.fail(f"_fault_parent.py {mode} did not report:\n{proc.stderr.read()}")
        line += byte
    return json.loads(line)


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


def lookup(x):
    if x == 42:
        return {"x": x}["tokens"]
    return rows(x)


def test_a_workers_key_error_is_a_key_error_naming_the_worker_lane_and_sample():
    # KeyError's str() quotes its argument: the message and traceback used to arrive on one
    # line, with literal "\n" in it.
    with small(lookup, workers=0) as pipe:
        local, _ = drain_until_error(pipe, 5)
    assert type(local) is KeyError, repr(local)
    where = getattr(local, WHERE)  # in process: the same place, as a note
    lane = re.search(r" on lane (\d+), ", where)
    assert lane and "at sample SamplePointer(component=0, index=42)" in where, where
    with small(lookup) as pipe:
        err, elapsed = drain_until_error(pipe, 5)
        workers = {w["id"]: w for w in pipe.stats()["workers"]}
    assert isinstance(err, KeyError) and isinstance(err, zp.WorkerError), type(err).__mro__
    with pytest.raises(KeyError):
        raise err
    msg = str(err)
    assert "\\n" not in msg, msg
    lines = msg.splitlines()
    assert lines[0] == "'tokens'", lines
    found = re.fullmatch(
        r"\[worker (\d+) \(pid (\d+)\) raised KeyError in (.*); its traceback:\]", lines[2]
    )
    assert found, lines[2]
    worker = workers[int(found[1])]
    assert worker["pid"] == int(found[2]) and int(lane[1]) in worker["lanes"]
    assert found[3] == where, (found[3], where)
    assert lines[3] == "Traceback (most recent call last):" and lines[-1] == "KeyError: 'tokens'"
    assert '    return {"x": x}["tokens"]' in lines, lines
    assert elapsed < 5


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


#: The most worker_timeout_s a timing test doubles its first (short) one to on a busy machine.
MOST_TIMEOUT_S = 32


def running_pipeline(first_timeout_s: float, **kw) -> tuple[zp.Pipeline, float]:
    """An endless ``lm_pipeline`` whose workers run (three batches delivered) under the
    shortest ``worker_timeout_s`` from ``first_timeout_s`` on, doubled until they start
    within it: on a loaded machine a spawned worker may take longer than a short timeout
    to import and produce its first batch, which the watchdog rightly reports. Returns it
    and the timeout it runs under."""
    timeout_s = first_timeout_s
    while True:
        pipe = lm_pipeline(num_epochs=None, worker_timeout_s=timeout_s, **kw)
        try:
            for _ in range(3):
                next(pipe)
            return pipe, timeout_s
        except zp.WorkerError:
            pipe.close()
            if timeout_s * 2 > MOST_TIMEOUT_S:
                raise
            timeout_s *= 2


def test_a_stopped_worker_trips_the_watchdog_and_close_still_cleans_up():
    workers: list[dict] = []
    pipe = None
    try:
        pipe, timeout_s = running_pipeline(2, seed=4, workers=2)
        workers = pipe.stats()["workers"]
        victim = workers[0]
        os.kill(victim["pid"], signal.SIGSTOP)
        err, elapsed = drain_until_error(pipe, timeout_s)
        assert isinstance(err, zp.WorkerError), repr(err)
        msg = str(err)
        assert f"worker {victim['id']} (pid {victim['pid']}" in msg, msg
        # it reached its loop, then stopped answering: hung, not "never reached its loop"
        assert f"worker_timeout_s={timeout_s:g}" in msg and "stopped" in msg, msg
        assert "produced nothing" in msg and "never reached" not in msg, msg
        # the watchdog waits out the timeout, then tells within a few polls (the margin is
        # for a busy machine: the timing under test is the timeout, not the machine's speed)
        assert timeout_s <= elapsed < 2 * timeout_s + 5, (elapsed, timeout_s)
        t0 = time.monotonic()
        pipe.close()
        assert time.monotonic() - t0 < 10, "close() waits on a stopped worker"
        assert not [w["pid"] for w in workers if _alive(w["pid"])]
    finally:
        try:
            if pipe is not None:
                pipe.close()
        finally:
            for w in workers:
                if _alive(w["pid"]):
                    os.kill(w["pid"], signal.SIGKILL)


def test_workers_exit_when_the_parent_is_killed(leaks):
    # The parent's workers block on full rings: only the parent-death signal stops them.
    proc, info = start_parent("idle", leaks)
    try:
        assert all(_alive(p) for p in info["pids"])
        shm, memfds = _held(_session(proc.pid))
        assert {f"/memfd:{r} (deleted)" for r in info["rings"]} <= memfds, memfds
        assert not shm, shm
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert not _wait_gone(info["pids"], 5), "workers outlived their parent by 5 s"
        # Nothing else of it is left: its rings went with the last process that held them.
        assert not _wait_session_gone(proc.pid, 5)
    finally:
        kill_group(proc)


# (method, moment): "starting" kills within 1.2 s of the parent's start, as it starts its
# first workers or its next ones; "running" within 0.3 s of a pipeline's first batch.
KILL_TRIALS = [
    ("spawn", "starting"),
    ("spawn", "starting"),
    ("spawn", "running"),
    ("forkserver", "starting"),
    ("forkserver", "running"),
    ("fork", "starting"),
    ("fork", "running"),
]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_the_parent_at_random_moments_leaves_no_segment_and_no_process(signum, leaks):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for method, moment in KILL_TRIALS:
        shm_before = {p.name for p in SHM.iterdir()}
        proc, _ = start_parent("churn", leaks, method)
        pids = {proc.pid}
        try:
            if moment == "running":
                pids.update(read_report(proc, "churn")["running"])
                delay = rng.uniform(0, 0.3)
            else:
                delay = rng.uniform(0, 1.2)
            time.sleep(delay)
            tree = _session(proc.pid)
            shm, memfds = _held(tree)
            os.kill(proc.pid, signum)
            proc.wait(10)
            left = _wait_session_gone(proc.pid, 10)
        finally:
            kill_group(proc)
        pids.update(tree)
        where = (
            f"{method}, {signal.Signals(signum).name} {delay:.2f} s after {moment} "
            f"(seed {seed}; it held {sorted(memfds)})"
        )
        assert proc.returncode == -signum, f"{where}: exit status {proc.returncode}"
        assert not left, f"{where}: {[f'{p}: {_cmdline(p)}' for p in left]} outlived the parent"
        assert not shm, f"{where}: its processes held files in /dev/shm: {sorted(shm)}"
        named = [
            n
            for n in {p.name for p in SHM.iterdir()} - shm_before
            if any(str(pid) in n for pid in pids)
        ]
        assert not named, f"{where}: left {named} in /dev/shm"
        if moment == "running":
            rings = {m for m in memfds if m.startswith("/memfd:zephon-ring-")}
            assert len(rings) == 2, f"{where}: the workers' rings were not held at the kill"


@pytest.mark.parametrize(
    ("how", "target"),
    [("handler", "parent"), ("handler", "group"), ("flag", "group")],
    ids=["handler-saves", "handler-saves-group-signalled", "flag-then-loop-saves"],
)
def test_a_training_loop_preempted_by_sigterm_saves_a_checkpoint_that_resumes_exactly(
    how, target, tmp_path, leaks
):
    # The loop's own SIGTERM handler stays in place (Zephon installs none) and may call
    # checkpoint() itself. Clusters signal the whole process group (Slurm) or the main
    # process (Kubernetes): workers ignore SIGTERM, so a loop that only sets a flag in its
    # handler can still read batches before it saves.
    from tests.integration._fault_parent import EXTRA_AFTER_FLAG, digest, preempted_pipeline

    stop_at = random.randrange(2, 12)
    path = tmp_path / "loader.zph"
    with preempted_pipeline(workers=0) as pipe:
        reference = [digest(next(pipe)) for _ in range(stop_at + EXTRA_AFTER_FLAG + 9)]
    proc, line = start_parent("preempted", leaks, str(path), str(stop_at), how)
    lines = [line]
    try:
        while "training" not in lines[-1]:
            lines.append(read_report(proc, "preempted"))
        (os.killpg if target == "group" else os.kill)(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    lines += [json.loads(text) for text in out.splitlines()]
    where = f"SIGTERM at step {stop_at} ({how}, {target})"
    assert proc.returncode == 0, f"{where}: exit status {proc.returncode}\n{err}"
    steps = [entry for entry in lines if "digest" in entry]
    assert all(entry["handler_kept"] for entry in steps), f"{where}: the handler was replaced"
    (saved,) = [entry["saved"] for entry in lines if "saved" in entry]
    assert saved == stop_at + (EXTRA_AFTER_FLAG if how == "flag" else 0), where
    assert [entry["digest"] for entry in steps] == reference[: saved + 1], where
    with preempted_pipeline(workers=0) as pipe:
        pipe.restore(zp.load(path))
        resumed = [digest(next(pipe)) for _ in range(8)]
    assert resumed == reference[saved + 1 : saved + 9], f"{where}: the resumed batches differ"


def test_starting_workers_deletes_nothing_in_dev_shm(leaks):
    # The start-up sweeper removed other jobs' rings that it took for stale (another PID
    # namespace sharing /dev/shm: 20 of 20 of that job's starts failed). Nothing sweeps now.
    stale = SHM / f"zephon_{dead_pid()}_1_feedfacefeedface"
    stale.write_bytes(b"x")
    try:
        with small(rows, workers=1) as pipe:
            next(pipe)
        assert stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_ctrl_c_raises_keyboard_interrupt_quickly_and_cleans_up(leaks):
    proc, info = start_parent("slow", leaks)
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
        _, stderr = communicate_or_show_stacks(proc, 10)
        elapsed = time.monotonic() - t0
    finally:
        kill_group(proc)
    assert "KeyboardInterrupt" in stderr, stderr
    assert "Traceback" in stderr and "WorkerError" not in stderr, stderr
    assert elapsed < 2, elapsed
    assert not [p for p in info["pids"] if _alive(p)]
    assert not _wait_session_gone(proc.pid, 5)


def test_a_pipeline_dropped_without_close_is_cleaned():
    before = _memfds()
    pipe = small(rows)
    next(pipe)
    workers = pipe.stats()["workers"]
    held = {entry.split(" -> ")[1] for entry in _memfds() - before}  # mmap holds a dup too
    assert held == {"/memfd:zephon-ring-0 (deleted)", "/memfd:zephon-ring-1 (deleted)"}
    del pipe
    gc.collect()
    assert not _memfds() - before
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
        env=_env(),
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


BLOCKING_MAIN = """
import fcntl
import zephon as zp
# One run at a time: the script holds a lock while it runs. Without a main guard, each
# spawned worker imports the script again and waits for that lock forever.
lock = open("run.lock", "w")
fcntl.flock(lock, fcntl.LOCK_EX)
docs = [f"document {i} " * REPEAT for i in range(300)]
src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=0, chunk_size=16)
pipe = (zp.Pipeline(src, canonical_replicas=2, workers=2, worker_timeout_s=TIMEOUT).fetch()
        .tokenize(zp.ByteTokenizer()).split(max_len=128).pack(seq_len=128, num_bins=4).batch(4))
with pipe:
    for batch in pipe:
        pass
"""


# About 600 KB of documents (the parent blocks writing the configuration the worker never
# reads: the start-up watchdog), or 4 KB (the pipe takes it whole: the watchdog in next()).
@pytest.mark.parametrize("repeat", [200, 1])
def test_a_worker_whose_main_module_blocks_is_an_error_naming_the_main_guard(
    tmp_path, leaks, repeat
):
    timeout_s = 3
    script = tmp_path / "blocks.py"
    script.write_text(
        BLOCKING_MAIN.replace("REPEAT", str(repeat)).replace("TIMEOUT", str(timeout_s))
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    leaks.add(proc.pid)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail("the parent hung on a worker that never reached its loop")
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("zephon.errors.WorkerError: worker 0 (pid "), last
    assert f"never reached its loop within worker_timeout_s={timeout_s} s" in last, last
    assert "it is still importing your main module" in last, last
    assert "worker_start_method='spawn'" in last
    assert "under `if __name__ == '__main__':`" in last
    assert "hung" not in last
    assert elapsed >= timeout_s
    assert not _wait_session_gone(proc.pid, 5), "its workers outlived it"


@pytest.mark.parametrize("fail_at", [0, 1])
def test_not_enough_shared_memory_is_a_clear_error(monkeypatch, fail_at):
    import zephon.shm.segment

    calls = []

    def available() -> int:
        calls.append(1)
        return 1 << 40 if len(calls) <= fail_at else 16 * 4096

    monkeypatch.setattr(zephon.shm.segment, "available_memory_bytes", available)
    pipe = small(rows)
    with pytest.raises(zp.ShmError) as info:
        next(pipe)
    pipe.close()
    msg = str(info.value)
    needs = re.search(r"needs (\d+) bytes, (\d+) bytes available", msg)
    assert needs, msg
    assert int(needs[1]) > 4 * AUTO_FIRST_SLOT_BYTES and int(needs[2]) == 16 * 4096
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


def _growing(x: int) -> dict[str, np.ndarray]:
    """Rows that grow with the sample: from 4 KiB to about 4.7 MiB."""
    return {"x": np.full(1024 + 12_000 * int(x), x, dtype=np.int32)}


@pytest.mark.parametrize("zero_copy", [False, True])
def test_ring_slots_are_sized_from_the_batches(zero_copy: bool) -> None:
    """ring_slot_bytes=None (the default): batches far above the first 1 MiB slots go
    through, the ring moving to bigger slots as they grow, and the stream is workers=0's."""

    def run(workers: int) -> list[bytes]:
        src = zp.StaticMixtureWorkSource(
            [zp.ArraySource(np.arange(100, dtype=np.int64))], seed=0, chunk_size=5, num_epochs=1
        )
        pipe = (
            zp.Pipeline(
                src,
                canonical_replicas=2,
                workers=workers,
                zero_copy=zero_copy,
                prefetch=1,
                ring_slots=4,
            )
            .fetch()
            .map(_growing)
            .batch(1)
        )
        with pipe:
            return [b["x"].tobytes() for b in pipe]

    ref = run(0)
    assert max(len(b) for b in ref) > 3 * AUTO_FIRST_SLOT_BYTES
    assert run(2) == ref


def _row_508(x: int) -> dict[str, np.ndarray]:
    return {"x": np.full(508, x, dtype=np.int32)}


def test_a_batch_that_fits_a_slot_only_without_its_metadata_moves_too() -> None:
    """512 rows of 2,032 bytes fill a 1 MiB slot but for 8 KiB; their 512 contributors
    (16 KiB of metadata) do not fit beside them: the worker moves to a bigger ring."""

    def run(workers: int) -> list[bytes]:
        src = zp.StaticMixtureWorkSource(
            [zp.ArraySource(np.arange(2048, dtype=np.int64))],
            seed=0,
            chunk_size=512,
            num_epochs=1,
        )
        pipe = zp.Pipeline(src, canonical_replicas=1, workers=workers).fetch().map(_row_508)
        with pipe.batch(512) as p:
            return [b["x"].tobytes() for b in p]

    ref = run(0)
    assert len(ref) == 4 and len(ref[0]) == 512 * 2032
    assert run(1) == ref


def test_a_batch_above_the_most_slots_may_grow_to_is_an_error_with_both_sizes(
    monkeypatch,
) -> None:
    import zephon.runners.processes as processes

    monkeypatch.setattr(processes, "AUTO_MAX_SLOT_BYTES", 2 << 20)

    def big(x):
        return {"x": np.full((3 << 20) // 4, x, dtype=np.int32)}

    with small(big) as pipe:
        err, _ = drain_until_error(pipe, 5)
    msg = str(err)
    need = re.search(r"needs (\d+) bytes but a shared-memory ring slot holds (\d+) bytes", msg)
    assert need, msg
    assert int(need[1]) > 3 << 20 and int(need[2]) == 2 << 20, msg


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
