"""examples/maxtext_style.py against MaxText's own Grain pipeline on one corpus: the same
feature names, dtypes and row shape, every document in both, the same next-token relation
wherever the loss counts; the one difference (ShiftData shifts across segment boundaries)
is exactly at the segments' last tokens. And the example itself runs and resumes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zephon as zp

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("maxtext_style", ROOT / "examples/maxtext_style.py")
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

SEQ = example.SEQ_LEN
PAD = example.PAD_ID


def _short_corpus(path: Path) -> Path:
    rng = np.random.default_rng(1)
    with open(path, "w") as f:
        for i in range(120):
            f.write(json.dumps({"text": "ab" * int(rng.integers(1, 100)) + f" {i}"}) + "\n")
    return path


def _maxtext_grain_batches(texts: list[str]) -> list[dict[str, np.ndarray]]:
    """MaxText's _grain_data_processing pretrain path, rebuilt from its code: tokenize and
    trim, Rekey inputs/targets, BestFitPackIterDataset, rename to *_segmentation and
    *_position, batch, ShiftData(ignored_ids=[pad_id], axis=1)."""
    grain = pytest.importorskip("grain.python")
    from grain.experimental import BestFitPackIterDataset

    tok = zp.ByteTokenizer()

    def tokenize(text: str) -> dict[str, np.ndarray]:
        ids = np.asarray(tok.encode(text), np.int32)[:SEQ]
        return {"inputs": ids, "targets": ids}

    ds = grain.MapDataset.source(texts).map(tokenize).to_iter_dataset()
    ds = BestFitPackIterDataset(
        ds, length_struct={"inputs": SEQ, "targets": SEQ}, num_packing_bins=8
    )
    out = []
    for row in ds:
        mt = {}
        for k in ("inputs", "targets"):
            mt[k] = row[k]
            mt[k + "_segmentation"] = row[k + "_segment_ids"]
            mt[k + "_position"] = row[k + "_positions"]
        # ShiftData: targets shifted left, padded with pad_id; targets_segmentation 0 where
        # the shifted target is an ignored id
        shifted = np.full_like(mt["targets"], PAD)
        shifted[:-1] = mt["targets"][1:]
        mt["targets"] = shifted
        mt["targets_segmentation"] = np.where(shifted != PAD, mt["targets_segmentation"], 0)
        out.append(mt)
    return out


def _documents(rows: list[dict[str, np.ndarray]]) -> list[bytes]:
    docs = []
    for r in rows:
        seg = r["inputs_segmentation"]
        for s in range(1, int(seg.max(initial=0)) + 1):
            docs.append(r["inputs"][seg == s].tobytes())
    return sorted(docs)


# The example batches with drop_last=True, as MaxText does: its end drops on purpose.
@pytest.mark.filterwarnings("ignore::zephon.errors.DroppedRecordsWarning")
def test_layout_matches_maxtexts_grain_pipeline(tmp_path: Path) -> None:
    corpus = _short_corpus(tmp_path / "c.jsonl")
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    mt_rows = _maxtext_grain_batches(texts)
    pipe = example.build(corpus, lanes=2, num_epochs=1)
    zp_rows = []
    with pipe:
        for batch in pipe:
            zp_rows.extend({k: v[i] for k, v in batch.items()} for i in range(len(batch["inputs"])))
    assert sorted(zp_rows[0]) == sorted(mt_rows[0])
    for k in mt_rows[0]:
        assert zp_rows[0][k].dtype == mt_rows[0][k].dtype, k
        assert zp_rows[0][k].shape == mt_rows[0][k].shape == (SEQ,), k
    # lockstep drops what lanes still held at the first lane's end: compare the documents
    # Zephon delivered, all of which MaxText's pipeline has too
    zp_docs, mt_docs = _documents(zp_rows), _documents(mt_rows)
    assert len(mt_docs) == len(texts)
    assert len(zp_docs) > len(texts) // 2
    assert not (set(zp_docs) - set(mt_docs))
    for rows in (zp_rows, mt_rows):
        for r in rows:
            live = np.nonzero(r["targets_segmentation"][:-1])[0]
            np.testing.assert_array_equal(r["targets"][live], r["inputs"][live + 1])
            seg, pos = r["inputs_segmentation"], r["inputs_position"]
            for s in range(1, int(seg.max(initial=0)) + 1):
                np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
    # the deliberate difference: MaxText counts each segment's last token (its target is
    # the next document's first token); Zephon does not
    for r in mt_rows:
        seg = r["inputs_segmentation"]
        ends = np.nonzero((seg[:-1] != 0) & (seg[1:] != seg[:-1]) & (seg[1:] != 0))[0]
        assert (r["targets_segmentation"][ends] != 0).all()
    for r in zp_rows:
        seg = r["inputs_segmentation"]
        ends = np.nonzero((seg[:-1] != 0) & (seg[1:] != seg[:-1]))[0]
        assert (r["targets_segmentation"][ends] == 0).all()


@pytest.mark.jax
def test_the_example_runs_and_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/maxtext_style.py"),
            "--workdir",
            str(tmp_path),
            "--steps",
            "14",
            "--save-at",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "inputs_segmentation" in proc.stdout
    assert "identical bit for bit" in proc.stdout
