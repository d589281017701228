"""One rank of a chaos job, as its own process (see :mod:`tests.chaos.harness`).

It trains for real as far as the loader can tell: a lockstep LM pipeline (tokenize, split,
pack, shuffle, ensure_mixture, batch) over :data:`LANES` lanes, one ``next()`` a step, a
short sleep for the model's step, ``checkpoint()`` every ``--every`` steps through the
job's store, and ``zp.save`` of what it returned on the ranks that save. Every outcome is
one JSON line appended to ``--log`` (``O_APPEND``, one ``write`` a line, so a SIGKILL never
leaves half a line)::

    {"kind": "start", "rank", "world_size", "step", "t"}
    {"kind": "call", "step", "ok": true, "round_id", "t0", "t1"}
    {"kind": "call", "step", "ok": false, "error", "t0", "t1"}
    {"kind": "file", "step", "path"}          a file saved from a committed round
    {"kind": "save_failed", "step", "error"}  the round committed, this rank's save failed
    {"kind": "end", "step"}

    python -m tests.chaos.rank --rank R --world-size N --log FILE --save-dir DIR
        (--dir D | --etcd URL) [--restore FILE] [--job-id ID] [--every K] [--steps S]
        [--timeout-s T] [--lease-s L] [--step-s X] [--saves r,r,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

#: The job's lanes: every world size of the harness (1, 2, 4, 8) divides it.
LANES = 8
#: The pipeline's seed: every job of the harness runs the same pipeline (one fingerprint),
#: so two jobs on one store meet unless their job ids keep them apart.
SEED = 7


def build(**kw: Any) -> Any:
    """The chaos job's pipeline (``kw``: rank, world size, store, ...)."""
    from tests.integration.corpus import lm_pipeline

    return lm_pipeline(
        seed=SEED,
        lanes=LANES,
        num_epochs=None,
        output="lockstep",
        chunk_size=5,
        seq_len=32,
        batch_size=2,
        prefetch=0,
        **kw,
    )


class Log:
    """JSON lines appended with one ``write`` each."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, **rec: Any) -> None:
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--dir")
    ap.add_argument("--etcd")
    ap.add_argument("--restore")
    ap.add_argument("--job-id")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--lease-s", type=float, default=1.0)
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--saves", default="0", help="the ranks that save what checkpoint() returns")
    a = ap.parse_args(argv)

    import zephon as zp
    from zephon.errors import AggregationError

    log = Log(a.log)
    saves = {int(r) for r in a.saves.split(",") if r}
    pipe = build(
        rank=a.rank,
        world_size=a.world_size,
        aggregate_dir=a.dir,
        aggregate_store=a.etcd,
        aggregate_timeout_s=a.timeout_s,
        aggregate_lease_s=a.lease_s,
        job_id=a.job_id,
    )
    step = 0
    if a.restore:
        state = zp.load(a.restore)
        pipe.restore(state)
        step = int(state["step"])
    log(kind="start", rank=a.rank, world_size=a.world_size, step=step, t=time.time())
    tag = os.path.basename(a.log).removesuffix(".jsonl")
    try:
        for _ in range(a.steps):
            next(pipe)
            step += 1
            time.sleep(a.step_s)  # the model's step
            if step % a.every:
                continue
            t0 = time.time()
            try:
                st = pipe.checkpoint()
            except AggregationError as e:
                log(kind="call", step=step, ok=False, error=str(e)[:2000], t0=t0, t1=time.time())
                continue
            round_id = (st.get("round") or {}).get("round_id")
            log(kind="call", step=step, ok=True, round_id=round_id, t0=t0, t1=time.time())
            if a.rank in saves:
                path = os.path.join(a.save_dir, f"{tag}-s{step}.zph")
                try:
                    zp.save(path, st)
                except (OSError, zp.CheckpointError) as e:
                    log(kind="save_failed", step=step, error=f"{type(e).__name__}: {e}"[:2000])
                    continue
                log(kind="file", step=step, path=path)
        log(kind="end", step=step)
    finally:
        pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
