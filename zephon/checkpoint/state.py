"""The checkpoint state: its keys, how one rank's state is built and checked, which lanes a
rank reports, and how the ranks' states merge into one covering every lane.

A state is a plain msgpack-able dict::

    {"format": "zephon.pipeline", "version": FORMAT_VERSION,
     "fingerprint": sha256 hex, "fingerprint_parts": {part: text},
     "canonical_replicas": L, "flush_every_k_chunks": k, "eviction": "watermark"|"epoch",
     "topology": {"rank", "world_size", "dp_rank", "dp_size", "canonical_replicas"
                  [, "merged": True]},
     "lanes": [lane state, ...],              # see zephon.tracking.schema
     "round_robin": {"dp_size": D, "next_lanes": {"<dp rank>": lane}},
     "step": S,                                # batches delivered since the start of
                                               # the data: the same on every rank at a
                                               # training step, what a round matches on
     ...}                                      # plus what rounds and holds add

A merged state (a round's) also names its round: ``"round": {"round_id", "step",
"job_id"}``.

``FORMAT_VERSION`` is the one version of the on-disk format: the state's ``"version"``
and the file header of :mod:`zephon.checkpoint.io` carry it.
"""

from __future__ import annotations

from typing import Any

from zephon._fingerprint import describe_differences
from zephon.errors import CheckpointError
from zephon.topology import Topology
from zephon.tracking.checks import checked_count, shown
from zephon.tracking.schema import LANE

FORMAT = "zephon.pipeline"
FORMAT_VERSION = 1
#: The state's step: batches delivered since the start of the data (restored with it).
STEP = "step"
#: What a round's merged state says of its round.
ROUND = "round"
#: The part map beside the fingerprint (see :mod:`zephon._fingerprint`); checkpoints made
#: before it existed lack it.
FINGERPRINT_PARTS = "fingerprint_parts"


def build_state(
    fingerprint: str,
    parts: dict[str, str],
    flush_every_k_chunks: int,
    eviction: str,
    topo: Topology,
    engine_state: dict[str, Any],
) -> dict[str, Any]:
    """One rank's state: the header, its lanes, its DP rank's next lane and its step
    (``engine_state`` is :meth:`zephon.pipeline.engine.Engine.state`)."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        FINGERPRINT_PARTS: parts,
        "canonical_replicas": topo.canonical_replicas,
        "flush_every_k_chunks": flush_every_k_chunks,
        "eviction": eviction,
        "topology": {
            "rank": topo.rank,
            "world_size": topo.world_size,
            "dp_rank": topo.dp_rank,
            "dp_size": topo.dp_size,
            "canonical_replicas": topo.canonical_replicas,
        },
        "lanes": engine_state["lanes"],
        "round_robin": {
            "dp_size": topo.dp_size,
            "next_lanes": {str(topo.dp_rank): engine_state["next_lane"]},
        },
        STEP: engine_state["step"],
    }


def state_step(state: dict[str, Any]) -> int:
    """The step a state names.

    Raises:
        CheckpointError: it names none, or not an int >= 0.
    """
    if STEP not in state:
        raise CheckpointError(
            f"malformed checkpoint: it names no {STEP!r} (the batches delivered since the"
            " start of the data, which every checkpoint since 2026-12 carries)"
        )
    step = state[STEP]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"malformed checkpoint: {STEP!r} must be an int >= 0; got {step!r}")
    return step


def check_header(state: dict[str, Any]) -> None:
    """Raises the CheckpointError for a state that is not a pipeline checkpoint of this
    format version."""
    if state.get("format") != FORMAT:
        raise CheckpointError(f"not a Zephon pipeline checkpoint (format={state.get('format')!r})")
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format version {state.get('version')!r} is not supported by this "
            f"Zephon (supports {FORMAT_VERSION}); upgrade zephon"
        )


def checked_layout(state: dict[str, Any]) -> tuple[dict[int, Any], dict[int, int], int]:
    """The lane states by lane, the round-robin's next lane per DP rank and its dp_size,
    checked for shape; a CheckpointError names what is malformed."""

    def fail(what: str, value: Any) -> CheckpointError:
        return CheckpointError(f"malformed checkpoint: {what}; got {shown(value)}")

    def count(what: str, value: Any) -> int:
        try:
            return checked_count(what, value)
        except CheckpointError as e:
            raise CheckpointError(f"malformed checkpoint: {e}") from None

    lanes, rr = state.get("lanes"), state.get("round_robin")
    if not isinstance(lanes, list):
        raise fail("'lanes' must be a list of lane states", lanes)
    by_lane: dict[int, Any] = {}
    for ls in lanes:
        if not isinstance(ls, dict) or LANE not in ls:
            raise fail(f"every entry of 'lanes' must be a dict with a {LANE!r}", ls)
        lane = count("a lane id", ls[LANE])
        if lane in by_lane:
            raise CheckpointError(f"malformed checkpoint: lane {lane} appears twice in 'lanes'")
        by_lane[lane] = ls
    if not isinstance(rr, dict) or not isinstance(rr.get("next_lanes"), dict):
        raise fail("'round_robin' must be a dict with a 'next_lanes' dict", rr)
    saved_dp_size = count("round_robin dp_size", rr.get("dp_size"))
    next_lanes = {}
    for key, value in rr["next_lanes"].items():
        if not (isinstance(key, str) and key.isdigit()):
            raise fail("round_robin next_lanes keys must be DP ranks written as str", key)
        next_lanes[int(key)] = count(f"round_robin next_lanes[{key!r}]", value)
    return by_lane, next_lanes, saved_dp_size


def lanes_of_rank(topo: Topology, rank: int) -> list[int]:
    """Lanes that ``rank`` must report, by this rank's view of the job's layout: ranks are
    dealt to DP groups like the default (dp_rank = rank * dp_size // world_size)."""
    dp_rank = rank * topo.dp_size // topo.world_size
    per = topo.canonical_replicas // topo.dp_size
    return list(range(dp_rank * per, (dp_rank + 1) * per))


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's state (index = rank) into one covering all lanes.

    Model-parallel peers of one DP group read the same lanes, so their lane states must
    be identical; the group's lowest rank speaks for it. The merged state names rank 0's
    step: a round merges states of one step only (it checks), while merging states of
    several steps by hand (each lane continues where it stopped) is the caller's choice.
    """
    from zephon.errors import AggregationError

    first = states[0]
    lanes: dict[int, Any] = {}
    owner: dict[int, int] = {}
    next_lanes: dict[str, int] = {}
    for rank, st in enumerate(states):
        if st["fingerprint"] != first["fingerprint"]:
            parts, first_parts = st.get(FINGERPRINT_PARTS), first.get(FINGERPRINT_PARTS)
            what = (
                "; ".join(describe_differences(parts, first_parts, f"rank {rank}", "rank 0"))
                if isinstance(parts, dict) and isinstance(first_parts, dict)
                else ""
            )
            raise AggregationError(
                f"rank {rank}'s pipeline fingerprint {st['fingerprint'][:12]}… differs from rank 0's "
                f"{first['fingerprint'][:12]}…{': ' + what if what else ''}: every rank must build "
                "the same pipeline over the same data"
            )
        next_lanes.update(st["round_robin"]["next_lanes"])
        for ls in st["lanes"]:
            lane = int(ls[LANE])
            if lane in lanes:
                if lanes[lane] != ls:
                    raise AggregationError(
                        f"ranks {owner[lane]} and {rank} report different states for lane {lane}: "
                        "model-parallel peers of a DP group must consume the same batches"
                    )
                continue
            lanes[lane] = ls
            owner[lane] = rank
    merged = {k: v for k, v in first.items() if k not in ("lanes", "topology", "round_robin")}
    merged["lanes"] = [lanes[lane] for lane in sorted(lanes)]
    merged["topology"] = {
        "rank": 0,
        "world_size": first["topology"]["world_size"],
        "dp_rank": 0,
        "dp_size": first["topology"]["dp_size"],
        "canonical_replicas": first["topology"]["canonical_replicas"],
        "merged": True,
    }
    merged["round_robin"] = {"dp_size": first["round_robin"]["dp_size"], "next_lanes": next_lanes}
    return merged
