"""The demo's proof: a pipeline run uninterrupted, run again until a step, checkpointed,
thrown away, rebuilt, restored and compared batch by batch; then the training run
(:mod:`zephon.demo.train_lm`). ``zephon demo`` runs :func:`demo`."""

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
    """The pipeline proof, then (unless ``--no-train``) the training proof; the exit status."""
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
