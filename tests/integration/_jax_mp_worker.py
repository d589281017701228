"""One process of the multi-process JAX test (test_jax_multiprocess.py).

    python _jax_mp_worker.py --port P --process-id I --num-processes N --workdir DIR
        --steps S [--save-at K] [--crash-after C] [--restore K]

The parent sets ``XLA_FLAGS=--xla_force_host_platform_device_count=...`` so the job has 4
CPU devices in all. With N > 1 the process joins ``jax.distributed`` (coordinator on
127.0.0.1:P, gloo collectives). It builds a lockstep pipeline over 4 lanes, iterates it
through ``zephon.jax.global_batches`` on a 1-D ``data`` mesh, and runs a jitted "train"
step (the global batch's token sum added to a replicated int32 accumulator). Every step it
gathers the full global batch (``process_allgather``, a gloo collective) and appends its
digest and the accumulator to ``DIR/digests-<I>-of-<N>-<tag>.jsonl``. With ``--save-at K``
the model (the accumulator) and the loader are saved together with Orbax after K steps;
with ``--aggregate`` the pipeline merges the ranks' states through the
coordination service (``aggregate_store="jax://"``); with ``--crash-after C`` the process SIGKILLs itself after C steps; with ``--restore K``
it restores model and loader from Orbax step K first and continues from batch K.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from tests.integration._jax_common import digest
from tests.integration.corpus import lm_pipeline

LANES = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-at", type=int)
    ap.add_argument("--crash-after", type=int)
    ap.add_argument("--restore", type=int)
    ap.add_argument("--aggregate", action="store_true", help='aggregate_store="jax://"')
    ap.add_argument("--tag", default="run")
    args = ap.parse_args()
    pid, n = args.process_id, args.num_processes

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if n > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=n,
            process_id=pid,
            initialization_timeout=60,
        )
    assert jax.device_count() == 4, jax.devices()
    # Imported after jax.distributed so Orbax sees the multi-process job.
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    import zephon.jax as zj

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    data = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())

    @jax.jit
    def train_step(acc, batch):
        return acc + jnp.sum(batch["tokens"], dtype=jnp.int32)

    # rank/world_size default to jax.process_index()/process_count().
    agg = {"aggregate_store": "jax://"} if args.aggregate else {}
    pipe = lm_pipeline(
        seed=17, lanes=LANES, num_epochs=None, batch_size=2, output="lockstep", **agg
    )
    assert pipe.lanes == list(range(pid * LANES // n, (pid + 1) * LANES // n)), pipe.lanes
    it = zj.global_batches(pipe, data, prefetch=2)
    mngr = ocp.CheckpointManager(args.workdir / "ckpt")
    acc = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    start = 0
    if args.restore is not None:
        restored = mngr.restore(
            args.restore,
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore(
                    {"acc": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)}
                ),
                loader=zj.CheckpointRestore(it),
            ),
        )
        acc, start = restored.model["acc"], args.restore

    out = open(args.workdir / f"digests-{pid}-of-{n}-{args.tag}.jsonl", "w")  # noqa: SIM115
    for step in range(start, args.steps):
        batch = next(it)
        assert batch["tokens"].shape == (LANES * 2, 64)
        full = multihost_utils.process_allgather(batch, tiled=True)
        acc = train_step(acc, batch)
        out.write(json.dumps({"step": step, "digest": digest(full), "acc": int(acc)}) + "\n")
        out.flush()
        done = step + 1
        if done == args.save_at:
            mngr.save(
                done,
                args=ocp.args.Composite(
                    model=ocp.args.StandardSave({"acc": acc}), loader=zj.CheckpointSave(it)
                ),
            )
            mngr.wait_until_finished()
        if done == args.crash_after:
            # Every process finishes the step first: a peer killed while another is still
            # inside a collective would make that one abort instead of being killed.
            multihost_utils.sync_global_devices(f"crash-{done}")
            os.kill(os.getpid(), signal.SIGKILL)
    mngr.close()
    it.close()
    out.close()
    print(f"OK {pid}", flush=True)
    if n > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
