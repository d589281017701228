"""A series of a pipeline's figures on disk: :func:`record` writes it while the pipeline
runs, :func:`read_series` reads it back (``zephon report`` draws it).

The format is JSON lines, append-only. The first line is a header::

    {"zephon_series": 1, "started_s": 1765000000.0, "every_s": 1.0, "pipeline": "Pipeline(...)"}

and each further line one sample, the wall time (seconds since the epoch) and
:func:`~zephon.metrics.scalars` then::

    {"time_s": 1765000001.0, "scalars": {"zephon_batches_delivered_total": 120.0, ...}}

Each line goes to the file in one ``write`` on a descriptor opened with ``O_APPEND``, so a
process that dies leaves whole lines; a line torn otherwise (the machine lost power
mid-write) is left out by :func:`read_series`, and a later recording appended to the same
file (a resumed job) starts on a line of its own.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import Any

from zephon.metrics.families import scalars

#: The header's ``zephon_series``: the format's version.
SERIES_VERSION = 1
#: The recorder looks at least this often whether the pipeline was dropped.
_POLL_S = 0.2

#: Each pipeline's running recorders, which its ``close()`` finishes (:func:`finish`).
_RUNNING: weakref.WeakKeyDictionary[Any, list[Recorder]] = weakref.WeakKeyDictionary()
# Reentrant: a dropped pipeline's __del__ closes it (and comes back here) on whichever
# thread drops its last reference or runs a GC pass, at any allocation, also one made
# while this thread holds the lock (a plain Lock deadlocked the test suite there).
_RUNNING_LOCK = threading.RLock()


class Recorder:
    """A running :func:`record`: ``path``, ``samples`` (lines written after the header);
    :meth:`close` writes one last sample and stops it (idempotent). ``pipe.close()`` does
    the same (the last sample is the pipeline's figures at its close), and a dropped
    pipeline stops it too."""

    def __init__(self, pipe: Any, path: str, every_s: float) -> None:
        self.path = path
        self.every_s = every_s
        self.samples = 0
        self._pipe = weakref.ref(pipe)
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._stop = threading.Event()
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")  # a torn line of a crashed run stays a line of its own
        header = {
            "zephon_series": SERIES_VERSION,
            "started_s": time.time(),
            "every_s": every_s,
            "pipeline": repr(pipe),
        }
        self._write(header)
        self._thread = threading.Thread(
            target=self._loop, name="zephon-metrics-record", daemon=True
        )
        with _RUNNING_LOCK:
            _RUNNING.setdefault(pipe, []).append(self)
        self._thread.start()

    def _write(self, obj: dict[str, Any]) -> None:
        line = (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)  # one write: whole lines (O_APPEND)

    def _sample(self) -> bool:
        """Write one sample; False once the pipeline is closed or gone."""
        pipe = self._pipe()
        if pipe is None or pipe._closed:  # noqa: SLF001 - the pipeline's own
            return False
        flat = scalars(pipe)
        if flat:  # nothing before the first next()
            flat = {k: v for k, v in flat.items() if v == v and abs(v) != float("inf")}
            self._write({"time_s": round(time.time(), 6), "scalars": flat})
            self.samples += 1
        return True

    def _loop(self) -> None:
        due = time.monotonic() + self.every_s
        while not self._stop.wait(max(0.0, min(due - time.monotonic(), _POLL_S))):
            pipe = self._pipe()
            if pipe is None or pipe._closed:  # noqa: SLF001
                break
            del pipe
            now = time.monotonic()
            if now >= due:
                due = max(due + self.every_s, now)  # on time, without catching up a backlog
                try:
                    if not self._sample():
                        break
                except Exception as e:  # noqa: BLE001 - never the training loop's problem
                    pipe = self._pipe()
                    if pipe is not None and not pipe._closed:  # noqa: SLF001
                        self.error = e  # (closing under the read is the normal end)
                    break
        if not self._stop.is_set():  # the pipeline closed: close() has nothing to add
            self._release()

    def _release(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _finish(self) -> None:
        """Stop the thread, write the last sample and close the file (once)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():  # else: the pipeline's last
            self._thread.join()  # reference was the thread's own, dropped after a sample
        try:
            if self._fd is not None and self.error is None:  # released if the pipeline closed
                self._sample()
        except Exception as e:  # noqa: BLE001 - raised by close(), never by pipe.close()
            self.error = e
        finally:
            self._release()

    @property
    def running(self) -> bool:
        """Whether the thread still records."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Write one last sample (if the pipeline is still open) and stop. Idempotent.

        Raises:
            RuntimeError: reading the figures failed in the thread (which then stopped),
                with that error as its cause.
        """
        self._finish()
        if self.error is not None:
            raise RuntimeError(
                f"zephon metrics: the recorder of {self.path} stopped after {self.samples} "
                f"samples: reading the figures failed ({type(self.error).__name__}: "
                f"{self.error})"
            ) from self.error

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder({self.path!r}, every_s={self.every_s}, samples={self.samples})"


def record(pipe: Any, path: str | os.PathLike[str], every_s: float = 1.0) -> Recorder:
    """Append ``pipe``'s figures (:func:`~zephon.metrics.scalars`) to ``path`` every
    ``every_s`` seconds from a background thread, as JSON lines (see the module), until the
    pipeline closes or the returned :class:`Recorder` is closed. Nothing is written before
    the first ``next()``. ``zephon report PATH --out PNG`` draws the series.

    Example::

        rec = zp.metrics.record(pipe, "loader.jsonl")
        for batch in pipe: ...
        rec.close()  # or pipe.close()

    Raises:
        ValueError: ``every_s`` is not a positive number.
        OSError: ``path`` cannot be opened for appending.
    """
    if isinstance(every_s, bool) or not isinstance(every_s, int | float) or not every_s > 0:
        raise ValueError(f"every_s must be a number of seconds > 0; got {every_s!r}")
    return Recorder(pipe, os.fspath(path), float(every_s))


def finish(pipe: Any) -> None:
    """What ``pipe.close()`` calls before it closes anything: each of ``pipe``'s running
    recorders writes its last sample and closes its file. A recorder that failed keeps
    its error for its own :meth:`Recorder.close` to raise."""
    with _RUNNING_LOCK:
        recorders = _RUNNING.pop(pipe, [])
    for rec in recorders:
        rec._finish()  # noqa: SLF001 - this module's own


def read_series(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The (first) header and the samples of a series that :func:`record` wrote, in time
    order, each with ``run``: 0, or how many later recordings were appended before it (the
    counters start again with each). A line torn by a crash is left out.

    Raises:
        ValueError: the file is not such a series (named, with the line that is not).
    """
    header: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = []
    run = 0
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            if header is not None:
                continue  # torn by a crash (the run after it starts on a line of its own)
            raise ValueError(f"{path}:{i + 1}: not a JSON line of a zephon series: {e}") from e
        if header is None:
            if not isinstance(obj, dict) or "zephon_series" not in obj:
                raise ValueError(
                    f"{path}: not a zephon series (its first line has no 'zephon_series'): "
                    "write one with zp.metrics.record(pipe, path)"
                )
            header = obj
        elif isinstance(obj, dict) and "zephon_series" in obj:
            run += 1  # a later recording appended to the same file (a resumed job)
        else:
            obj["run"] = run
            samples.append(obj)
    if header is None:
        raise ValueError(f"{path}: empty; write a series with zp.metrics.record(pipe, path)")
    samples.sort(key=lambda s: (s["run"], s["time_s"]))
    return header, samples
