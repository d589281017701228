"""One rank of a multi-rank checkpoint round, as its own OS process (and the fake states
the round tests share).

    python _rounds_rank.py --root DIR --rank R --world-size N --out FILE
        [--rounds K] [--timeout-s S] [--lease-ttl-s T] [--mode MODE] [--linger-s L]

Modes: ``ok``; ``absent`` (never calls round()); ``bad-lanes`` (reports one lane too few);
``die-in-merge`` (the leader SIGKILLs itself in merge(), after writing ``FILE.dying`` with
the time); ``stop-in-merge`` (the leader writes ``FILE.stopped`` and SIGSTOPs itself in
merge(): the test sends SIGCONT when it wants). Writes ``FILE`` as JSON: ``{"rank", "merged": [...], "digests": [...], "error",
"error_type", "elapsed_s", "failed_at_unix"}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

LANES_PER_RANK = 2


def lanes_of(rank: int) -> list[int]:
    return list(range(rank * LANES_PER_RANK, (rank + 1) * LANES_PER_RANK))


def fake_state(rank: int, world_size: int, step: int) -> dict[str, Any]:
    return {
        "topology": {
            "rank": rank,
            "world_size": world_size,
            "dp_rank": rank,
            "dp_size": world_size,
            "canonical_replicas": world_size * LANES_PER_RANK,
        },
        "lanes": [
            {"lane": lane, "cursor": [step, lane], "inflight": [step * 10 + i for i in range(4)]}
            for lane in lanes_of(rank)
        ],
        "step": step,
    }


def merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    lanes = sorted((lane for st in states for lane in st["lanes"]), key=lambda x: x["lane"])
    return {"step": states[0]["step"], "lanes": lanes, "world_size": len(states)}


def share_of(merged: dict[str, Any], rank: int) -> dict[str, Any]:
    """What a follower's round returns (its "share" entry aside): the merged header and
    its own lanes."""
    mine = set(lanes_of(rank))
    return {**merged, "lanes": [x for x in merged["lanes"] if x["lane"] in mine]}


def digest(merged: dict[str, Any]) -> str:
    from zephon.checkpoint.io import dumps

    return hashlib.sha256(dumps(merged)).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=20.0)
    ap.add_argument("--lease-ttl-s", type=float, default=10.0)
    ap.add_argument(
        "--mode",
        default="ok",
        choices=["ok", "absent", "bad-lanes", "die-in-merge", "stop-in-merge"],
    )
    ap.add_argument(
        "--linger-s", type=float, default=0.0, help="after an error, wait before close()"
    )
    args = ap.parse_args(argv)

    from zephon.checkpoint.aggregate import Aggregator, open_store

    result: dict[str, Any] = {"rank": args.rank, "merged": [], "digests": [], "error": None}
    if args.mode == "absent":
        _write(args.out, result)
        return 0

    def merge_fn(states: list[dict[str, Any]]) -> dict[str, Any]:
        if args.mode == "die-in-merge":
            _write(args.out + ".dying", {"at_unix": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        if args.mode == "stop-in-merge":
            _write(args.out + ".stopped", {"at_unix": time.time()})
            os.kill(os.getpid(), signal.SIGSTOP)
            _write(args.out + ".resumed", {"at_unix": time.time()})
        return merge(states)

    agg = Aggregator(
        open_store(args.root),
        rank=args.rank,
        world_size=args.world_size,
        timeout_s=args.timeout_s,
        expected_lanes=lanes_of,
        merge=merge_fn,
        lease_ttl_s=args.lease_ttl_s,
    )
    try:
        for step in range(args.rounds):
            state = fake_state(args.rank, args.world_size, step)
            if args.mode == "bad-lanes":
                state["lanes"].pop()
            t = time.monotonic()
            try:
                merged = agg.round(state)
            except Exception as e:
                result.update(
                    error=str(e),
                    error_type=type(e).__name__,
                    elapsed_s=time.monotonic() - t,
                    failed_at_unix=time.time(),
                )
                break
            assert merged.pop("round")["step"] == step  # (its round id differs every run)
            result["merged"].append(merged)
            result["digests"].append(digest(merged))
        if result["error"] is not None and args.linger_s:
            time.sleep(args.linger_s)  # a training loop reporting the error before it exits
    finally:
        agg.close()
    _write(args.out, result)
    return 0


def _write(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
