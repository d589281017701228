"""zephon.jax.CheckpointSave / CheckpointRestore: the loader saved in the same Orbax
CheckpointManager step as the model, restored together (one process; the two-process test
is test_jax_multiprocess.py).

Run in a fresh process by test_jax_orbax.py (see _jax_common.py for why).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration._jax_common import digest, require
from tests.integration.corpus import lm_pipeline
from zephon.checkpoint import dumps, loads
from zephon.checkpoint.io import MAGIC
from zephon.checkpoint.state import merge_states
from zephon.errors import CheckpointError

require("jax", "orbax.checkpoint")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import zephon.jax as zj  # noqa: E402
from zephon.jax.orbax import MERGED_FILE, process_file, read_state  # noqa: E402

pytestmark = pytest.mark.jax

STEPS = 10


def build(**kw):
    return lm_pipeline(seed=9, lanes=4, num_epochs=None, batch_size=2, output="lockstep", **kw)


def sharding():
    return NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data")
    )


def host(batch):
    return digest({k: np.asarray(v) for k, v in batch.items()})


@pytest.fixture(scope="module")
def reference():
    with build() as pipe:
        return [digest(next(pipe)) for _ in range(STEPS)]


@jax.jit
def train_step(acc, batch):
    return acc + jnp.sum(batch["tokens"], dtype=jnp.int32)


def test_model_and_loader_restore_together(reference, tmp_path):
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    acc = jnp.zeros((), jnp.int32)
    accs = []
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
        with zj.global_batches(build(), sharding(), prefetch=2) as it:
            for step in range(1, 7):
                acc = train_step(acc, next(it))
                accs.append(int(acc))
                if step in (3, 5):
                    mngr.save(
                        step,
                        args=ocp.args.Composite(
                            model=ocp.args.StandardSave({"acc": acc}),
                            loader=zj.CheckpointSave(it),
                        ),
                    )
            mngr.wait_until_finished()
        assert mngr.all_steps() == [3, 5]

    loader_dir = tmp_path / "ckpt" / "5" / "loader"
    ours = sorted(p.name for p in loader_dir.iterdir() if p.suffix == ".zph")
    assert ours == [MERGED_FILE]  # one rank: its state is the merged state
    assert (loader_dir / MERGED_FILE).read_bytes()[:8] == MAGIC  # Zephon's format, no pickle

    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
        it2 = zj.global_batches(build(), sharding(), prefetch=2)
        restored = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore({"acc": jax.ShapeDtypeStruct((), jnp.int32)}),
                loader=zj.CheckpointRestore(it2),
            ),
        )
    assert restored.loader is it2
    assert int(restored.model["acc"]) == accs[4]
    with it2:
        assert [host(next(it2)) for _ in range(STEPS - 5)] == reference[5:]


def test_a_plain_pipeline_is_saved_and_restored_too(reference, tmp_path):
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        with build() as pipe:
            for _ in range(4):
                next(pipe)
            mngr.save(4, args=ocp.args.Composite(loader=zj.CheckpointSave(pipe)))
            mngr.wait_until_finished()
        with build() as pipe2:
            mngr.restore(4, args=ocp.args.Composite(loader=zj.CheckpointRestore(pipe2)))
            assert [digest(next(pipe2)) for _ in range(STEPS - 4)] == reference[4:]


def test_per_rank_files_are_merged_on_restore(reference, tmp_path):
    # Two ranks simulated in one process (no aggregation): each writes process_<r>-of-2, and
    # a one-rank restore merges them.
    handler = zj.LoaderCheckpointHandler()
    ranks = [build(rank=r, world_size=2) for r in range(2)]
    for p in ranks:
        for _ in range(3):
            next(p)
        handler.save(tmp_path, zj.CheckpointSave(p))
        p.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [process_file(0, 2), process_file(1, 2)]
    with build() as whole:
        handler.restore(tmp_path, zj.CheckpointRestore(whole))
        assert [digest(next(whole)) for _ in range(STEPS - 3)] == reference[3:]


def test_missing_and_mixed_rank_files_are_named(tmp_path):
    with build(rank=0, world_size=2) as p:
        next(p)
        state = p.checkpoint()
    (tmp_path / process_file(0, 2)).write_bytes(dumps(state))
    with pytest.raises(CheckpointError, match=r"ranks \[1\] of 2 is missing \(process_1-of-2.zph"):
        read_state(tmp_path)
    (tmp_path / process_file(0, 4)).write_bytes(dumps(state))
    with pytest.raises(CheckpointError, match=r"different world sizes \[2, 4\]"):
        read_state(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no Zephon loader state"):
        read_state(tmp_path / "empty")


def test_a_corrupt_loader_file_is_named(tmp_path):
    with build() as p:
        next(p)
        blob = bytearray(dumps(p.checkpoint()))
    blob[-1] ^= 0xFF
    (tmp_path / MERGED_FILE).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"loader.zph: corrupt: checksum mismatch"):
        read_state(tmp_path)


def test_merge_of_rank_files_equals_merge_states(tmp_path):
    states = []
    for r in range(2):
        with build(rank=r, world_size=2) as p:
            next(p)
            states.append(loads(dumps(p.checkpoint())))
            (tmp_path / process_file(r, 2)).write_bytes(dumps(states[-1]))
    assert read_state(tmp_path) == merge_states(states)


def _big_state(lanes: int) -> dict:
    return {
        "format": "zephon.pipeline",
        "topology": {"rank": 0, "world_size": 4, "merged": True},
        "round_robin": {"dp_size": 4, "next_lanes": {"0": 0}},
        "lanes": [{"lane": lane, "cursor": [lane, 7], "blob": bytes(50)} for lane in range(lanes)],
    }


def test_a_large_merged_state_is_sharded_and_a_restore_reads_only_its_lanes(tmp_path):
    from zephon.jax.orbax import SHARD_LANES, write_merged

    state = _big_state(2 * SHARD_LANES + 10)
    write_merged(tmp_path, state)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        f"loader-lanes-000000-{SHARD_LANES - 1:06d}.zph",
        f"loader-lanes-{SHARD_LANES:06d}-{2 * SHARD_LANES - 1:06d}.zph",
        f"loader-lanes-{2 * SHARD_LANES:06d}-{2 * SHARD_LANES + 9:06d}.zph",
        MERGED_FILE,
    ]
    assert read_state(tmp_path) == state  # every lane, as saved
    # A rank owning 16 lanes of the middle shard reads the index and that shard only: the
    # others may as well be gone.
    for name in (names[0], names[2]):
        (tmp_path / name).unlink()
    mine = list(range(SHARD_LANES + 16, SHARD_LANES + 32))
    got = read_state(tmp_path, lanes=mine)
    assert [ls["lane"] for ls in got["lanes"]] == mine
    assert {k: v for k, v in got.items() if k != "lanes"} == {
        k: v for k, v in state.items() if k != "lanes"
    }
    with pytest.raises(CheckpointError, match="lane shard named by loader.zph is missing"):
        read_state(tmp_path, lanes=[0])
    (tmp_path / names[1]).write_bytes(dumps({"format": "zephon.loader-shard", "lanes": []}))
    with pytest.raises(CheckpointError, match="sha256 differs"):
        read_state(tmp_path, lanes=mine)


class _Follower:
    """What a follower's checkpoint() returns: its share of the round's merged state."""

    def __init__(self, share: dict) -> None:
        self._share = share

    def checkpoint(self) -> dict:
        return self._share


def test_a_follower_share_is_not_written_by_the_primary_host(tmp_path):
    share = _big_state(4)
    share["lanes"] = share["lanes"][2:]
    share["share"] = {"rank": 1, "world_size": 2, "round_id": "r", "lanes_total": 4}
    handler = zj.LoaderCheckpointHandler()  # this one process is the primary host
    with pytest.raises(CheckpointError, match="holds only rank 1's share"):
        handler.save(tmp_path, zj.CheckpointSave(_Follower(share)))
    from orbax.checkpoint import options as ocp_options

    every = zj.LoaderCheckpointHandler(
        multiprocessing_options=ocp_options.MultiprocessingOptions(primary_host=None)
    )
    every.save(tmp_path, zj.CheckpointSave(_Follower(share)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [process_file(1, 2)]
    # Host-local storage: the share restores the lanes it holds, nothing else.
    assert [ls["lane"] for ls in read_state(tmp_path, lanes=[2, 3])["lanes"]] == [2, 3]
    with pytest.raises(CheckpointError, match=r"ranks \[0\] of 2 is missing"):
        read_state(tmp_path, lanes=[0, 1])
