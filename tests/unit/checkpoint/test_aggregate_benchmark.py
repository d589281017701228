"""benchmarks/round_latency.py runs (threads, two rounds) and writes its results."""

from __future__ import annotations

import json

from benchmarks import round_latency


def test_round_latency_quick(tmp_path, capsys):
    assert (
        round_latency.main(["--quick", "--threads", "--rounds", "2", "--results", str(tmp_path)])
        == 0
    )
    assert "Checkpoint round latency" in capsys.readouterr().out
    rows = json.loads((tmp_path / "round_latency.json").read_text())["rows"]
    assert [(r["store"], r["ranks"]) for r in rows] == [
        (store, n) for store in ("directory", "etcd") for n in (2, 4, 8)
    ]
    assert all(0 < r["median ms"] <= r["max ms"] for r in rows)


def test_states_cover_the_lanes_the_round_expects():
    states = [round_latency.rank_state(r, 4, 3, step=1) for r in range(4)]
    merged = round_latency.merge(states)
    assert [lane["lane"] for lane in merged["lanes"]] == list(range(12))
