"""StaticMixtureWorkSource: a weighted mixture of random-access datasets, one lane of it.

Per component ``c`` (dataset of length ``N``, named ``name``) the global sample stream is the
concatenation of dataset epochs ``e = 0, 1, 2, …``, epoch ``e`` being ``permute(range(N), N,
key=mix64(seed, k, e))`` with ``k = component_key(name)`` (64 bits of the name's blake2b:
the order does not depend on the dataset's place in the mixture), or the identity without
shuffling. Lane ``l`` of ``L`` takes global positions ``g = l + p * L`` for ``p = 0, 1, 2,
…`` — so the lanes are disjoint within every dataset epoch, together cover it, and every lane
gets samples even when ``N < L``. Sample ``p`` of the lane is ``permute(g % N, N, mix64(seed,
k, g // N))``.

Components are interleaved by worst-case fair weighted fair queueing (WF2Q+, see
:mod:`zephon.work_sources.interleave`): every component stays within about one of its
samples of its share of the lane's units, a unit being a sample (``weight_unit="samples"``)
or a token (``"tokens"``: the sample's token count, from ``lengths``). No random draws, so
every window of the stream tracks the weights. With
``num_epochs`` a component is exhausted for the lane once ``g >= E * N``; it then leaves the
interleave and the others share its place (``on_exhausted="renormalize"``), or the lane ends
(``"stop"``). ``weights`` may be a :class:`~zephon.Schedule` of the lane's own progress.

State is ``(next_chunk_id, the lane's tokens, where the weights were last looked up, the
virtual time, and per component: position, tokens, units received since the last change of
weights, a carried credit)``: constant size, packed small, and restoring it costs nothing
whatever the position.

This class holds what its lanes share and answers for the source; the constructor's
arguments are checked in :mod:`~zephon.work_sources.mixture_args`, one lane runs in
:mod:`~zephon.work_sources.mixture_lane`, and its state's format is
:mod:`~zephon.work_sources.lane_state`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon.chunks import WorkChunk
from zephon.errors import CheckpointError
from zephon.sources.identity import dataset_identity
from zephon.tracking.checks import checked_count
from zephon.work_sources.base import RandomAccessDataset
from zephon.work_sources.lane_state import unpack_components
from zephon.work_sources.lengths import ComponentLengths
from zephon.work_sources.mixture_args import (
    ON_EXHAUSTED,
    WEIGHT_UNITS,
    Datasets,
    Lengths,
    NumEpochs,
    Weights,
    as_int,
    check_datasets,
    check_epochs,
    check_lengths,
    check_sizes,
    validate_lane,
    weight_vectors,
)
from zephon.work_sources.mixture_lane import LaneInputs, MixtureLane
from zephon.work_sources.schedule import Schedule

__all__ = ["StaticMixtureWorkSource"]

#: The most pointers a work chunk may hold. A lane's in-flight chunks are stored in full in
#: every checkpoint (12 bytes a pointer: 768 KiB a chunk of 2**16), a restore replays whole
#: chunks, and a chunk's arrays are made at once: ``chunk_size=2**40`` asks numpy for 24 TiB,
#: ``2**63`` fails inside it ("Maximum allowed dimension exceeded"). The default is 64.
MAX_CHUNK_SIZE = 2**16


class StaticMixtureWorkSource:
    """One lane of a weighted mixture of random-access datasets.

    Args:
        datasets: a list/tuple of datasets (anything with ``__len__`` and ``__getitem__``),
            named ``"0"``, ``"1"``, …; or a dict name -> dataset. Component ``c`` is the
            position in the list, or in the dict's order.
        weights: one non-negative finite weight per component (list/tuple in component
            order, or a dict with exactly the dataset names as keys when ``datasets`` is a
            dict); None means equal weights; or a :class:`~zephon.Schedule` of weights that
            change with the lane's progress. Normalised to sum to 1. A zero-weight component
            is never drawn and may be empty.
        seed: seeds the per-epoch permutations and the per-chunk seeds.
        shuffle: permute every dataset epoch; False reads each dataset in order.
        chunk_size: pointers per work chunk, at most ``2**16`` (the last chunk of an
            exhausted lane may be shorter).
        num_epochs: passes over every dataset (counted over all lanes together) before it
            is exhausted: an int for all, a dict name -> int or None (names left out repeat
            forever), or None to repeat forever.
        weight_unit: what the weights share out: ``"samples"`` (each component's share of
            the samples) or ``"tokens"`` (its share of the tokens, from ``lengths``).
        lengths: each component's token count per sample: None (asked of the dataset when
            needed: ``TokenFileSource``, an ``ArraySource`` of token arrays), or a dict
            name -> (an array of counts, a :func:`~zephon.open_length_index`, or a column
            name of a ``ParquetSource``), or a list of those in component order. Needed for
            ``weight_unit="tokens"`` and ``Schedule(unit="tokens")``; otherwise, when given,
            only counted (``zephon inspect`` shows the tokens dealt).
        on_exhausted: with ``num_epochs``, what a lane does when one of its components with
            a positive weight runs out: ``"renormalize"`` (the others share its place; the
            lane ends when none is left) or ``"stop"`` (the lane ends there).
        lane: this source's lane, ``0 <= lane < num_lanes``.
        num_lanes: the number of lanes the stream is dealt across.

    Example::

        src = zp.StaticMixtureWorkSource(
            {"web": zp.TokenFileSource("web.bin", eos_id=0), "code": code},
            weights={"web": 0.7, "code": 0.3}, weight_unit="tokens",
            lengths={"code": zp.open_length_index(code, tokenizer)})

    Raises:
        ValueError: mismatched datasets/weights, a negative or non-finite weight, weights
            summing to zero, an empty dataset with positive weight, ``chunk_size`` outside
            1..2**16 (:data:`MAX_CHUNK_SIZE`), ``num_epochs < 1``, a lane out of range, an
            unknown ``weight_unit`` or ``on_exhausted``, token weights for a dataset whose
            lengths are unknown or all zero; weights given as strings or booleans.
        TypeError: a dataset without ``__len__``/``__getitem__``, or a non-int parameter.
    """

    def __init__(
        self,
        datasets: Datasets,
        weights: Weights = None,
        seed: int = 0,
        shuffle: bool = True,
        chunk_size: int = 64,
        num_epochs: NumEpochs = None,
        *,
        weight_unit: str = "samples",
        lengths: Lengths = None,
        on_exhausted: str = "renormalize",
        lane: int = 0,
        num_lanes: int = 1,
    ) -> None:
        names, dsets = check_datasets(datasets)
        if weight_unit not in WEIGHT_UNITS:
            raise ValueError(f"weight_unit must be one of {WEIGHT_UNITS}; got {weight_unit!r}")
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {ON_EXHAUSTED}; got {on_exhausted!r}")
        schedule, vectors, first, raw_weights = weight_vectors(weights, datasets, names)
        sizes = check_sizes(names, dsets, raw_weights)

        seed = as_int("seed", seed)
        if not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits (msgpack-able); got seed={seed}")
        chunk_size = as_int("chunk_size", chunk_size)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; got chunk_size={chunk_size}")
        if chunk_size > MAX_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size must be at most {MAX_CHUNK_SIZE} (2**16 pointers: every in-flight "
                f"chunk is stored in full in each checkpoint and replayed whole on restore); "
                f"got chunk_size={chunk_size}: leave it at 64, or give the samples one lane "
                "reads at a time (the batch size is batch()'s)"
            )
        epochs = check_epochs(num_epochs, names)

        self._names: tuple[str, ...] = names
        self._datasets: tuple[RandomAccessDataset, ...] = dsets
        self._lengths: tuple[int, ...] = sizes
        self._schedule = schedule
        self._weights: tuple[float, ...] = first
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._chunk_size = chunk_size
        self._num_epochs: Any = dict(num_epochs) if isinstance(num_epochs, Mapping) else num_epochs
        self._weight_unit = weight_unit
        self._on_exhausted = on_exhausted
        needs_tokens = weight_unit == "tokens" or (
            schedule is not None and schedule.unit == "tokens"
        )
        self._token_lengths = check_lengths(lengths, names, dsets, raw_weights, needs_tokens)
        self._inputs = LaneInputs.build(
            names,
            sizes,
            epochs,
            schedule,
            vectors,
            self._token_lengths,
            seed,
            self._shuffle,
            chunk_size,
            weight_unit,
            on_exhausted,
        )
        self._stream = MixtureLane(self._inputs, *validate_lane(lane, num_lanes))

    def for_lane(self, lane: int, num_lanes: int) -> StaticMixtureWorkSource:
        """A fresh source for ``lane`` of ``num_lanes`` sharing this one's datasets and
        parameters."""
        lane, num_lanes = validate_lane(lane, num_lanes)
        new = copy.copy(self)
        new._stream = MixtureLane(self._inputs, lane, num_lanes)
        return new

    def config(self) -> dict[str, Any]:
        """Msgpack-able description for the pipeline fingerprint (no lane, no progress).

        ``identities`` holds each dataset's content identity (its ``content_identity()``,
        or its type's name for a dataset without one; see :mod:`zephon.sources.identity`),
        computed now from bounded reads. Options left at their defaults are left out, so a
        pipeline that does not use them keeps its fingerprint.

        Raises:
            TypeError: a dataset's ``content_identity()`` returned something that is not a
                dict of plain values; the message names the component.
        """
        identities = []
        for c, (name, ds) in enumerate(zip(self._names, self._datasets, strict=True)):
            try:
                identities.append(dataset_identity(ds))
            except TypeError as e:
                raise TypeError(f"dataset {name!r} (component {c}): {e}") from e
        config: dict[str, Any] = {
            "class": type(self).__name__,
            "names": list(self._names),
            "lengths": list(self._lengths),
            "weights": list(self._weights),
            "seed": self._seed,
            "shuffle": self._shuffle,
            "chunk_size": self._chunk_size,
            "num_epochs": self._num_epochs,
            # Last, so that the config without it is the one checkpoints held before.
            "identities": identities,
        }
        if self._weight_unit != "samples":
            config["weight_unit"] = self._weight_unit
        if any(t is not None for t in self._token_lengths):
            config["token_lengths"] = [
                None if t is None else t.description for t in self._token_lengths
            ]
        if self._schedule is not None:
            config["schedule"] = self._schedule.config()
        if self._on_exhausted != "renormalize":
            config["on_exhausted"] = self._on_exhausted
        return config

    # ------------------------------------------------------------------------ properties

    @property
    def datasets(self) -> tuple[RandomAccessDataset, ...]:
        return self._datasets

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each dataset's length (samples)."""
        return self._lengths

    @property
    def weights(self) -> tuple[float, ...] | None:
        """Normalised weights, summing to 1; None when they follow a :class:`Schedule`."""
        return None if self._schedule is not None else self._weights

    @property
    def schedule(self) -> Schedule | None:
        return self._schedule

    @property
    def weight_unit(self) -> str:
        return self._weight_unit

    @property
    def token_lengths(self) -> tuple[ComponentLengths | None, ...]:
        """Each component's token counts, where known."""
        return self._token_lengths

    @property
    def on_exhausted(self) -> str:
        return self._on_exhausted

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def num_epochs(self) -> Any:
        """As given: an int, a dict name -> int or None, or None."""
        return self._num_epochs

    @property
    def lane(self) -> int:
        return self._stream.lane

    @property
    def next_chunk_id(self) -> int:
        """The id of the chunk :meth:`next_chunk` returns next."""
        return self._stream.next_chunk_id

    @property
    def num_lanes(self) -> int:
        return self._stream.num_lanes

    @property
    def num_components(self) -> int:
        return len(self._datasets)

    @property
    def positions(self) -> tuple[int, ...]:
        """Samples of each component this lane has dealt."""
        return self._stream.positions

    @property
    def tokens_dealt(self) -> tuple[int, ...]:
        """Tokens of each component this lane has dealt (0 where lengths are unknown)."""
        return self._stream.tokens_dealt

    @property
    def current_weights(self) -> tuple[float, ...]:
        """The weights the next chunk is dealt with (a schedule's, at the lane's progress)."""
        return self._stream.current_weights

    # ---------------------------------------------------------------------------- stream

    def next_chunk(self) -> WorkChunk | None:
        """The lane's next chunk of up to ``chunk_size`` pointers, or None once it is
        exhausted (every component with a positive weight is, or with ``on_exhausted=
        "stop"`` one of them)."""
        return self._stream.next_chunk()

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "lane", "num_lanes", "next_chunk_id", "lane_tokens",
        "schedule_position", "virtual_time", "positions", "tokens", "received", "carry",
        "stopped"}``: a few numbers, and per component packed bytes whose size does not grow with the progress
        (``received`` is stored as its difference from the samples or tokens dealt, zero
        until the weights first change; ``carry`` is empty until then)."""
        return self._stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the source that saved ``state`` stood. O(1) in the
        progress (O(C) in the components).

        Raises:
            CheckpointError (a ValueError): unknown version, missing or unknown keys, a
                state for another lane / lane count / number of components, or values
                inconsistent with this source's parameters.
        """
        self._stream.load_state_dict(state)

    def remapped_state(
        self,
        state: Mapping[str, Any],
        old_names: Sequence[str],
        kept: Mapping[str, str],
    ) -> dict[str, Any]:
        """A lane's state saved by a source over other components (``old_names``), for
        this one: what ``pipeline.restore(allow_mixture_change=True)`` loads.

        ``kept`` maps each of this source's names whose dataset stays to its old name:
        those keep their position and tokens; every other component starts at its
        beginning. The interleave starts afresh at the lane's progress (the new weights
        from now on); the chunk id and the lane's tokens go on.

        Raises:
            CheckpointError: the state is not a readable state of ``len(old_names)``
                components.
        """
        if not isinstance(state, Mapping):
            raise CheckpointError(f"work source state must be a dict; got {type(state).__name__}")
        count = len(old_names)
        positions = unpack_components(state.get("positions"), count, "positions", self._names)
        tokens = unpack_components(state.get("tokens"), count, "tokens", self._names)
        new_pos = np.zeros(self.num_components, dtype=np.int64)
        new_tok = np.zeros(self.num_components, dtype=np.int64)
        index = {n: c for c, n in enumerate(old_names)}
        for c, name in enumerate(self._names):
            if name in kept:
                new_pos[c] = positions[index[kept[name]]]
                new_tok[c] = tokens[index[kept[name]]]
        next_chunk_id = checked_count("state next_chunk_id", state.get("next_chunk_id"))
        lane_tokens = checked_count("state lane_tokens", state.get("lane_tokens"))
        fresh = MixtureLane(self._inputs, self._stream.lane, self._stream.num_lanes)
        return fresh.restarted_state(new_pos, new_tok, next_chunk_id, lane_tokens)

    def __repr__(self) -> str:
        extra = ""
        if self._weight_unit != "samples":
            extra += f", weight_unit={self._weight_unit!r}"
        if self._schedule is not None:
            extra += f", schedule={self._schedule!r}"
        if self._on_exhausted != "renormalize":
            extra += f", on_exhausted={self._on_exhausted!r}"
        return (
            f"{type(self).__name__}(names={self._names}, lengths={self._lengths}, "
            f"weights={self._weights}, seed={self._seed}, shuffle={self._shuffle}, "
            f"chunk_size={self._chunk_size}, num_epochs={self._num_epochs}{extra}, "
            f"lane={self.lane}, num_lanes={self.num_lanes})"
        )
