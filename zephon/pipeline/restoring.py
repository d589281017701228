"""What ``Pipeline.restore`` checks and plans before the engine loads the lanes: that
iteration has not begun, the header, the fingerprint (naming the part that differs; only
``batch``'s parameters may differ, or the mixture with ``allow_mixture_change``), the lane
layout, the holds of ``ensure_mixture``, an edited mixture's translation of the lane
states, and whose turn the consumer's next batch is."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from zephon._fingerprint import describe_differences, expand_parts
from zephon.checkpoint.share import Share
from zephon.checkpoint.state import FINGERPRINT_PARTS, check_header, checked_layout
from zephon.errors import CheckpointError
from zephon.operators.ensure_mixture import EnsureMixture
from zephon.tracking.checks import checked_holds
from zephon.tracking.schema import HELD, NEXT_CHUNK_ID, SOURCE
from zephon.work_sources.mixture_change import (
    MixtureChange,
    check_inflight,
    is_mixture_part,
    plan_change,
    remap_inflight,
)


def plan_restore(
    pipe: Any, state: dict[str, Any], allow_mixture_change: bool
) -> tuple[dict[int, Any], dict[int, list[list[Any]]], int | None, MixtureChange | None]:
    """``state`` checked against ``pipe``: the lane states by lane, each lane's holds, the
    lane whose turn is next (None: another layout, the engine picks the least advanced),
    and the mixture change (None when the mixture is the checkpoint's). Raises the
    CheckpointError that says what is wrong (``pipe``'s iteration began, ``state`` is not
    a dict, or it does not fit ``pipe``); nothing of ``pipe`` changes."""
    if pipe._engine is not None and pipe._engine.started:
        raise CheckpointError(
            "restore() after iteration began; build a fresh pipeline and restore into it"
        )
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict; got {type(state).__name__}")
    check_header(state)
    if state.get("canonical_replicas") != pipe.canonical_replicas:
        raise CheckpointError(
            f"checkpoint has canonical_replicas={state.get('canonical_replicas')!r} but this "
            f"pipeline has {pipe.canonical_replicas}; lanes are fixed for a training run"
        )
    planned = check_fingerprint(pipe, state, allow_mixture_change)
    by_lane, next_lanes, saved_dp_size = checked_layout(state)
    missing = [lane for lane in pipe.lanes if lane not in by_lane]
    if missing and isinstance(state, Share):
        # A follower's share of a round, restored on lanes it does not hold: the whole
        # merged state is still in the round's store.
        state = state.merged()
        by_lane, next_lanes, saved_dp_size = checked_layout(state)
        missing = [lane for lane in pipe.lanes if lane not in by_lane]
    if missing and isinstance(state.get("share"), dict):
        share = state["share"]
        raise CheckpointError(
            f"checkpoint is rank {share.get('rank')}'s share of merged round "
            f"{share.get('round_id')} (its own {len(by_lane)} of "
            f"{share.get('lanes_total')} lanes) and has no state for lanes {missing} that "
            "this rank owns; restore the merged state that rank 0 returned (or saved) "
            "from that round, which holds every lane"
        )
    if missing:
        raise CheckpointError(
            f"checkpoint has no state for lanes {missing} that this rank owns; restore a "
            "merged (all-rank) checkpoint: set aggregate_dir= or aggregate_store="
        )
    holds: dict[int, list[list[Any]]] = {}
    for lane in pipe.lanes:
        if isinstance(by_lane[lane], dict):
            try:
                holds[lane] = checked_holds(by_lane[lane])
            except CheckpointError as e:
                raise CheckpointError(f"lane {lane}: {e}") from e
    change = None
    if planned is not None:
        change, kept = planned
        by_lane, holds = change_mixture(pipe, state, change, kept, by_lane, holds)
    for i, op in enumerate(pipe._compiled().ops):
        if isinstance(op, EnsureMixture):  # (replacing what an earlier restore held)
            op.hold(
                {
                    lane: [(until, w) for o, until, w in entries if o == i]
                    for lane, entries in holds.items()
                }
            )
    topo = pipe._topology
    same_layout = saved_dp_size == topo.dp_size
    if same_layout and topo.dp_rank not in next_lanes:
        raise CheckpointError(
            f"malformed checkpoint: round_robin next_lanes has no entry for DP rank "
            f"{topo.dp_rank} (it has {sorted(next_lanes)}) though dp_size={saved_dp_size} "
            "is this pipeline's"
        )
    if same_layout and next_lanes[topo.dp_rank] not in pipe.lanes:
        raise CheckpointError(
            f"malformed checkpoint: round_robin next_lanes gives DP rank {topo.dp_rank} "
            f"lane {next_lanes[topo.dp_rank]}, which it does not own (its lanes: {pipe.lanes})"
        )
    return by_lane, holds, next_lanes[topo.dp_rank] if same_layout else None, change


def change_mixture(
    pipe: Any,
    state: dict[str, Any],
    change: MixtureChange,
    kept: dict[str, str],
    by_lane: dict[int, Any],
    holds: dict[int, list[list[Any]]],
) -> tuple[dict[int, Any], dict[int, list[list[Any]]]]:
    """The lane states of this rank translated into the new mixture (see
    :mod:`zephon.work_sources.mixture_change`), and what each ``ensure_mixture`` must hold
    per lane while the in-flight epochs replay: ``[op, until, weights]`` entries in the
    new component order."""
    source = pipe.source
    if not callable(getattr(source, "remapped_state", None)):
        raise CheckpointError(
            f"allow_mixture_change=True needs a work source that can take a state into "
            f"another mixture (StaticMixtureWorkSource); this one is a {type(source).__name__}"
        )
    new_names = list(source.names)
    old_names = list(change.old_names)
    mine = {lane: by_lane[lane] for lane in pipe.lanes}
    check_inflight(change, mine, new_names)
    old_index = {n: c for c, n in enumerate(old_names)}
    old_to_new = np.full(len(old_names), -1, dtype=np.int64)
    for c, name in enumerate(new_names):
        if name in kept:
            old_to_new[old_index[kept[name]]] = c

    def remapped(weights: list[float]) -> list[float]:
        if len(weights) != len(old_names):
            raise CheckpointError(
                f"a held entry has {len(weights)} weights for the checkpoint's "
                f"{len(old_names)} components"
            )
        return [0.0 if n not in kept else weights[old_index[kept[n]]] for n in new_names]

    plan = pipe._compiled()
    ensure = [(i, op) for i, op in enumerate(plan.ops) if isinstance(op, EnsureMixture)]
    if ensure:
        order = [old_index[kept[n]] for n in new_names if n in kept]
        if order != sorted(order):
            raise CheckpointError(
                "allow_mixture_change=True with ensure_mixture: the datasets that stay must "
                f"keep their relative order (was {[old_names[c] for c in sorted(order)]}, now "
                f"{[old_names[c] for c in order]}), because ensure_mixture breaks ties by "
                "component order and the replayed epochs must come out as they did; put "
                "them back in that order (new datasets may go anywhere)"
            )
    saved_parts = state.get(FINGERPRINT_PARTS) or {}
    saved_parts = expand_parts(saved_parts) if isinstance(saved_parts, dict) else {}
    k = plan.flush_every_k_chunks
    new_holds: dict[int, list[list[Any]]] = {}
    for lane, ls in mine.items():
        entries = [[o, until, remapped(w)] for o, until, w in holds.get(lane, [])]
        next_id = ls.get(NEXT_CHUNK_ID) if isinstance(ls, dict) else None
        if isinstance(next_id, int) and next_id > 0 and k > 0:
            until = -(-next_id // k) * k  # the flush that ends the lane's last epoch
            for i, op in ensure:
                if any(o == i and u >= until for o, u, _ in entries):
                    continue  # an earlier hold already covers that epoch
                old_w = _old_ensure_weights(saved_parts, i, op, len(old_names))
                entries.append([i, until, remapped(old_w)])
        new_holds[lane] = sorted(entries, key=lambda e: (e[0], e[1]))
    out = dict(by_lane)
    for lane, ls in mine.items():
        if not isinstance(ls, dict):
            continue  # malformed: the tracker's checks name it
        try:
            translated = source.for_lane(lane, pipe.canonical_replicas).remapped_state(
                ls.get(SOURCE), old_names, kept
            )
        except CheckpointError as e:
            raise CheckpointError(f"lane {lane}: work source state: {e}") from e
        lane_state = {**remap_inflight(ls, old_to_new), SOURCE: translated}
        lane_state.pop(HELD, None)
        out[lane] = lane_state
    if change.replaced:
        warnings.warn(
            f"restore: the data of {list(change.replaced)} is not what the checkpoint was "
            "made with (another content identity or length): they are treated as new "
            "datasets and start at their beginning",
            UserWarning,
            stacklevel=3,
        )
    return out, new_holds


def check_fingerprint(
    pipe: Any, state: dict[str, Any], allow_mixture_change: bool = False
) -> tuple[MixtureChange, dict[str, str]] | None:
    mine, parts, legacy = pipe._fingerprints()
    theirs = state.get("fingerprint")
    if theirs == mine:
        return None
    saved_parts = state.get(FINGERPRINT_PARTS)
    if saved_parts is None and theirs == legacy:
        warnings.warn(
            "the checkpoint predates dataset content identities (it has no "
            f"{FINGERPRINT_PARTS!r}): its pipeline definition matches this one, but "
            "whether the datasets hold the same data cannot be checked. Checkpoints made "
            "from now on carry it",
            UserWarning,
            stacklevel=3,
        )
        return None
    head = f"checkpoint fingerprint {str(theirs)[:12]}… does not match this pipeline's {mine[:12]}…"
    if saved_parts is None:
        raise CheckpointError(
            f"{head}: the pipeline definition (source, operators or their parameters, "
            "flush_every_k_chunks) differs from the one that was checkpointed"
        )
    if not isinstance(saved_parts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in saved_parts.items()
    ):
        raise CheckpointError(
            f"{head}, and the checkpoint's {FINGERPRINT_PARTS!r} is malformed (a "
            f"{type(saved_parts).__name__}, expected a dict of str to str), so what differs "
            "cannot be said; restore a checkpoint written by zephon.save"
        )
    if saved_parts != parts and _without_batch(saved_parts) == _without_batch(parts):
        # Only batch's parameters differ: the cut is on records, before batch, so the
        # record stream goes on exactly and is batched the new way.
        return None
    saved_parts = _without_batch(saved_parts)
    parts = _without_batch(parts)
    if allow_mixture_change:
        ensure = [i for i, op in enumerate(pipe._compiled().ops) if isinstance(op, EnsureMixture)]
        outside = describe_differences(
            {k: v for k, v in saved_parts.items() if not is_mixture_part(k, ensure)},
            {k: v for k, v in parts.items() if not is_mixture_part(k, ensure)},
        )
        if outside:
            raise CheckpointError(
                f"{head}, and not only in the mixture (allow_mixture_change=True lets the "
                f"datasets and weights change, nothing else): {'; '.join(outside)}"
            )
        return plan_change(saved_parts, parts)
    differences = describe_differences(saved_parts, parts)
    if not differences:
        raise CheckpointError(
            f"{head}, though every part it records agrees: what differs is something the "
            "parts do not show (such as an operator's class behind the same name and "
            f"parameters), or the checkpoint's {FINGERPRINT_PARTS!r} was edited"
        )
    content = any("content identity" in d for d in differences)
    ensure = [i for i, op in enumerate(pipe._compiled().ops) if isinstance(op, EnsureMixture)]
    mixture_only = all(
        is_mixture_part(k, ensure)
        for k in set(saved_parts) | set(parts)
        if saved_parts.get(k) != parts.get(k)
    )
    raise CheckpointError(
        f"{head}: {'; '.join(differences)}. "
        + (
            "Only the mixture differs (its datasets or weights): if you changed it on "
            "purpose, restore with pipe.restore(state, allow_mixture_change=True) (kept "
            "datasets go on where they stopped, new ones start at their beginning); "
            "otherwise restore into the pipeline (and datasets) that made the checkpoint"
            if mixture_only
            else "Restore into the pipeline (and datasets) that made the checkpoint"
        )
        + (
            "; a content identity differs when a dataset holds other data (another file, "
            "or the same one edited)"
            if content
            else ""
        )
    )


def _old_ensure_weights(parts: Any, i: int, op: EnsureMixture, count: int) -> list[float]:
    """The weights operator ``i`` (an ``ensure_mixture``) had in the checkpoint's pipeline,
    by its old component order: from its fingerprint part, or, when that was too long to
    keep and the operator follows the work source, from the old components' weights."""
    import ast

    def literal(text: Any) -> Any:
        try:
            return ast.literal_eval(text) if isinstance(text, str) else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None

    value = literal(parts.get(f"op.{i}.weights"))
    if (
        isinstance(value, list)
        and len(value) == count
        and all(isinstance(w, float | int) for w in value)
    ):
        return [float(w) for w in value]
    if op.weights is None:
        weights = [literal(parts.get(f"component.{c}.weight")) for c in range(count)]
        if all(isinstance(w, float | int) for w in weights) and sum(weights) > 0:
            s = sum(weights)
            return [w / s for w in weights]
    raise CheckpointError(
        f"allow_mixture_change=True: the checkpoint does not say which weights operator {i} "
        "(ensure_mixture) had, which replaying its epochs needs; restore without changing "
        "the mixture, or give ensure_mixture no weights (it then follows the work source)"
    )


def _without_batch(parts: dict[str, str]) -> dict[str, str]:
    """A part map without ``batch``'s parameters (its position and name stay)."""
    batch = {k for k, v in parts.items() if v == "batch" and k.count(".") == 1}
    return {k: v for k, v in parts.items() if k.rsplit(".", 1)[0] not in batch}
