"""Question 3: what ``flush_every_k_chunks`` (k) costs and buys, for k in 1, 2, 4, 8, 16.

Every k chunks of a lane a flush sentinel makes the packer emit its half-full bins, empties
the shuffle buffer and resets both; that is what lets a finished epoch leave the in-flight
set, so k bounds what a restore replays. A small k therefore pays in padding and in shuffle
quality; a large k pays in replay work and checkpoint bytes. Pipeline: the LM workload
(``zephon_lm_pipeline``'s chain: Feistel-shuffled source, byte tokens, split and first-fit pack
to 2048 with 8 bins, batch 8) with ``.shuffle(buffer_size=64)`` before ``batch``.

Measured per k:

* **padding fraction**: 1 - real tokens / padded positions over every delivered batch.
* **shuffle quality**: the mean absolute displacement, in documents, between a document's
  position in its lane's *source* order (the order the work source dealt it to the lane:
  chunk 0 offsets 0..63, chunk 1, ...) and its position in that lane's *output* order (the
  order its first piece appears in the lane's batches, row by row, left to right). To see
  documents in the output, each document is prefixed with an 8-byte tag ``~NNNNNNN`` (its
  index; ``~`` and digits never occur in the synthetic text), read back from the packed
  tokens; a document seen twice in a lane (a later dataset epoch) is matched occurrence by
  occurrence. Packing alone already moves documents a little (short ones fill older bins);
  the shuffle moves them further, but never across a flush, so the displacement grows with
  k. For scale, the table gives the displacement a uniformly random permutation of one whole
  epoch (k x chunk_size documents) would have, (k x chunk_size) / 3.
* **replayed chunks**: ``stats()["replayed_chunks"]`` right after restoring checkpoints
  taken at a few steps (the max over those steps, all lanes together, and per lane), each
  checked to continue exactly (the first restored batch equals the uninterrupted one). Each
  checkpoint is taken after a 0.1 s pause, as a training step would give the prefetch pump
  time to fill: chunks the pump has already pulled from the work source are in flight, so
  the count (and the checkpoint bytes) include what prefetch=3 keeps ahead, and a checkpoint
  taken right after a burst of ``next()`` calls can be a little smaller.
* **checkpoint bytes**: what ``zp.save`` writes (msgpack + zstd), the max over those steps.
* **throughput**: batches/s over interleaved repetitions (median).

    python -m benchmarks.flush_tradeoff [--quick] [--results DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import zephon as zp
from benchmarks.harness.batches import batch_token_counts, batches_equal
from benchmarks.harness.results import write_results
from benchmarks.harness.stats import summarize
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, measure_throughput
from benchmarks.workload import (
    BATCH_SIZE,
    BYTE_OFFSET,
    NUM_BINS,
    SEQ_LEN,
    SyntheticDocs,
    pregenerate,
)
from benchmarks.zephon_lm import zephon_lm_pipeline

KS = (1, 2, 4, 8, 16)
SHUFFLE_BUFFER = 64
PUMP_SETTLE_S = 0.1

TAG_CHAR = "~"
TAG_DIGITS = 7
_TAG_TOKEN = ord(TAG_CHAR) + BYTE_OFFSET
_DIGIT0_TOKEN = ord("0") + BYTE_OFFSET
_POW10 = 10 ** np.arange(TAG_DIGITS - 1, -1, -1, dtype=np.int64)


def tagged_docs(num_docs: int, seed: int = 0) -> list[str]:
    """The LM workload's documents, each prefixed with ``~NNNNNNN`` (its index)."""
    if num_docs >= 10**TAG_DIGITS:
        raise ValueError(f"at most {10**TAG_DIGITS - 1} tagged documents")
    docs = pregenerate(SyntheticDocs(num_docs, seed=seed))
    return [f"{TAG_CHAR}{i:0{TAG_DIGITS}d}{d}" for i, d in enumerate(docs)]


def doc_tags(tokens: np.ndarray) -> np.ndarray:
    """Indices of the documents whose first piece is in ``tokens`` ([rows, seq]), in row-major
    order (rows in order, left to right inside a row)."""
    tokens = np.asarray(tokens)
    rows, cols = np.nonzero(tokens == _TAG_TOKEN)
    if rows.size == 0:
        return np.zeros(0, dtype=np.int64)
    digits = tokens[rows[:, None], cols[:, None] + 1 + np.arange(TAG_DIGITS)] - _DIGIT0_TOKEN
    return digits.astype(np.int64) @ _POW10


def lm_shuffle_pipeline(
    docs: Sequence[str],
    seed: int = 0,
    *,
    workers: int = 0,
    lanes: int = 8,
    chunk_size: int = 64,
    k: int = 4,
    shuffle_buffer: int = SHUFFLE_BUFFER,
    seq_len: int = SEQ_LEN,
    num_bins: int = NUM_BINS,
    batch_size: int = BATCH_SIZE,
    prefetch: int = 3,
    **pipeline_kw: Any,
) -> zp.Pipeline:
    """The LM workload chain with ``.shuffle(shuffle_buffer)`` before ``batch``.

    ``pipeline_kw`` goes to ``zp.Pipeline`` (``rank``, ``world_size``, ``output``, ...).
    """
    return zephon_lm_pipeline(
        docs,
        seed,
        workers,
        lanes=lanes,
        chunk_size=chunk_size,
        flush_every_k_chunks=k,
        seq_len=seq_len,
        num_bins=num_bins,
        batch_size=batch_size,
        prefetch=prefetch,
        shuffle_buffer=shuffle_buffer,
        **pipeline_kw,
    )


def source_positions(
    docs: Sequence[str], seed: int, lane: int, lanes: int, chunk_size: int, count: int
) -> dict[tuple[int, int], int]:
    """``{(doc index, occurrence): position}`` of the first ``count`` documents the work
    source deals to ``lane``, in its order."""
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(list(docs))], seed=seed, chunk_size=chunk_size
    ).for_lane(lane, lanes)
    pos: dict[tuple[int, int], int] = {}
    seen: dict[int, int] = {}
    n = 0
    while n < count:
        chunk = src.next_chunk()
        if chunk is None:
            break
        for idx in np.asarray(chunk.indices).tolist():
            occ = seen.get(idx, 0)
            seen[idx] = occ + 1
            pos[(idx, occ)] = n
            n += 1
    return pos


def quality_run(
    docs: Sequence[str], k: int, lanes: int, chunk_size: int, batches: int, seed: int = 0
) -> dict[str, Any]:
    """Padding and document displacement over the first ``batches`` batches."""
    out_order: dict[int, list[int]] = {lane: [] for lane in range(lanes)}
    real = padded = 0
    with lm_shuffle_pipeline(docs, seed, lanes=lanes, chunk_size=chunk_size, k=k) as p:
        for _ in range(batches):
            b = next(p)
            (lane,) = p.last_batch_lanes
            r, pad = batch_token_counts(b)
            real += r
            padded += pad
            out_order[lane].extend(doc_tags(b["tokens"]).tolist())
    disp: list[int] = []
    for lane, order in out_order.items():
        # The source deals in whole chunks; a margin covers documents still in flight.
        src_pos = source_positions(
            docs, seed, lane, lanes, chunk_size, len(order) + (2 * k + 8) * chunk_size
        )
        seen: dict[int, int] = {}
        for i, idx in enumerate(order):
            occ = seen.get(idx, 0)
            seen[idx] = occ + 1
            disp.append(abs(i - src_pos[(idx, occ)]))
    return {
        "padding_fraction": 1.0 - real / padded if padded else float("nan"),
        "mean_displacement": float(np.mean(disp)) if disp else float("nan"),
        "p90_displacement": float(np.percentile(disp, 90)) if disp else float("nan"),
        "docs_seen": len(disp),
    }


def restore_run(
    docs: Sequence[str], k: int, lanes: int, chunk_size: int, steps: Sequence[int], seed: int = 0
) -> list[dict[str, Any]]:
    """Checkpoint at each step on one uninterrupted run, then restore each into a fresh
    pipeline: replayed chunks, time to first batch, checkpoint bytes, exactness."""
    saved: list[tuple[int, bytes, float, dict[str, np.ndarray]]] = []
    with lm_shuffle_pipeline(docs, seed, lanes=lanes, chunk_size=chunk_size, k=k) as p:
        done = 0
        for step in sorted(steps):
            for _ in range(step - done):
                next(p)
            done = step
            # As in training, where a step takes longer than loading a batch: the prefetch
            # pump is full when the checkpoint is taken. (Chunks the pump has pulled are in
            # flight, so what a checkpoint holds, and a restore replays, depends on how far
            # the pump ran ahead; a full pump is the steady state and makes it repeatable.)
            time.sleep(PUMP_SETTLE_S)
            t0 = time.perf_counter()
            state = p.checkpoint()
            ckpt_s = time.perf_counter() - t0
            blob = zp.checkpoint.dumps(state)
            expected = next(p)
            done += 1
            saved.append((step, blob, ckpt_s, expected))
    out = []
    for step, blob, ckpt_s, expected in saved:
        t0 = time.perf_counter()
        with lm_shuffle_pipeline(docs, seed, lanes=lanes, chunk_size=chunk_size, k=k) as q:
            q.restore(zp.checkpoint.loads(blob))
            first = next(q)
            restore_s = time.perf_counter() - t0
            replayed = int(q.stats()["replayed_chunks"])
        out.append(
            {
                "step": step,
                "replayed_chunks": replayed,
                "ckpt_bytes": len(blob),
                "checkpoint_s": ckpt_s,
                "restore_s": restore_s,
                "exact": batches_equal(first, expected),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        n_docs, lanes, chunk_size = 1500, 2, 16
        quality_batches, steps = 120, (10, 45, 90)
        tput_batches, warmup, repeats = 30, 5, 1
    else:
        n_docs, lanes, chunk_size = 20000, 8, 64
        quality_batches, steps = 2000, (50, 500, 1500, 3000)
        tput_batches, warmup, repeats = 300, 20, args.repeats
    docs = tagged_docs(n_docs)

    tput = interleaved_repeats(
        {
            k: lambda k=k: measure_throughput(
                lambda: lm_shuffle_pipeline(docs, 0, lanes=lanes, chunk_size=chunk_size, k=k),
                tput_batches,
                warmup,
            )
            for k in KS
        },
        repeats,
        rotate=True,
    )
    rows = []
    restores: dict[int, list[dict[str, Any]]] = {}
    for k in KS:
        q = quality_run(docs, k, lanes, chunk_size, quality_batches)
        rs = restores[k] = restore_run(docs, k, lanes, chunk_size, steps)
        bps = summarize([r["batches_per_s"] for r in tput[k]])
        replayed = [r["replayed_chunks"] for r in rs]
        rows.append(
            {
                "k": k,
                "padding": round(q["padding_fraction"], 4),
                "displacement": round(q["mean_displacement"], 1),
                "p90 displ.": round(q["p90_displacement"], 1),
                "epoch perm. ref": round(k * chunk_size / 3, 1),
                "replayed max": max(replayed),
                "replayed/lane": round(max(replayed) / lanes, 2),
                "ckpt bytes": max(r["ckpt_bytes"] for r in rs),
                "restore ms": round(statistics.median(r["restore_s"] for r in rs) * 1e3, 1),
                "batches/s": round(bps["median"], 1),
                "range": f"{bps['min']:.0f}-{bps['max']:.0f}",
                "exact": all(r["exact"] for r in rs),
            }
        )
    print_table(
        rows,
        list(rows[0]),
        title=(
            f"flush_every_k_chunks trade-off ({lanes} lanes, chunk_size {chunk_size}, "
            f"shuffle({SHUFFLE_BUFFER}); displacement in documents; restores at steps "
            f"{', '.join(map(str, steps))})"
        ),
    )
    path = write_results(
        "flush_tradeoff",
        rows,
        args.results,
        extra={
            "args": vars(args),
            "lanes": lanes,
            "chunk_size": chunk_size,
            "shuffle_buffer": SHUFFLE_BUFFER,
            "restore_steps": list(steps),
            "restores": {str(k): v for k, v in restores.items()},
        },
    )
    from benchmarks.plots import tradeoff_plot

    ks = [r["k"] for r in rows]
    png = tradeoff_plot(
        path.with_suffix(".png"),
        ks,
        [
            {"y": [r["padding"] for r in rows], "ylabel": "padding fraction", "better": "lower"},
            {
                "y": [r["displacement"] for r in rows],
                "ylabel": "mean doc displacement (docs)",
                "better": "higher",
                "ref": ([r["epoch perm. ref"] for r in rows], "random perm. of an epoch"),
            },
            {
                "y": [r["replayed/lane"] for r in rows],
                "ylabel": "chunks replayed per lane on restore",
                "better": "lower",
            },
            {"y": [r["ckpt bytes"] for r in rows], "ylabel": "checkpoint bytes", "better": "lower"},
            {
                "y": [summarize([x["batches_per_s"] for x in tput[k]])["median"] for k in ks],
                "range": (
                    [summarize([x["batches_per_s"] for x in tput[k]])["min"] for k in ks],
                    [summarize([x["batches_per_s"] for x in tput[k]])["max"] for k in ks],
                ),
                "ylabel": "batches/s",
                "better": "higher",
                "from_zero": True,
            },
        ],
        xlabel="flush_every_k_chunks (k)",
        title=f"Choosing flush_every_k_chunks ({lanes} lanes, chunk_size {chunk_size})",
    )
    print(f"results: {path}" + (f"\nplot:    {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
