"""The pre-tokenized path: a token file through split -> pack -> batch, in process.

No tokenizer runs: what is left is reading documents, cutting them, placing pieces into
bins and assembling rows, which is where a loader's own overhead shows. One token file
(uint16, documents ending at an EOS id, lengths drawn like the LM workload's: a mean of
about 550 tokens, so about 30 documents per 8 x 2048 batch) read by Zephon's
``TokenFileSource`` and by Grain's ``MapDataset.source`` over the same memory-mapped
file, split to 2048 and packed first-fit into 8 bins of 2048 (Grain's
``FirstFitPackIterDataset``), batches of 8. Reported: CPU microseconds per document and
batches/s, the minimum of ``--repeats`` interleaved runs. Goal: <= 3 us per document.

    python -m benchmarks.pretokenized [--quick] [--repeats N] [--docs N] [--no-grain]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import zephon as zp
from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats

SEQ_LEN = 2048
NUM_BINS = 8
BATCH = 8
EOS = 1


def write_token_file(path: Path, docs: int, seed: int = 0) -> int:
    """``docs`` documents of lognormal lengths (median ~300, mean ~550 tokens, capped at
    8,000), each ending with EOS; returns the token count."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5.7, 1.1, docs).astype(np.int64) + 2, 8000)
    tokens = rng.integers(3, 50000, int(lengths.sum()), dtype=np.uint16)
    ends = np.cumsum(lengths) - 1
    tokens[ends] = EOS
    tokens[tokens == EOS] = 2  # EOS only at the ends
    tokens[ends] = EOS
    tokens.tofile(path)
    return len(tokens)


def zephon_batches(path: Path) -> Iterator[dict[str, np.ndarray]]:
    src = zp.StaticMixtureWorkSource(
        [zp.TokenFileSource(path, eos_id=EOS)], seed=0, chunk_size=64, num_epochs=1
    )
    pipe = (
        zp.Pipeline(src, canonical_replicas=1, prefetch=0)
        .fetch()
        .split(SEQ_LEN)
        .pack(SEQ_LEN, NUM_BINS)
        .batch(BATCH)
    )
    with pipe:
        yield from pipe


def grain_batches(path: Path) -> Iterator[dict[str, np.ndarray]]:
    from benchmarks.grain_baseline import SplitToMaxLen, _grain

    grain = _grain()
    source = zp.TokenFileSource(path, eos_id=EOS)  # random access by index, like any source
    ds = grain.MapDataset.source(source).to_iter_dataset(grain.ReadOptions(num_threads=0))
    grain.experimental.FlatMapTransform.register(SplitToMaxLen)
    ds = grain.experimental.FlatMapIterDataset(ds, SplitToMaxLen(SEQ_LEN, 8001))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"tokens": SEQ_LEN}, num_packing_bins=NUM_BINS
    )
    yield from ds.batch(BATCH, drop_remainder=True)


def _timed(
    make: Callable[[Path], Iterator[Any]], path: Path, docs: int
) -> Callable[[], dict[str, float]]:
    def once() -> dict[str, float]:
        it = make(path)
        next(it)  # start-up (index scan, first bins) out of the window
        n = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in it:
            n += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"batches": n, "wall_s": wall, "cpu_s": cpu}

    return once


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--docs", type=int, default=None)
    ap.add_argument("--no-grain", action="store_true")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    docs = args.docs or (6_000 if args.quick else 60_000)
    with tempfile.TemporaryDirectory(prefix="zephon-pretok-") as tmp:
        path = Path(tmp) / "tokens.bin"
        write_token_file(path, docs)
        candidates = {"zephon": _timed(zephon_batches, path, docs)}
        if not args.no_grain:
            candidates["grain"] = _timed(grain_batches, path, docs)
        runs = interleaved_repeats(candidates, repeats, rotate=True)
    rows = []
    for name, results in runs.items():
        best = min(results, key=lambda r: r["cpu_s"])
        per_doc = best["cpu_s"] / docs * 1e6  # the first batch's ~30 documents are noise
        rows.append(
            {
                "loader": name,
                "us_per_doc_cpu": round(per_doc, 2),
                "batches_per_s": round(best["batches"] / best["wall_s"], 1),
                "batches": int(best["batches"]),
            }
        )
    if len(rows) == 2:
        rows[0]["vs_grain"] = round(rows[1]["us_per_doc_cpu"] / rows[0]["us_per_doc_cpu"], 2)
    print_table(rows, title=f"token file, {docs:,} documents, split -> pack first-fit -> batch")
    print(f"zephon: {rows[0]['us_per_doc_cpu']} us per document (goal <= 3)")
    write_results("pretokenized", rows, args.results, extra={"docs": docs, "repeats": repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
