"""zephon.jax.Checkpointable in Orbax v1 checkpoints. The one-process cases are in
_jax_cases_orbax_v1.py and run in a fresh process with 4 CPU devices (see _jax_common.py
for why not in this one); here also a two-process JAX job saves model and loader with
save_checkpointables, with and without a checkpoint round, and one process restores
both checkpoints and continues with the same global batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.integration._jax_common import require, run_cases, run_jax_processes
from tests.integration._orbax_v1_mp_worker import LAYOUTS, SAVE_AT, STEPS, build
from zephon.testing import assert_same_batches, take

require("jax", "orbax.checkpoint")

pytestmark = pytest.mark.jax

HERE = Path(__file__).parent
WORKER = HERE / "_orbax_v1_mp_worker.py"
TIMEOUT_S = 180


def test_orbax_v1_checkpointable():
    run_cases("_jax_cases_orbax_v1.py", devices=4)


def _launch(workdir: Path, num_processes: int, mode: str) -> None:
    ran = run_jax_processes(
        WORKER, num_processes, "--workdir", str(workdir), "--mode", mode, timeout_s=TIMEOUT_S
    )
    for i, (code, log) in enumerate(ran):
        assert code == 0, f"{mode} process {i} exited with {code}:\n{log[-4000:]}"


def _batches(path: Path) -> list[dict[str, np.ndarray]]:
    with np.load(path) as z:
        steps = sorted({int(k.split("/")[0]) for k in z.files})
        return [{k.split("/")[1]: z[k] for k in z.files if k.startswith(f"{s}/")} for s in steps]


def test_two_processes_save_and_one_process_restores(tmp_path):
    with build() as pipe:  # one rank over all 4 lanes: the global batches
        reference = take(pipe, STEPS)
    _launch(tmp_path, 2, "save")
    for name, files in LAYOUTS.items():
        loader = tmp_path / name / "loader"
        assert sorted(p.name for p in loader.iterdir()) == files, name
        # lockstep: rank 0's rows then rank 1's are the global batch
        ranks = [_batches(tmp_path / f"{name}-rank{r}.npz") for r in range(2)]
        joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*ranks, strict=True)]
        assert_same_batches(reference, joined, f"{name}: the two-process run")
    _launch(tmp_path, 1, "restore")
    for name in LAYOUTS:
        resumed = _batches(tmp_path / f"{name}-resumed.npz")
        assert_same_batches(reference[SAVE_AT:], resumed, f"{name}: restored on one process")
