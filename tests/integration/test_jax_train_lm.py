"""The main job, short: examples/train_lm.py trains with loader worker processes, is
SIGKILLed at step 7, is run again with the same command, and its losses equal the
uninterrupted run's exactly; the loss plot is written."""

from __future__ import annotations

import json

import pytest

from tests.integration._jax_common import JAX_STACK, require

require(*JAX_STACK)

from zephon.demo.losses import LOG, compare, trajectory  # noqa: E402
from zephon.demo.train_lm import run_demo  # noqa: E402

pytestmark = [pytest.mark.jax, pytest.mark.processes]

STEPS, CRASH_AT, CKPT_EVERY = 12, 7, 3


def test_losses_after_sigkill_and_resume_equal_the_uninterrupted_runs(tmp_path, capsys):
    png = tmp_path / "losses.png"
    assert run_demo(
        tmp_path, steps=STEPS, crash_at=CRASH_AT, workers=1, ckpt_every=CKPT_EVERY, out_png=png
    )
    assert "PROOF: all 12 losses identical" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    ref, run = tmp_path / "uninterrupted", tmp_path / "crash-and-resume"
    records = [json.loads(line) for line in (run / LOG).read_text().splitlines()]
    events = [r for r in records if "event" in r]
    assert [e["event"] for e in events] == ["start", "crash", "start", "end"]
    assert events[1]["step"] == CRASH_AT
    resumed_from = events[2]["from_step"]
    # Step 6's save may still have been committing when the SIGKILL came: then step 3.
    assert resumed_from in (3, 6)
    attempts = {(r["attempt"], r["step"]) for r in records if "loss" in r}
    assert {s for a, s in attempts if a == 0} == set(range(CRASH_AT))
    assert {s for a, s in attempts if a == 1} == set(range(resumed_from, STEPS))

    ref_losses = trajectory(ref)
    assert list(ref_losses) == list(range(STEPS))
    assert trajectory(run) == ref_losses  # exact float equality, no tolerance
    assert compare(ref, run) == (True, "")


def test_compare_reports_the_first_differing_step(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(
        "".join(json.dumps({"attempt": 0, "step": s, "loss": 1.0 + s}) + "\n" for s in range(3))
    )
    b.write_text(
        "".join(
            json.dumps({"attempt": 0, "step": s, "loss": 1.0 + s + (s == 2) * 1e-7}) + "\n"
            for s in range(3)
        )
    )
    same, why = compare(a, b)
    assert not same and why.startswith("step 2: uninterrupted loss 3.0, resumed 3.0000001")
