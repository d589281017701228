"""zephon.jax.global_batches: global jax.Array batches with device prefetch, and a cut at the
batches the iterator returned (not the ones it prefetched).

Run in a fresh process by test_jax_global_batches.py (see _jax_common.py for why).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.integration._jax_common import digest, require
from tests.integration.corpus import lm_pipeline
from zephon.checkpoint import dumps, loads
from zephon.errors import DroppedRecordsWarning

require("jax", "orbax.checkpoint")
import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import zephon.jax as zj  # noqa: E402

pytestmark = pytest.mark.jax

LANES = 4
STEPS = 12


def build(**kw):
    kw.setdefault("output", "lockstep")
    return lm_pipeline(seed=5, lanes=LANES, num_epochs=None, batch_size=2, **kw)


def sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    return NamedSharding(mesh, PartitionSpec("data"))


def run(it, n):
    out = []
    for _ in range(n):
        batch = next(it)
        assert all(isinstance(v, jax.Array) for v in batch.values())
        out.append(digest({k: np.asarray(v) for k, v in batch.items()}))
    return out


@pytest.fixture(scope="module")
def reference():
    with build() as pipe:
        return [digest(next(pipe)) for _ in range(STEPS)]


def test_global_batches_equal_the_pipelines_batches(reference):
    with zj.global_batches(build(), sharding(), prefetch=2) as it:
        got = run(it, STEPS)
    assert got == reference
    with zj.global_batches(build(), sharding(), prefetch=0) as it:
        first = next(it)
    assert first["tokens"].shape == (LANES * 2, 64)
    assert first["tokens"].sharding == sharding()


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_iterator_checkpoint_is_at_the_last_returned_batch(reference, prefetch, k):
    with zj.global_batches(build(), sharding(), prefetch=prefetch) as it:
        head = run(it, k)
        if k:
            assert it.on_device == prefetch  # ahead of the loop, not delivered
        state = loads(dumps(it.checkpoint()))
        # More steps after the checkpoint must not change what it said.
        run(it, 2)
    with zj.global_batches(build(), sharding(), prefetch=prefetch) as it2:
        it2.restore(state)
        tail = run(it2, STEPS - k)
    assert head + tail == reference


def test_the_pipelines_own_checkpoint_would_skip_the_prefetched_batches(reference):
    # Why the iterator keeps a state per batch: the wrapped pipeline is `prefetch` ahead.
    with zj.global_batches(build(), sharding(), prefetch=2) as it:
        run(it, 4)
        ahead = loads(dumps(it.pipeline.checkpoint()))
    with build() as p:
        p.restore(ahead)
        assert digest(next(p)) == reference[6]


def test_checkpoint_with_aggregation_runs_the_round_on_the_returned_batchs_state(
    reference, tmp_path
):
    with zj.global_batches(
        build(aggregate_dir=str(tmp_path / "agg")), sharding(), prefetch=2
    ) as it:
        head = run(it, 3)
        state = loads(dumps(it.checkpoint()))
    assert state["topology"]["merged"] is True
    with zj.global_batches(build(), sharding(), prefetch=2) as it2:
        it2.restore(state)
        assert head + run(it2, STEPS - 3) == reference


def test_restore_after_iteration_began_is_refused():
    from zephon.errors import CheckpointError

    with zj.global_batches(build(), sharding(), prefetch=1) as it:
        state = it.checkpoint()
        next(it)
        with pytest.raises(CheckpointError, match="after iteration began"):
            it.restore(state)


def test_interleave_and_exhaustion():
    p = lm_pipeline(seed=5, lanes=2, num_epochs=1, n_docs=20, batch_size=4)
    with p, pytest.warns(DroppedRecordsWarning):  # drop_last=True: the end says so
        want = [digest(b) for b in p]
    with (
        zj.global_batches(
            lm_pipeline(seed=5, lanes=2, num_epochs=1, n_docs=20, batch_size=4),
            sharding(),
            prefetch=2,
        ) as it,
        pytest.warns(DroppedRecordsWarning),
    ):
        got = [digest({k: np.asarray(v) for k, v in b.items()}) for b in it]
        with pytest.raises(StopIteration):
            next(it)
    assert got == want and len(got) > 3


def test_a_batch_axis_replicated_across_data_parallel_groups_is_refused():
    # Rank 0 of 2 feeds only its own lanes; a sharding that gives this process every row
    # would silently make a global batch of half the data.
    replicated = NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("data",)), PartitionSpec()
    )
    with zj.global_batches(build(rank=0, world_size=2), replicated, prefetch=1) as it:
        with pytest.raises(ValueError, match="does not split the batch axis across processes"):
            next(it)


def test_bad_arguments():
    with pytest.raises(ValueError, match="prefetch must be an int >= 0; got -1"):
        zj.global_batches(build(), sharding(), prefetch=-1)
    with pytest.raises(TypeError, match="takes a zp.Pipeline"):
        zj.global_batches([1, 2], sharding())


def test_import_zephon_does_not_import_jax():
    code = "import sys, zephon, zephon.demo.corpus; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _fail_on_13(x):
    if x == 13:
        raise KeyError("sample 13")
    return np.int32(x)


def test_a_pipeline_error_comes_after_the_batches_pulled_before_it():
    import zephon as zp

    def build_failing():
        src = zp.StaticMixtureWorkSource(
            datasets={"n": zp.ArraySource(list(range(40)))},
            weights={"n": 1.0},
            seed=0,
            shuffle=False,
            chunk_size=4,
        )
        return zp.Pipeline(src, canonical_replicas=1).fetch().map(_fail_on_13).batch(4)

    with build_failing() as p:
        good = []
        with pytest.raises(KeyError, match="sample 13"):
            while True:
                good.append(next(p))
    with zj.global_batches(build_failing(), sharding(), prefetch=3) as it:
        got = []
        with pytest.raises(KeyError, match="sample 13"):
            while True:
                got.append(np.asarray(next(it)))
    assert len(good) == 3
    assert [b.tolist() for b in got] == [b.tolist() for b in good]
