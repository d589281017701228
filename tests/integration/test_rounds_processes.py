"""Checkpoint rounds with every rank its own OS process, over a directory and over a real
etcd: two jobs, or two pipelines of one job, on one store location never return a mixed
state; and a leader SIGSTOPped just before its commit ends with every rank agreeing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.etcd_server import etcd_server

pytestmark = [pytest.mark.stores, pytest.mark.processes]

RANK = Path(__file__).parent / "_store_rounds_rank.py"
WORLD = 3
ROUNDS = 3


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as server:
        yield server


@pytest.fixture(params=["directory", pytest.param("etcd", marks=pytest.mark.etcd)])
def location(request, tmp_path):
    if request.param == "directory":
        return str(tmp_path / "agg")
    return request.getfixturevalue("etcd").url


def _start(url: str, namespace: str, env: dict[str, str], mode: str = "normal", ttl: float = 5.0):
    return [
        subprocess.Popen(
            [sys.executable, str(RANK), url, namespace, str(r), str(WORLD), str(ROUNDS)]
            + [str(ttl), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        for r in range(WORLD)
    ]


def _finish(procs: list[subprocess.Popen], timeout_s: float = 120) -> list[list[dict]]:
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.communicate()
    return [[json.loads(x) for x in out.splitlines() if x.startswith("{")] for _, out, _ in outs]


@pytest.mark.parametrize("split", ["jobs", "pipelines"])
def test_two_jobs_or_two_pipelines_on_one_location_never_mix(location, split):
    namespace = uuid.uuid4().hex
    if split == "jobs":  # same pipeline, two job ids (what two launchers would give)
        envs = [{"ZEPHON_JOB_ID": "job-a"}, {"ZEPHON_JOB_ID": "job-b"}]
    else:  # one job, a train and an eval pipeline
        envs = [{"ZEPHON_TEST_FINGERPRINT": "a" * 64}, {"ZEPHON_TEST_FINGERPRINT": "b" * 64}]
    envs = [{**env, "ZEPHON_TEST_MARK": mark} for env, mark in zip(envs, "AB", strict=True)]
    if split == "pipelines":
        for env in envs:
            env["ZEPHON_JOB_ID"] = "one-job"
    procs = [_start(location, namespace, env) for env in envs]  # both jobs at once
    results = [_finish(p) for p in procs]
    for mark, ranks in zip("AB", results, strict=True):
        for rank, records in enumerate(ranks):
            assert [r.get("round") for r in records] == list(range(ROUNDS)), records
            for rec in records:
                assert rec["ok"], rec
                assert {lane["mark"] for lane in rec["merged"]["lanes"]} == {mark}, rec
                lanes = [lane["lane"] for lane in rec["merged"]["lanes"]]
                assert lanes == (list(range(2 * WORLD)) if rank == 0 else [2 * rank, 2 * rank + 1])


@pytest.mark.etcd
def test_stale_leader_sigstopped_before_its_commit_over_etcd_the_ranks_agree(etcd):
    """The leader SIGSTOPs itself after collecting every state; its lease expires and the
    followers give it up (deciding the round as failed). Resumed, it must fail too."""
    ttl = 2.0
    procs = _start(etcd.url, uuid.uuid4().hex, {}, mode="stop_before_publish", ttl=ttl)
    try:
        line = procs[0].stdout.readline()
        assert "stopped" in line, line
        for p in procs[1:]:
            p.wait(timeout=60)
        time.sleep(0.1)
        os.kill(procs[0].pid, signal.SIGCONT)
    finally:
        results = _finish(procs)
    for records in results[1:]:
        (rec,) = records
        assert not rec["ok"] and "is gone" in rec["error"], rec
    lead = [r for r in results[0] if "round" in r]
    assert len(lead) == 1 and not lead[0]["ok"], "a split: the resumed leader succeeded"
    assert (
        "lapsed during round" in lead[0]["error"]
        or "ended before this leader could commit it" in lead[0]["error"]
    ), lead[0]["error"]
