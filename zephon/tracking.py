"""In-flight chunks, per-offset completion, eviction and the replay cursor, per lane.

This is the parent-side half of the seed page. A :class:`LaneTracker` hands out a lane's
chunks (and flush sentinels), learns from delivered batches and tombstones which offsets
are closed, and evicts chunks whose every derived sample has been delivered:

* monotone mode (every operator preserves cursor order): a watermark, everything below the
  chunk of the last delivered record goes;
* epoch mode: bottom-up, whole epochs at a time, authorised only by boundaries this lane
  recorded itself, and never the epoch the replay cursor points into (cursor pinning).

Offsets close when the number of delivered children reaches the total that
``is_last_child`` revealed; children may arrive in any order.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence
from typing import Any

from zephon._native import load
from zephon.chunks import WorkChunk
from zephon.errors import CheckpointError
from zephon.records import Contributor, FlushSentinel, SampleCursor

_NATIVE = load("_pack")  # ChunkTrack.add_run in C, for chunks of up to 64 samples

MONOTONE = "monotone"
EPOCH = "epoch"

Feed = list[WorkChunk | FlushSentinel]


class ChunkTrack:
    """Completion of one in-flight chunk: a bitmap of closed offsets plus its popcount.

    A restored chunk (:meth:`stored`) keeps its checkpoint form and is decoded when it is
    first used: a restore then decodes only what the first batches replay.
    """

    __slots__ = ("chunk_id", "size", "delivered", "total", "bitmap", "closed", "_chunk", "_state")

    def __init__(self, chunk: WorkChunk | None, size: int = 0, state: Any = None) -> None:
        self._chunk = chunk
        self._state: dict[str, Any] | None = state
        if chunk is not None:
            self.chunk_id, size = chunk.chunk_id, len(chunk)
        else:
            self.chunk_id = state["chunk_id"]
        self.size = size
        self.delivered = [0] * size  # children delivered (or tombstoned) per offset
        self.total = [0] * size  # children in all, 0 until the last child is seen
        self.bitmap = 0
        self.closed = 0

    @classmethod
    def stored(cls, state: Any) -> ChunkTrack:
        """The track of a chunk in its :meth:`WorkChunk.to_state` form, checked now and
        decoded on first use (a malformed one raises ``TypeError``, ``KeyError`` or
        ``ValueError``)."""
        comps, indices = state["components"], state["indices"]
        if not isinstance(comps, bytes) or not isinstance(indices, bytes):
            raise TypeError(
                f"components and indices must be bytes; got {type(comps).__name__} and "
                f"{type(indices).__name__}"
            )
        size = len(comps) // 4
        if len(comps) != 4 * size or len(indices) != 8 * size:
            raise ValueError(
                f"chunk arrays of {len(comps)} and {len(indices)} bytes are not int32 and int64 "
                "of one length"
            )
        plain = {
            "lane": int(state["lane"]),
            "chunk_id": int(state["chunk_id"]),
            "components": comps,
            "indices": indices,
            "seed": int(state["seed"]),
        }
        return cls(None, size, plain)

    @property
    def chunk(self) -> WorkChunk:
        if self._chunk is None:
            self._chunk = WorkChunk.from_state(self._state)  # type: ignore[arg-type]
        return self._chunk

    @property
    def lane(self) -> int:
        return self._chunk.lane if self._chunk is not None else self._state["lane"]  # type: ignore[index]

    def to_state(self) -> dict[str, Any]:
        """The chunk's checkpoint form (a restored chunk's is the one it came from)."""
        return self._state if self._state is not None else self.chunk.to_state()

    def add_run(self, pieces: Sequence[Contributor], i: int) -> int:
        """Counts ``pieces[i]``, ``pieces[i + 1]``, ... for as long as they are of this chunk;
        returns the index of the first that is not (or ``len(pieces)``)."""
        chunk_id = self.chunk_id
        delivered, total = self.delivered, self.total
        if _NATIVE is not None and self.size <= 64 and type(pieces) is list:
            i, self.bitmap, closed = _NATIVE.close_run(
                delivered, total, self.bitmap, chunk_id, pieces, i
            )
            self.closed += closed
            return i  # type: ignore[no-any-return]
        for piece in itertools.islice(pieces, i, None):
            if piece[0] != chunk_id:
                break
            offset = piece[1]
            delivered[offset] += 1
            if piece[3]:  # the last child: now the total is known
                total[offset] = piece[2] + 1
            if delivered[offset] == total[offset] and not (self.bitmap >> offset) & 1:
                self.bitmap |= 1 << offset
                self.closed += 1
            i += 1
        return i

    @property
    def complete(self) -> bool:
        return self.closed == self.size


class LaneTracker:
    """Everything the parent knows about one lane."""

    def __init__(self, lane: int, source: Any, mode: str, flush_every_k_chunks: int) -> None:
        self.lane = lane
        self.source = source
        self.mode = mode
        self.k = flush_every_k_chunks
        self.inflight: dict[int, ChunkTrack] = {}  # ascending chunk id (insertion order)
        self.boundaries: list[int] = []  # ascending; b = first chunk after a sentinel
        self.cursor: SampleCursor | None = None
        self.batches = 0  # outputs delivered from this lane
        self.done = False  # the end of the lane's stream was delivered
        self.exhausted = False  # the source said so and the final sentinel went out
        self.replay: deque[ChunkTrack | FlushSentinel] = deque()  # restored, to replay
        self.evicted = 0
        self.next_chunk_id = 0

    # ----------------------------------------------------------------- handing out
    def pull(self) -> Feed:
        """The next feed unit of the lane: a chunk (maybe followed by a sentinel), the final
        sentinel, or ``[]`` once the lane has nothing more."""
        if self.replay:
            first = self.replay.popleft()
            items: Feed = [first.chunk if isinstance(first, ChunkTrack) else first]
            if self.replay and isinstance(self.replay[0], FlushSentinel):
                items.append(self.replay.popleft())  # type: ignore[arg-type]
            return items
        if self.exhausted:
            return []
        chunk = self.source.next_chunk()
        if chunk is None:
            self.exhausted = True
            return [FlushSentinel(self.lane, self.next_chunk_id, final=True)]
        if chunk.lane != self.lane:
            raise ValueError(
                f"work source for lane {self.lane} produced a chunk of lane {chunk.lane}; "
                "for_lane(lane, num_lanes) must return a source bound to that lane"
            )
        if chunk.chunk_id != self.next_chunk_id:
            raise ValueError(
                f"work source for lane {self.lane} produced chunk {chunk.chunk_id}, expected "
                f"{self.next_chunk_id}; chunk ids must count up from 0 by 1"
            )
        self.inflight[chunk.chunk_id] = ChunkTrack(chunk)
        self.next_chunk_id += 1
        items = [chunk]
        if self.k and (chunk.chunk_id + 1) % self.k == 0:
            self.boundaries.append(chunk.chunk_id + 1)
            items.append(FlushSentinel(self.lane, chunk.chunk_id + 1))
        return items

    # ------------------------------------------------------------------ delivery
    def close(self, contributors: list[Contributor]) -> None:
        """Count delivered (or tombstoned) children; unknown chunks are a bug upstream."""
        inflight = self.inflight
        i, n = 0, len(contributors)
        while i < n:  # pieces come in runs of one chunk
            chunk_id = contributors[i][0]
            track = inflight.get(chunk_id)
            if track is None:
                raise RuntimeError(
                    f"lane {self.lane}: delivery names chunk {chunk_id}, which is not in "
                    f"flight (in flight: {list(inflight)[:8]}...); this is a Zephon bug"
                )
            i = track.add_run(contributors, i)

    def deliver(self, contributors: list[Contributor], last_cursor: SampleCursor | None) -> None:
        self.close(contributors)
        if last_cursor is not None:
            self.cursor = last_cursor
            self.batches += 1
        self.evict()

    def evict(self) -> None:
        if self.mode == MONOTONE:
            self._evict_watermark()
        else:
            self._evict_epochs()

    def _pinned(self, lo: int, hi: int) -> bool:
        return self.cursor is not None and lo <= self.cursor.chunk_id < hi

    def _evict_watermark(self) -> None:
        inflight = self.inflight
        mark = self.cursor.chunk_id if self.cursor is not None else -1
        while inflight:
            lo = next(iter(inflight))
            if lo < mark or (lo != mark and inflight[lo].complete):
                del inflight[lo]
                self.evicted += 1
            else:
                break

    def _evict_epochs(self) -> None:
        inflight = self.inflight
        while inflight:
            lo = next(iter(inflight))
            i = bisect.bisect_right(self.boundaries, lo)
            if i == len(self.boundaries):
                return  # open epoch: only this lane's own boundary may close it
            hi = self.boundaries[i]
            if self._pinned(lo, hi):
                return
            ids = [c for c in inflight if c < hi]
            if not all(inflight[c].complete for c in ids):
                return
            for c in ids:
                del inflight[c]
            self.evicted += len(ids)
            del self.boundaries[:i]  # boundaries at or below the new bottom say nothing more

    # ---------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        lo = next(iter(self.inflight), None)
        floor = lo if lo is not None else self.next_chunk_id
        return {
            "lane": self.lane,
            "inflight": [t.to_state() for t in self.inflight.values()],
            "boundaries": [b for b in self.boundaries if b > floor or (lo is None and b == floor)],
            "source": self.source.state_dict(),
            "cursor": None if self.cursor is None else list(self.cursor[1:]),
            "batches": self.batches,
            "done": self.done,
            "next_chunk_id": self.next_chunk_id,
        }

    def load(self, state: dict[str, Any]) -> int:
        """Restore from :meth:`state`; returns how many chunks phase 1 will replay."""
        try:
            chunks = [ChunkTrack.stored(c) for c in state["inflight"]]
            boundaries = sorted(int(b) for b in state["boundaries"])
            cursor = state["cursor"]
            self.source.load_state_dict(state["source"])
            self.batches = int(state["batches"])
            self.done = bool(state["done"])
            next_id = int(state["next_chunk_id"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"lane {self.lane}: malformed lane state ({e!r})") from e
        ids = [c.chunk_id for c in chunks]
        contiguous = not ids or ids == list(range(ids[0], next_id))
        if any(c.lane != self.lane for c in chunks) or not contiguous:
            raise CheckpointError(
                f"lane {self.lane}: in-flight chunks must be this lane's and contiguous up to "
                f"next_chunk_id={next_id}; got ids {ids}"
            )
        self.cursor = None if cursor is None else SampleCursor(self.lane, *(int(x) for x in cursor))
        if self.cursor is not None and self.cursor.chunk_id not in ids:
            raise CheckpointError(
                f"lane {self.lane}: replay cursor {tuple(self.cursor)} points outside the in-flight "
                f"chunks {ids[:1]}..{ids[-1:]}; the checkpoint is inconsistent"
            )
        self.inflight = {c.chunk_id: c for c in chunks}
        self.boundaries = boundaries
        self.next_chunk_id = next_id
        self.replay.clear()
        bset = set(boundaries)
        for c in chunks:
            self.replay.append(c)
            if c.chunk_id + 1 in bset:
                self.replay.append(FlushSentinel(self.lane, c.chunk_id + 1))
        return len(chunks)
