"""Two OS processes in a jax.distributed job on the CPU backend (gloo collectives, 2 + 2
devices) train on lockstep global batches, save model and loader with Orbax at step K and
are killed; one process with 4 devices restores step K, and every global batch after K —
and the model state — equals the uninterrupted two-process run's.

The processes are _jax_mp_worker.py; see its docstring for what each one does.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.integration._jax_common import require, run_jax_processes

require("jax", "orbax.checkpoint")

pytestmark = pytest.mark.jax

HERE = Path(__file__).parent
WORKER = HERE / "_jax_mp_worker.py"
STEPS, SAVE_AT, CRASH_AFTER = 10, 4, 7
TIMEOUT_S = 120


def launch(workdir: Path, num_processes: int, tag: str, *extra: str) -> list[int]:
    """Run one job of ``num_processes`` workers (4 devices in all); their return codes."""
    ran = run_jax_processes(
        WORKER, num_processes, "--workdir", str(workdir), "--steps", str(STEPS), "--tag", tag,
        *extra, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    codes = [code for code, _ in ran]
    logs = [log for _, log in ran]
    crashed = "--crash-after" in extra
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        # After the step barrier each process kills itself; one that the coordination
        # service sees its peer die first aborts (SIGABRT) on its way to the same kill.
        ok = code in (-signal.SIGKILL, -signal.SIGABRT) if crashed else code == 0
        assert ok, f"{tag} process {i} exited with {code}:\n{log[-4000:]}"
    return codes


def read(workdir: Path, pid: int, n: int, tag: str) -> list[dict]:
    lines = (workdir / f"digests-{pid}-of-{n}-{tag}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref_dir = tmp_path_factory.mktemp("ref")
    launch(ref_dir, 2, "ref")
    ref = read(ref_dir, 0, 2, "ref")
    assert [r["step"] for r in ref] == list(range(STEPS))
    assert read(ref_dir, 1, 2, "ref") == ref  # both processes see the same global batches
    return ref


@pytest.mark.parametrize(
    "aggregate, files",
    [
        # No aggregation: one file per rank, merged on restore.
        (False, ["process_0-of-2.zph", "process_1-of-2.zph"]),
        # aggregate_store="jax://": every rank holds the merged state; the primary writes it.
        (True, ["loader.zph"]),
    ],
    ids=["per-rank-files", "jax-aggregation"],
)
def test_two_processes_crash_and_one_process_resumes_the_same_global_batches(
    reference, tmp_path, aggregate, files
):
    flags = ["--aggregate"] if aggregate else []
    launch(
        tmp_path, 2, "crash", "--save-at", str(SAVE_AT), "--crash-after", str(CRASH_AFTER), *flags
    )
    for pid in range(2):
        assert read(tmp_path, pid, 2, "crash") == reference[:CRASH_AFTER]
    loader = tmp_path / "ckpt" / str(SAVE_AT) / "loader"
    assert sorted(p.name for p in loader.iterdir() if p.suffix == ".zph") == files

    launch(tmp_path, 1, "resumed", "--restore", str(SAVE_AT))
    resumed = read(tmp_path, 0, 1, "resumed")
    assert resumed == reference[SAVE_AT:], "global batches (or the model) after the restore differ"
