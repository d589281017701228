"""The operator contract: ``process``, ``flush(reset, lane_id)``, ``pending(lane_id)``.

Every operator keeps all of its per-lane state keyed by ``lane_id`` so one instance can serve
every lane a process runs. History-dependent operators must return to their construction
state on ``flush(reset=True, ...)``; the runner checks ``pending(lane_id) == 0`` afterwards and
raises :class:`~zephon.errors.ContractViolation` naming the operator otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon._fingerprint import call_parameters
from zephon.records import Contributor, FlushSentinel, Record, Tombstone

Output = Record | Tombstone


@dataclass(frozen=True)
class OpTraits:
    """What the compiler needs to know about an operator.

    Args:
        preserves_cursor_order: records leave in the order (of cursors) they came in. Any
            operator that reorders forces epoch-based eviction and flush sentinels.
        stateful: the operator keeps history between records (bins, buffers, deficits);
            such operators run in ``stream_items`` mode and are flushed at every sentinel.
    """

    preserves_cursor_order: bool
    stateful: bool


class OpStats:
    """An operator's counters in a chain runner: records in and out, seconds spent."""

    __slots__ = ("records_in", "records_out", "seconds")

    def __init__(self) -> None:
        self.records_in = 0
        self.records_out = 0
        self.seconds = 0.0


@dataclass
class PipelineContext:
    """What an operator may learn about the pipeline it is compiled into."""

    datasets: Sequence[Any] = ()
    weights: Sequence[float] | None = None
    seed: int = 0
    num_components: int = 0
    names: Sequence[str] = ()


class Operator:
    """Base class for built-in and custom operators.

    Subclasses set ``traits`` and ``name`` and implement :meth:`process`; history-dependent
    ones also implement :meth:`flush` and :meth:`pending`. ``parallelism`` > 1 lets an
    order-preserving stateless operator run on a thread pool (results put back in order).
    """

    traits: OpTraits = OpTraits(preserves_cursor_order=True, stateful=False)
    name: str = "op"
    parallelism: int = 1
    #: Only ``batch`` may hold records across an epoch boundary (it sits after the replay
    #: filter, so the checkpoint cut always falls between whole batches).
    stalls_at_boundaries: bool = False

    def bind(self, ctx: PipelineContext) -> None:
        """Called once at compile time, before any record."""

    def process(self, record: Record) -> Iterable[Output]:
        raise NotImplementedError(f"{type(self).__name__} must implement process(record)")

    def process_batch(self, records: list[Record]) -> list[Output]:
        """A run of records in arrival order (a chunk's, or those between two flush
        sentinels); the same as :meth:`process` on each in turn. Override to batch I/O or to
        save per-record calls."""
        out: list[Output] = []
        for r in records:
            out.extend(self.process(r))
        return out

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        """Emit everything pending for ``lane_id``; with ``reset`` forget the lane's state."""
        return ()

    def pending(self, lane_id: int) -> int:
        """How many records (or fragments) the operator still holds for ``lane_id``."""
        return 0

    def on_sentinel(self, sentinel: FlushSentinel) -> None:
        """Sees every flush sentinel before :meth:`flush` (used by the replay filter)."""

    def fresh(self) -> Operator:
        """A copy with no per-lane state, so two pipelines never share accumulators."""
        return copy.deepcopy(self)

    def fingerprint(self) -> str:
        """A stable description of the definition (parameters, not state)."""
        return repr(self)

    def fingerprint_parts(self) -> dict[str, str]:
        """:meth:`fingerprint` by parameter, so that a checkpoint mismatch can name the one
        that differs. The default reads a fingerprint written as ``Name(a=1, b=2)``; any
        other text is one part, ``definition``."""
        return call_parameters(self.fingerprint())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LaneStateOperator(Operator):
    """An operator whose state lives in ``self._lanes[lane_id]``; ``fresh`` shares the rest."""

    def __init__(self) -> None:
        self._lanes: dict[int, Any] = {}

    def fresh(self) -> Operator:
        clone = copy.copy(self)
        clone._lanes = {}
        return clone


def check_fits(what: str, feature: str, value: Any, dtype: np.dtype) -> None:
    """Raises unless ``dtype`` holds ``value`` exactly: the one check of every pad, BOS and
    ignore value an operator writes into a feature. A float is never taken for an integer or
    boolean feature, and a boolean feature takes only 0, 1, False and True.

    ``what`` names the operator call (``"pack(bos_id=70000)"``) for the error."""
    dtype = np.dtype(dtype)
    try:
        fits = np.can_cast(np.min_scalar_type(value), dtype) or bool(
            np.asarray(value).astype(dtype) == value
            and not (isinstance(value, float) and dtype.kind in "biu")
        )
    except (TypeError, ValueError, OverflowError):
        fits = False
    if not fits:
        raise ValueError(
            f"{what} does not fit feature {feature!r} of dtype {dtype}: give a value that "
            f"{dtype} holds exactly, or cast the feature first (e.g. in .map())"
        )


def component_text(component: int, names: Sequence[str] = ()) -> str:
    """A component as an error names it: ``component 'web' (0)``, or ``component 0`` where
    it has no name of its own (a list of datasets names them ``"0"``, ``"1"``, ...)."""
    name = names[component] if 0 <= component < len(names) else None
    if name is None or name == str(component):
        return f"component {component}"
    return f"component {name!r} ({component})"


def sample_text(
    lane: int, first: Contributor, components: Iterable[int], names: Sequence[str] = ()
) -> str:
    """The sample an error is about, by what a record carries: its component(s) and its
    cursor (``first``, the record's first piece, in ``lane``), e.g. ``the sample of
    component 'web' (0) at lane 0, chunk 3, offset 5``. (A record does not carry its
    sample's dataset index; the chunk and offset locate it in the lane's stream.)"""
    comps = sorted(components)
    at = f"lane {lane}, chunk {first[0]}, offset {first[1]}"
    if first[2] or not first[3]:
        at += f", piece {first[2]}"
    if len(comps) == 1:
        return f"the sample of {component_text(comps[0], names)} at {at}"
    parts = ", ".join(component_text(c, names) for c in comps)
    return f"the record of {parts} whose first sample is at {at}"


def record_text(record: Any, names: Sequence[str] = ()) -> str:
    """:func:`sample_text` of ``record`` (any record: a packed row is named by its first
    piece and its components)."""
    try:
        cursor = record.cursor
        first = record.contributors[0]
        comps = list(record.component_tokens)
    except (AttributeError, IndexError):
        return "a record"
    return sample_text(cursor.lane, first, comps, names)


def data_text(data: Any) -> str:
    """What a record's data is, for an error about a feature it lacks: its features (a
    dict's keys), or its type (``None`` said as such: a ``map`` function that returned
    nothing)."""
    if isinstance(data, dict):
        return f"its features: {sorted(map(str, data))}"
    if data is None:
        return "its data is None"
    return f"its data is a {type(data).__name__}, not a dict of features"
