"""Question 10: what does a mixture of many components cost?

Four figures for 2, 100 and 1,000 equally weighted components (``--components``):

* ``next_chunk`` of one lane's work source (lane 0 of 8, chunk_size 64, 2,000 samples per
  component; with ``--unit tokens`` token weights over random lengths): CPU microseconds per
  call over blocks of 200 calls after a warm-up (mean, median block, slowest), and the
  wall-clock mean (on a shared machine the CPU figure is the one to compare);
* the per-lane state and caches: the bytes Python allocates for one lane's work source
  (``for_lane`` plus 1,000 chunks, the chunks themselves dropped; ``tracemalloc``), beside
  what the datasets, weights and lengths that every lane shares cost once;
* the pipeline: the LM workload in process (8 lanes, byte tokens, split and pack to 2048,
  batch 8) over the same 16,000 synthetic documents dealt into C components: batches/s
  (median of ``--repeats`` interleaved repetitions, each ``--batches`` batches after a
  warm-up), and its ratio to the 2-component figure;
* the checkpoint after that run: ``zp.save``'s bytes (msgpack + zstd) per lane, the whole
  file and the lanes alone (without the fingerprint's part map, which names every
  component once per checkpoint).

    python -m benchmarks.many_components [--quick] [--components 2,100,1000]
        [--unit samples|tokens] [--batches N] [--repeats N] [--results DIR]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import sys
import time
import tracemalloc
from typing import Any

import numpy as np

import zephon as zp
from benchmarks.harness.results import write_results
from benchmarks.harness.stats import median_and_range
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats
from zephon.demo.pipelines import lm_chain

LANES = 8
CHUNK_SIZE = 64
PER_COMPONENT = 2000
CORPUS_DOCS = 16_000


def _has_token_weights() -> bool:
    return "weight_unit" in inspect.signature(zp.StaticMixtureWorkSource).parameters


def make_source(components: int, unit: str, seed: int = 0) -> Any:
    """C components of ``PER_COMPONENT`` samples (ints), equal weights."""
    datasets = {
        f"c{c}": range(c * PER_COMPONENT, (c + 1) * PER_COMPONENT) for c in range(components)
    }
    kw: dict[str, Any] = {}
    if unit == "tokens":
        rng = np.random.default_rng(seed)
        kw = {
            "weight_unit": "tokens",
            "lengths": {
                name: rng.integers(20, 4000, size=PER_COMPONENT).astype(np.int32)
                for name in datasets
            },
        }
    return zp.StaticMixtureWorkSource(datasets, None, seed=seed, chunk_size=CHUNK_SIZE, **kw)


def next_chunk_us(components: int, unit: str, calls: int) -> dict[str, Any]:
    """CPU microseconds per call (``time.process_time``: what the call costs this process,
    whatever else the machine runs), over blocks of 200 calls after a warm-up: the mean,
    the median block and the slowest; and the wall-clock mean beside it."""
    lane = make_source(components, unit).for_lane(0, LANES)
    for _ in range(50):
        lane.next_chunk()
    blocks, walls = [], []
    block = 200
    for _ in range(max(1, calls // block)):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(block):
            lane.next_chunk()
        blocks.append((time.process_time() - c0) / block * 1e6)
        walls.append((time.perf_counter() - t0) / block * 1e6)
    return {
        "next_chunk CPU us": round(statistics.fmean(blocks), 1),
        "median block us": round(statistics.median(blocks), 1),
        "slowest block us": round(max(blocks), 1),
        "wall us": round(statistics.fmean(walls), 1),
    }


def lane_bytes(components: int, unit: str) -> dict[str, Any]:
    """Bytes one lane's source holds beyond what it shares with the description."""
    gc.collect()
    tracemalloc.start()
    shared0 = tracemalloc.get_traced_memory()[0]
    base = make_source(components, unit)
    shared = tracemalloc.get_traced_memory()[0] - shared0
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    lane = base.for_lane(0, LANES)
    for _ in range(1000):
        lane.next_chunk()
    gc.collect()
    per_lane = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del lane
    return {
        "per-lane state+caches KB": round(per_lane / 1024, 1),
        "shared KB": round(shared / 1024, 1),
    }


def lm_pipeline(components: int, unit: str) -> zp.Pipeline:
    from benchmarks.workload import BATCH_SIZE, NUM_BINS, SEQ_LEN, SyntheticDocs, pregenerate

    corpus = _corpus(pregenerate, SyntheticDocs)
    per = CORPUS_DOCS // components
    datasets = {f"c{c}": zp.ArraySource(corpus[c * per : (c + 1) * per]) for c in range(components)}
    kw: dict[str, Any] = {}
    if unit == "tokens":
        tok = zp.ByteTokenizer()
        kw = {
            "weight_unit": "tokens",
            "lengths": {
                name: np.asarray(tok.count_tokens(list(corpus[c * per : (c + 1) * per])))
                for c, name in enumerate(datasets)
            },
        }
    src = zp.StaticMixtureWorkSource(datasets, None, seed=0, chunk_size=CHUNK_SIZE, **kw)
    return lm_chain(
        zp.Pipeline(src, canonical_replicas=LANES, flush_every_k_chunks=4, prefetch=0),
        seq_len=SEQ_LEN,
        num_bins=NUM_BINS,
        batch_size=BATCH_SIZE,
    )


_CORPUS: tuple[str, ...] | None = None


def _corpus(pregenerate: Any, synthetic: Any) -> tuple[str, ...]:
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = pregenerate(synthetic(CORPUS_DOCS, seed=0))
    return _CORPUS


def pipeline_run(components: int, unit: str, batches: int) -> dict[str, Any]:
    with lm_pipeline(components, unit) as pipe:
        for _ in range(2 * LANES):  # every lane's first batch
            next(pipe)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(pipe)
        bps = batches / (time.perf_counter() - t0)
        state = pipe.checkpoint()
    whole = len(zp.checkpoint.dumps(state))
    lanes_only = len(zp.checkpoint.dumps({"lanes": state["lanes"]}))
    return {"bps": bps, "ckpt_bytes": whole, "lane_bytes": lanes_only}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--components", default="2,100,1000")
    ap.add_argument("--unit", choices=("samples", "tokens"), default="samples")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--calls", type=int, default=2000, help="next_chunk calls timed")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.components.split(",")]
    if args.unit == "tokens" and not _has_token_weights():
        print("this Zephon has no token weights: --unit samples only", file=sys.stderr)
        return 2
    batches, calls = (40, 400) if args.quick else (args.batches, args.calls)
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3

    rows: dict[int, dict[str, Any]] = {}
    for c in counts:
        rows[c] = {
            "components": c,
            **next_chunk_us(c, args.unit, calls),
            **lane_bytes(c, args.unit),
        }
    results = interleaved_repeats(
        {str(c): lambda c=c: pipeline_run(c, args.unit, batches) for c in counts},
        repeats,
        rotate=True,
    )
    base_bps = None
    for c in counts:
        runs = results[str(c)]
        bps = [r["bps"] for r in runs]
        med = statistics.median(bps)
        if base_bps is None:
            base_bps = med
        rows[c].update(median_and_range("batches/s", bps))
        rows[c]["vs first"] = round(med / base_bps, 2)
        rows[c]["ckpt B/lane"] = round(runs[0]["ckpt_bytes"] / LANES)
        rows[c]["lanes-only B/lane"] = round(runs[0]["lane_bytes"] / LANES)
    table = list(rows.values())
    print_table(
        table,
        list(table[0]),
        title=(
            f"Many components ({args.unit} weights): next_chunk of lane 0 of {LANES}, chunk_size "
            f"{CHUNK_SIZE}; LM pipeline in process over {CORPUS_DOCS:,} documents, {batches} "
            f"batches x {repeats} repetitions; checkpoint = zp.save bytes / {LANES} lanes"
        ),
    )
    path = write_results(
        "many_components",
        table,
        args.results,
        extra={"args": vars(args), "lanes": LANES, "chunk_size": CHUNK_SIZE, "repeats": repeats},
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
