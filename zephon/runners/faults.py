"""How a worker failed, in words: what the parent raises when a worker dies, hangs, raises,
never starts or never reaches its loop, and what a worker sends about an exception it could
not handle."""

from __future__ import annotations

import builtins
import signal
import sys
import traceback
from typing import Any

from zephon.errors import WorkerError
from zephon.runners import wire
from zephon.runners.chain import WHERE

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
    """What a worker sends the parent about ``e``: its type, message, traceback and, for an
    operator's error, where in the stream it was raised (lane, operator, sample: see
    :func:`zephon.runners.chain._annotate`; the note saying so is left out of the traceback,
    the parent's message says it first)."""
    where = getattr(e, WHERE, None)
    tb = traceback.TracebackException.from_exception(e)
    if where is not None and tb.__notes__:
        tb.__notes__ = [n for n in tb.__notes__ if not n.endswith(where)]
    return {
        wire.KIND: wire.ERROR,
        "type": type(e).__name__,
        "module": type(e).__module__,
        "qualname": type(e).__qualname__,
        "message": _clip(str(e)),
        "traceback": _clip("".join(tb.format())),
        "where": where,
        **extra,
    }


class _Raised(WorkerError):
    """A worker's exception raised again in the parent (mixed into a class of its own
    type): its text is the message as it is, over several lines, even where the original
    type would quote it (``str(KeyError("a\nb"))`` is ``"'a\\nb'"``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


_REBUILT: dict[type, type] = {}  # one class per original type: errors of a kind compare alike


def _original_type(msg: dict[str, Any]) -> type | None:
    """The worker's exception class where this process has it: a builtin, or a class of a
    module already imported here (the worker's ``__mp_main__`` is our ``__main__``). Its
    constructor does not run: the rebuilt class takes its message through RuntimeError's."""
    module = msg.get("module")
    if module == "builtins":
        cls = getattr(builtins, msg["type"], None)
    else:
        mod = sys.modules.get("__main__" if module == "__mp_main__" else str(module))
        qualname = msg.get("qualname") or msg["type"]
        cls = mod
        for part in qualname.split("."):
            cls = getattr(cls, part, None)
    if (
        isinstance(cls, type)
        and issubclass(cls, Exception)
        and not issubclass(cls, (WorkerError, StopIteration, StopAsyncIteration))
    ):
        return cls
    return None  # a StopIteration out of next() would end the caller's loop without a word


def _rebuilt(base: type, text: str) -> BaseException | None:
    """``text`` as an instance of a class that is both ``base`` and WorkerError, or None
    where there is no such class (a layout or metaclass conflict) or where making one with
    a message fails (a ``__new__`` of other arguments)."""
    try:
        cls = _REBUILT.get(base)
        if cls is None:
            cls = type(base.__name__, (_Raised, base), {"__module__": "zephon.errors"})
            _REBUILT[base] = cls
        err = cls(text)
        err.args = (text,)
        return err  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - TypeError mostly; any failure falls back
        return None


def rebuild_error(worker: int, pid: int, msg: dict[str, Any]) -> BaseException:
    """The worker's exception as an instance of its own type *and* WorkerError.

    Its message is the original's, then the worker (id and pid), where in the stream it
    was raised (the operator, the lane, the sample and its cursor), and the worker's
    traceback, over as many lines as they take. The type is kept for builtin exceptions
    (``except KeyError`` catches a worker's KeyError) and for classes of modules this
    process has imported; the rest, and StopIteration (out of ``next()`` it would end the
    caller's loop quietly), are a plain WorkerError whose message starts with the type's
    name. The original's ``args`` and attributes do not cross processes: ``args`` is the
    message, and the class's own constructor does not run."""
    if msg["type"] == "SystemExit" and "exit_code" in msg:
        arg = msg.get("exit_arg", repr(msg["message"]))
        return WorkerError(
            f"worker {worker} (pid {pid}) exited with code {msg['exit_code']}: a function it ran "
            f"called sys.exit({arg}). Its traceback:\n{msg['traceback']}"
        )
    return raised_as(msg, f"worker {worker} (pid {pid})")


def raised_as(msg: dict[str, Any], who: str, elsewhere: str = "") -> BaseException:
    """The exception ``msg`` describes, raised by ``who`` (a worker, a Ray actor), with its
    message, who raised it, where (``msg["where"]``, else ``elsewhere``) and its traceback:
    of its own type and WorkerError where :func:`rebuild_error` says so."""
    where = msg.get("where")
    at = f" in {where}" if where else elsewhere
    text = (
        f"{msg['message']}\n\n[{who} raised {msg['type']}{at}; its "
        f"traceback:]\n{msg['traceback'].rstrip()}"
    )
    base = _original_type(msg)
    err = None if base is None else _rebuilt(base, text)
    return err if err is not None else WorkerError(f"{msg['type']}: {text}")


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
    worker: int,
    pid: int,
    lanes: list[int],
    code: int | None,
    configured: bool,
    worker_start_method: str,
) -> WorkerError:
    """A worker ended before it said it runs: most often a script without a main guard."""
    hint = ""
    if worker_start_method != "fork":
        hint = (
            f". With worker_start_method={worker_start_method!r} a worker first imports your"
            " main module again: a script that builds and iterates pipelines at import time must"
            " do so under `if __name__ == '__main__':`"
        )
    when = (
        "before it began to run the pipeline" if configured else "before it read its configuration"
    )
    return WorkerError(
        f"worker {worker} (pid {pid}, lanes {lanes}) {how(code)} while starting, {when} "
        f"(its stderr may say why){hint}"
    )


def never_reached_loop(
    worker: int,
    pid: int | None,
    lanes: list[int],
    worker_timeout_s: float,
    worker_start_method: str,
    booted: bool,
) -> WorkerError:
    """A worker did not reach its loop within ``worker_timeout_s``: still importing (with
    spawn and forkserver, the parent's main module again: most often a script without a
    main guard whose top level blocks) or, ``booted``, still loading its configuration."""
    state = proc_state(pid)
    where = f"; its process is {_STATES.get(state, state)}" if state else ""
    if booted:
        doing = (
            "it is still loading its configuration (unpickling the operators and datasets it "
            f"was sent){where}. Raise Pipeline(worker_timeout_s=...) if that may legitimately "
            "take that long"
        )
    elif worker_start_method == "fork":
        doing = f"it never began to run Zephon's code{where}"
    else:
        doing = (
            f"it is still importing your main module{where}. With worker_start_method="
            f"{worker_start_method!r} a worker first imports the main module again, before it "
            "runs anything of Zephon's: a script whose top level builds and iterates pipelines "
            "(or otherwise blocks) must do so under `if __name__ == '__main__':`"
        )
    return WorkerError(
        f"worker {worker} (pid {pid}, lanes {lanes}) never reached its loop within "
        f"worker_timeout_s={worker_timeout_s:g} s: {doing}"
    )


def hung(worker: int, pid: int | None, lanes: list[int], worker_timeout_s: float) -> WorkerError:
    """A worker that reached its loop produced nothing for ``worker_timeout_s``."""
    state = proc_state(pid)
    where = f"; its process is {_STATES.get(state, state)}" if state else ""
    return WorkerError(
        f"worker {worker} (pid {pid}, lanes {lanes}) produced nothing for "
        f"{worker_timeout_s:g} s (worker_timeout_s={worker_timeout_s:g}): it is hung or "
        f"stopped{where}. The pipeline cannot continue: restore the last checkpoint into a "
        "new pipeline, and raise Pipeline(worker_timeout_s=...) if a batch may legitimately "
        "take that long"
    )
