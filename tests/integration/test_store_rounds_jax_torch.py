"""Checkpoint rounds with ranks as OS processes over the JAX coordination service
(``jax://``) and torch's TCPStore (``torch://``), as a Pipeline would run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.etcd_server import free_port

RANK = Path(__file__).parent / "_store_rounds_rank.py"
pytestmark = [pytest.mark.stores, pytest.mark.processes]


def run_ranks(url: str, world: int, env_for) -> list[list[dict]]:
    """Runs ``world`` ranks; ``env_for(rank, port)`` is a rank's environment around a port
    from :func:`free_port`. Another process can take that port before the ranks bind it:
    then every rank is stopped and they start again on a new one (up to three times)."""
    for _ in range(3):
        port = free_port()
        procs, outputs = _run_once(url, world, lambda rank, port=port: env_for(rank, port))
        if not any("EADDRINUSE" in err for _, err in outputs):
            break
    report = "\n".join(
        f"rank {rank} exited {p.returncode}: {out[-2000:]}{err[-3000:]}"
        for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode != 0
    )
    assert not report, report  # (a rank killed because another failed exited -9)
    return [
        [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for out, _ in outputs
    ]


def _run_once(url: str, world: int, env_for) -> tuple[list[subprocess.Popen], list[tuple]]:
    procs = []
    for rank in range(world):
        env = {**os.environ, **env_for(rank)}
        cmd = [
            sys.executable,
            str(RANK),
            url,
            "rounds-test",
            str(rank),
            str(world),
            "3",
            "5",
            "normal",
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    # A rank that failed stops the others at once (they would wait for it until their
    # timeouts); the ranks print a few lines, so no pipe fills while this polls.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    outputs = []
    for p in procs:  # collect every rank before judging any, so no pipe is left open
        if p.poll() is None:
            p.kill()
        outputs.append(p.communicate())
    return procs, outputs


def check_identical_merged(results: list[list[dict]], world: int) -> None:
    """The leader got the merged state, every follower its share of it."""
    from tests.integration._store_rounds_rank import expected_result, without_share

    for round_no in range(3):
        got = [next(r["merged"] for r in rank if r.get("round") == round_no) for rank in results]
        for rank, result in enumerate(got):
            assert without_share(result) == expected_result(rank, world, round_no), (rank, result)
        assert [x["lane"] for x in got[0]["lanes"]] == list(range(2 * world))


@pytest.mark.jax
def test_rounds_over_the_jax_coordination_service():
    pytest.importorskip("jax")
    results = run_ranks(
        "jax://", 2, lambda r, port: {"ZEPHON_TEST_COORDINATOR": f"127.0.0.1:{port}"}
    )
    check_identical_merged(results, 2)


def test_rounds_over_torch_tcpstore():
    pytest.importorskip("torch")
    results = run_ranks(
        "torch://",
        3,
        lambda r, port: {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": "3",
        },
    )
    check_identical_merged(results, 3)
