"""How a worker failed, in words: what the parent raises when a worker dies, hangs, raises
or never starts, and what a worker sends about an exception it could not handle."""

from __future__ import annotations

import builtins
import signal
import traceback
from typing import Any

from zephon.errors import WorkerError
from zephon.runners import wire

_REPORT_CHARS = 16_000  # cap on an error's message and traceback sent over the pipe

_STATES = {
    "T": "stopped (SIGSTOP or job control)",
    "t": "stopped by a debugger",
    "D": "blocked in uninterruptible I/O",
    "R": "running",
    "S": "sleeping",
    "Z": "a zombie",
}


def _clip(text: str) -> str:
    if len(text) <= _REPORT_CHARS:
        return text
    half = _REPORT_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - _REPORT_CHARS} characters cut ...]\n{text[-half:]}"


def exit_code(e: SystemExit) -> int:
    """The status ``sys.exit(e.code)`` gives: None is 0, an int itself, anything else 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    return 1


def error_message(e: BaseException, **extra: Any) -> dict[str, Any]:
    """What a worker sends the parent about ``e`` (raised where it is handled)."""
    return {
        wire.KIND: wire.ERROR,
        "type": type(e).__name__,
        "module": type(e).__module__,
        "message": _clip(str(e)),
        "traceback": _clip(traceback.format_exc()),
        **extra,
    }


def rebuild_error(worker: int, pid: int, msg: dict[str, Any]) -> BaseException:
    """The worker's exception as an instance of its own builtin type *and* WorkerError."""
    if msg["type"] == "SystemExit" and "exit_code" in msg:
        arg = msg.get("exit_arg", repr(msg["message"]))
        return WorkerError(
            f"worker {worker} (pid {pid}) exited with code {msg['exit_code']}: a function it ran "
            f"called sys.exit({arg}). Its traceback:\n{msg['traceback']}"
        )
    text = (
        f"{msg['message']}\n\n[worker {worker} (pid {pid}) raised {msg['type']}; its traceback:]\n"
        f"{msg['traceback']}"
    )
    base = getattr(builtins, msg["type"], None) if msg.get("module") == "builtins" else None
    if isinstance(base, type) and issubclass(base, Exception) and not issubclass(base, WorkerError):
        try:
            cls = type(msg["type"], (WorkerError, base), {"__module__": "zephon.errors"})
            return cls(text)
        except TypeError:
            pass  # layout conflict (e.g. OSError subclasses): fall back to WorkerError
    return WorkerError(f"{msg['type']}: {text}")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "a signal"


def how(code: int | None) -> str:
    """How a worker that exited with ``code`` (None: not yet) ended, for an error message."""
    if code is None:
        return "stopped answering and did not exit"
    if code < 0:
        text = f"was killed by {_signal_name(-code)} (signal {-code})"
        if code == -signal.SIGKILL:
            text += " (the kernel's OOM killer sends SIGKILL too: see `dmesg`)"
        return text
    return f"exited with code {code}"


def proc_state(pid: int | None) -> str | None:
    """The state letter in ``/proc/<pid>/stat`` (R, S, D, T, t, Z, ...), None if gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return None


def died(worker: int, pid: int, lanes: list[int], code: int | None) -> WorkerError:
    """A worker that was running the pipeline ended without a word."""
    text = how(code)
    if code is not None and code >= 0:
        text += " without reporting an error (its stderr may say why)"
    return WorkerError(
        f"worker {worker} (pid {pid}, lanes {lanes}) {text}; the pipeline cannot "
        "continue. Restore the last checkpoint into a new pipeline to go on"
    )


def died_starting(
    worker: int, pid: int, lanes: list[int], code: int | None, configured: bool, start_method: str
) -> WorkerError:
    """A worker ended before it said it runs: most often a script without a main guard."""
    hint = ""
    if start_method != "fork":
        hint = (
            f". With worker_start_method={start_method!r} a worker first imports your main"
            " module again: a script that builds and iterates pipelines at import time must"
            " do so under `if __name__ == '__main__':`"
        )
    when = (
        "before it began to run the pipeline" if configured else "before it read its configuration"
    )
    return WorkerError(
        f"worker {worker} (pid {pid}, lanes {lanes}) {how(code)} while starting, {when} "
        f"(its stderr may say why){hint}"
    )


def hung(worker: int, pid: int | None, lanes: list[int], timeout_s: float) -> WorkerError:
    """A worker produced nothing for ``timeout_s``."""
    state = proc_state(pid)
    where = f"; its process is {_STATES.get(state, state)}" if state else ""
    return WorkerError(
        f"worker {worker} (pid {pid}, lanes {lanes}) produced nothing for {timeout_s:g} s "
        f"(worker_timeout_s={timeout_s:g}): it is hung or stopped{where}. The pipeline cannot "
        "continue: restore the last checkpoint into a new pipeline, and raise "
        "Pipeline(worker_timeout_s=...) if a batch may legitimately take that long"
    )
