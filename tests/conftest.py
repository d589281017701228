"""Suite-wide rules.

Under ``CI=true`` a skipped test is a failed test: every piece a test needs (etcd, JAX, the
native ring, optional extras) is installed by the test command, so a skip there means
something is missing, and CI must say so instead of passing quietly.

Tests marked ``native`` compare the C extensions with their pure-Python twins, so they need
the extensions. Under ``ZEPHON_PURE_PYTHON=1`` (the second pass of ``scripts/test``, which
runs everything else on the Python twins) the extensions are off on purpose, and these tests
are deselected rather than skipped.

Nothing a test starts may outlive the run: at the end of the session (after every fixture,
etcd servers included, has stopped what it started) a process descended from this one that
is still alive fails the run, and is killed. The helpers that ``multiprocess`` starts once
per process (its resource tracker, its fork server), which end with this process, are not
counted. After each test module, a ``zephon*`` name left in ``/dev/shm`` or a Zephon
shared-memory segment (a memfd) this process still holds fails the module's last test.

A hung test fails: one that runs ``HANG_S`` seconds (``ZEPHON_TEST_HANG_S``, 600; the longest
take about a minute) has every thread's stack written down and its test process exits
(under pytest-xdist the worker "crashed while running" that test), instead of holding the
run until CI's limit. The stacks are printed at the end of the run under "hung test" (by
xdist's controller; a run without ``-n`` ends there, and leaves them in a folder
``zephon-test-hangs-*`` in the temporary directory).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CI = os.environ.get("CI", "").lower() == "true"
ROOT = Path(__file__).resolve().parents[1]
# The tests are the package ``tests`` (pytest puts the checkout on sys.path); the processes
# they start (rank scripts, fault parents, benchmark children) import the same helpers.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
PURE_PYTHON = os.environ.get("ZEPHON_PURE_PYTHON") == "1"


def pytest_collection_modifyitems(config, items):
    if not PURE_PYTHON:
        return
    native = [item for item in items if item.get_closest_marker("native")]
    if native:
        config.hook.pytest_deselected(items=native)
        items[:] = [item for item in items if not item.get_closest_marker("native")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true (a required piece is missing): {reason}"


# ------------------------------------------------------------------ a hang is a failure
HANG_S = float(os.environ.get("ZEPHON_TEST_HANG_S", "600"))
#: The folder where each test process writes down its hung test (set by the first process,
#: inherited by xdist's workers).
_HANGS_ENV = "ZEPHON_TEST_HANGS_DIR"
#: That folder, in the process that made it (which prints and removes it).
_hangs_owner = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if _HANGS_ENV not in os.environ:
        os.environ[_HANGS_ENV] = tempfile.mkdtemp(prefix="zephon-test-hangs-")
        config.stash[_hangs_owner] = os.environ[_HANGS_ENV]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of ``item`` under a watchdog (faulthandler's, a C thread:
    it writes the stacks even when the hang holds the GIL)."""
    path = Path(os.environ[_HANGS_ENV]) / f"{os.getpid()}.txt"
    with path.open("w") as f:
        f.write(f"{item.nodeid} ran past {HANG_S:g} s (hung); every thread's stack then:\n")
        f.flush()
        faulthandler.dump_traceback_later(HANG_S, exit=True, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    path.unlink()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    folder = config.stash.get(_hangs_owner, None)
    if folder is None or _xdist_worker(config):
        return
    for hung in sorted(Path(folder).glob("*.txt")):
        terminalreporter.write_sep("=", "hung test", red=True)
        terminalreporter.write_line(hung.read_text(errors="replace"))


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_hangs_owner, None)
    if folder is not None:  # printed above (a test process that hung never gets here)
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ nothing left behind
SHM = Path("/dev/shm")
#: How long processes that are on their way out get before they count as left behind.
LEFT_GRACE_S = 5.0


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of ``pid`` from /proc, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def _descendants(root: int) -> dict[int, str]:
    """The live processes below ``root`` (zombies have exited: not counted), with their
    command lines."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] != "Z":
                parents[int(entry.name)] = st[1]
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                try:
                    cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    cmd = b"?"
                found[child] = cmd.decode(errors="replace").strip()[:200]
                frontier.append(child)
    return found


def _process_helpers() -> set[int]:
    """The resource trackers and fork servers of ``multiprocess`` (and of the standard
    ``multiprocessing``): started once by the first worker that needs them, they live as
    long as this process and end with it."""
    pids: set[int] = set()
    for package in ("multiprocess", "multiprocessing"):
        tracker = sys.modules.get(f"{package}.resource_tracker")
        server = sys.modules.get(f"{package}.forkserver")
        for owner, attr in (
            (getattr(tracker, "_resource_tracker", None), "_pid"),
            (getattr(server, "_forkserver", None), "_forkserver_pid"),
        ):
            pid = getattr(owner, attr, None)
            if isinstance(pid, int):
                pids.add(pid)
    return pids


def left_processes(grace_s: float = LEFT_GRACE_S) -> dict[int, str]:
    """The processes this one started (at any depth) that are still alive after ``grace_s``,
    less multiprocess's helpers (but not what a fork server started)."""
    deadline = time.monotonic() + grace_s
    while True:
        helpers = _process_helpers()
        left = {pid: cmd for pid, cmd in _descendants(os.getpid()).items() if pid not in helpers}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _xdist_worker(config: pytest.Config) -> bool:
    """This process runs tests for pytest-xdist's controller."""
    return hasattr(config, "workerinput")


def _xdist_controller(config: pytest.Config) -> bool:
    """This process hands the tests to pytest-xdist's workers (``-n N``): its children are
    those workers, and each checks what its own tests left."""
    return getattr(config.option, "numprocesses", None) not in (None, 0) and not hasattr(
        config, "workerinput"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Runs after the last fixture's teardown: a process alive now was left by a test.
    if _xdist_controller(session.config):
        left_names = sorted(_shm_names() - _NAMES_AT_START)
        for name in left_names:
            (SHM / name).unlink(missing_ok=True)
        if left_names:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            print(f"the tests left shared-memory names in /dev/shm: {left_names}", file=sys.stderr)
        return
    left = left_processes()
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"  pid {pid} ({(_stat(pid) or ('gone',))[0]}): {cmd}" for pid, cmd in left.items()]
    for pid in left:  # killed, so that one run's leftovers do not burden the next
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in left:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # not our child: its own parent reaps it
    text = (
        f"{len(left)} process(es) started by the tests outlived them (killed now); a test or "
        "fixture must stop what it starts:\n" + "\n".join(lines)
    )
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "processes left behind", red=True)
        reporter.write_line(text)
    else:
        print(text, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _shm_names() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith("zephon")}
    except OSError:
        return set()


_NAMES_AT_START = _shm_names()


def own_memfds(prefix: str = "/memfd:") -> set[str]:
    """This process's open memfd descriptors whose target starts with ``prefix``
    (``fd -> /memfd:name``): the shared-memory segments it holds."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith(prefix):
            held.add(f"{fd} -> {target}")
    return held


def _zephon_memfds() -> set[str]:
    """This process's descriptors of Zephon's shared memory (``fd -> /memfd:zephon...``)."""
    return own_memfds("/memfd:zephon")


@pytest.fixture(scope="module", autouse=True)
def no_shared_memory_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a module: no ``zephon*`` name new in /dev/shm (Zephon's segments have none: a
    name there is a leak that outlives every process), and no Zephon segment still held by
    this process once what the module dropped is collected (its memory lives as long as
    this process does)."""
    # Under pytest-xdist another process's test may make a name meanwhile (on purpose: see
    # test_starting_workers_deletes_nothing_in_dev_shm): the names are then checked once,
    # for the whole run, by the process that started the workers (pytest_sessionfinish).
    by_module = not _xdist_worker(request.config)
    names = _shm_names()
    memfds = _zephon_memfds()
    yield
    gc.collect()  # pipelines and rings only dropped close when collected
    new_names = sorted(_shm_names() - names) if by_module else []
    held = sorted(_zephon_memfds() - memfds)
    for name in new_names:
        (SHM / name).unlink(missing_ok=True)
    for entry in held:
        os.close(int(entry.split(" ", 1)[0]))
    assert not new_names, f"the module left shared-memory names in /dev/shm: {new_names}"
    assert not held, f"the module left Zephon shared-memory segments open: {held}"
