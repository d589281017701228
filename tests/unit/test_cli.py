"""The command line: ``zephon inspect`` and a short ``zephon demo``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zephon as zp
from zephon.cli.main import EXIT_BROKEN_PIPE, main
from zephon.demo.corpus import demo_pipeline

REPO = Path(__file__).resolve().parents[2]


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


def test_inspect_shows_each_component_and_its_content_identity(ckpt, capsys):
    path, state = ckpt
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"component 0 'topics': [\d,]+ samples, weight 0\.3, kind=items sample=[0-9a-f]{16}", out
    ), out
    assert re.search(r"component 1 'paragraphs': [\d,]+ samples, weight 0\.7, kind=items", out), out
    assert main(["inspect", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    first = info["components"][0]
    assert first["name"] == "topics" and first["identity"]["kind"] == "items"
    assert first["identity"]["sample"] == state["fingerprint_parts"][
        "component.0.identity.sample"
    ].strip("'")
    assert info["fingerprint_parts"] == state["fingerprint_parts"]


def test_inspect_of_a_checkpoint_without_parts_says_so(ckpt, capsys):
    path, state = ckpt
    zp.save(path, {k: v for k, v in state.items() if k != "fingerprint_parts"})
    assert main(["inspect", str(path)]) == 0
    assert (
        "components: not recorded (a checkpoint made before content identities)"
        in capsys.readouterr().out
    )


def _run_into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run the command line with stdout a pipe whose reader is gone, as ``| head`` leaves it
    once it has read enough."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "zephon.cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=REPO,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "--json", "{path}"],
        ["inspect", "{path}"],
        [
            "demo",
            "--steps",
            "8",
            "--crash-at",
            "3",
            "--lanes",
            "2",
            "--workers",
            "0",
            "--quiet",
            "--no-train",
        ],
        ["--help"],
    ],
    ids=["inspect --json", "inspect", "demo", "help"],
)
def test_a_closed_stdout_ends_quietly(ckpt, args):
    path, _ = ckpt
    done = _run_into_a_closed_pipe(*(a.format(path=path) for a in args))
    assert done.stderr == b""
    # argparse's help swallows the error itself (and exits 0); the rest stop with SIGPIPE's
    # status, as cat or grep would.
    assert done.returncode == (0 if args == ["--help"] else EXIT_BROKEN_PIPE)


def test_inspect_shows_per_component_samples_tokens_epoch_and_position(tmp_path, capsys):
    """Over all lanes: samples dealt, in flight, delivered, tokens dealt, dataset epoch and
    position, checked against the lanes' own work sources."""
    import numpy as np

    docs = {"short": ["ab" * (1 + i % 5) for i in range(30)], "long": ["xyz" * 40] * 7}
    tok = zp.ByteTokenizer()
    src = zp.StaticMixtureWorkSource(
        {n: zp.ArraySource(d) for n, d in docs.items()},
        {"short": 1, "long": 1},
        weight_unit="tokens",
        lengths={n: np.asarray(tok.count_tokens(d)) for n, d in docs.items()},
        chunk_size=4,
    )
    pipe = (
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2, prefetch=0)
        .fetch()
        .tokenize(tok)
        .split(32)
        .pack(32, num_bins=2)
        .batch(2)
    )
    with pipe:
        for _ in range(80):
            next(pipe)
        state = pipe.checkpoint()
        sources = [pipe._engine.trackers[lane].source for lane in pipe.lanes]
    path = tmp_path / "tok.zph"
    zp.save(path, state)
    assert main(["inspect", "--json", str(path)]) == 0
    mix = json.loads(capsys.readouterr().out)["mixture"]
    for c, name in enumerate(docs):
        samples = sum(s.positions[c] for s in sources)
        inflight = sum(
            int(np.count_nonzero(np.frombuffer(ch["components"], "<i4") == c))
            for ls in state["lanes"]
            for ch in ls["inflight"]
        )
        assert mix[c] == {
            "component": c,
            "name": name,
            "weight": 0.5,
            "samples": samples,
            "in_flight": inflight,
            "delivered": samples - inflight,
            "tokens": sum(s.tokens_dealt[c] for s in sources),
            "epoch": samples // len(docs[name]),
            "position": samples % len(docs[name]),
        }
    assert mix[1]["epoch"] >= 1  # the long component wrapped around its 7 documents
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "samples dealt, in flight (replayed on restore), delivered, tokens dealt" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("1  long"))
    assert f"{mix[1]['tokens']:,}" in line and f"{mix[1]['epoch']} / {mix[1]['position']}" in line
