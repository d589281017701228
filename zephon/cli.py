"""``zephon demo | bench | inspect | lengths``."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import tempfile
import time
from typing import Any

import numpy as np


def _digest(batch: dict[str, np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for k in sorted(batch):
        a = np.ascontiguousarray(batch[k])
        h.update(k.encode())
        h.update(str(a.dtype).encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.digest()


def _run(pipe: Any, steps: int, desc: str, quiet: bool) -> tuple[list[bytes], float, float, int]:
    """Digests of ``steps`` batches, start-up seconds (to the first batch), steady seconds
    (the rest), and real (non-padding) tokens after the first batch."""
    from tqdm import tqdm

    digests, real_tokens = [], 0
    t0 = time.perf_counter()
    startup = 0.0
    with tqdm(
        total=steps, desc=desc, unit="batch", disable=quiet, leave=False, file=sys.stderr
    ) as bar:
        for i in range(steps):
            batch = next(pipe)
            if i == 0:
                startup = time.perf_counter() - t0
            else:
                real_tokens += int((batch["tokens_segment_ids"] > 0).sum())
            digests.append(_digest(batch))
            bar.update()
    return digests, startup, time.perf_counter() - t0 - startup, real_tokens


def demo(args: argparse.Namespace) -> int:
    import zephon as zp
    from zephon.demo.corpus import demo_pipeline

    def build() -> Any:
        return demo_pipeline(seed=args.seed, lanes=args.lanes, workers=args.workers)

    crash = (
        args.crash_at if args.crash_at is not None else random.Random().randint(1, args.steps - 1)
    )
    if not 0 < crash < args.steps:
        print(f"--crash-at must be in (0, --steps={args.steps}); got {crash}", file=sys.stderr)
        return 2
    print(
        f"zephon demo: {args.steps} batches of a tokenize->split->pack->shuffle->ensure_mixture->batch"
    )
    print(
        f"pipeline over the pydoc topics corpus, {args.lanes} lanes, workers={args.workers}; crash at step {crash}"
    )
    with build() as ref_pipe:
        if args.explain:
            print(ref_pipe.explain())
        ref, startup_s, ref_s, ref_tokens = _run(ref_pipe, args.steps, "uninterrupted", args.quiet)

    with tempfile.TemporaryDirectory(prefix="zephon-demo-") as tmp:
        path = os.path.join(tmp, "loader.zph")
        with build() as first:
            head, *_ = _run(first, crash, "until the crash", args.quiet)
            t0 = time.perf_counter()
            nbytes = zp.save(path, first.checkpoint())
            save_ms = (time.perf_counter() - t0) * 1e3
        # The pipeline is gone; a new process would start here.
        t0 = time.perf_counter()
        second = build()
        second.restore(zp.load(path))
        first_batch = next(second)
        restore_ms = (time.perf_counter() - t0) * 1e3
        replayed = second.stats()["replayed_chunks"]
        rest, *_ = (
            _run(second, args.steps - crash - 1, "resumed", args.quiet)
            if crash < args.steps - 1
            else ([],)
        )
        second.close()
    resumed = head + [_digest(first_batch)] + rest
    same = resumed == ref
    mismatch = next((i for i, (a, b) in enumerate(zip(ref, resumed, strict=False)) if a != b), None)
    whole = hashlib.sha256(b"".join(ref)).hexdigest()[:16]
    print()
    steady = args.steps - 1
    print(
        f"  uninterrupted run   first batch after {startup_s * 1e3:.0f} ms, then {steady} batches at {steady / ref_s:,.0f} batches/s ({ref_tokens / ref_s / 1e6:.2f} M real tokens/s)"
    )
    print(
        f"  checkpoint          at step {crash}: {nbytes:,} bytes on disk ({nbytes / args.lanes:,.0f} per lane), saved in {save_ms:.1f} ms"
    )
    print(
        f"  restore             {replayed} in-flight chunks replayed, first batch after {restore_ms:.1f} ms"
    )
    print(
        f"  resumed run         steps {crash}..{args.steps - 1} compared with the uninterrupted run"
    )
    if not same:
        print(f"  FAILED: batch {mismatch} differs from the uninterrupted run", file=sys.stderr)
        return 1
    print(f"  PROOF: all {args.steps} batches identical bit for bit (sha256 of the stream {whole})")
    if args.no_train:
        return 0
    return _train_demo(args)


def _train_demo(args: argparse.Namespace) -> int:
    """The main job: a small JAX transformer trained on that pipeline, SIGKILLed mid-run,
    resumed from its Orbax checkpoint; the loss curves must be identical."""
    import importlib.util

    missing = [
        m for m in ("jax", "optax", "orbax", "matplotlib") if importlib.util.find_spec(m) is None
    ]
    if missing:
        print(
            f"\n(the training part of the demo needs {', '.join(missing)}: pip install 'zephon[jax]')"
        )
        return 0
    from zephon.demo.train_lm import run_demo  # runs JAX in subprocesses, not in this one

    workdir = args.workdir or tempfile.mkdtemp(prefix="zephon-demo-train-")
    print(f"\nTraining a small JAX transformer on that pipeline in {workdir}:")
    ok = run_demo(
        workdir, steps=args.train_steps, crash_at=None, workers=args.workers, out_png=args.png
    )
    return 0 if ok else 1


def inspect(args: argparse.Namespace) -> int:
    import zephon as zp
    from zephon.inspect import describe

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
        zp.build_length_index(ds, tokenizer, target, progress=not args.quiet)
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
    sub.add_parser(
        "bench", help="run the benchmark suite (from a source checkout; --help for its options)"
    )
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
