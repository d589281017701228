"""CPU accounting of this process and its descendants: ``/proc`` parsing, the live
descendant tree, and :class:`CpuMeter` (parent and children CPU seconds over a window)."""

from __future__ import annotations

import math
import os
import resource
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_children(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc (``task/*/children``, or a scan of every
    ``/proc/N/stat`` for its parent pid where the kernel lacks that file); empty without /proc."""
    out: list[int] = []
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except FileNotFoundError:
            return _scan_children(pid)
        except OSError:
            continue
    return out


def _scan_children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                data = f.read()
        except OSError:
            continue
        if int(data[data.rindex(")") + 2 :].split()[1]) == pid:
            out.append(int(entry))
    return out


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process in seconds (its own, not its children's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields resume after the last ')'.
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime/stime are fields 14/15.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def descendant_pids(pid: int | None = None) -> list[int]:
    """Every live descendant process of ``pid`` (this process by default)."""
    stack = _proc_children(os.getpid() if pid is None else pid)
    seen: list[int] = []
    while stack:
        child = stack.pop()
        if child not in seen:
            seen.append(child)
            stack.extend(_proc_children(child))
    return seen


def descendant_cpu() -> dict[int, float]:
    """CPU seconds so far of every live descendant process of this process, by pid."""
    result: dict[int, float] = {}
    for pid in descendant_pids():
        cpu = _proc_cpu_s(pid)
        if cpu is not None:
            result[pid] = cpu
    return result


def _rusage_children_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class CpuMeter:
    """Parent and children CPU time over a window.

    Parent: ``time.process_time`` (all threads of this process). Children: live descendants
    read from /proc at both ends (a process born inside the window counts from 0), plus
    ``getrusage(RUSAGE_CHILDREN)`` for children reaped inside the window, minus what those
    had already used when the window opened.
    """

    def start(self) -> CpuMeter:
        self._wall0 = time.perf_counter()
        self._cpu0 = time.process_time()
        self._ru0 = _rusage_children_s()
        self._kids0 = descendant_cpu()
        return self

    def stop(self) -> dict[str, float]:
        kids1 = descendant_cpu()
        ru1 = _rusage_children_s()
        cpu1 = time.process_time()
        wall = time.perf_counter() - self._wall0
        live = sum(c - self._kids0.get(pid, 0.0) for pid, c in kids1.items())
        gone_before = sum(c for pid, c in self._kids0.items() if pid not in kids1)
        reaped = max(0.0, (ru1 - self._ru0) - gone_before)
        children = max(0.0, live) + reaped
        parent = cpu1 - self._cpu0
        return {
            "wall_s": wall,
            "parent_cpu_s": parent,
            "children_cpu_s": children,
            "parent_cpu_per_wall": parent / wall if wall > 0 else math.nan,
            "children_cpu_per_wall": children / wall if wall > 0 else math.nan,
        }
