"""Grain 0.2.18 baseline for the LM workload (benchmarks only; grain is never a runtime dep).

The pipeline, exactly (all names as exported by grain 0.2.18)::

    ds = grain.MapDataset.source(docs).shuffle(seed=seed).map(tokenize_to_dict)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    ds = grain.experimental.FlatMapIterDataset(ds, SplitToMaxLen(SEQ_LEN))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"tokens": SEQ_LEN}, num_packing_bins=NUM_BINS, seed=seed)
    ds = ds.batch(BATCH_SIZE, drop_remainder=True)
    # only when min_shm_size is given:
    ds = grain.experimental.WithOptionsIterDataset(
        ds, grain.experimental.DatasetOptions(min_shm_size=min_shm_size))
    # only when workers > 0:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    it = iter(ds)    # it.get_state() / it.set_state(state) for checkpoints

Output per batch: ``tokens``, ``tokens_segment_ids``, ``tokens_positions``, int32
``[BATCH_SIZE, SEQ_LEN]`` (segment id 0 = padding), the same names Zephon's ``pack`` emits.

Version quirks found by reading the installed 0.2.18 source:

* ``FirstFitPackIterDataset(parent, *, length_struct, num_packing_bins, seed=0,
  shuffle_bins=True, ...)``: everything after ``parent`` is keyword-only; bins are shuffled on
  emission by default (seeded by ``seed`` + a row counter). An element longer than its
  ``length_struct`` entry raises ``ValueError("Inputs to PackedBatch must be truncated to max
  length ...")`` - packing never splits. Documents here reach 5001 tokens, so, to do the same
  job as Zephon's ``split(max_len=SEQ_LEN)``, a ``FlatMapIterDataset`` with a ``FlatMapTransform``
  (``grain.experimental.FlatMapTransform``, ``max_fan_out`` = 3) cuts them into consecutive
  pieces first. It is checkpointable: its state is (parent state before the element, index
  into the pieces), and ``set_state`` re-reads and re-splits that one element.
* ``grain.DatasetOptions`` does not exist at top level in 0.2.18: it is
  ``grain.experimental.DatasetOptions``, applied with ``grain.experimental.WithOptionsIterDataset``
  (there is no ``IterDataset.with_options`` method). ``min_shm_size`` (default 0 = every
  numpy array goes through a fresh shared-memory segment) is read *inside the worker process*
  from the options of the dataset handed to ``mp_prefetch``, so the wrapper must sit *below*
  ``mp_prefetch``; put above it, it has no effect on the workers.
* With ``num_workers > 1``, ``mp_prefetch`` calls ``enable_shared_memory_output()`` on the
  dataset it is given when that is a ``BatchIterDataset``: ``batch`` then stacks straight into
  shared memory and ``min_shm_size`` is bypassed for those arrays (a ``SharedMemoryArray`` leaf
  is always sent as shm metadata). Wrapping the batch in ``WithOptionsIterDataset`` (as done here
  when ``min_shm_size`` is given) hides the batch from that check, so ``np.stack`` is used and
  arrays below ``min_shm_size`` (a batch array is 8*2048*4 = 64 KiB) are pickled through the
  worker's ``multiprocessing.Queue`` instead. :func:`batch_transport` reports which path a
  received batch took.
* ``mp_prefetch`` workers are started with the ``spawn`` context and the dataset is
  cloudpickled into each worker (the whole document list included); each worker packs its own
  slice ``i::num_workers`` of the shuffled documents, so the output depends on ``num_workers``
  (documented by Grain). With ``num_workers == 1`` no slicing happens. Because of ``spawn``,
  the calling program's ``__main__`` must be importable and guarded by
  ``if __name__ == "__main__"``: from ``python -`` (stdin) the workers die at start-up and the
  parent waits forever on the first ``next``.
* With JAX installed (jaxlib extension version >= 448, e.g. jax 0.10.2), ``mp_prefetch``
  reads the absl flag ``--grain_enable_multiprocess_worker_profiling`` through
  ``FlagHolder.value`` instead of Grain's own ``config.get_or_default``, so any program that has
  not parsed absl flags (anything not started by ``absl.app.run``) fails on the first ``next``
  with ``UnparsedFlagAccessError``. Without JAX the check short-circuits and all is well.
  :func:`_grain` works around it with ``absl.flags.FLAGS.mark_as_parsed()`` (defaults kept).
  Importing grain also logs "Failed to load jax profiler" when JAX is absent (harmless).
* ``ReadOptions(num_threads=0)`` makes ``to_iter_dataset`` read synchronously in the consumer
  (no prefetch thread pool).
* Grain's iterator state is a small nested dict (MapDataset next index, flat-map and packing
  positions), so restoring is O(1) in the step: ``set_state`` re-reads at most the elements of
  the current packing round.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from benchmarks.harness.batches import batches_equal, copy_batch
from benchmarks.harness.timing import time_calls
from benchmarks.workload import (
    BATCH_SIZE,
    MAX_DOC_BYTES,
    NUM_BINS,
    SEQ_LEN,
    byte_tokenize,
    split_tokens,
)

GRAIN_VERSION = "0.2.18"


def _grain():
    """Imports grain lazily (it is a benchmark-only extra).

    Also marks absl flags as parsed (keeping their defaults) unless the program already parsed
    them: with JAX installed (jaxlib extension >= 448), ``mp_prefetch`` reads the absl flag
    ``--grain_enable_multiprocess_worker_profiling`` directly and raises
    ``UnparsedFlagAccessError`` in any program that does not run ``absl.app``.
    """
    import grain  # noqa: PLC0415
    from absl import flags  # noqa: PLC0415  (a grain dependency)

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return grain


def tokenize_to_dict(text: str) -> dict[str, np.ndarray]:
    """The Grain-side tokenizer: ``{"tokens": int32 ids}``, same ids as ``zp.ByteTokenizer``."""
    return {"tokens": byte_tokenize(text)}


class SplitToMaxLen:
    """Grain ``FlatMapTransform``: consecutive pieces of at most ``max_len`` tokens, as Zephon's
    ``split`` does. Registered as a virtual subclass of ``grain.experimental.FlatMapTransform``
    when a pipeline is built (a plain module-level class so that cloudpickle sends it to
    ``mp_prefetch`` workers by reference)."""

    def __init__(self, max_len: int = SEQ_LEN, max_doc_tokens: int = MAX_DOC_BYTES + 1) -> None:
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self.max_len = int(max_len)
        self.max_fan_out = -(-int(max_doc_tokens) // self.max_len)

    def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [{"tokens": piece} for piece in split_tokens(element["tokens"], self.max_len)]


def grain_lm_dataset(
    docs: Sequence[str],
    seed: int,
    workers: int = 0,
    min_shm_size: int | None = None,
    *,
    seq_len: int = SEQ_LEN,
    num_bins: int = NUM_BINS,
    batch_size: int = BATCH_SIZE,
    per_worker_buffer_size: int = 1,
):
    """The Grain ``IterDataset`` for the LM workload (see the module docstring)."""
    grain = _grain()
    # repeated (reshuffled each epoch) like the Zephon source, so deep restores have data
    ds = grain.MapDataset.source(docs).shuffle(seed=seed).repeat().map(tokenize_to_dict)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    grain.experimental.FlatMapTransform.register(SplitToMaxLen)
    ds = grain.experimental.FlatMapIterDataset(ds, SplitToMaxLen(seq_len))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"tokens": seq_len}, num_packing_bins=num_bins, seed=seed
    )
    ds = ds.batch(batch_size, drop_remainder=True)
    if min_shm_size is not None:
        options = grain.experimental.DatasetOptions(min_shm_size=int(min_shm_size))
        ds = grain.experimental.WithOptionsIterDataset(ds, options)
    if workers > 0:
        ds = ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=workers, per_worker_buffer_size=per_worker_buffer_size
            )
        )
    return ds


def grain_lm_iter(
    docs: Sequence[str],
    seed: int,
    workers: int = 0,
    min_shm_size: int | None = None,
    **kwargs: Any,
) -> Iterator[dict[str, np.ndarray]]:
    """An iterator of LM batches (``tokens``, ``tokens_segment_ids``, ``tokens_positions``).

    Close it (``it.close()``) when ``workers > 0`` to stop the worker processes promptly.
    """
    return iter(grain_lm_dataset(docs, seed, workers, min_shm_size, **kwargs))


def get_state(it) -> dict[str, Any]:
    """Grain's checkpoint of an iterator (a JSON-able dict)."""
    return it.get_state()


def set_state(it, state: dict[str, Any]) -> None:
    it.set_state(state)


def state_nbytes(state: dict[str, Any]) -> int:
    """Size of the state as Grain's own checkpoint handler writes it (JSON)."""
    return len(json.dumps(state).encode("utf-8"))


def batch_transport(batch: dict[str, np.ndarray]) -> str:
    """How a batch reached the parent: ``"shm"`` (SharedMemoryArray) or ``"copy"``."""
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray  # noqa: PLC0415

    leaves = list(batch.values())
    return "shm" if all(isinstance(x, SharedMemoryArray) for x in leaves) else "copy"


def _close(it) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


class GrainRestore:
    """A Grain iterator checkpointed once after ``step`` batches, to time fresh starts and
    restores against (call :meth:`time_fresh` and :meth:`time_restore` as often as wanted).

    Building runs an iterator ``step`` batches, calls ``get_state`` ``checkpoint_calls`` times in
    a row (``checkpoint_s``: the latency of each), keeps the last state as JSON, as Grain's own
    checkpoint handler writes it (``state_bytes``), and the batch the iterator produced next.
    """

    def __init__(
        self,
        docs: Sequence[str],
        seed: int,
        step: int,
        workers: int = 0,
        min_shm_size: int | None = None,
        *,
        checkpoint_calls: int = 5,
        **kwargs: Any,
    ) -> None:
        self._make = functools.partial(grain_lm_iter, docs, seed, workers, min_shm_size, **kwargs)
        it = self._make()
        try:
            for _ in range(step):
                next(it)
            self.checkpoint_s, state = time_calls(lambda: get_state(it), checkpoint_calls)
            self.state_json = json.dumps(state)
            self.state_bytes = state_nbytes(state)
            self.expected = copy_batch(next(it))
        finally:
            _close(it)

    def time_fresh(self) -> float:
        """Seconds from a new iterator to its first batch."""
        t0 = time.perf_counter()
        it = self._make()
        try:
            next(it)
            return time.perf_counter() - t0
        finally:
            _close(it)

    def time_restore(self) -> dict[str, Any]:
        """``restore_s``: seconds from a new iterator through decoding the JSON state and
        ``set_state`` to its first batch; ``exact``: whether that batch equals the one the
        checkpointed iterator produced next."""
        t0 = time.perf_counter()
        it = self._make()
        try:
            set_state(it, json.loads(self.state_json))
            first = next(it)
            restore_s = time.perf_counter() - t0
            return {"restore_s": restore_s, "exact": batches_equal(first, self.expected)}
        finally:
            _close(it)
