"""The builder half of a Pipeline (zephon/pipeline/building.py): a builder method returns a new
pipeline and leaves the one it was called on as it was, whatever that one had compiled or
started."""

from __future__ import annotations

import numpy as np

import zephon as zp
from zephon.testing import take


def _base() -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(200))], seed=0, chunk_size=8)
    return zp.Pipeline(src, canonical_replicas=2, prefetch=0).fetch()


def test_a_builder_method_leaves_its_pipeline_as_it_was() -> None:
    base = _base()
    before = (base._ops, base.fingerprint(), base.explain())
    longer = base.shuffle(buffer_size=4).batch(4)
    assert (base._ops, base.fingerprint(), base.explain()) == before
    assert longer._ops[: len(base._ops)] == base._ops
    assert [op.name for op in longer._ops] == ["fetch", "shuffle", "batch"]
    assert longer.fingerprint() != base.fingerprint()


def test_extending_a_started_or_closed_pipeline_gives_a_fresh_one() -> None:
    expected = take(_base().batch(4), 3)
    started = _base()
    take(started, 5)
    started.checkpoint()
    started.close()
    fresh = started.batch(4)
    assert fresh._engine is None and fresh._plan is None and fresh._agg is None
    batches = take(fresh, 3)
    assert [b.tolist() for b in batches] == [b.tolist() for b in expected]
    fresh.close()


def test_builder_methods_return_the_caller_s_class() -> None:
    class Tagged(zp.Pipeline):
        pass

    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(10))], seed=0, chunk_size=8)
    assert type(Tagged(src, canonical_replicas=2).fetch().batch(2)) is Tagged
