"""Pausing CPython's cyclic garbage collector around a call that builds a big acyclic value.

A rank owning thousands of lanes holds a great many tracked objects (pieces waiting in
bins, trackers, work sources), and iteration frees about as many as it makes. CPython lowers
the young generation's count when any tracked object is freed, old ones included, so young
collections hardly run and the young generation fills with survivors that no collection has
scanned yet. A call that then allocates many objects and keeps them (a checkpoint builds one
state dict per lane) triggers collections that scan that backlog, which can cost several
times the checkpoint itself, and once in a while a full collection. The state is dicts,
lists, ints and bytes: it holds no cycle to find, so the collector is paused while it is
built. (The sizes and times are on the docs' Performance page, under "One rank owning many
lanes": ``python -m benchmarks.many_lanes``.)

With ``promote`` (a process owning :data:`PROMOTE_LANES` lanes or more: what
:meth:`zephon.Pipeline.local_checkpoint` asks), what is alive when the pause begins and what
the block made are moved to the oldest generation without a scan (``gc.freeze()`` then
``gc.unfreeze()``, two list splices): the checkpoint pays for no collection, and the
objects are next looked at by a full collection, which runs on CPython's own schedule.
Nothing is promoted where the program froze objects itself (``gc.get_freeze_count()``):
unfreezing would thaw those too.

Pauses nest, across threads too: the collector is re-enabled when the last one ends, and
only if it was enabled when the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: From how many lanes a process owns its checkpoint promotes the young generation (the
#: backlog grows with the pieces waiting in the lanes' bins; below this it costs little).
PROMOTE_LANES = 1024

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_promoting = False


@contextmanager
def collector_paused(promote: bool = False) -> Iterator[None]:
    """No cyclic collection inside the block; with ``promote``, the young generation and
    the block's objects end in the oldest one, unscanned (see the module docstring)."""
    global _depth, _was_enabled, _promoting
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
            _promoting = promote and _was_enabled and gc.get_freeze_count() == 0
            if _promoting:
                gc.freeze()  # what is alive now, out of every generation
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _promoting:
                    gc.freeze()  # the block's objects too
                    gc.unfreeze()  # all of them into the oldest generation
                    _promoting = False
                if _was_enabled:
                    gc.enable()
