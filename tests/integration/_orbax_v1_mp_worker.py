"""One process of the two-process Orbax v1 test (test_orbax_v1.py).

    python _orbax_v1_mp_worker.py --port P --process-id I --num-processes N --workdir DIR
        --mode save|restore

``save`` (N = 2, in a ``jax.distributed`` job on the CPU backend, gloo collectives): two
lockstep pipelines over 4 lanes, rank and world size from JAX, one without aggregation
(each rank saves its own lanes) and one with ``aggregate_store="jax://"`` (the
checkpoint round merges them and the primary host writes the merged state); each runs
``STEPS`` steps, and after ``SAVE_AT`` saves ``{"params", "loader"}`` with
``save_checkpointables`` into ``DIR/<layout>``. Each rank's local batches go to
``DIR/<layout>-rank<I>.npz``. ``restore`` (N = 1): fresh one-rank pipelines load both
checkpoints with ``load_checkpointables`` and write the batches after ``SAVE_AT`` to
``DIR/<layout>-resumed.npz``.

JAX is imported in ``main()`` only: the test imports this module's constants.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tests.integration.corpus import lm_pipeline
from zephon.testing import take

STEPS, SAVE_AT = 8, 3
#: layout -> the files its loader item holds
LAYOUTS = {
    "per-rank": ["process_0-of-2.zph", "process_1-of-2.zph"],
    "merged": ["loader.zph"],
}


def build(**kw):
    return lm_pipeline(seed=23, lanes=4, num_epochs=None, batch_size=2, output="lockstep", **kw)


def _write(path: Path, batches: list) -> None:
    np.savez(path, **{f"{s}/{k}": v for s, b in enumerate(batches) for k, v in b.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--mode", choices=["save", "restore"], required=True)
    args = ap.parse_args()
    pid, n = args.process_id, args.num_processes

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if n > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=n,
            process_id=pid,
            initialization_timeout=60,
        )
    # Imported after jax.distributed so Orbax sees the multi-process job.
    import orbax.checkpoint.experimental.v1 as ocp

    import zephon.jax as zj

    agg = {"per-rank": {}, "merged": {"aggregate_store": "jax://"}}
    for name in LAYOUTS:
        if args.mode == "save":
            with build(**agg[name]) as pipe:  # rank, world_size: JAX's
                assert pipe.lanes == list(range(pid * 4 // n, (pid + 1) * 4 // n)), pipe.lanes
                batches = take(pipe, SAVE_AT)
                ocp.save_checkpointables(
                    args.workdir / name,
                    {"params": {"w": np.arange(4.0)}, "loader": zj.Checkpointable(pipe)},
                )
                batches += take(pipe, STEPS - SAVE_AT)
            _write(args.workdir / f"{name}-rank{pid}.npz", batches)
        else:
            with build() as pipe:
                restored = ocp.load_checkpointables(
                    args.workdir / name, {"params": None, "loader": zj.Checkpointable(pipe)}
                )
                np.testing.assert_array_equal(restored["params"]["w"], np.arange(4.0))
                _write(args.workdir / f"{name}-resumed.npz", take(pipe, STEPS - SAVE_AT))
    print(f"OK {pid}", flush=True)
    if n > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
