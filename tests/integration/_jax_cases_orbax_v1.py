"""zephon.jax.Checkpointable: the loader in an Orbax v1 checkpoint (save_checkpointables /
load_checkpointables, and v1's training.Checkpointer) together with the model, restored
exactly (one process; the two-process test is in test_orbax_v1.py).

Run in a fresh process by test_orbax_v1.py (see _jax_common.py for why).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.integration._jax_common import digest, require
from tests.integration.corpus import lm_pipeline
from zephon.checkpoint.io import MAGIC
from zephon.checkpoint.layout import MERGED_FILE, process_file
from zephon.errors import CheckpointError
from zephon.testing import assert_same_batches, take

require("jax", "orbax.checkpoint")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint.experimental.v1 as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import zephon.jax as zj  # noqa: E402

pytestmark = pytest.mark.jax

STEPS, CUT = 10, 4


def build(**kw):
    return lm_pipeline(seed=9, lanes=4, num_epochs=None, batch_size=2, output="lockstep", **kw)


def sharding():
    return NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data")
    )


@pytest.fixture(scope="module")
def reference():
    with build() as pipe:
        return take(pipe, STEPS)


def params_after(batches) -> dict:
    """A "model" that depends on every batch seen: restored, it must equal the saved one."""
    acc = jnp.zeros((), jnp.int32)
    for b in batches:
        acc = acc + jnp.sum(jnp.asarray(b["tokens"]), dtype=jnp.int32)
    return {"acc": acc, "w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}


@pytest.mark.parametrize("workers", [0, 2])
def test_model_and_loader_in_one_v1_checkpoint_resume_exactly(reference, tmp_path, workers):
    path = tmp_path / "ckpt"
    with build(workers=workers) as pipe:
        head = take(pipe, CUT)
        params = params_after(head)
        ocp.save_checkpointables(path, {"params": params, "loader": zj.Checkpointable(pipe)})
    assert_same_batches(reference[:CUT], head)
    assert (path / "loader" / MERGED_FILE).read_bytes()[:8] == MAGIC  # Zephon's, no pickle
    assert sorted(p.name for p in (path / "loader").iterdir()) == [MERGED_FILE]

    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
    )
    with build(workers=workers) as fresh:
        restored = ocp.load_checkpointables(
            path, {"params": abstract, "loader": zj.Checkpointable(fresh)}
        )
        assert restored["loader"].item is fresh
        assert int(restored["params"]["acc"]) == int(params["acc"])
        np.testing.assert_array_equal(restored["params"]["w"], params["w"])
        assert_same_batches(reference[CUT:], take(fresh, STEPS - CUT), f"workers={workers}")


def test_global_batches_with_the_v1_training_checkpointer(reference, tmp_path):
    with ocp.training.Checkpointer(tmp_path / "run") as ckptr:
        with zj.global_batches(build(), sharding(), prefetch=2) as it:
            for step in range(1, 7):
                next(it)
                if step in (3, 5):
                    ckptr.save_checkpointables(
                        step,
                        {"params": {"step": np.full(1, step)}, "loader": zj.Checkpointable(it)},
                    )
        assert [m.step for m in ckptr.checkpoints] == [3, 5]
    with ocp.training.Checkpointer(tmp_path / "run") as ckptr:
        with zj.global_batches(build(), sharding(), prefetch=2) as it2:
            restored = ckptr.load_checkpointables(
                5, {"params": None, "loader": zj.Checkpointable(it2)}
            )
            assert int(restored["params"]["step"][0]) == 5
            got = [digest({k: np.asarray(v) for k, v in next(it2).items()}) for _ in range(5)]
    assert got == [digest(b) for b in reference[5:]]


def test_the_state_is_taken_when_an_async_save_starts(reference, tmp_path):
    with build() as pipe:
        take(pipe, CUT)
        response = ocp.save_checkpointables_async(
            tmp_path / "ckpt", {"loader": zj.Checkpointable(pipe)}
        )
        take(pipe, 3)  # the loop goes on while Orbax writes
        response.result()
    with build() as fresh:
        ocp.load_checkpointables(tmp_path / "ckpt", {"loader": zj.Checkpointable(fresh)})
        assert_same_batches(reference[CUT:], take(fresh, STEPS - CUT))


def test_an_evaluation_job_loads_the_model_without_the_loader(tmp_path):
    with build() as pipe:
        take(pipe, 2)
        ocp.save_checkpointables(
            tmp_path / "ckpt", {"params": {"w": np.arange(3)}, "loader": zj.Checkpointable(pipe)}
        )
    restored = ocp.load_checkpointables(tmp_path / "ckpt", {"params": None})
    assert sorted(restored) == ["params"]


class _Creating:
    """A path awaiting creation (what Orbax hands a checkpointable's save), already made."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def await_creation(self) -> Path:
        return self.path


def _save(item, path: Path) -> None:
    async def go() -> None:
        await (await zj.Checkpointable(item).save(_Creating(path)))

    asyncio.run(go())


def _load(item, path: Path) -> None:
    async def go() -> None:
        await (await zj.Checkpointable(item).load(path))

    asyncio.run(go())


def test_per_rank_files_are_merged_on_load(reference, tmp_path):
    # Two ranks simulated in one process (no aggregation): each writes its own file, as it
    # would as one process of a two-process job, and a one-rank job merges them.
    for r in range(2):
        with build(rank=r, world_size=2) as p:
            take(p, 3)
            _save(p, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [process_file(0, 2), process_file(1, 2)]
    with build() as whole:
        _load(whole, tmp_path)
        assert_same_batches(reference[3:], take(whole, STEPS - 3))
    # and each rank of a two-rank job restores its own lanes (reading both files)
    for r in range(2):
        with build(rank=r, world_size=2) as ref_rank:
            expected = take(ref_rank, STEPS)
        with build(rank=r, world_size=2) as again:
            _load(again, tmp_path)
            assert_same_batches(expected[3:], take(again, STEPS - 3), f"rank {r}")


class _Follower:
    """What a follower's checkpoint() returns: its share of the round's merged state."""

    def __init__(self, share: dict) -> None:
        self._share = share

    def checkpoint(self) -> dict:
        return self._share


def test_a_share_follows_the_contexts_primary_host(tmp_path):
    with build(rank=1, world_size=2) as p:
        take(p, 1)
        share = p.checkpoint()
    share["share"] = {"rank": 1, "world_size": 2, "round_id": "r", "lanes_total": 4}
    with pytest.raises(CheckpointError, match="holds only rank 1's share"):
        _save(_Follower(share), tmp_path)  # this one process is the primary host
    ctx = ocp.Context()
    ctx.multiprocessing.primary_host = None  # every host writes (host-local storage)
    with ctx:
        _save(_Follower(share), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [process_file(1, 2)]


def test_no_loader_state_is_named(tmp_path):
    (tmp_path / "loader").mkdir()
    with build() as p, pytest.raises(CheckpointError, match="no Zephon loader state"):
        _load(p, tmp_path / "loader")
