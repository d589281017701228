"""The command line: ``zephon inspect`` and a short ``zephon demo``."""

from __future__ import annotations

import json

import pytest

import zephon as zp
from zephon.cli import main
from zephon.demo.corpus import demo_pipeline


@pytest.fixture()
def ckpt(tmp_path):
    with demo_pipeline(lanes=2, seq_len=256) as p:
        for _ in range(30):
            next(p)
        state = p.checkpoint()
    path = tmp_path / "loader.zph"
    zp.save(path, state)
    return path, state


def test_inspect_prints_lanes_cursor_and_what_restore_replays(ckpt, capsys):
    path, state = ckpt
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: {path.stat().st_size:,} bytes" in out
    assert "2 lanes, eviction=epoch, flush_every_k_chunks=4" in out
    replayed = sum(len(ls["inflight"]) for ls in state["lanes"])
    assert f"restore replays {replayed} chunks" in out
    for ls in state["lanes"]:
        cursor = "(" + ", ".join(map(str, ls["cursor"])) + ")"
        assert cursor in out


def test_inspect_json_is_machine_readable(ckpt, capsys):
    path, state = ckpt
    assert main(["inspect", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint"] == state["fingerprint"]
    assert [ln["lane"] for ln in info["lanes"]] == [0, 1]
    assert info["restore_replays"]["chunks"] == sum(
        len(ln["inflight_chunk_ids"]) for ln in info["lanes"]
    )
    assert info["lanes"][0]["replay_cursor"] == state["lanes"][0]["cursor"]


def test_inspect_corrupt_file_gets_the_load_error(ckpt, capsys):
    path, _ = ckpt
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "corrupt" in err and str(path) in err


def test_demo_pipeline_part_proves_identity(capsys):
    assert (
        main(
            [
                "demo",
                "--steps",
                "40",
                "--crash-at",
                "17",
                "--lanes",
                "2",
                "--workers",
                "0",
                "--quiet",
                "--no-train",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "PROOF: all 40 batches identical bit for bit" in out
    assert "crash at step 17" in out


def test_demo_rejects_a_crash_step_outside_the_run(capsys):
    assert main(["demo", "--steps", "10", "--crash-at", "10", "--no-train", "--quiet"]) == 2
    assert "--crash-at must be in (0, --steps=10)" in capsys.readouterr().err
