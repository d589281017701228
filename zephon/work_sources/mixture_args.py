"""Checking a :class:`~zephon.StaticMixtureWorkSource`'s constructor arguments.

Each function takes one argument as the user gave it (datasets, weights or a Schedule,
``num_epochs``, ``lengths``, the lane) and returns it in the form the source keeps, one entry
per component in component order, or raises with the value and the fix.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon.work_sources.base import RandomAccessDataset
from zephon.work_sources.lengths import (
    ComponentLengths,
    data_paths,
    resolve_lengths,
    shown_paths,
)
from zephon.work_sources.schedule import Schedule, not_a_number

__all__ = [
    "ON_EXHAUSTED",
    "WEIGHT_UNITS",
    "Datasets",
    "Lengths",
    "NumEpochs",
    "Weights",
    "as_int",
    "check_datasets",
    "check_epochs",
    "check_lengths",
    "check_sizes",
    "check_weights",
    "validate_lane",
    "weight_vectors",
]

WEIGHT_UNITS = ("samples", "tokens")
ON_EXHAUSTED = ("renormalize", "stop")

Datasets = Sequence[RandomAccessDataset] | Mapping[str, RandomAccessDataset]
Weights = Sequence[float] | Mapping[str, float] | np.ndarray | Schedule | None
Lengths = Sequence[Any] | Mapping[str, Any] | None
NumEpochs = int | Mapping[str, int | None] | None


def as_int(name: str, value: Any) -> int:
    """``value`` as an int (anything with ``__index__`` but a bool), else a TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int; got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError as e:
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}") from e


def validate_lane(lane: Any, num_lanes: Any) -> tuple[int, int]:
    """``(lane, num_lanes)`` as ints with ``0 <= lane < num_lanes``."""
    lane = as_int("lane", lane)
    num_lanes = as_int("num_lanes", num_lanes)
    if num_lanes < 1:
        raise ValueError(f"num_lanes must be >= 1; got num_lanes={num_lanes}")
    if not 0 <= lane < num_lanes:
        raise ValueError(
            f"lane must satisfy 0 <= lane < num_lanes; got lane={lane}, num_lanes={num_lanes} "
            f"(use a lane in 0..{num_lanes - 1})"
        )
    return lane, num_lanes


def check_datasets(
    datasets: Datasets,
) -> tuple[tuple[str, ...], tuple[RandomAccessDataset, ...]]:
    """The components' names and datasets, from a list/tuple or a dict name -> dataset."""
    if isinstance(datasets, Mapping):
        for k in datasets:
            if not isinstance(k, str):
                raise TypeError(
                    f"dataset names (dict keys) must be str; got {type(k).__name__} {k!r}"
                )
        names = tuple(datasets)
        dsets = tuple(datasets.values())
    elif isinstance(datasets, list | tuple):
        dsets = tuple(datasets)
        names = tuple(str(c) for c in range(len(dsets)))
    else:
        raise TypeError(
            f"datasets must be a list/tuple of datasets or a dict name -> dataset; got "
            f"{type(datasets).__name__}"
        )
    if not dsets:
        raise ValueError("datasets is empty; pass at least one dataset")
    for c, (name, ds) in enumerate(zip(names, dsets, strict=True)):
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise TypeError(
                f"dataset {name!r} (component {c}) of type {type(ds).__name__} is not "
                f"random-access: it needs __len__ and __getitem__ (wrap it in a source "
                f"such as ArraySource)"
            )
    return names, dsets


def weight_vectors(
    weights: Weights, datasets: Datasets, names: tuple[str, ...]
) -> tuple[Schedule | None, list[np.ndarray], tuple[float, ...], tuple[float, ...]]:
    """``(schedule, vectors, first, largest)``: the Schedule or None; the weight vectors
    the lanes look up (one for fixed weights); the normalised weights at the start; and the
    largest weight each component gets (the raw weights when fixed), which decides whether
    it may be empty or needs lengths."""
    if isinstance(weights, Schedule):
        vectors = weights.vectors_for(names)
        first = tuple(float(w) for w in vectors[0])
        most = np.max(np.vstack(vectors), axis=0)  # the largest weight a component gets
        return weights, vectors, first, tuple(float(w) for w in most)
    raw_weights = check_weights(weights, datasets, names)
    first = _normalise(raw_weights)
    return None, [np.asarray(first, dtype=np.float64)], first, raw_weights


def check_weights(
    weights: Weights, datasets: Datasets, names: tuple[str, ...]
) -> tuple[float, ...]:
    """Fixed weights (not a Schedule) as one float per component, not yet normalised."""
    if weights is None:
        return tuple(1.0 for _ in names)
    if isinstance(weights, Mapping):
        if not isinstance(datasets, Mapping):
            raise ValueError(
                f"weights is a dict (keys {sorted(map(str, weights))}) but datasets is a "
                f"{type(datasets).__name__}; pass weights as a list in dataset order, or "
                f"datasets as a dict"
            )
        missing = [n for n in names if n not in weights]
        extra = [k for k in weights if k not in datasets]
        if missing or extra:
            raise ValueError(
                f"weights keys must equal datasets keys; missing weights for {missing}, "
                f"weights for unknown datasets {extra}"
            )
        values = [weights[n] for n in names]
    elif isinstance(weights, list | tuple | np.ndarray):
        values = list(weights)
        if len(values) != len(names):
            raise ValueError(
                f"got {len(values)} weights for {len(names)} datasets; pass one weight per dataset"
            )
    else:
        raise TypeError(
            f"weights must be a list/tuple, a dict name -> weight, a zp.Schedule or None; "
            f"got {type(weights).__name__}"
        )
    out = []
    for c, (name, w) in enumerate(zip(names, values, strict=True)):
        not_number = not_a_number(w)
        if not_number:
            raise ValueError(
                f"weight of dataset {name!r} (component {c}) must be a number; got {not_number}"
            )
        try:
            wf = float(w)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"weight of dataset {name!r} (component {c}) must be a number; got {w!r}"
            ) from e
        if not math.isfinite(wf) or wf < 0:
            raise ValueError(
                f"weight of dataset {name!r} (component {c}) must be finite and >= 0; got {w!r}"
            )
        out.append(wf)
    if not any(w > 0 for w in out):
        raise ValueError(
            f"weights must have a positive sum; got {out} (give at least one dataset a "
            f"positive weight)"
        )
    return tuple(out)


def _normalise(weights: tuple[float, ...]) -> tuple[float, ...]:
    # Divide by the max first so a sum of huge finite weights cannot overflow to inf.
    top = max(weights)
    scaled = [w / top for w in weights]
    total = math.fsum(scaled)
    return tuple(w / total for w in scaled)


def check_sizes(
    names: tuple[str, ...], datasets: tuple[RandomAccessDataset, ...], weights: tuple[float, ...]
) -> tuple[int, ...]:
    """Each dataset's length; only a component of weight 0 may be empty."""
    sizes = []
    for c, (name, ds) in enumerate(zip(names, datasets, strict=True)):
        n = len(ds)
        if n == 0 and weights[c] > 0:
            files = _files(ds)
            raise ValueError(
                f"dataset {name!r} (component {c}{files}) is empty but has weight "
                f"{weights[c]!r}; "
                + ("check the path (an empty file has no samples), " if files else "")
                + "give it weight 0 or remove it"
            )
        sizes.append(int(n))
    return tuple(sizes)


def _files(dataset: Any) -> str:
    """``, a JsonlSource of /data/web.jsonl``: the files of a dataset read from files (a
    few, then how many more), for an error that would otherwise name it by its place in the
    mixture alone; "" for any other dataset."""
    paths = data_paths(dataset)
    if paths is None:
        return ""
    return f", a {type(dataset).__name__} of {shown_paths(paths)}"


def check_epochs(num_epochs: NumEpochs, names: tuple[str, ...]) -> tuple[int | None, ...]:
    """Each component's number of epochs, None for forever."""

    def one(value: Any, what: str) -> int | None:
        if value is None:
            return None
        value = as_int(what, value)
        if value < 1:
            raise ValueError(f"{what} must be >= 1, or None to repeat forever; got {what}={value}")
        return value

    if isinstance(num_epochs, Mapping):
        unknown = [k for k in num_epochs if k not in names]
        if unknown:
            raise ValueError(
                f"num_epochs names unknown datasets {unknown}; the datasets are {list(names)}"
            )
        return tuple(one(num_epochs.get(n), f"num_epochs[{n!r}]") for n in names)
    epochs = one(num_epochs, "num_epochs")
    if epochs is not None:
        return tuple(epochs for _ in names)
    return tuple(None for _ in names)


def check_lengths(
    lengths: Lengths,
    names: tuple[str, ...],
    datasets: tuple[RandomAccessDataset, ...],
    weights: tuple[float, ...],
    needed: bool,
) -> tuple[ComponentLengths | None, ...]:
    """Each component's token counts: resolved where given, or where ``needed`` (token
    weights or a token schedule) for a component with a positive weight; else None."""
    if lengths is None:
        specs: list[Any] = [None] * len(names)
        given = [False] * len(names)
    elif isinstance(lengths, Mapping):
        unknown = [k for k in lengths if k not in names]
        if unknown:
            raise ValueError(
                f"lengths names unknown datasets {unknown}; the datasets are {list(names)}"
            )
        specs = [lengths.get(n) for n in names]
        given = [n in lengths for n in names]
    elif isinstance(lengths, list | tuple):
        if len(lengths) != len(names):
            raise ValueError(
                f"got lengths for {len(lengths)} datasets, there are {len(names)}; give "
                "one entry (or None) per dataset, or a dict"
            )
        specs = list(lengths)
        given = [s is not None for s in lengths]
    else:
        raise TypeError(
            f"lengths must be None, a dict name -> lengths or a list; got {type(lengths).__name__}"
        )
    out: list[ComponentLengths | None] = []
    for c, (name, ds, spec) in enumerate(zip(names, datasets, specs, strict=True)):
        if given[c] or (needed and weights[c] > 0):
            lengths_c = resolve_lengths(name, c, ds, spec)
            if needed and weights[c] > 0 and not lengths_c.any_tokens():
                raise ValueError(
                    f"dataset {name!r} (component {c}{_files(ds)}) has no tokens: every one "
                    f"of its {len(ds)} samples is 0 tokens long, and the mixture shares out "
                    f"tokens (weight {weights[c]!r}); its samples cannot make up any share: "
                    "check its lengths (a length index of another dataset or tokenizer? an "
                    "empty text field?), or give it weight 0"
                )
            out.append(lengths_c)
        else:
            out.append(None)
    return tuple(out)
