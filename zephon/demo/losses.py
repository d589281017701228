"""The demo's loss log: one JSON line per computed step and attempt, written as training
goes (a SIGKILL loses nothing written), read back as a trajectory, compared exactly between
an uninterrupted run and a crashed-then-resumed one, and plotted.

:mod:`zephon.demo.train_lm` writes it to ``WORKDIR/losses.jsonl``; a step recomputed after a
resume appears once per attempt, and the trajectory is the last value per step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LOG = "losses.jsonl"


def write_record(f: Any, record: dict[str, Any]) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()  # a SIGKILL loses nothing that was written


def attempts(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for r in read_log(path) if r.get("event") == "start")


def read_log(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def trajectory(path: str | Path) -> dict[int, float]:
    """step -> loss, the last attempt's value for a step computed more than once."""
    out: dict[int, float] = {}
    for r in read_log(_log_path(path)):
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return dict(sorted(out.items()))


def _log_path(path: str | Path) -> Path:
    p = Path(path)
    return p / LOG if p.is_dir() else p


def plot_losses(ref_log: str | Path, resumed_log: str | Path, out_png: str | Path) -> None:
    """Overlay the uninterrupted run's loss curve and the crashed-then-resumed run's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = trajectory(ref_log)
    records = read_log(_log_path(resumed_log))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(list(ref), list(ref.values()), color="0.75", linewidth=5, label="uninterrupted run")
    styles = ["-", "--", ":", "-."]
    for attempt in sorted({r["attempt"] for r in records if "loss" in r}):
        pts = [(r["step"], r["loss"]) for r in records if "loss" in r and r["attempt"] == attempt]
        label = "crashed run" if attempt == 0 else f"resumed run (attempt {attempt})"
        ax.plot(*zip(*pts, strict=True), styles[attempt % len(styles)], linewidth=1.4, label=label)
    for r in records:
        if r.get("event") == "crash":
            ax.axvline(r["step"], color="tab:red", linewidth=0.8)
            ax.annotate(" SIGKILL", (r["step"], ax.get_ylim()[1]), color="tab:red", va="top")
        if r.get("event") == "start" and r["from_step"]:
            ax.axvline(r["from_step"], color="tab:green", linewidth=0.8)
            ax.annotate(
                f" restored step {r['from_step']}",
                (r["from_step"], ax.get_ylim()[1]),
                color="tab:green",
                va="top",
                ha="right",
                rotation=90,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("Zephon: loss after crash + resume vs. uninterrupted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def compare(ref_log: str | Path, resumed_log: str | Path) -> tuple[bool, str]:
    """Whether the resumed run's losses equal the uninterrupted run's exactly, and why not.

    Also checks the steps recomputed after the resume (between the checkpoint and the
    crash) against what the crashed attempt computed for them.
    """
    ref, got = trajectory(ref_log), trajectory(resumed_log)
    if list(ref) != list(got):
        return False, f"steps differ: uninterrupted has {len(ref)}, resumed has {len(got)}"
    for step, loss in ref.items():
        if got[step] != loss:
            return False, f"step {step}: uninterrupted loss {loss!r}, resumed {got[step]!r}"
    first: dict[int, float] = {}
    for r in read_log(_log_path(resumed_log)):
        if "loss" in r:
            if r["step"] in first and first[r["step"]] != r["loss"]:
                return (
                    False,
                    f"step {r['step']} recomputed after the resume gave {r['loss']!r}, the crashed run {first[r['step']]!r}",
                )
            first.setdefault(r["step"], r["loss"])
    return True, ""
