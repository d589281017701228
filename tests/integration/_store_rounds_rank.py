"""One rank of the multi-process checkpoint-round tests over a real store.

    python _store_rounds_rank.py STORE_URL NAMESPACE RANK WORLD_SIZE ROUNDS LEASE_TTL_S MODE

Opens the store with ``open_store`` (as a Pipeline would; STORE_URL without ``://`` is an
``aggregate_dir``), runs ROUNDS rounds of
``Aggregator.round`` with a small synthetic state (two lanes per rank), and prints one JSON
line per round: ``{"rank", "round", "ok", "merged" | "error", "t"}`` (``t`` = time.time() at
the end of the round). MODE ``die_before_publish``: the leader prints ``{"dying": t}`` and
SIGKILLs itself inside ``merge``, after collecting every state and before publishing;
``$ZEPHON_TEST_MARK`` marks every lane of this rank's states, ``$ZEPHON_TEST_FINGERPRINT``
is the pipeline fingerprint the rounds run under;
``stop_before_publish``: it prints ``{"stopped": t}`` and SIGSTOPs itself there (the test
sends SIGCONT).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from zephon.checkpoint.aggregate import Aggregator, open_store
from zephon.errors import AggregationError

LANES_PER_RANK = 2


def lanes_of(rank: int) -> list[int]:
    return list(range(rank * LANES_PER_RANK, (rank + 1) * LANES_PER_RANK))


def state_of(rank: int, world_size: int, round_no: int, mark: str | None = None) -> dict:
    """A small state; with ``mark`` every lane carries it (to see whose lanes a job got)."""
    lanes: list[dict] = [
        {"lane": lane, "position": 100 * round_no + lane} for lane in lanes_of(rank)
    ]
    if mark is not None:
        for lane in lanes:
            lane["mark"] = mark
    return {
        "topology": {
            "rank": rank,
            "world_size": world_size,
            "dp_size": world_size,
            "canonical_replicas": world_size * LANES_PER_RANK,
        },
        "lanes": lanes,
        "step": round_no,
    }


def merge(states: list[dict]) -> dict:
    lanes = sorted((x for s in states for x in s["lanes"]), key=lambda x: x["lane"])
    return {"lanes": lanes, "step": states[0]["step"]}


def expected_result(rank: int, world_size: int, round_no: int) -> dict:
    """What rank ``rank`` gets back (its "share" entry aside): the merged state on the
    leader, the merged header with its own lanes on a follower."""
    merged = merge([state_of(r, world_size, round_no) for r in range(world_size)])
    if rank == 0:
        return merged
    return {**merged, "lanes": state_of(rank, world_size, round_no)["lanes"]}


def without_share(result: dict) -> dict:
    """The result without its "share" entry and what it says of its round (checked: the
    round's step is the state's)."""
    assert result["round"]["step"] == result["step"], result
    return {k: v for k, v in result.items() if k not in ("share", "round")}


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    url, namespace = sys.argv[1], sys.argv[2]
    rank, world_size, rounds = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    lease_ttl_s, mode = float(sys.argv[6]), sys.argv[7]

    def leader_merge(states: list[dict]) -> dict:
        if mode == "die_before_publish":
            emit(dying=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop_before_publish":
            emit(stopped=time.time())
            os.kill(os.getpid(), signal.SIGSTOP)
        return merge(states)

    if url == "jax://":  # this rank joins a jax.distributed job first (coordinator in env)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=os.environ["ZEPHON_TEST_COORDINATOR"],
            num_processes=world_size,
            process_id=rank,
        )
    # torch:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE as under torchrun
    if "://" in url:
        store = open_store(aggregate_store=url, namespace=namespace)
    else:
        store = open_store(aggregate_dir=url, namespace=namespace)
    mark = os.environ.get("ZEPHON_TEST_MARK")
    agg = Aggregator(
        store,
        rank=rank,
        world_size=world_size,
        timeout_s=30.0,
        expected_lanes=lanes_of,
        merge=leader_merge,
        lease_ttl_s=lease_ttl_s,
        fingerprint=os.environ.get("ZEPHON_TEST_FINGERPRINT", ""),
    )
    try:
        for round_no in range(rounds):
            t0 = time.time()
            try:
                merged = agg.round(state_of(rank, world_size, round_no, mark))
            except AggregationError as e:
                emit(rank=rank, round=round_no, ok=False, error=str(e), t=time.time())
                sys.exit(3)
            emit(
                rank=rank,
                round=round_no,
                ok=True,
                merged=merged,
                t=time.time(),
                ms=(time.time() - t0) * 1e3,
            )
    finally:
        agg.close()


if __name__ == "__main__":
    main()
