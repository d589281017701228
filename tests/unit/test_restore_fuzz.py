"""Every malformed checkpoint state is a CheckpointError, never another exception.

A real checkpoint (a StaticMixtureWorkSource mixture, in-flight chunks, epoch boundaries,
a replay cursor) is decoded, then one or more of its values, at every level, is deleted,
retyped or changed, and restored into a fresh pipeline. Either restore raises
CheckpointError, or the change was harmless to the state's shape and the restored pipeline
iterates to its end or stops with CheckpointError (a replay target that never reappears).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zephon as zp
from zephon.errors import CheckpointError
from zephon.testing import roundtrip, take

DOCS = [f"document {i} " * (1 + i % 4) for i in range(30)]
Path = tuple[Any, ...]


def build() -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        {"docs": zp.ArraySource(DOCS), "more": zp.ArraySource(DOCS[:12])},
        weights=[2, 1],
        seed=5,
        chunk_size=3,
        num_epochs=1,
    )
    return (
        # prefetch=0: no pump thread, so the thousands of restores below run fast.
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2, prefetch=0)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(12)
        .pack(12, num_bins=2)
        .shuffle(3)
        .batch(2)
    )


@functools.cache
def real_state() -> dict[str, Any]:
    with build() as pipe:
        take(pipe, 5)
        state = roundtrip(pipe.checkpoint())
    lanes = state["lanes"]
    # What the fuzzing must reach: in-flight chunks, boundaries, a cursor, a source state.
    assert any(ls["inflight"] for ls in lanes)
    assert any(ls["boundaries"] for ls in lanes)
    assert any(ls["cursor"] is not None for ls in lanes)
    assert all(set(ls["source"]) >= {"positions", "received", "carry"} for ls in lanes)
    return state


def paths(value: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every key and index at every level (the root excluded)."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, child in items:
        yield (*prefix, key)
        yield from paths(child, (*prefix, key))


ALL_PATHS = list(paths(real_state()))

# Values of every msgpack type, and the edges of the ones a state holds.
REPLACEMENTS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    7,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    1.5,
    float("nan"),
    float("inf"),
    "garbage",
    "12",
    "",
    b"",
    b"\x00\x01\x02",
    b"\xff" * 12,
    [],
    [0],
    [None, "x", 1.5],
    {},
    {"lane": 0},
]


def mutations(value: Any) -> list[tuple[str, Any]]:
    """What to do at one path: delete it, replace it, or change it in a way of its type."""
    out: list[tuple[str, Any]] = [("delete", None)]
    out += [("set", r) for r in REPLACEMENTS]
    if isinstance(value, int) and not isinstance(value, bool):
        out += [("set", value + 1), ("set", value - 1), ("set", float(value)), ("set", str(value))]
    if isinstance(value, bytes) and value:
        out += [
            ("set", value[:-1]),
            ("set", value + value[:4]),
            ("set", bytes([value[0] ^ 0xFF]) + value[1:]),
        ]
    if isinstance(value, list) and value:
        out += [("set", value[:-1]), ("set", [*value, value[-1]]), ("set", value[::-1])]
    if isinstance(value, dict):
        out += [("set", {**value, "unknown": 1}), ("set", list(value.values()))]
    return out


def get(state: Any, path: Path) -> Any:
    for key in path:
        state = state[key]
    return state


def mutated(state: dict[str, Any], path: Path, op: str, value: Any) -> dict[str, Any]:
    new = copy.deepcopy(state)
    parent = get(new, path[:-1])
    if op == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(value)
    return new


def restore_and_run(state: dict[str, Any]) -> str:
    """'refused' (CheckpointError at restore), 'lost' (CheckpointError while iterating) or
    'ran'; any other exception fails the test."""
    pipe = build()
    try:
        try:
            pipe.restore(state)
        except CheckpointError:
            return "refused"
        try:
            take(pipe, 3)  # the replay, and the first batches after it
        except CheckpointError:
            return "lost"
        return "ran"
    finally:
        pipe.close()


@pytest.mark.parametrize("path", ALL_PATHS, ids=lambda p: ".".join(map(str, p)))
def test_every_single_change_is_refused_or_harmless(path: Path) -> None:
    state = real_state()
    original = get(state, path)
    outcomes = {
        (op, repr(value)): restore_and_run(mutated(state, path, op, value))
        for op, value in mutations(original)
    }
    # Deleting a key that restore reads is never harmless. Restore does not read what only
    # describes the run (topology, eviction, the flush cadence, which the fingerprint covers)
    # nor the fingerprint parts when the fingerprint matches.
    described = {"topology", "eviction", "flush_every_k_chunks", "fingerprint_parts"}
    if isinstance(get(state, path[:-1]), dict) and path[0] not in described:
        assert outcomes[("delete", "None")] == "refused", path
    assert set(outcomes.values()) <= {"refused", "lost", "ran"}


def test_the_reported_case_a_garbage_cursor() -> None:
    state = copy.deepcopy(real_state())
    lane = next(ls for ls in state["lanes"] if ls["cursor"] is not None)
    lane["cursor"] = ["x", 0, 0]
    with pytest.raises(
        CheckpointError, match=r"lane \d: replay cursor chunk_id must be an int .* got str 'x'"
    ):
        build().restore(state)
    lane["cursor"] = [1, 2]
    with pytest.raises(
        CheckpointError, match=r"replay cursor must be None or \[chunk_id, offset, child\]"
    ):
        build().restore(state)


def test_the_unmutated_state_restores_and_runs() -> None:
    assert restore_and_run(copy.deepcopy(real_state())) == "ran"


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_several_changes_at_once_are_refused_or_harmless(data: st.DataObject) -> None:
    state = copy.deepcopy(real_state())
    for _ in range(data.draw(st.integers(1, 4), label="changes")):
        live = list(paths(state))
        if not live:
            break
        path = data.draw(st.sampled_from(live), label="path")
        op, value = data.draw(st.sampled_from(mutations(get(state, path))), label="mutation")
        state = mutated(state, path, op, value)
    assert restore_and_run(state) in {"refused", "lost", "ran"}
