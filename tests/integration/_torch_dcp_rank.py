"""One rank of the two-rank DCP test (test_torch_adapter.py).

    python _torch_dcp_rank.py RANK DIR

Joins a gloo process group of 2 over a FileStore in DIR, runs the lockstep pipeline of
the test for its lanes through zephon.torch.Loader, saves model and loader with
``dcp.save`` after CUT steps into DIR/ckpt and goes on to STEPS, writing its local batches
to DIR/rank<RANK>.npz; then builds a fresh loader, restores it with ``dcp.load`` and
checks that its batches after CUT are the ones it had.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zephon.torch as zt
from tests.integration.corpus import lm_pipeline
from zephon.testing import assert_same_batches, take
from zephon.topology import resolve_topology

STEPS, CUT = 10, 4


def build(rank: int):
    return lm_pipeline(
        seed=5, lanes=4, num_epochs=None, batch_size=2, output="lockstep", rank=rank, world_size=2
    )


def main() -> None:
    rank, workdir = int(sys.argv[1]), Path(sys.argv[2])
    store = dist.FileStore(str(workdir / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        # A pipeline built without rank= and world_size= takes them from the process group.
        assert (resolve_topology(4).rank, resolve_topology(4).world_size) == (rank, 2)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        with zt.Loader(build(rank)) as loader:
            batches = [{k: v.numpy() for k, v in b.items()} for b in take(loader, CUT)]
            dcp.save(
                {"model": model.state_dict(), "loader": loader}, checkpoint_id=workdir / "ckpt"
            )
            batches += [{k: v.numpy() for k, v in b.items()} for b in take(loader, STEPS - CUT)]
        np.savez(
            workdir / f"rank{rank}.npz",
            **{f"{s}/{k}": v for s, b in enumerate(batches) for k, v in b.items()},
        )
        with zt.Loader(build(rank)) as fresh:
            state = {"model": torch.nn.Linear(4, 3).state_dict(), "loader": fresh}
            dcp.load(state, checkpoint_id=workdir / "ckpt", planner=zt.LoadPlanner())
            rest = [{k: v.numpy() for k, v in b.items()} for b in take(fresh, STEPS - CUT)]
        assert_same_batches(batches[CUT:], rest, f"rank {rank} restored on two ranks")
        assert torch.equal(state["model"]["weight"], model.weight)
    finally:
        dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    main()
