"""In-flight chunks, per-offset completion, eviction and the replay cursor, per lane.

This is the parent-side half of the seed page. A :class:`LaneTracker` hands out a lane's
chunks (and flush sentinels), learns from delivered batches and tombstones which offsets
are closed, and evicts chunks whose every derived sample has been delivered:

* monotone mode (every operator preserves cursor order): a watermark, everything below the
  chunk of the last delivered record goes;
* epoch mode: bottom-up, whole epochs at a time, authorised only by boundaries this lane
  recorded itself, and never the epoch the replay cursor points into (cursor pinning).

Offsets close when the number of delivered children reaches the total that
``is_last_child`` revealed; children may arrive in any order. The checks of a lane state
being loaded are in :mod:`zephon.tracking.checks`.
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
from zephon.tracking.checks import (
    check_pointers,
    checked_boundaries,
    checked_chunk,
    checked_count,
    checked_cursor,
    checked_holds,
    checked_keys,
    shown,
)
from zephon.tracking.schema import (
    BATCHES,
    BOUNDARIES,
    CHUNK_ID,
    CHUNK_LANE,
    CURSOR,
    DONE,
    HELD,
    INFLIGHT,
    LANE,
    LANE_KEYS,
    NEXT_CHUNK_ID,
    SOURCE,
)

_NATIVE = load("_track")  # ChunkTrack.add_run in C, for chunks of up to 64 samples

MONOTONE = "monotone"
EPOCH = "epoch"

Feed = list[WorkChunk | FlushSentinel]


class ChunkTrack:
    """Completion of one in-flight chunk: a bitmap of closed offsets plus its popcount.

    A restored chunk (:meth:`stored`) keeps its checkpoint form and is decoded when it is
    first used: a restore then decodes only what the first batches replay.
    """

    __slots__ = (
        "chunk_id",
        "size",
        "delivered",
        "total",
        "bitmap",
        "closed",
        "_chunk",
        "_state",
        "_components",
    )

    def __init__(self, chunk: WorkChunk | None, size: int = 0, state: Any = None) -> None:
        self._chunk = chunk
        self._state: dict[str, Any] | None = state
        if chunk is not None:
            self.chunk_id, size = chunk.chunk_id, len(chunk)
        else:
            self.chunk_id = state[CHUNK_ID]
        self.size = size
        self.delivered = [0] * size  # children delivered (or tombstoned) per offset
        self.total = [0] * size  # children in all, 0 until the last child is seen
        self.bitmap = 0
        self.closed = 0
        self._components: list[int] | None = None  # per offset, once a document is counted

    @classmethod
    def stored(cls, state: Any) -> ChunkTrack:
        """The track of a chunk in its :meth:`WorkChunk.to_state` form, checked now and
        decoded on first use (its pointers are checked against the datasets by the lane,
        for all its chunks at once).

        Raises:
            CheckpointError: a key is missing, a value has the wrong type or is out of
                range; the message says which.
        """
        plain, size = checked_chunk(state)
        return cls(None, size, plain)

    @property
    def chunk(self) -> WorkChunk:
        if self._chunk is None:
            self._chunk = WorkChunk.from_state(self._state)  # type: ignore[arg-type]
        return self._chunk

    @property
    def lane(self) -> int:
        return self._chunk.lane if self._chunk is not None else self._state[CHUNK_LANE]  # type: ignore[index]

    def to_state(self) -> dict[str, Any]:
        """The chunk's checkpoint form (a restored chunk's is the one it came from); made
        once, a chunk never changes."""
        if self._state is None:
            self._state = self.chunk.to_state()
        return self._state

    @property
    def components(self) -> list[int]:
        """The chunk's component per offset, as a list (made once)."""
        if self._components is None:
            self._components = self.chunk.components.tolist()
        return self._components

    def add_run(
        self, pieces: Sequence[Contributor], i: int, docs: dict[int, int] | None = None
    ) -> int:
        """Counts ``pieces[i]``, ``pieces[i + 1]``, ... for as long as they are of this chunk;
        returns the index of the first that is not (or ``len(pieces)``). With ``docs``, a
        document's last piece adds 1 to ``docs[its component]``."""
        chunk_id = self.chunk_id
        delivered, total = self.delivered, self.total
        comps = None
        if docs is not None:
            comps = self._components  # (the property's list, without a call per run)
            if comps is None:
                comps = self.components
        if _NATIVE is not None and self.size <= 64 and type(pieces) is list:
            i, self.bitmap, closed = _NATIVE.close_run(
                delivered, total, self.bitmap, chunk_id, pieces, i, comps, docs
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
                if comps is not None:
                    c = comps[offset]
                    docs[c] = docs.get(c, 0) + 1  # type: ignore[index,union-attr]
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

    # Slots: a checkpoint of a rank of thousands of lanes reads every tracker once, and
    # a slot is read from the object itself, not from an instance dict beside it.
    __slots__ = (
        "lane",
        "source",
        "mode",
        "flush_every_k_chunks",
        "inflight",
        "boundaries",
        "cursor",
        "batches",
        "_done",
        "exhausted",
        "replay",
        "evicted",
        "next_chunk_id",
        "_state",
        "_base",
        "_held",
    )

    def __init__(self, lane: int, source: Any, mode: str, flush_every_k_chunks: int) -> None:
        self.lane = lane
        self.source = source
        self.mode = mode
        self.flush_every_k_chunks = flush_every_k_chunks
        self.inflight: dict[int, ChunkTrack] = {}  # ascending chunk id (insertion order)
        self.boundaries: list[int] = []  # ascending; b = first chunk after a sentinel
        self.cursor: SampleCursor | None = None
        self.batches = 0  # outputs delivered from this lane
        self._done = False  # the end of the lane's stream was delivered
        self.exhausted = False  # the source said so and the final sentinel went out
        self.replay: deque[ChunkTrack | FlushSentinel] = deque()  # restored, to replay
        self.evicted = 0
        self.next_chunk_id = 0
        #: :meth:`state` as last built, and the state but its cursor and batch count (with
        #: the ``inflight`` and ``boundaries`` lists in it), until :meth:`_moved` drops
        #: them: a checkpoint of a rank of thousands of lanes rebuilds only the lanes that
        #: moved since the last, and a delivery that evicts nothing only copies the second.
        self._state: dict[str, Any] | None = None
        self._base: dict[str, Any] | None = None
        self._held: list[list[Any]] = []

    @property
    def held(self) -> list[list[Any]]:
        """``[op, until, weights]`` entries: an ``ensure_mixture`` (operator ``op``) holds
        ``weights`` for this lane until the flush at chunk ``until`` (after a restore into
        an edited mixture); carried in the state while an in-flight chunk precedes it."""
        return self._held

    @held.setter
    def held(self, value: list[list[Any]]) -> None:
        self._held = value
        self._moved()

    @property
    def done(self) -> bool:
        """The end of the lane's stream was delivered."""
        return self._done

    @done.setter
    def done(self, value: bool) -> None:
        self._done = value
        self._moved()

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
        self._moved()  # the source moves on
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
        # Its checkpoint form now, while the chunk is in the cache (a chunk never changes;
        # see state()).
        self.inflight[chunk.chunk_id] = ChunkTrack(chunk, state=chunk.to_state())
        self.next_chunk_id += 1
        items = [chunk]
        if self.flush_every_k_chunks and (chunk.chunk_id + 1) % self.flush_every_k_chunks == 0:
            self.boundaries.append(chunk.chunk_id + 1)
            items.append(FlushSentinel(self.lane, chunk.chunk_id + 1))
        return items

    # ------------------------------------------------------------------ delivery
    def close(self, contributors: list[Contributor], docs: dict[int, int] | None = None) -> None:
        """Count delivered (or tombstoned) children; unknown chunks are a bug upstream. With
        ``docs``, each document whose last piece is among them adds 1 to ``docs[its
        component]``."""
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
            i = track.add_run(contributors, i, docs)

    def deliver(
        self,
        contributors: list[Contributor],
        last_cursor: SampleCursor | None,
        docs: dict[int, int] | None = None,
        tombstones: list[Contributor] | None = None,
    ) -> None:
        """A batch's ``contributors`` (their documents counted in ``docs``, when given)
        and the ``tombstones`` delivered with it (records dropped on the way: not counted)."""
        self._moved(cursor_only=True)  # (and evict() says so if chunks go)
        self.close(contributors, docs)
        if tombstones:
            self.close(tombstones)
        if last_cursor is not None:
            self.cursor = last_cursor
            self.batches += 1
        self.evict()

    def evict(self) -> None:
        evicted = self.evicted
        if self.mode == MONOTONE:
            self._evict_watermark()
        else:
            self._evict_epochs()
        if self.evicted != evicted:
            self._moved()

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
    def _moved(self, cursor_only: bool = False) -> None:
        """Something :meth:`state` shows changed (``cursor_only``: nothing but the cursor
        and the batch count): the one place the states built before are dropped. Every
        method that changes the lane calls it: :meth:`pull` dealing a chunk,
        :meth:`deliver`, :meth:`evict` when chunks went, :meth:`load`, and the ``done`` and
        ``held`` setters."""
        self._state = None
        if not cursor_only:
            self._base = None

    def state(self) -> dict[str, Any]:
        """The lane's checkpoint state (its keys: :mod:`zephon.tracking.schema`). Shared
        with later calls until the lane moves: read it, never change it in place.

        A checkpoint of a rank of thousands of lanes builds the state of every lane that
        moved since the last one, each lane's objects cold in the cache; so the parts that
        change with a chunk are made when the chunk is dealt, while they are hot: the
        chunk's checkpoint form (it never changes) and the work source's state (a
        ``StaticMixtureWorkSource`` makes it after each chunk). What is left here is the
        lane's dict of them, and a moved lane's copy with its cursor and batch count."""
        state = self._state
        if state is None:
            base = self._base
            if base is None:
                base = self._base = self._base_state()
            state = self._state = base.copy()
            state[CURSOR] = None if self.cursor is None else list(self.cursor[1:])
            state[BATCHES] = self.batches
        return state

    def _base_state(self) -> dict[str, Any]:
        """:meth:`state` with a placeholder cursor and batch count."""
        inflight = self.inflight
        lo = next(iter(inflight), None)
        floor = lo if lo is not None else self.next_chunk_id
        base = {
            LANE: self.lane,
            INFLIGHT: [t.to_state() for t in inflight.values()],
            BOUNDARIES: [b for b in self.boundaries if b > floor or (lo is None and b == floor)],
            SOURCE: self.source.state_dict(),
            CURSOR: None,
            BATCHES: 0,
            DONE: self._done,
            NEXT_CHUNK_ID: self.next_chunk_id,
        }
        held = [h for h in self._held if lo is not None and lo < h[1]] if self._held else None
        if held:  # only while a replay would need it; absent otherwise
            base[HELD] = held
        return base

    def load(self, state: dict[str, Any]) -> int:
        """Restore from :meth:`state`; returns how many chunks phase 1 will replay.

        Raises:
            CheckpointError: the state is malformed (a key missing, a value of the wrong
                type or out of range, chunks, boundaries or cursor inconsistent with each
                other or with the work source); the message starts with the lane.
        """
        self._moved()  # (a load that fails may have moved the source)
        try:
            return self._load(state)
        except CheckpointError as e:
            raise CheckpointError(f"lane {self.lane}: {e}") from e

    def _load(self, state: dict[str, Any]) -> int:
        checked_keys("the lane state", state, LANE_KEYS)
        raw_chunks = state[INFLIGHT]
        if not isinstance(raw_chunks, list):
            raise CheckpointError(f"inflight must be a list of chunks; got {shown(raw_chunks)}")
        lengths = getattr(self.source, "lengths", None)
        if not (isinstance(lengths, tuple | list) and all(isinstance(n, int) for n in lengths)):
            lengths = None
        chunks = [ChunkTrack.stored(c) for c in raw_chunks]
        if lengths is not None and chunks:
            check_pointers([c.to_state() for c in chunks], lengths)
        next_id = checked_count("next_chunk_id", state[NEXT_CHUNK_ID])
        batches = checked_count("batches", state[BATCHES])
        done = state[DONE]
        if not isinstance(done, bool):
            raise CheckpointError(f"done must be a bool; got {shown(done)}")
        ids = [c.chunk_id for c in chunks]
        contiguous = not ids or (
            next_id - ids[0] == len(ids) and ids == list(range(ids[0], next_id))
        )
        if any(c.lane != self.lane for c in chunks) or not contiguous:
            raise CheckpointError(
                f"in-flight chunks must be this lane's and contiguous up to "
                f"next_chunk_id={next_id}; got ids {ids} of lanes "
                f"{sorted({c.lane for c in chunks})}"
            )
        boundaries = checked_boundaries(state[BOUNDARIES], ids, next_id, self.flush_every_k_chunks)
        cursor = checked_cursor(state[CURSOR], self.lane, {c.chunk_id: c.size for c in chunks})
        try:
            self.source.load_state_dict(state[SOURCE])
        except CheckpointError as e:
            raise CheckpointError(f"work source state: {e}") from e
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            raise CheckpointError(f"malformed work source state ({e!r})") from e
        source_next = getattr(self.source, "next_chunk_id", None)
        if isinstance(source_next, int) and source_next != next_id:
            raise CheckpointError(
                f"the work source state is at chunk {source_next} but the lane's "
                f"next_chunk_id is {next_id}; the checkpoint is inconsistent"
            )
        self.held = checked_holds(state)
        self.batches = batches
        self.done = done
        self.cursor = cursor
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
