"""SIGSTOP for the fault tests, waited out: :func:`stop_process` returns once every thread
of the process is stopped. ``os.kill`` returns at once, but each thread stops only when it
next runs: on a loaded machine that took 10-16 ms here, and a server that was sent
requests in between answered them (a "stalled" TCPStore served three calls in a row)."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid``, then wait until each of its threads is in the stopped state."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped in {timeout_s} s: {states}"
        time.sleep(0.002)
