"""Restoring a checkpoint into an edited mixture: ``restore(state, allow_mixture_change=True)``.

The contract:

* Everything but the mixture must match the checkpoint's fingerprint: operators and their
  parameters, ``canonical_replicas``, the flush cadence, and the work source's seed,
  shuffle and chunk size. The mixture is the components (names, datasets, weights,
  schedule, ``weight_unit``, lengths, ``num_epochs``, ``on_exhausted``) and the weights of
  ``ensure_mixture``.
* Components are matched by name, never by position.
* In-flight chunks replay exactly as they were made (same samples, same order, same
  seeds), so the batches up to the checkpoint's cut come out as before and the replay
  filter drops exactly what was delivered: nothing is lost or repeated. An
  ``ensure_mixture`` keeps the old weights for the epochs being replayed (until the lane's
  next flush), so it reorders them as it did.
* New chunks follow the new weights, from the lane's progress at the checkpoint (a
  schedule is looked up there); the interleave starts afresh.
* A dataset that stays (same name, same content identity and length) keeps its cursor: no
  sample of its current epoch is repeated or skipped.
* A new name starts at its beginning. So does a name whose dataset's content identity or
  length changed: it is treated as new, and the restore says so (a ``UserWarning``, and the
  returned :class:`MixtureChange`).
* A dataset left out of the mixture is dropped with its cursor, which is only allowed when
  none of its samples is in flight in this rank's lanes; otherwise the restore refuses and
  names it: keep it with weight 0 (it keeps its cursor and is never drawn), and drop it at
  a later restore (``zephon inspect`` shows what is in flight per component). Likewise a
  dataset whose content changed may not have samples in flight.
* With ``ensure_mixture``, the components that stay must keep their relative order (its
  ties go to the lower component).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon._fingerprint import comparable_parts
from zephon.errors import CheckpointError
from zephon.tracking.schema import INFLIGHT

__all__ = ["MIXTURE_SOURCE_KEYS", "MixtureChange", "is_mixture_part", "plan_change"]

#: ``source.<key>`` fingerprint parts that belong to the mixture.
MIXTURE_SOURCE_KEYS = frozenset(
    {"weight_unit", "token_lengths", "schedule", "num_epochs", "on_exhausted"}
)


def is_mixture_part(key: str, ensure_ops: Sequence[int]) -> bool:
    """Whether fingerprint part ``key`` describes the mixture (so may differ)."""
    if key == "components" or key.startswith("component."):
        return True
    head, _, rest = key.partition(".")
    if head == "source":
        return rest in MIXTURE_SOURCE_KEYS
    if head == "op":
        i, _, param = rest.partition(".")
        return param == "weights" and i.isdigit() and int(i) in ensure_ops
    return False


@dataclass(frozen=True)
class MixtureChange:
    """What a restore with ``allow_mixture_change=True`` did to the mixture, by name.

    Attributes:
        kept: datasets that stay, with their cursors.
        added: new names; they start at their beginning.
        replaced: names whose dataset's content identity (or length) changed; treated as
            new, they start at their beginning.
        removed: names no longer in the mixture (none of their samples was in flight).
        reweighted: whether the weights (or their schedule, unit or end policy) changed.

    Example::

        change = pipe.restore(zp.load("loader.zph"), allow_mixture_change=True)
        if change is not None:
            print(change)  # mixture change: kept ['web', 'code']; added ['math']
            assert "web" in change.kept
    """

    kept: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    reweighted: bool = False
    old_names: tuple[str, ...] = field(default=(), repr=False)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.replaced or self.removed or self.reweighted)

    def __str__(self) -> str:
        parts = [f"kept {list(self.kept)}"]
        for label, names in (
            ("added", self.added),
            ("replaced (new content, from its beginning)", self.replaced),
            ("removed", self.removed),
        ):
            if names:
                parts.append(f"{label} {list(names)}")
        if self.reweighted:
            parts.append("weights changed")
        return "mixture change: " + "; ".join(parts)


def _value(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def _components(parts: Mapping[str, str]) -> list[dict[str, str]]:
    count = parts.get("components", "")
    n = int(count) if count.isdigit() else 0
    out: list[dict[str, str]] = [{} for _ in range(n)]
    for key, text in parts.items():
        if not key.startswith("component."):
            continue
        c, _, prop = key[len("component.") :].partition(".")
        if c.isdigit() and int(c) < n:
            out[int(c)][prop] = text
    return out


def _content(props: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in props.items() if k == "length" or k.startswith("identity.")}


def plan_change(
    saved: Mapping[str, str], mine: Mapping[str, str]
) -> tuple[MixtureChange, dict[str, str]]:
    """Compare the mixture of a checkpoint's fingerprint parts with this pipeline's.

    Returns:
        The change, and the map new name -> old name of the datasets that stay.

    Raises:
        CheckpointError: the checkpoint's parts do not name its components.
    """
    saved, mine = comparable_parts(dict(saved), dict(mine))
    old, new = _components(saved), _components(mine)
    old_names = [_value(p.get("name")) for p in old]
    new_names = [_value(p.get("name")) for p in new]
    if not old or any(not isinstance(n, str) for n in old_names):
        raise CheckpointError(
            "allow_mixture_change=True needs the checkpoint to name its components (its "
            f"fingerprint parts have {saved.get('components')!r} components, names "
            f"{old_names[:8]}); restore it without changing the mixture"
        )
    by_old = {n: c for c, n in enumerate(old_names)}
    kept: dict[str, str] = {}
    added, replaced = [], []
    for c, name in enumerate(new_names):
        if name not in by_old:
            added.append(name)
        elif _content(old[by_old[name]]) == _content(new[c]):
            kept[name] = name
        else:
            replaced.append(name)
    removed = [n for n in old_names if n not in new_names]
    weights_then = {n: _value(old[c].get("weight")) for c, n in enumerate(old_names)}
    weights_now = {n: _value(new[c].get("weight")) for c, n in enumerate(new_names)}
    policy = [k for k in mine if k.startswith("source.")] + [
        k for k in saved if k.startswith("source.")
    ]
    reweighted = weights_then != weights_now or any(
        saved.get(k) != mine.get(k) for k in policy if k.partition(".")[2] in MIXTURE_SOURCE_KEYS
    )
    change = MixtureChange(
        kept=tuple(kept),
        added=tuple(added),
        replaced=tuple(replaced),
        removed=tuple(removed),
        reweighted=reweighted,
        old_names=tuple(old_names),
    )
    return change, kept


def inflight_components(lane_state: Mapping[str, Any]) -> np.ndarray:
    """Component ids of every in-flight pointer of a lane state (checked by the tracker
    later; here only read)."""
    chunks = lane_state.get(INFLIGHT)
    if not isinstance(chunks, list):
        return np.zeros(0, dtype=np.int32)
    parts = []
    for ch in chunks:
        comps = ch.get("components") if isinstance(ch, Mapping) else None
        if isinstance(comps, bytes) and len(comps) % 4 == 0:
            parts.append(np.frombuffer(comps, dtype="<i4"))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def check_inflight(
    change: MixtureChange, lanes: Mapping[int, Mapping[str, Any]], new_names: Sequence[str]
) -> None:
    """Refuse when samples of a removed or replaced dataset are in flight.

    Raises:
        CheckpointError: naming each such dataset, its in-flight samples and lanes, and the
            fix.
    """
    bad = {
        n: ("not in the new mixture" if n in change.removed else "holds other data now")
        for n in (*change.removed, *change.replaced)
    }
    if not bad:
        return
    index = {n: c for c, n in enumerate(change.old_names)}
    found: dict[str, tuple[int, list[int]]] = {}
    for lane, ls in sorted(lanes.items()):
        comps = inflight_components(ls)
        for name in bad:
            hits = int(np.count_nonzero(comps == index[name]))
            if hits:
                count, where = found.get(name, (0, []))
                found[name] = (count + hits, [*where, lane])
    if found:
        text = "; ".join(
            f"{name!r} ({bad[name]}): {count} samples in flight in lanes {where}"
            for name, (count, where) in found.items()
        )
        raise CheckpointError(
            f"cannot restore into this mixture: {text}. In-flight chunks replay as they were "
            "made, so their datasets must still be there with the same data: keep each with "
            "weight 0 (and its data unchanged) for this restore, and drop it at a later one "
            "(`zephon inspect` shows what is in flight per component)"
        )


def remap_inflight(lane_state: Mapping[str, Any], old_to_new: np.ndarray) -> dict[str, Any]:
    """The lane state with its in-flight chunks' component ids in the new order."""
    out = dict(lane_state)
    chunks = lane_state.get(INFLIGHT)
    if not isinstance(chunks, list):
        return out
    remapped = []
    for ch in chunks:
        comps = ch.get("components") if isinstance(ch, Mapping) else None
        if isinstance(comps, bytes) and len(comps) % 4 == 0:
            ids = np.frombuffer(comps, dtype="<i4")
            if ids.size and (ids.min() < 0 or ids.max() >= old_to_new.size):
                remapped.append(ch)  # malformed: the tracker's checks name it
                continue
            ch = {**ch, "components": old_to_new[ids].astype("<i4").tobytes()}
        remapped.append(ch)
    out[INFLIGHT] = remapped
    return out
