"""``fetch``: resolve sample pointers to raw samples, batched per source."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from zephon.chunks import SamplePointer
from zephon.operators.base import Operator, OpTraits, Output, PipelineContext
from zephon.records import Record
from zephon.sources._fs import reads_remote, thread_reads
from zephon.sources.reading import read_many, read_token_spans

#: Held while a read's counts are added (a module lock: operators are pickled to workers).
_COUNTING = threading.Lock()


class Fetch(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "fetch"

    def __init__(self, parallelism: int = 1) -> None:
        self.parallelism = parallelism
        self._datasets: Sequence[Any] = ()
        #: Reads retried after transient I/O failures, per lane (``stats()["io_retries"]``).
        self.io_retries: dict[int, int] = {}
        #: Per lane, per component read: ``[bytes, requests, retries]`` of the range reads
        #: its dataset made (``stats()["reads"]``; see :meth:`lane_reads`).
        self.reads: dict[int, dict[int, list[int]]] = {}
        #: Per lane, what :meth:`lane_reads` returns, made when first asked for after the
        #: lane's counts changed (a lane's counts are asked for after every run).
        self._lane_reads: dict[int, tuple[tuple[int, int, int, int], ...]] = {}
        #: Some dataset reads from object storage: a worker reads chunks ahead.
        self.remote = False
        #: The components' names, for the error that names a sample it could not read.
        self._names: tuple[str, ...] = ()

    def bind(self, ctx: PipelineContext) -> None:
        self._datasets = ctx.datasets
        self._names = tuple(ctx.names)
        self.remote = any(reads_remote(ds) for ds in self._datasets)
        if not self._datasets:
            raise ValueError(
                "fetch needs the work source's datasets; the work source exposes none "
                "(give it a `datasets` attribute, or drop .fetch() and resolve pointers in .map)"
            )

    def process(self, record: Record) -> Iterable[Output]:
        ptr: SamplePointer = record.data
        return (record.replace(self._read([ptr[0]], [ptr[1]], read_many, record.lane)[0]),)

    def process_batch(self, records: list[Record]) -> list[Output]:
        pointers = [r.data for r in records]
        lane = records[0].lane if records else None
        samples = self.read([c for c, _ in pointers], [i for _, i in pointers], lane)
        return [r.replace(s) for r, s in zip(records, samples, strict=True)]

    def read(
        self, comps: list[int], indices: list[int], lane: int | None = None, spans: bool = False
    ) -> list[Any]:
        """Sample ``k`` is row ``indices[k]`` of dataset ``comps[k]``; one read per dataset
        (a file source reads a batch with concurrent, coalesced range requests). The bytes,
        requests and retries of the range reads each dataset made on this thread are
        counted for ``lane`` (:meth:`lane_reads`). With ``spans``, a dataset that offers
        token spans gives them instead of its samples
        (:func:`~zephon.sources.reading.read_token_spans`: only for the plan's fused
        stage that takes them)."""
        return self._read(comps, indices, read_token_spans if spans else read_many, lane)

    def lane_reads(self, lane: int) -> tuple[tuple[int, int, int, int], ...]:
        """``(component, bytes, requests, retries)`` per component that ``lane`` read
        from, since this operator started (what a lane's counters carry to the parent):
        the same tuple until the lane's counts change."""
        got = self._lane_reads.get(lane)
        if got is None:
            with _COUNTING:
                per = self.reads.get(lane)
                got = () if per is None else tuple((c, *v) for c, v in sorted(per.items()))  # type: ignore[misc]
                self._lane_reads[lane] = got
        return got

    def _read(
        self, comps: list[int], indices: list[int], read: Any = read_many, lane: int | None = None
    ) -> list[Any]:
        if comps and comps.count(comps[0]) == len(comps):
            return self._read_one(read, comps[0], indices, lane)
        by_component: dict[int, list[int]] = {}
        for pos, c in enumerate(comps):
            by_component.setdefault(c, []).append(pos)
        samples: list[Any] = [None] * len(comps)
        for c, positions in by_component.items():
            got = self._read_one(read, c, [indices[p] for p in positions], lane)
            for p, sample in zip(positions, got, strict=True):
                samples[p] = sample
        return samples

    def _read_one(
        self, read: Any, c: int, indices: list[int], lane: int | None = None
    ) -> list[Any]:
        """Rows ``indices`` of dataset ``c``, its reads counted for ``lane``. The dataset's
        own ``IndexError`` or ``KeyError`` is raised again, of its type, naming the
        component and the index."""
        ds = self._datasets[c]
        before = thread_reads()
        try:
            return read(ds, indices)  # type: ignore[no-any-return]
        except (IndexError, KeyError) as e:
            raise _named(e, self._where(ds, c, indices, e)) from e
        finally:
            if lane is not None:
                after = thread_reads()
                if after != before:
                    self._count(lane, c, before, after)

    def _count(
        self, lane: int, c: int, before: tuple[int, int, int], after: tuple[int, int, int]
    ) -> None:
        """Adds the reads between ``before`` and ``after`` (:func:`thread_reads`) to
        ``lane``'s and component ``c``'s counts."""
        with _COUNTING:  # reads of one lane may run on several threads (parallelism)
            self._lane_reads.pop(lane, None)
            row = self.reads.setdefault(lane, {}).setdefault(c, [0, 0, 0])
            row[0] += after[0] - before[0]
            row[1] += after[1] - before[1]
            retried = after[2] - before[2]
            if retried:
                row[2] += retried
                self.io_retries[lane] = self.io_retries.get(lane, 0) + retried

    def _where(self, ds: Any, c: int, indices: list[int], e: BaseException) -> str:
        """The sample of ``indices`` whose read raised ``e`` (of ``ds``, component ``c``),
        in words: found by reading them one at a time where the dataset is local (this runs
        only once a read has failed), else all of them."""
        bad = None
        if len(indices) == 1:
            bad = indices[0]
        elif not reads_remote(ds):
            for i in indices:
                try:
                    ds[i]
                except type(e):
                    bad = i
                    break
                except Exception:  # noqa: BLE001 - another failure: not the one looked for
                    continue
        if bad is not None:
            where = f"sample {SamplePointer(c, bad)}"
        else:
            shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
            where = f"one of indices [{shown}] (read together)"
        try:
            size = f"len(ds) says {len(ds)}"
        except Exception:  # noqa: BLE001 - the message must not fail
            size = "its len() failed"
        name = self._names[c] if c < len(self._names) else str(c)
        return (
            f"fetch: dataset {name!r} (component {c}, a {type(ds).__name__}) raised {e!r} "
            f"reading {where}; a dataset must give ds[i] (and ds.read(indices)) for every "
            f"0 <= i < len(ds) ({size}): fix its __getitem__, or its __len__ if it counts "
            "samples it does not have"
        )

    def fresh(self) -> Operator:
        # A shallow copy (a deep one would duplicate the user's datasets) whose counters
        # start at zero: two pipelines built from one chain count their own reads.
        clone = copy.copy(self)
        clone.io_retries = {}
        clone.reads = {}
        clone._lane_reads = {}
        return clone

    def fingerprint(self) -> str:
        return "Fetch()"  # parallelism changes speed, never results

    def __repr__(self) -> str:
        return f"Fetch(parallelism={self.parallelism})"


def _named(e: IndexError | KeyError, message: str) -> BaseException:
    """``e``'s type (so ``except KeyError`` still catches it) with ``message``; the
    builtin it derives from where its own class cannot be made with a message."""
    try:
        new = type(e)(message)
    except Exception:  # noqa: BLE001 - a subclass with another constructor
        new = (KeyError if isinstance(e, KeyError) else IndexError)(message)
    return new
