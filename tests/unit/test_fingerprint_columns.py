"""A mixture of many components keeps its fingerprint parts in columns (names, lengths and
weights whole, each content identity as a 4-byte digest): small in a checkpoint, and a
mismatch or an edited mixture is still named component by component."""

from __future__ import annotations

import re

import numpy as np
import pytest

import zephon as zp
import zephon._fingerprint as fp
from zephon._fingerprint import comparable_parts, describe_differences, expand_parts
from zephon.checkpoint import dumps
from zephon.cli.inspect import components
from zephon.errors import CheckpointError
from zephon.testing import roundtrip, take
from zephon.work_sources.mixture_change import plan_change


def pipeline(
    n: int,
    *,
    weights: dict[int, float] | None = None,
    shifted: tuple[int, ...] = (),
    extra: int = 0,
) -> zp.Pipeline:
    """``n`` components ``c0``, ``c1``, ... of 6 unique ints each (``shifted`` ones hold
    other ints), equal weights but for ``weights``; ``extra`` more named ``new0``, ..."""
    names = [f"c{c}" for c in range(n)] + [f"new{c}" for c in range(extra)]
    datasets = {
        name: zp.ArraySource(np.arange(6) + 100 * c + (50 if c in shifted else 0))
        for c, name in enumerate(names)
    }
    w = {name: (weights or {}).get(c, 1.0) for c, name in enumerate(names)}
    src = zp.StaticMixtureWorkSource(datasets, w, seed=3, chunk_size=4, num_epochs=1)
    return zp.Pipeline(src, canonical_replicas=2, prefetch=0).fetch().batch(2)


def test_many_components_are_kept_in_columns_and_compress_small() -> None:
    flat = pipeline(fp.COLUMNS_ABOVE).fingerprint_parts()
    assert "component.0.identity.sample" in flat and not fp.is_columnar(flat)
    parts = pipeline(1000).fingerprint_parts()
    assert fp.is_columnar(parts)
    assert not any(re.match(r"component\.\d", k) for k in parts)
    assert len(parts["component.identity.digest"]) == 1000 * fp.IDENTITY_DIGEST_HEX
    expanded = expand_parts(parts)
    assert expanded["component.999.name"] == "'c999'"
    assert expanded["component.7.length"] == "6"
    assert float(expanded["component.7.weight"]) == pytest.approx(0.001)
    assert re.fullmatch(r"'[0-9a-f]{8}'", expanded["component.7.identity.digest"])
    # Names, lengths and weights whole, a digest per identity: a fifth of the flat map.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fp, "COLUMNS_ABOVE", 10_000)
        flat = pipeline(1000).fingerprint_parts()
    assert comparable_parts(flat, parts) == (fp._digested(flat), expanded)
    assert len(dumps({"p": parts})) < 6_000 < 4 * 6_000 < len(dumps({"p": flat}))


def test_a_mismatch_names_the_component_and_what_differs() -> None:
    n = fp.COLUMNS_ABOVE + 6
    with pipeline(n) as pipe:
        take(pipe, 3)
        state = roundtrip(pipe.checkpoint())
    with pytest.raises(CheckpointError) as e:
        pipeline(n, weights={5: 2.0}).restore(state)
    assert re.search(
        r"component 5 \('c5'\) weight: the checkpoint has 0\.01\d+, this pipeline", str(e.value)
    )
    assert "content identity" not in str(e.value)
    with pytest.raises(CheckpointError) as e:
        pipeline(n, shifted=(7,)).restore(state)
    assert re.search(
        r"component 7 \('c7'\) content identity digest: the checkpoint has '[0-9a-f]{8}', this "
        r"pipeline has '[0-9a-f]{8}'",
        str(e.value),
    ), str(e.value)
    assert "component 6 " not in str(e.value) and "another file, or the same one" in str(e.value)


def test_an_edited_mixture_of_many_components_is_matched_by_name() -> None:
    n = fp.COLUMNS_ABOVE + 6
    saved = pipeline(n).fingerprint_parts()
    change, kept = plan_change(
        saved, pipeline(n, weights={3: 5.0}, shifted=(4,), extra=2).fingerprint_parts()
    )
    assert change.added == ("new0", "new1") and change.replaced == ("c4",)
    assert change.reweighted and "c3" in kept and "c4" not in kept and len(kept) == n - 1
    # A checkpoint of fewer components (a flat map) into more (columns), and back.
    flat = pipeline(fp.COLUMNS_ABOVE - 1).fingerprint_parts()
    change, kept = plan_change(flat, saved)
    assert len(kept) == fp.COLUMNS_ABOVE - 1 and len(change.added) == 7 and not change.replaced
    change, kept = plan_change(saved, flat)
    assert len(kept) == fp.COLUMNS_ABOVE - 1 and len(change.removed) == 7 and not change.replaced


def test_a_flat_map_of_many_components_compares_with_columns() -> None:
    # A checkpoint written before columns existed holds every identity in full.
    n = fp.COLUMNS_ABOVE + 6
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fp, "COLUMNS_ABOVE", 10_000)
        old = pipeline(n).fingerprint_parts()
    assert describe_differences(old, pipeline(n).fingerprint_parts()) == []
    diff = describe_differences(old, pipeline(n, weights={2: 3.0}).fingerprint_parts())
    assert any(d.startswith("component 2 ('c2') weight: the checkpoint has 0.0142") for d in diff)
    assert not any("identity" in d for d in diff) and diff[-1].startswith("and ")  # all weights


def test_inspect_reads_columns() -> None:
    comps = components(pipeline(fp.COLUMNS_ABOVE + 1).fingerprint_parts())
    assert comps is not None and len(comps) == fp.COLUMNS_ABOVE + 1
    assert comps[3]["name"] == "c3" and comps[3]["length"] == 6
    assert set(comps[3]["identity"]) == {"digest"}


def test_a_malformed_column_is_left_as_it_is() -> None:
    parts = {"components": "2", "component.name": "not json", "component.identity.digest": "xyz"}
    assert expand_parts(parts) == parts


def test_a_restore_into_an_edited_mixture_of_many_components() -> None:
    n = fp.COLUMNS_ABOVE + 6
    with pipeline(n) as pipe:
        before = take(pipe, 40)
        state = roundtrip(pipe.checkpoint())
    with pipeline(n, weights={3: 5.0}, extra=1) as pipe:
        change = pipe.restore(state, allow_mixture_change=True)
        assert change is not None and change.added == ("new0",) and change.reweighted
        assert len(change.kept) == n
        after = take(pipe, 40)
    seen = [int(x) for b in before + after for x in np.asarray(b).ravel()]
    assert len(seen) == len(set(seen))  # nothing repeated (one dataset epoch of each)
