"""The interleave (WF2Q+ over two heaps): C and Python twins agree, and shares stay within
one sample of the weights for any length distribution."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon as zp
from zephon.work_sources import interleave as il
from zephon.work_sources.static_mixture import StaticMixtureWorkSource

NATIVE = il._NATIVE


def lengths_strategy(n: int) -> st.SearchStrategy[np.ndarray]:
    """Token counts of n samples from one of several shapes of distribution."""
    shapes = st.sampled_from(["constant", "uniform", "lognormal", "bimodal", "heavy"])

    def draw(shape: str, seed: int, scale: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        if shape == "constant":
            out = np.full(n, scale)
        elif shape == "uniform":
            out = rng.integers(1, 2 * scale + 1, size=n)
        elif shape == "lognormal":
            out = np.exp(rng.normal(np.log(scale), 1.0, size=n))
        elif shape == "bimodal":
            out = np.where(rng.random(n) < 0.9, scale // 4 + 1, scale * 8)
        else:
            out = rng.pareto(1.5, size=n) * scale + 1
        return np.clip(out, 1, 20_000).astype(np.int64)

    return st.builds(draw, shapes, st.integers(0, 2**32 - 1), st.integers(1, 3000))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    k=st.integers(1, 5),
    unit=st.sampled_from(["samples", "tokens"]),
    chunk_size=st.integers(1, 50),
)
def test_every_prefix_is_within_one_sample_of_the_weights(data, k, unit, chunk_size) -> None:
    """The WF2Q+ bound, for every prefix of a lane's stream and every component:
    ``|units_c - w_c * units| <= the longest sample``, whatever the lengths look like."""
    n = 200
    lengths = [data.draw(lengths_strategy(n)) for _ in range(k)]
    weights = data.draw(st.lists(st.integers(1, 50), min_size=k, max_size=k))
    src = StaticMixtureWorkSource(
        [list(range(n)) for _ in range(k)],
        weights,
        chunk_size=chunk_size,
        weight_unit=unit,
        lengths=lengths,
        lane=1,
        num_lanes=3,
    )
    chunks = [src.next_chunk() for _ in range(1 + 3000 // chunk_size)]
    comps = np.concatenate([c.components for c in chunks])
    idx = np.concatenate([c.indices for c in chunks])
    units = (
        np.ones(comps.size)
        if unit == "samples"
        else np.array([lengths[c][i] for c, i in zip(comps, idx, strict=True)])
    )
    per = np.zeros((comps.size, k))
    per[np.arange(comps.size), comps] = units
    got = np.cumsum(per, axis=0)
    total = got.sum(axis=1, keepdims=True)
    w = np.asarray(src.weights)
    longest = 1 if unit == "samples" else max(int(x.max()) for x in lengths)
    deviation = np.abs(got - total * w)
    assert deviation.max() <= longest * (1 + 1e-9)
    # ... and the token counts the source keeps are the ones it dealt.
    if unit == "tokens":
        assert list(src.tokens_dealt) == got[-1].astype(int).tolist()


def random_lane(seed: int, k: int, unit: str, limited: bool, stop: bool) -> StaticMixtureWorkSource:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, size=k).tolist()
    lengths = [
        rng.integers(0, 300, size=n).astype(rng.choice(["<u2", "<i4", "<u4", "<i8"])) for n in sizes
    ]
    weights = rng.integers(0, 5, size=k).tolist()
    if sum(weights) == 0:
        weights[0] = 1
    return StaticMixtureWorkSource(
        [list(range(n)) for n in sizes],
        weights,
        seed=int(rng.integers(0, 2**63)),
        shuffle=bool(rng.integers(0, 2)),
        chunk_size=int(rng.integers(1, 20)),
        num_epochs=int(rng.integers(1, 4)) if limited else None,
        weight_unit=unit,
        lengths=lengths,
        on_exhausted="stop" if stop else "renormalize",
        lane=int(rng.integers(0, 3)),
        num_lanes=3,
    )


@pytest.mark.native
@pytest.mark.skipif(NATIVE is None, reason="zephon._permute is not built (or ZEPHON_PURE_PYTHON=1)")
@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 6),
    unit=st.sampled_from(["samples", "tokens"]),
    limited=st.booleans(),
    stop=st.booleans(),
)
def test_c_and_python_twins_agree_on_every_array(seed, k, unit, limited, stop) -> None:
    """Two copies of one lane, one through the C functions and one through the Python twin:
    the same chunks, and after every chunk the same arrays (heap layouts included) and the
    same state."""
    native = random_lane(seed, k, unit, limited, stop)
    python = random_lane(seed, k, unit, limited, stop)
    python._inputs.table.native = None  # this copy takes the Python path
    for _ in range(40):
        a, b = native.next_chunk(), python.next_chunk()
        assert (a is None) == (b is None)
        if a is None:
            break
        assert a == b
        assert np.array_equal(native._stream.f64, python._stream.f64)
        assert np.array_equal(native._stream.i64, python._stream.i64)
        assert np.array_equal(native._stream.heaps, python._stream.heaps)
        assert native.state_dict() == python.state_dict()


def test_a_heavy_component_spreads_the_light_ones() -> None:
    """Worst-case fairness: with weights 16:1:1:1 the light components come one at a time,
    never in a burst, and every 19 samples hold each exactly once."""
    src = StaticMixtureWorkSource([list(range(50))] * 4, [16, 1, 1, 1], chunk_size=19 * 10)
    comps = src.next_chunk().components.reshape(10, 19)
    for window in comps:
        assert sorted(np.bincount(window, minlength=4).tolist()) == [1, 1, 1, 16]
    flat = comps.ravel()
    light = np.flatnonzero(flat > 0)
    assert np.diff(light).min() > 1  # never two light samples in a row


def test_zero_length_samples_still_advance_their_component() -> None:
    """A sample of no tokens counts as one unit, so a component of mostly empty documents
    cannot take the whole stream (one of nothing but empty ones is refused: see
    test_static_mixture)."""
    empty = np.zeros(10, np.int64)
    empty[9] = 3  # one document of 3 tokens, nine of none
    src = StaticMixtureWorkSource(
        {"empty": list(range(10)), "full": list(range(10))},
        {"empty": 1, "full": 1},
        weight_unit="tokens",
        lengths={"empty": empty, "full": np.full(10, 3)},
        chunk_size=40,
    )
    chunk = src.next_chunk()
    comps = chunk.components
    assert 0.6 < np.mean(comps == 0) < 0.9  # 1.2 units vs 3 a sample: about 5:2 by count
    assert src.tokens_dealt[0] == 3 * int(np.sum((comps == 0) & (chunk.indices == 9)))


def test_length_table_pickles_and_rebuilds_its_native_side() -> None:
    import pickle

    src = StaticMixtureWorkSource(
        [zp.ArraySource([np.arange(5)] * 4)], weight_unit="tokens", chunk_size=3
    )
    clone = pickle.loads(pickle.dumps(src))
    assert clone.next_chunk() == src.next_chunk()
    assert (clone._inputs.table.native is None) == (NATIVE is None)
