"""Pausing CPython's cyclic garbage collector around a call that builds a big acyclic value.

A rank owning thousands of lanes holds about a million tracked objects (pieces waiting in
bins, trackers, work sources), and iteration frees about as many as it makes, so the
collector's young generation fills with survivors that no collection has scanned yet.
A call that then allocates tens of thousands of objects and keeps them (a checkpoint of
4,096 lanes builds one state dict per lane) triggers dozens of collections, each scanning
that backlog again: 40-190 ms of a 20 ms checkpoint, and once in a while a full collection
(over a second). The state is dicts, lists, ints and bytes: it holds no cycle to find, so
the collector is paused while it is built, and the first allocation after it runs one
collection instead of dozens. A full collection the process owes for its million objects
still runs then (``benchmarks.many_lanes`` reports the collector's time in and after a
checkpoint); fewer objects per waiting piece is what makes that one cheap.

Pauses nest, across threads too: the collector is re-enabled when the last one ends, and
only if it was enabled when the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
