"""``zephon demo | bench | inspect | lengths | report | top``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np


def demo(args: argparse.Namespace) -> int:
    from zephon.demo.proof import demo as run

    return run(args)


def inspect(args: argparse.Namespace) -> int:
    import zephon as zp
    from zephon.cli.inspect import describe

    try:
        text = describe(args.path, as_json=args.json)
    except zp.CheckpointError as e:
        print(f"zephon inspect: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


def _tokenizer(spec: str) -> Any:
    """``byte``, or a tokenizer file: a Hugging Face ``tokenizer.json`` or a sentencepiece
    ``.model``, with their default settings (the pipeline's tokenizer must be the same)."""
    import zephon as zp

    if spec == "byte":
        return zp.ByteTokenizer()
    if spec.endswith(".json"):
        return zp.HFTokenizer(spec)
    if spec.endswith(".model"):
        return zp.SentencePieceTokenizer(spec)
    raise ValueError(
        f"--tokenizer must be 'byte', a tokenizer.json or a sentencepiece .model file; got {spec!r}"
    )


def lengths(args: argparse.Namespace) -> int:
    """``zephon lengths DATA --tokenizer ...``: a length index beside the data."""
    import zephon as zp
    from zephon.work_sources.lengths import PARTIAL, default_index_path

    fmt = args.format or ("parquet" if args.data[0].endswith(".parquet") else "jsonl")
    try:
        tokenizer = _tokenizer(args.tokenizer)
        if fmt == "parquet":
            ds: Any = zp.ParquetSource(args.data, field=args.field)
        else:
            ds = zp.JsonlSource(args.data, field=args.field)
        target = args.out or default_index_path(ds, tokenizer)
    except (OSError, ValueError, ImportError) as e:
        print(f"zephon lengths: {e}", file=sys.stderr)
        return 2
    resuming = os.path.exists(target + PARTIAL)
    t0 = time.perf_counter()
    try:
        target = zp.build_length_index(ds, tokenizer, args.out, progress=not args.quiet)
    except KeyboardInterrupt:
        print(
            f"\nzephon lengths: interrupted; {target}{PARTIAL} keeps what was counted: run the "
            "same command again to resume",
            file=sys.stderr,
        )
        return 130
    except (OSError, ValueError) as e:
        print(f"zephon lengths: {e}", file=sys.stderr)
        return 1
    counts = zp.open_length_index(ds, tokenizer, target)
    total = int(counts.sum(dtype=np.int64))
    mean = total / len(counts) if len(counts) else 0.0
    print(
        f"{target}: {len(counts):,} samples, {total:,} tokens (mean {mean:,.1f}) with "
        f"{tokenizer!r}{' (resumed)' if resuming else ''} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def report(args: argparse.Namespace) -> int:
    from zephon.cli.report import report as run

    return run(args)


def top(args: argparse.Namespace) -> int:
    from zephon.cli.top import top as run

    return run(args)


def bench(argv: list[str]) -> int:
    """``zephon bench [args]``: the suite in ``benchmarks/`` of a source checkout."""
    if os.path.isfile(os.path.join("benchmarks", "__main__.py")) and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script's path does not hold the checkout
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError:
        print(
            "zephon bench runs the suite in benchmarks/ of a source checkout: "
            "run it from the repository root (or python -m benchmarks)",
            file=sys.stderr,
        )
        return 2
    return int(bench_main(argv) or 0)


#: The exit status when the reader of stdout went away (``zephon inspect f | head``): what a
#: shell reports for a command that SIGPIPE ended, as ``cat`` or ``grep`` would be.
EXIT_BROKEN_PIPE = 128 + 13


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns its exit status.

    When stdout is a pipe whose reader has gone (``zephon inspect --json f | head``), the
    command stops quietly with :data:`EXIT_BROKEN_PIPE` instead of a traceback.
    """
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at exit where it cannot be caught
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    return status


def _discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so that the interpreter's final flush of what
    is still buffered does not fail again (and print a traceback) at exit."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (tests, tools)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its options belong to the suite, not to this parser
        return bench(argv[1:])
    parser = argparse.ArgumentParser(
        prog="zephon", description="Zephon: an exactly-resumable data loader for JAX."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser(
        "demo", help="crash a pipeline at a random step, resume it, prove the batches are identical"
    )
    d.add_argument("--steps", type=int, default=600)
    d.add_argument("--crash-at", type=int, default=None, help="step to crash at (default: random)")
    d.add_argument("--seed", type=int, default=0, help="data seed")
    d.add_argument("--lanes", type=int, default=4)
    d.add_argument(
        "--workers", type=int, default=2, help="worker processes (0: run in this process)"
    )
    d.add_argument("--explain", action="store_true", help="print the compiled stages")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    d.add_argument("--no-train", action="store_true", help="only the pipeline proof, no JAX")
    d.add_argument("--train-steps", type=int, default=200, help="steps of the JAX training run")
    d.add_argument("--workdir", default=None, help="where training writes (default: a temp dir)")
    d.add_argument("--png", default=None, help="loss plot (default: WORKDIR/losses.png)")
    d.set_defaults(fn=demo)
    i = sub.add_parser("inspect", help="print what a checkpoint file holds")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=inspect)
    ln = sub.add_parser(
        "lengths",
        help="count every sample's tokens once and store them beside the data (the length "
        "index that token-weighted mixtures read)",
    )
    ln.add_argument("data", nargs="+", help="the dataset's JSON-lines or Parquet file(s)")
    ln.add_argument(
        "--tokenizer",
        required=True,
        help="the pipeline's tokenizer: 'byte', a tokenizer.json or a sentencepiece .model",
    )
    ln.add_argument(
        "--field", default=None, help="the text field, as JsonlSource/ParquetSource(field=...)"
    )
    ln.add_argument(
        "--format", choices=("jsonl", "parquet"), default=None, help="default: from the suffix"
    )
    ln.add_argument("--out", default=None, help="default: DATA.lengths-<tokenizer>.zlen")
    ln.add_argument("--quiet", action="store_true", help="no progress bar")
    ln.set_defaults(fn=lengths)
    r = sub.add_parser(
        "report",
        help="draw a series that zp.metrics.record wrote as one PNG (throughput, waits, busy "
        "time per stage, mixture shares)",
    )
    r.add_argument("series", help="the JSON-lines file zp.metrics.record(pipe, path) wrote")
    r.add_argument("--out", default=None, help="the PNG (default: SERIES with .png)")
    r.set_defaults(fn=report)
    t = sub.add_parser(
        "top", help="a live view of a running pipeline from its metrics endpoint (q to quit)"
    )
    t.add_argument(
        "url", help="the endpoint: http://HOST:PORT/metrics, HOST:PORT or a port on 127.0.0.1"
    )
    t.add_argument("--interval", type=float, default=1.0, help="seconds between screens")
    t.add_argument(
        "--once", action="store_true", help="print one screen (rates over --interval) and exit"
    )
    t.set_defaults(fn=top)
    sub.add_parser(
        "bench", help="run the benchmark suite (from a source checkout; --help for its options)"
    )
    args = parser.parse_args(argv)
    return int(args.fn(args))
