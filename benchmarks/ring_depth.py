"""Worker ring depth and consumer prefetch: which defaults get two workers their best.

Two knobs set how far ahead work runs with workers: ``ring_slots`` (each worker's ring:
how many batches a worker may finish ahead of the parent) and ``prefetch`` (batches the
parent's pump thread takes out of the rings ahead of ``next()``). Two workloads: the LM
workload with the byte tokenizer, and the same documents through a byte-level BPE
tokenizer (Hugging Face ``tokenizers``, trained here on the corpus), packed to 1024:
slower and more variable per document, which is where depth matters. Every (ring_slots, prefetch) pair
runs interleaved with the others; the table gives batches/s and the share of the best pair
of its workload, and marks the defaults.

    python -m benchmarks.ring_depth [--quick] [--repeats N] [--batches N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zephon as zp
from benchmarks.harness.results import write_results
from benchmarks.harness.stats import summarize
from benchmarks.harness.tables import print_table
from benchmarks.harness.timing import interleaved_repeats, measure_throughput
from benchmarks.workload import SyntheticDocs, pregenerate
from benchmarks.zephon_lm import zephon_lm_pipeline
from zephon.demo.pipelines import lm_chain
from zephon.pipeline.options import DEFAULT_RING_SLOTS

DEFAULT_PREFETCH = 0  # Pipeline's default with workers (prefetch=None)


def train_bpe(docs: Sequence[str], path: Path, vocab_size: int = 4096) -> Path:
    """A byte-level BPE tokenizer trained on ``docs``, saved as ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>"])
    tok.train_from_iterator(docs[:5000], trainer)
    tok.save(str(path))
    return path


def pipeline(
    docs: Sequence[str], workload: str, tokenizer_path: Path, ring_slots: int, prefetch: int
) -> zp.Pipeline:
    kw: dict[str, Any] = {"ring_slots": ring_slots, "prefetch": prefetch}
    if workload == "lm":
        return zephon_lm_pipeline(docs, 0, 2, **kw)
    src = zp.StaticMixtureWorkSource([zp.ArraySource(docs)], seed=0, chunk_size=64)
    return lm_chain(
        zp.Pipeline(src, canonical_replicas=8, workers=2, **kw),
        tokenizer=zp.HFTokenizer(tokenizer_path),
        seq_len=1024,
        num_bins=8,
        batch_size=8,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--slots", default="2,4,8,16,32")
    ap.add_argument("--prefetch", default="0,3,8")
    ap.add_argument("--workloads", default="lm,bpe")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.batches, args.docs = 1, 10, 1500
        args.slots, args.prefetch = "4,8", "0,3"
    docs = pregenerate(SyntheticDocs(args.docs, seed=0))
    slots = [int(s) for s in args.slots.split(",")]
    prefetches = [int(p) for p in args.prefetch.split(",")]
    warmup = 5 if args.quick else 30
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = train_bpe(docs, Path(tmp) / "tokenizer.json")
        for workload in args.workloads.split(","):
            cands = {
                (s, p): lambda s=s, p=p, w=workload: measure_throughput(
                    lambda: pipeline(docs, w, tok_path, s, p), args.batches, warmup
                )
                for s in slots
                for p in prefetches
            }
            named = {f"{workload} ring_slots={s} prefetch={p}": f for (s, p), f in cands.items()}
            results = interleaved_repeats(named, args.repeats, rotate=True)
            medians = {
                name: summarize([r["batches_per_s"] for r in runs])
                for name, runs in results.items()
            }
            best = max(m["median"] for m in medians.values())
            for (s, p), name in zip(cands, named, strict=True):
                m = medians[name]
                rows.append(
                    {
                        "workload": workload,
                        "ring_slots": s,
                        "prefetch": p,
                        "batches/s": round(m["median"], 1),
                        "range": f"{m['min']:.0f}-{m['max']:.0f}",
                        "of best": round(m["median"] / best, 3),
                        "default": "yes"
                        if (s, p) == (DEFAULT_RING_SLOTS, DEFAULT_PREFETCH)
                        else "",
                    }
                )
    print_table(
        rows,
        list(rows[0]),
        title=f"Ring depth x prefetch, 2 workers ({args.batches} batches x {args.repeats}, medians)",
    )
    write_results("ring_depth", rows, args.results, extra={"args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
