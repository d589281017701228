"""examples/vlm_captions.py: its rows tie every image to its placeholders, and the example
itself runs (a few JAX training steps on CPU) and resumes exactly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zephon.testing import assert_resumes_exactly

pytest.importorskip("PIL.Image", reason="pip install zephon[media]")

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("vlm_captions", ROOT / "examples/vlm_captions.py")
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def test_the_examples_rows_tie_each_image_to_its_placeholders_and_resume(tmp_path: Path) -> None:
    shards = example.write_shards(tmp_path, shards=2, per_shard=16)
    reference = assert_resumes_exactly(lambda: example.build(shards, num_epochs=1), cuts=[0, 2])
    assert len(reference) >= 3
    for batch in reference:
        example.check_layout(batch)  # the k-th placeholder run is image k, in its segment
        assert batch["image"].shape == (example.BATCH, example.MAX_IMAGES, 16, 16, 3)
    images = sum(int(b["image_mask"].sum()) for b in reference)
    tokens = np.concatenate([b["tokens"].ravel() for b in reference])
    assert (tokens == example.IMAGE_ID).sum() == images * example.PATCHES > 0
    assert any(b["image_mask"].sum(axis=1).max() > 1 for b in reference)  # rows of several


@pytest.mark.jax
def test_the_example_trains_and_resumes_exactly() -> None:
    pytest.importorskip("jax")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples/vlm_captions.py"), "--steps", "4", "--save-at", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "image_segment_ids    int32  (4, 3)" in proc.stdout
    assert "steps 2..3 identical bit for bit" in proc.stdout
