"""The keys of a lane's checkpoint state and of an in-flight chunk's, in one place.

A lane state (:meth:`~zephon.tracking.tracker.LaneTracker.state`) is a plain dict::

    {"lane": 3,
     "inflight": [chunk state, ...],      # ascending chunk id, each as WorkChunk.to_state
     "boundaries": [4, 8],                # ascending; b = the first chunk after a sentinel
     "source": {...},                     # the work source's state_dict()
     "cursor": [chunk_id, offset, child], # the replay cursor, or None
     "batches": 12,                       # outputs delivered from the lane
     "done": False,                       # the end of the lane's stream was delivered
     "next_chunk_id": 9,
     ["held": [[op, until, [weights...]], ...]]}  # only while a replay needs it

The tracker writes the entries in this order (msgpack keeps it, so the same run writes the
same bytes) and reads ``state[KEY]`` strictly when it loads one (the checks:
:mod:`zephon.tracking.checks`); :mod:`zephon.checkpoint.state`, ``restore`` and
``zephon inspect`` read them by these names.
"""

from __future__ import annotations

# An in-flight chunk's keys are the chunk's own (WorkChunk.to_state), re-exported here.
from zephon.chunks import (
    CHUNK_COMPONENTS,
    CHUNK_ID,
    CHUNK_INDICES,
    CHUNK_KEYS,
    CHUNK_LANE,
    CHUNK_SEED,
)

LANE = "lane"
INFLIGHT = "inflight"
BOUNDARIES = "boundaries"
SOURCE = "source"
CURSOR = "cursor"
BATCHES = "batches"
DONE = "done"
NEXT_CHUNK_ID = "next_chunk_id"
#: The optional key of ``ensure_mixture`` holds (see :attr:`LaneTracker.held`).
HELD = "held"

#: The keys a lane state must have beside :data:`LANE` (which the checkpoint's layout checks
#: first), in the order they are written.
LANE_KEYS = (INFLIGHT, BOUNDARIES, SOURCE, CURSOR, BATCHES, DONE, NEXT_CHUNK_ID)

__all__ = [
    "BATCHES",
    "BOUNDARIES",
    "CHUNK_COMPONENTS",
    "CHUNK_ID",
    "CHUNK_INDICES",
    "CHUNK_KEYS",
    "CHUNK_LANE",
    "CHUNK_SEED",
    "CURSOR",
    "DONE",
    "HELD",
    "INFLIGHT",
    "LANE",
    "LANE_KEYS",
    "NEXT_CHUNK_ID",
    "SOURCE",
]
