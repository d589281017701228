"""A MaxText-style input pipeline on Zephon, saved and restored with Orbax.

JSONL documents -> tokenize -> best-fit pack with a cap on segments per row ->
``lm_targets(names="maxtext")`` -> lockstep global ``jax.Array`` batches with MaxText's
feature names (``inputs``, ``inputs_segmentation``, ``inputs_position``, ``targets``,
``targets_segmentation``, ``targets_position``), the loader saved with the model in one
Orbax step and restored exactly:

    python examples/maxtext_style.py --workdir /tmp/mt --steps 40 --save-at 20

runs 40 steps, saves at step 20, builds everything again, restores step 20 and checks
that steps 21..39 come out bit for bit as before. ``layout()`` prints what a batch holds.
On a multi-host job call ``jax.distributed.initialize()`` first: ranks then default to
JAX's, and the global batch of a step is the same for any number of hosts.

MaxText's own Grain pipeline (``_grain_data_processing.py``) does the same with
``Rekey({"inputs": "text", "targets": "text"})``, ``BestFitPackIterDataset``,
``batch`` and ``ShiftData(ignored_ids=[pad_id])``. The layout is the same (names, shapes,
dtypes, segment ids from 1, positions from 0 per segment); one deliberate difference:
``ShiftData`` shifts targets across segment boundaries, so the last token of a document
is trained to predict the next document's first token, where Zephon gives it
``ignore_id`` and a 0 in ``targets_segmentation`` (tests/integration/test_maxtext_example.py
compares the two on one corpus).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import zephon as zp

SEQ_LEN = 256
PER_LANE_BATCH = 2
PAD_ID = 0


def write_corpus(path: Path, docs: int = 400, seed: int = 0) -> Path:
    """A small JSONL corpus of documents of varied length (for trying the example)."""
    rng = np.random.default_rng(seed)
    words = ["data", "loader", "exact", "resume", "token", "pack", "shard", "host", "step"]
    with open(path, "w") as f:
        for i in range(docs):
            n = int(rng.integers(3, 120))
            f.write(json.dumps({"text": " ".join(rng.choice(words, n)) + f" #{i}"}) + "\n")
    return path


def build(
    corpus: Path, lanes: int = 4, workers: int = 0, num_epochs: int | None = None
) -> zp.Pipeline:
    """The pipeline: every lane's batch is ``PER_LANE_BATCH`` rows; lockstep concatenates
    the lanes, so a global batch is ``lanes * PER_LANE_BATCH`` rows."""
    src = zp.StaticMixtureWorkSource(
        [zp.JsonlSource(corpus, field="text")], seed=0, chunk_size=32, num_epochs=num_epochs
    )
    return (
        zp.Pipeline(src, canonical_replicas=lanes, output="lockstep", workers=workers)
        .fetch()
        .tokenize(zp.ByteTokenizer())  # MaxText: its sentencepiece / HF tokenizer
        .split(max_len=SEQ_LEN)  # MaxText truncates; split keeps the rest as more pieces
        .pack(SEQ_LEN, num_bins=8, strategy="best_fit", max_segments=16)
        .lm_targets(ignore_id=PAD_ID, names="maxtext")
        .batch(PER_LANE_BATCH)
    )


def layout(batch: dict[str, Any]) -> str:
    return "\n".join(
        f"  {k:22s} {np.asarray(v).dtype.name:6s} {tuple(np.shape(v))}"
        for k, v in sorted(batch.items())
    )


def run(workdir: Path, steps: int, save_at: int) -> bool:
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    import zephon.jax

    corpus = write_corpus(workdir / "corpus.jsonl")
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))

    def digests(it: Any, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            batch = next(it)
            out.append(b"".join(np.asarray(batch[k]).tobytes() for k in sorted(batch)))
        return out

    manager = ocp.CheckpointManager(workdir / "ckpt")
    with zephon.jax.global_batches(build(corpus), sharding) as it:
        first = next(it)
        print("a global batch:\n" + layout(first))
        before = [b"".join(np.asarray(first[k]).tobytes() for k in sorted(first))]
        before += digests(it, save_at - 1)
        manager.save(save_at, args=ocp.args.Composite(loader=zephon.jax.CheckpointSave(it)))
        manager.wait_until_finished()
        before += digests(it, steps - save_at)
    with zephon.jax.global_batches(build(corpus), sharding) as it:
        manager.restore(save_at, args=ocp.args.Composite(loader=zephon.jax.CheckpointRestore(it)))
        after = digests(it, steps - save_at)
    manager.close()
    same = after == before[save_at:]
    print(
        f"restored step {save_at}: steps {save_at}..{steps - 1} "
        + ("identical bit for bit" if same else "DIFFER")
    )
    return same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-at", type=int, default=20)
    args = ap.parse_args(argv)
    if not 0 < args.save_at < args.steps:
        ap.error(f"--save-at must be in (0, --steps={args.steps}); got {args.save_at}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    return 0 if run(args.workdir, args.steps, args.save_at) else 1


if __name__ == "__main__":
    sys.exit(main())
