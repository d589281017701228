"""The benchmark suite still runs: every question's script in ``--quick`` mode (tiny sizes,
one repetition) writes its JSON with rows, and ``python -m benchmarks`` runs questions and
writes its summary. Numbers are not checked here (CI machines are noisy); correctness claims
the benchmarks make (exact resume, exact elastic continuation) are.

These runs are benchmark code, not product code: they carry the ``bench`` marker, which the
default run leaves out (``pyproject.toml``); ``pytest -m bench`` runs them.

Grain is a benchmark-only extra: where it is not installed the scripts measure Zephon alone.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = [
    "lm_throughput",
    "restore",
    "flush_tradeoff",
    "mixture_fidelity",
    "elastic",
    "transport",
    "round_latency",
    "ring_depth",
    "many_lanes",
    "worker_memory",
    "many_components",
    "packing",
    "data_at_scale",
    "random_map",
    "pretokenized",
    "media",
]


def _rows(results: Path, name: str) -> list[dict]:
    path = results / f"{name}.json"
    assert path.exists(), f"{name} wrote no {path.name}"
    payload = json.loads(path.read_text())
    assert payload["name"] == name
    assert payload["machine"]["packages"]["zephon"], "machine/versions not recorded"
    assert payload["machine"]["date"]
    rows = payload["rows"]
    assert isinstance(rows, list) and rows, f"{name}.json has no rows"
    return rows


@pytest.mark.bench
@pytest.mark.processes
@pytest.mark.parametrize("name", SCRIPTS)
def test_script_quick(name, tmp_path, capsys):
    try:
        mod = importlib.import_module(f"benchmarks.{name}")
    except ImportError as e:  # round_latency is written separately; the suite guards it too
        pytest.skip(f"benchmarks.{name} not importable: {e}")
    assert mod.main(["--quick", "--results", str(tmp_path)]) == 0
    rows = _rows(tmp_path, name)
    out = capsys.readouterr().out
    assert "---" in out, "no table printed"
    if name == "flush_tradeoff":
        assert [r["k"] for r in rows] == [1, 2, 4, 8, 16]
        assert all(r["exact"] for r in rows), rows
        assert (tmp_path / "flush_tradeoff.png").exists()
    elif name == "mixture_fidelity":
        assert any("ensure_mixture" in r["approach"] for r in rows)
        assert (tmp_path / "mixture_fidelity.png").exists()
    elif name == "elastic":
        zephon_rows = [r for r in rows if r["loader"] == "zephon"]
        assert len(zephon_rows) == 4
        for r in zephon_rows:
            assert r["lanes exact"] == "8/8" and r["docs repeated"] == 0, r
            assert r["stream exact"] in (True, None), r
    elif name == "packing":
        strategies = ["first_fit", "best_fit", "concat_then_split"]
        zephon = {r["strategy"]: r for r in rows if r["loader"] == "zephon"}
        assert sorted(zephon) == sorted(strategies)
        assert all(r["batches/s best"] > 0 for r in rows), rows
        assert zephon["concat_then_split"]["padding fraction"] <= min(
            zephon["first_fit"]["padding fraction"], zephon["best_fit"]["padding fraction"]
        ), rows
        if any(r["loader"] == "grain" for r in rows):
            assert {r["strategy"] for r in rows if r["loader"] == "grain"} == set(strategies)
            assert all(zephon[s]["x grain"] > 0 for s in strategies), rows
    elif name == "random_map":
        assert [r["operator"] for r in rows][:2] == ["map", "random_map"], rows
        assert all(r["us_per_record"] > 0 for r in rows), rows
    elif name == "pretokenized":
        assert rows[0]["loader"] == "zephon" and rows[0]["batches"] > 0, rows
    elif name == "restore":
        assert all(r["exact"] for r in rows), rows
    elif name == "worker_memory":
        pss = [r for r in rows if "after" in r]
        assert [r["after"] for r in pss] == ["first batch", "full pass"]
        # The array is in the caller's memory and shared once: never a copy per worker.
        assert all(r["(PSS - baseline) / array"] < 2.6 for r in pss), pss  # a copy each: 3


@pytest.mark.bench
def test_suite_runner_writes_summary(tmp_path, capsys):
    from benchmarks.__main__ import main

    assert main(["--quick", "--only", "q6", "--results", str(tmp_path)]) == 0
    summary = _rows(tmp_path, "suite")
    assert [(r["question"], r["module"], r["status"]) for r in summary] == [
        ("q6", "transport", "ok")
    ]
    _rows(tmp_path, "transport")
    assert "results:" in capsys.readouterr().out


def test_suite_runner_only_parsing():
    from benchmarks.__main__ import QUESTIONS, _parse_only

    assert _parse_only(None) == list(QUESTIONS)
    assert _parse_only("q3, elastic,7,q3") == ["q3", "q5", "q7"]
    with pytest.raises(SystemExit, match="unknown question"):
        _parse_only("q99")
