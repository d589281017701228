"""Ranks as OS processes: one checkpoint round per checkpoint() (directory and etcd), the
same merged state on every rank, and elastic resume of that state in another topology."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zephon as zp
from tests.etcd_server import etcd_server
from tests.integration.corpus import lm_pipeline

SCRIPT = Path(__file__).parent / "_ranks_pipeline.py"
pytestmark = pytest.mark.processes


def run_job(
    tmp: Path,
    name: str,
    world: int,
    workers: int,
    steps: list[int],
    agg: list[str],
    restore: Path | None = None,
):
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable,
            str(SCRIPT),
            str(rank),
            str(world),
            str(workers),
            str(steps[rank]),
            str(tmp / f"{name}-{rank}"),
            *agg,
        ]
        if restore is not None:
            cmd += ["--restore", str(restore)]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = []
    for p in procs:  # collect every rank before judging any, so no pipe is left open
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank}: {out}"
    states = [zp.load(tmp / f"{name}-{rank}.zph") for rank in range(world)]
    streams: dict[int, list[str]] = {}
    for rank in range(world):
        for lane, digest in json.loads((tmp / f"{name}-{rank}.json").read_text()):
            streams.setdefault(lane, []).append(digest)
    return states, streams


def uninterrupted(steps: int) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    with lm_pipeline(seed=41, lanes=4, num_epochs=None) as p:
        for _ in range(steps):
            batch = next(p)
            digest = hashlib.sha256(
                b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch))
            )
            out.setdefault(p.last_batch_lanes[0], []).append(digest.hexdigest()[:16])
    return out


def check_lanes(ref, before, after):
    for lane in range(4):
        got = before.get(lane, []) + after.get(lane, [])
        assert got, f"lane {lane} produced nothing"
        assert got == ref[lane][: len(got)], f"lane {lane} lost or repeated data"


def check_merged_and_shares(tmp: Path, name: str, states: list[dict]) -> None:
    """Rank 0 returned the merged state; every other rank its share (its own lanes, and
    what they are a share of), which ``zp.save`` saved as the whole merged state."""
    merged = states[0]
    assert sorted(ls["lane"] for ls in merged["lanes"]) == [0, 1, 2, 3]
    assert "share" not in merged
    for rank, st in enumerate(states):
        assert st == merged, f"rank {rank}'s saved checkpoint is not the merged state"
        got = json.loads((tmp / f"{name}-{rank}.share.json").read_text())
        if rank == 0:
            assert got["share"] is None and got["lanes"] == [0, 1, 2, 3], got
            continue
        assert got["share"]["rank"] == rank and got["share"]["lanes_total"] == 4, got
        assert 0 < len(got["lanes"]) < 4, got  # checkpoint() returned its own lanes only


def test_directory_round_4x2_then_resume_in_2x1(tmp_path):
    agg = ["--dir", str(tmp_path / "agg")]
    states, before = run_job(tmp_path, "a", 4, 2, [4, 4, 4, 4], agg)
    check_merged_and_shares(tmp_path, "a", states)
    # What rank 2 saved from its share resumes the whole job in another topology.
    _, after = run_job(
        tmp_path, "b", 2, 1, [6, 6], ["--dir", str(tmp_path / "agg2")], restore=tmp_path / "a-2.zph"
    )
    check_lanes(uninterrupted(60), before, after)
    assert not list((tmp_path / "agg").rglob("*")) or all(
        p.is_dir() for p in (tmp_path / "agg").rglob("*")
    )


@pytest.mark.etcd
def test_etcd_round_then_resume_in_one_process(tmp_path):
    with etcd_server() as etcd:
        agg = ["--etcd", f"etcd://{etcd.endpoint}"]
        states, before = run_job(tmp_path, "a", 2, 0, [5, 5], agg)
        check_merged_and_shares(tmp_path, "a", states)
    with lm_pipeline(seed=41, lanes=4, num_epochs=None) as p:
        p.restore(states[1])  # rank 1's saved share, on one rank
        after: dict[int, list[str]] = {}
        for _ in range(12):
            batch = next(p)
            digest = hashlib.sha256(
                b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch))
            )
            after.setdefault(p.last_batch_lanes[0], []).append(digest.hexdigest()[:16])
    check_lanes(uninterrupted(60), before, after)
