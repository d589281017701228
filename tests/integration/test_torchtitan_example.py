"""examples/torchtitan_style.py runs, dies at a step (SIGKILL), and the restarted job
resumes from the last DCP checkpoint with the same losses, bit for bit, as a run that
never stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.processes

ROOT = Path(__file__).parents[2]
STEPS, EVERY, CRASH_AT = 12, 4, 10


def run(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/torchtitan_style.py"),
            "--workdir",
            str(workdir),
            "--steps",
            str(STEPS),
            "--checkpoint-every",
            str(EVERY),
            *extra,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )


def losses(workdir: Path) -> list[tuple[int, float]]:
    lines = (workdir / "losses.jsonl").read_text().splitlines()
    return [(d["step"], d["loss"]) for d in map(json.loads, lines)]


def test_the_example_crashes_and_resumes_with_the_same_losses(tmp_path):
    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    reference = losses(tmp_path / "whole")
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))

    crashed = run(tmp_path / "job", "--crash-at", str(CRASH_AT))
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    resumed = run(tmp_path / "job")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    last = CRASH_AT // EVERY * EVERY
    assert f"resumed from step {last}" in resumed.stdout
    # the crashed run's steps, then the resumed run's from the checkpoint on
    assert losses(tmp_path / "job") == reference[:CRASH_AT] + reference[last:]
