"""One rank of a multi-process job: iterate, checkpoint through a round, save the result.

Every rank saves what its ``checkpoint()`` returned with ``zp.save`` (a follower's share is
saved as the whole merged state) and writes ``OUT.share.json``: the result's ``"share"``
entry as returned and what its round read. Rank 0 closes its pipeline (which removes the
round's merged lanes from the store) only once every rank has saved: a share can be saved
until the next round or until rank 0 closes.

python _ranks_pipeline.py RANK WORLD WORKERS STEPS OUT_PREFIX [--dir D | --etcd URL] [--restore CKPT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np

import zephon as zp
from tests.integration.corpus import lm_pipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("rank", "world", "workers", "steps"):
        ap.add_argument(name, type=int)
    ap.add_argument("out")
    ap.add_argument("--dir")
    ap.add_argument("--etcd")
    ap.add_argument("--restore")
    a = ap.parse_args()
    pipe = lm_pipeline(
        seed=41,
        lanes=4,
        num_epochs=None,
        rank=a.rank,
        world_size=a.world,
        workers=a.workers,
        aggregate_dir=a.dir,
        aggregate_store=a.etcd,
        aggregate_timeout_s=60,
    )
    with pipe:
        if a.restore:
            pipe.restore(zp.load(a.restore))
        seen = []
        for _ in range(a.steps):
            batch = next(pipe)
            digest = hashlib.sha256(
                b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch))
            )
            seen.append([pipe.last_batch_lanes[0], digest.hexdigest()[:16]])
        state = pipe.checkpoint()
        stats = pipe._agg.last_round if pipe._agg is not None else None
        share = {
            "share": state.get("share"),
            "lanes": sorted(ls["lane"] for ls in state["lanes"]),
            "bytes_read": stats.bytes_read if stats is not None else None,
        }
        zp.save(f"{a.out}.zph", state)
        Path(f"{a.out}.share.json").write_text(json.dumps(share))
        Path(f"{a.out}.json").write_text(json.dumps(seen))
        if a.rank == 0 and (a.dir or a.etcd):
            prefix = a.out[: -len("-0")]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                Path(f"{prefix}-{r}.json").exists() for r in range(a.world)
            ):
                time.sleep(0.05)


if __name__ == "__main__":
    main()
