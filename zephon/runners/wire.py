"""What passes between a worker and the parent: one schema, named fields, msgpack.

Two channels. The control pipe carries small messages (``kind`` first): a worker asks for a
lane's next feed unit (``need``), the parent answers (``feed``), the worker says it is
past its start method's imports (``booted``: with spawn, the main module's), that it
reached its loop (``ready``) or what it raised (``error``), the parent says ``stop``. With slots sized from
the batches (``ring_slot_bytes=None``) a worker whose output does not fit asks for a bigger
ring (``grow``); the parent answers ``ring`` followed by the new ring's descriptor, and the
worker writes a ``moved`` marker as the old ring's last message. The ring carries the
outputs: a slot holds an output's arrays and its metadata (:func:`encode_output`), read back
by :func:`decode_output`. Nothing is pickled on either channel.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from zephon.chunks import WorkChunk
from zephon.errors import WorkerError
from zephon.records import BatchRecord, Contributor, FlushSentinel, Record, SampleCursor
from zephon.runners.chain import LaneCounts, LaneOutput

# control messages: their kinds
KIND = "kind"
NEED = "need"
FEED = "feed"
BOOTED = "booted"  # worker -> parent: it runs Zephon's code (its start method's imports done)
READY = "ready"
ERROR = "error"
STOP = "stop"
GROW = "grow"  # worker -> parent: a ring whose slots hold BYTES, please
RING = "ring"  # parent -> worker: the new ring's descriptor follows
BYTES = "bytes"

# an output's metadata in its ring slot
LANE = "lane"
TOMBSTONES = "tombstones"
COUNTS = "counts"
END = "end"
CONTRIBUTORS = "contributors"
MIX = "mix"
LAST_CURSOR = "last_cursor"
NUM_RECORDS = "num_records"
KEYS = "keys"  # the data is a dict of these arrays, in this order
SINGLE = "single"  # the data is the one array
VALUE = "value"  # the data is this msgpack-able value (no arrays)
MOVED = "moved"  # the old ring's last message: read on in the new one


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes | memoryview) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


# ------------------------------------------------------------------------------- control
def need(lane: int) -> dict[str, Any]:
    """A worker's request for ``lane``'s next feed unit."""
    return {KIND: NEED, LANE: lane}


def feed(lane: int, items: list[WorkChunk | FlushSentinel]) -> dict[str, Any]:
    """The parent's answer to ``need``: the lane's next feed unit (empty: none left)."""
    units = [
        {"chunk": it.to_state()}
        if isinstance(it, WorkChunk)
        else {"boundary": it.boundary, "final": it.final}
        for it in items
    ]
    return {KIND: FEED, LANE: lane, "items": units}


def feed_items(msg: dict[str, Any]) -> list[WorkChunk | FlushSentinel]:
    lane = msg[LANE]
    return [
        WorkChunk.from_state(it["chunk"])
        if "chunk" in it
        else FlushSentinel(lane, it["boundary"], it["final"])
        for it in msg["items"]
    ]


# ------------------------------------------------------------------------------- outputs
def flat(contributors: list[Contributor]) -> bytes:
    """Contributors on the wire: little-endian int64 ``(chunk_id, offset, child, is_last)``
    rows, which the parent turns back into rows without a Python call per piece."""
    return np.array(contributors, dtype="<i8").tobytes()


def unflat(raw: bytes) -> list[Contributor]:
    """Plain ``[chunk_id, offset, child, is_last]`` rows, which is all the parent's tracking
    reads (building Contributor objects would cost a call per piece)."""
    if len(raw) % 32:
        raise WorkerError(f"a worker sent {len(raw)} bytes of contributors, not rows of 4 int64")
    return np.frombuffer(raw, dtype="<i8").reshape(-1, 4).tolist()  # type: ignore[return-value]


def output_meta(out: LaneOutput, data: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
    """An output's metadata and the arrays that go into its slot beside it (``data`` is
    the record's data, already built; None at the end of a lane)."""
    meta: dict[str, Any] = {LANE: out.lane, TOMBSTONES: flat(out.tombstones)}
    if out.counts is not None:
        c = out.counts
        meta[COUNTS] = [list(c.ops), c.replay_dropped, c.io_retries, c.dropped_at_end, c.reads]
    rec = out.record
    if out.end or rec is None:
        meta[END] = True
        return meta, []
    meta[CONTRIBUTORS] = flat(rec.contributors)
    meta[MIX] = [[int(c), int(w)] for c, w in rec.component_tokens.items()]
    if isinstance(rec, BatchRecord):
        meta[LAST_CURSOR] = list(rec.last_cursor[1:])
        meta[NUM_RECORDS] = rec.num_records
    if isinstance(data, dict) and all(isinstance(v, np.ndarray) for v in data.values()):
        meta[KEYS] = list(data)
        return meta, list(data.values())
    if isinstance(data, np.ndarray):
        meta[SINGLE] = True
        return meta, [data]
    meta[VALUE] = data  # msgpack-able plain data
    return meta, []


def decode_output(meta: dict[str, Any], arrays: list[np.ndarray]) -> LaneOutput:
    """The output that :func:`output_meta` described (its arrays read from the slot)."""
    lane = meta[LANE]
    tombs = unflat(meta[TOMBSTONES])
    counts = meta.get(COUNTS)
    if counts is not None:
        ops = [tuple(c) for c in counts[0]]
        reads = tuple(tuple(row) for row in counts[4])
        counts = LaneCounts(ops, int(counts[1]), int(counts[2]), int(counts[3]), reads)  # type: ignore[arg-type]
    if meta.get(END):
        return LaneOutput(lane, None, tombs, end=True, counts=counts)
    keys = meta.get(KEYS)
    if keys is not None:
        data: Any = dict(zip(keys, arrays, strict=True))
    elif meta.get(SINGLE):
        data = arrays[0]
    else:
        data = meta[VALUE]
    mix = dict(meta[MIX])
    contributors = unflat(meta[CONTRIBUTORS])
    rec: Record
    if LAST_CURSOR in meta:
        last = SampleCursor(lane, *meta[LAST_CURSOR])
        rec = BatchRecord(data, lane, contributors, mix, last, meta[NUM_RECORDS])
    else:
        rec = Record(data, lane, contributors, mix)
    return LaneOutput(lane, rec, tombs, counts=counts)
