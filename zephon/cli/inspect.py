"""``zephon inspect CKPT``: what a checkpoint holds and what restoring it will replay."""

from __future__ import annotations

import ast
import json
import os
from typing import Any

from zephon._fingerprint import expand_parts
from zephon.checkpoint.io import load, peek_header
from zephon.tracking.schema import (
    BATCHES,
    BOUNDARIES,
    CHUNK_COMPONENTS,
    CHUNK_ID,
    CHUNK_INDICES,
    CURSOR,
    DONE,
    INFLIGHT,
    LANE,
    NEXT_CHUNK_ID,
    SOURCE,
)
from zephon.work_sources.lane_state import decode_state


def summarize(
    state: dict[str, Any], file_bytes: int | None = None, header: dict[str, Any] | None = None
) -> dict[str, Any]:
    lanes = []
    for ls in state.get("lanes", []):
        inflight = ls.get(INFLIGHT, [])
        samples = sum(len(c[CHUNK_INDICES]) // 8 for c in inflight)
        lanes.append(
            {
                "lane": ls[LANE],
                "inflight_chunk_ids": [c[CHUNK_ID] for c in inflight],
                "epoch_boundaries": list(ls.get(BOUNDARIES, [])),
                "replay_cursor": ls.get(CURSOR),
                "batches_delivered": ls.get(BATCHES),
                "next_chunk_id": ls.get(NEXT_CHUNK_ID),
                "work_source": ls.get(SOURCE),
                "replays": {"chunks": len(inflight), "samples": samples},
                "done": ls.get(DONE),
            }
        )
    return {
        "file_bytes": file_bytes,
        "file_format_version": None if header is None else header["format_version"],
        "uncompressed_bytes": None if header is None else header["uncompressed_bytes"],
        "state_format": state.get("format"),
        "state_version": state.get("version"),
        "fingerprint": state.get("fingerprint"),
        "components": components(state.get("fingerprint_parts")),
        "fingerprint_parts": state.get("fingerprint_parts"),
        "canonical_replicas": state.get("canonical_replicas"),
        "flush_every_k_chunks": state.get("flush_every_k_chunks"),
        "eviction": state.get("eviction"),
        "round_robin": state.get("round_robin"),
        "mixture": mixture(state),
        "lanes": lanes,
        "restore_replays": {
            "chunks": sum(ln["replays"]["chunks"] for ln in lanes),
            "samples": sum(ln["replays"]["samples"] for ln in lanes),
        },
    }


def _value(text: Any) -> Any:
    """A part's text as the value it shows (``"'web'"`` -> ``"web"``); a digest (``#…``) or
    anything else that is not a literal stays text."""
    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def components(parts: Any) -> list[dict[str, Any]] | None:
    """Each component's name, length, weight and content identity from a checkpoint's
    fingerprint parts; None for a checkpoint without them (made before they existed)."""
    if not isinstance(parts, dict):
        return None
    parts = expand_parts(parts)
    count = parts.get("components")
    n = int(count) if isinstance(count, str) and count.isdigit() else 0
    out = []
    for c in range(n):
        prefix = f"component.{c}."
        props = {k[len(prefix) :]: v for k, v in parts.items() if k.startswith(prefix)}
        out.append(
            {
                "component": c,
                "name": _value(props.get("name")),
                "length": _value(props.get("length")),
                "weight": _value(props.get("weight")),
                "identity": {
                    k[len("identity.") :]: _value(v)
                    for k, v in props.items()
                    if k.startswith("identity.")
                },
            }
        )
    return out


def mixture(state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per component, over the checkpoint's lanes: ``samples`` the lanes have dealt,
    ``in_flight`` (dealt, in chunks not yet wholly delivered: restoring replays them),
    ``delivered`` (the rest: every piece of them reached the training loop), ``tokens``
    dealt (None where the work source does not know the lengths), and the dataset
    ``epoch`` and ``position`` in it that the samples dealt reach (``samples // length``,
    ``samples % length``; exact when the checkpoint holds every lane). None for a work
    source whose state does not say (or a checkpoint without component names)."""
    comps = components(state.get("fingerprint_parts"))
    lanes = state.get("lanes")
    if not comps or not isinstance(lanes, list):
        return None
    n = len(comps)
    samples, tokens, in_flight = [0] * n, [0] * n, [0] * n
    known_tokens = False
    for ls in lanes:
        src = ls.get(SOURCE) if isinstance(ls, dict) else None
        if not isinstance(src, dict):
            return None
        try:
            decoded = decode_state(src)
        except ValueError:
            return None
        if not decoded:
            return None
        for key, acc in (("positions", samples), ("tokens", tokens)):
            values = decoded[key]
            if values is None:
                continue
            if len(values) != n:
                return None
            if key == "tokens":
                known_tokens = True
            for c, v in enumerate(values):
                acc[c] += v
        for chunk in ls.get(INFLIGHT, []):
            raw = chunk.get(CHUNK_COMPONENTS) if isinstance(chunk, dict) else None
            if isinstance(raw, bytes):
                for c in _int32s(raw):
                    if 0 <= c < n:
                        in_flight[c] += 1
    out = []
    for c, comp in enumerate(comps):
        length = comp["length"]
        epoch = position = None
        if isinstance(length, int) and length > 0:
            epoch, position = divmod(samples[c], length)
        out.append(
            {
                "component": c,
                "name": comp["name"],
                "weight": comp["weight"],
                "samples": samples[c],
                "in_flight": in_flight[c],
                "delivered": samples[c] - in_flight[c],
                "tokens": tokens[c] if known_tokens else None,
                "epoch": epoch,
                "position": position,
            }
        )
    return out


def _int32s(raw: bytes) -> list[int]:
    import numpy as np

    if len(raw) % 4:
        return []
    return np.frombuffer(raw, dtype="<i4").tolist()


def _positions_text(src: Any) -> Any:
    """A lane's per-component positions, short."""
    if not isinstance(src, dict):
        return src
    try:
        values = decode_state(src).get("positions", src.get("positions"))
    except ValueError:
        return src.get("positions")
    if values is None:
        return "all 0"
    if isinstance(values, list) and len(values) > 8:
        return f"{values[:8]}... ({len(values)} components)"
    return values


def _mixture_line(m: dict[str, Any]) -> str:
    tokens = "-" if m["tokens"] is None else f"{m['tokens']:,}"
    where = "-" if m["epoch"] is None else f"{m['epoch']} / {m['position']:,}"
    return (
        f"  {m['component']:>4}  {str(m['name'])[:18]:<18}  {m['samples']:>10,}  "
        f"{m['in_flight']:>9,}  {m['delivered']:>10,}  {tokens:>14}  {where:>16}"
    )


def _component_line(comp: dict[str, Any]) -> str:
    identity = " ".join(f"{k}={v}" for k, v in comp["identity"].items() if v is not None)
    length = comp["length"]
    size = f"{length:,} samples" if isinstance(length, int) else f"length {length}"
    weight = comp["weight"]
    shown = f"{weight:.4g}" if isinstance(weight, float) else str(weight)
    return f"  component {comp['component']} {comp['name']!r}: {size}, weight {shown}, {identity}"


def _chunk_ids(ids: list[int]) -> str:
    return (
        "-" if not ids else (f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}..{ids[-1]} ({len(ids)})")
    )


def describe(path: str | os.PathLike[str], *, as_json: bool = False) -> str:
    state = load(path)
    with open(path, "rb") as f:
        header = peek_header(f.read(64))
    info = summarize(state, os.path.getsize(path), header)
    if as_json:
        return json.dumps(
            info, indent=2, default=lambda o: o.hex() if isinstance(o, bytes) else str(o)
        )
    out = [
        f"{os.fspath(path)}: {info['file_bytes']:,} bytes ({info['uncompressed_bytes']:,} uncompressed), file format v{info['file_format_version']}",
        f"  state {info['state_format']} v{info['state_version']}, fingerprint {str(info['fingerprint'])[:16]}",
        f"  {info['canonical_replicas']} lanes, eviction={info['eviction']}, flush_every_k_chunks={info['flush_every_k_chunks']}, next lanes {info['round_robin'] and info['round_robin'].get('next_lanes')}",
        *(
            [_component_line(comp) for comp in info["components"]]
            if info["components"] is not None
            else ["  components: not recorded (a checkpoint made before content identities)"]
        ),
        *(
            [
                "  mixture over these lanes: samples dealt, in flight (replayed on restore), "
                "delivered, tokens dealt, dataset epoch / position",
                "  comp  name                   samples  in flight   delivered          tokens  "
                "epoch / position",
                *(_mixture_line(m) for m in info["mixture"]),
            ]
            if info["mixture"]
            else []
        ),
        f"  restore replays {info['restore_replays']['chunks']} chunks ({info['restore_replays']['samples']} samples)",
        "  lane  in-flight chunks      boundaries        replay cursor     batches  source position",
    ]
    for ln in info["lanes"]:
        src = ln["work_source"] or {}
        pos = _positions_text(src)
        cursor = (
            "-"
            if ln["replay_cursor"] is None
            else "(" + ", ".join(map(str, ln["replay_cursor"])) + ")"
        )
        out.append(
            f"  {ln['lane']:>4}  {_chunk_ids(ln['inflight_chunk_ids']):<20}  {str(ln['epoch_boundaries']):<16}  "
            f"{cursor:<16}  {ln['batches_delivered']:>7}  {pos}{'  (done)' if ln['done'] else ''}"
        )
    return "\n".join(out)


__all__ = ["components", "describe", "mixture", "summarize"]
