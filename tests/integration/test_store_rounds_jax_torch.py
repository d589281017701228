"""Checkpoint rounds with ranks as OS processes over the JAX coordination service
(``jax://``) and torch's TCPStore (``torch://``), as a Pipeline would run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from etcd_server import free_port  # noqa: E402

RANK = Path(__file__).parent / "_store_rounds_rank.py"
pytestmark = pytest.mark.processes


def run_ranks(url: str, world: int, env_for) -> list[list[dict]]:
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
    outputs = []
    for p in procs:  # collect every rank before judging any, so no pipe is left open
        try:
            outputs.append(p.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate())
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank}: {err[-3000:]}"
    return [
        [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for out, _ in outputs
    ]


def check_identical_merged(results: list[list[dict]], world: int) -> None:
    for round_no in range(3):
        merged = [next(r["merged"] for r in rank if r.get("round") == round_no) for rank in results]
        assert all(m == merged[0] for m in merged), f"round {round_no} differs across ranks"
        assert [x["lane"] for x in merged[0]["lanes"]] == list(range(2 * world))


@pytest.mark.jax
def test_rounds_over_the_jax_coordination_service():
    pytest.importorskip("jax")
    coordinator = f"127.0.0.1:{free_port()}"
    results = run_ranks("jax://", 2, lambda r: {"ZEPHON_TEST_COORDINATOR": coordinator})
    check_identical_merged(results, 2)


def test_rounds_over_torch_tcpstore():
    pytest.importorskip("torch")
    port = str(free_port())
    results = run_ranks(
        "torch://",
        3,
        lambda r: {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(r),
            "WORLD_SIZE": "3",
        },
    )
    check_identical_merged(results, 3)
