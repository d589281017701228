"""Random operator chains and random checkpoint steps resume exactly (Hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zephon as zp
from tests.integration.corpus import docs
from zephon.testing import assert_resumes_exactly, take

SEQ = 32


def _upper(d):
    return {**d, "tokens": d["tokens"] * 1}


def _keep(d):
    return int(d["tokens"].sum()) % 5 != 0


def _jitter(d, rng):
    return {**d, "tokens": d["tokens"] + rng.integers(0, 3, size=len(d["tokens"])).astype(np.int32)}


def _pad(d):
    out = np.zeros(SEQ, dtype=np.int32)
    t = d["tokens"][:SEQ]
    out[: len(t)] = t
    return {"tokens": out}


# Each choice maps to (builder step). Fixed-shape output is guaranteed by pack or _pad.
MIDDLE = {
    "map": lambda p: p.map(_upper),
    "filter": lambda p: p.filter(_keep),
    "shuffle": lambda p: p.shuffle(buffer_size=3),
    "ensure_mixture": lambda p: p.ensure_mixture(),
    "random_map": lambda p: p.random_map(_jitter),
}


@st.composite
def chains(draw):
    middle = draw(st.lists(st.sampled_from(sorted(MIDDLE)), max_size=3))
    return {
        "middle_before": middle,
        "pack": draw(st.sampled_from([None, "first_fit", "best_fit", "concat_then_split"])),
        "pack_kw": draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "max_segments": st.integers(1, 4),
                    "pad_values": st.just({"tokens": -1}),
                    "component_feature": st.just("tokens_component"),
                    "bos_handling": st.just("replace_first_token"),
                    "fields": st.just(True),
                },
            )
        ),
        "middle_after": draw(
            st.lists(st.sampled_from(["shuffle", "ensure_mixture", "filter"]), max_size=2)
        ),
        "lanes": draw(st.sampled_from([1, 2, 3])),
        "k": draw(st.sampled_from([1, 2, 3])),
        "chunk": draw(st.sampled_from([1, 3, 8])),
        "seed": draw(st.integers(0, 2**16)),
        "batch": draw(st.sampled_from([1, 2, 3])),
        "trim_or_pad": draw(st.booleans()),
        "lm_targets": draw(st.booleans()),
        "pad_last": draw(st.booleans()),
        "output": draw(st.sampled_from(["interleave", "lockstep"])),
    }


def _with_fields(texts, weight):
    return [{"text": t, "weight": weight + i % 2} for i, t in enumerate(texts)]


def _mask(d):
    return {**d, "mask": (d["tokens"] % 3).astype(np.int16)}


def build_from(spec):
    kw = dict(spec["pack_kw"]) if spec["pack"] else {}
    fields = kw.pop("fields", False)
    if kw.pop("bos_handling", None):
        kw.update(bos_id=1, bos_handling="replace_first_token")
    if fields:
        kw.update(meta_features=("mask",), broadcast={"weight": "float32"})
    long_docs, short_docs = docs(24, spec["seed"], 3, 70), docs(24, spec["seed"] + 1, 3, 20)
    if fields:
        long_docs, short_docs = _with_fields(long_docs, 0.5), _with_fields(short_docs, 2.0)
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(long_docs), zp.ArraySource(short_docs)],
        weights=[0.5, 0.5],
        seed=spec["seed"],
        chunk_size=spec["chunk"],
        num_epochs=1,
    )
    p = zp.Pipeline(
        src,
        canonical_replicas=spec["lanes"],
        flush_every_k_chunks=spec["k"],
        output=spec["output"],
        prefetch=1,
    )
    p = p.fetch().tokenize(zp.ByteTokenizer())
    if fields:
        p = p.map(_mask)
    if spec["pack"] != "concat_then_split":  # it cuts documents itself
        p = p.split(max_len=SEQ)
    for name in spec["middle_before"]:
        p = MIDDLE[name](p)
    if spec["pack"] == "concat_then_split":
        p = p.pack(seq_len=SEQ, strategy="concat_then_split", **kw)
    elif spec["pack"]:
        p = p.pack(seq_len=SEQ, num_bins=2, strategy=spec["pack"], **kw)
    else:
        p = p.trim_or_pad(SEQ) if spec["trim_or_pad"] else p.map(_pad)
    for name in spec["middle_after"]:
        p = MIDDLE[name](p)
    if spec["lm_targets"] and (spec["pack"] or spec["trim_or_pad"]):
        p = p.lm_targets()
    return p.batch(spec["batch"], pad_last=spec["pad_last"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=chains(), data=st.data())
def test_random_chain_resumes_exactly(spec, data):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # monotone chains force k to 0
        build = lambda: build_from(spec)  # noqa: E731
        with build() as p:
            ref = take(p)
        cuts = data.draw(st.lists(st.integers(0, len(ref)), min_size=1, max_size=3))
        assert_resumes_exactly(build, cuts=cuts, reference=ref)
