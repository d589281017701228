"""Global ``jax.Array`` batches from a pipeline, with batches prefetched onto the devices.

Where the cut is. The pipeline counts a batch as delivered when its ``next()`` returns it,
so once this iterator has put ``prefetch`` batches on device ahead of the training loop,
``pipe.checkpoint()`` describes a point ``prefetch`` batches *after* the last batch the loop
received: restoring it would skip those batches. The iterator therefore takes the
pipeline's (local, cheap: a few dicts) state right after pulling each batch and keeps it
with that batch; when it returns a batch, that batch's state becomes the iterator's
state. :meth:`GlobalBatches.checkpoint` returns it — the loader as of the last batch the
iterator returned — and runs the multi-rank aggregation round on it when the pipeline
has ``aggregate_dir=``/``aggregate_store=``. Batches sitting on device but not yet returned
are not delivered: after a restore they come again.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from zephon.errors import CheckpointError
from zephon.pipeline.pipeline import Pipeline
from zephon.runners.lanes import LOCKSTEP

__all__ = ["GlobalBatches", "global_batches"]


class GlobalBatches:
    """An iterator of global ``jax.Array`` batches over a :class:`~zephon.Pipeline`.

    Each step takes the pipeline's next batch — with ``output="lockstep"`` this process's
    lanes concatenated in lane order — and builds global arrays with
    ``jax.make_array_from_process_local_data(sharding, local_batch)``. ``prefetch`` batches
    are kept on device ahead of the one returned (JAX dispatches the transfers
    asynchronously, so they overlap the training step; host-side work already overlaps
    through the pipeline's own pump thread).

    ``checkpoint()``/``restore()`` work like the pipeline's but at the batches this
    iterator *returned* (see the module docstring); save and restore through the iterator,
    never through the pipeline it wraps. Use it as a context manager or call
    :meth:`close`, which also closes the pipeline.

    Args:
        pipe: a freshly built (or freshly restored) pipeline; the iterator owns it from now on.
        sharding: how the global batch is laid out, typically
            ``NamedSharding(mesh, PartitionSpec("data"))`` whose first (batch) axis is the
            data-parallel axis; one sharding for every array of the batch, or a pytree of
            shardings matching the batch (a dict keyed like the batch's features).
        prefetch: batches kept on device beyond the one returned (0: none).

    Raises:
        ValueError: ``prefetch`` is negative; on the first batch, with lockstep output, this
            process's devices do not hold the rows of the global batch that its lanes fill
            (the mesh's devices are not ordered by process).
    """

    def __init__(self, pipe: Pipeline, sharding: Any, prefetch: int = 2) -> None:
        if not isinstance(pipe, Pipeline):
            raise TypeError(f"global_batches() takes a zp.Pipeline; got {type(pipe).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0; got {prefetch!r}")
        self.pipeline = pipe
        self.sharding = sharding
        self.prefetch = prefetch
        # (global batch, the pipeline's local state right after it was pulled), oldest first.
        self._ahead: collections.deque[tuple[Any, dict[str, Any]]] = collections.deque()
        self._state: dict[str, Any] | None = None  # local state at the last returned batch
        self._exhausted = False
        self._error: BaseException | None = None  # the pipeline's, raised once the batches
        # pulled before it have been returned
        self._checked_rows = False
        self._steps = 0

    # ----------------------------------------------------------------- iterate
    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self._fill(self.prefetch + 1)
        if not self._ahead:
            if self._error is not None:
                raise self._error
            raise StopIteration
        batch, state = self._ahead.popleft()
        self._state = state
        self._steps += 1
        return batch

    def _fill(self, n: int) -> None:
        while len(self._ahead) < n and not self._exhausted:
            try:
                local = next(self.pipeline)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as e:  # noqa: BLE001 - re-raised by __next__, in order
                self._exhausted, self._error = True, e
                return
            # Taken before anything else can move the pipeline: the state that says "this
            # batch and every one before it were delivered".
            state = self.pipeline.local_checkpoint()
            if self.pipeline.zero_copy:
                # Views into shared memory expire at the pipeline's next next(); on CPU JAX
                # may alias host buffers instead of copying them.
                local = jax.tree.map(np.array, local)
            if not self._checked_rows:
                _check_rows(self.pipeline, self.sharding, local)
                self._checked_rows = True
            self._ahead.append(
                (jax.make_array_from_process_local_data(self.sharding, local), state)
            )

    @property
    def steps(self) -> int:
        """Batches returned since this iterator was built (not counting restored ones)."""
        return self._steps

    @property
    def on_device(self) -> int:
        """Batches put on device but not yet returned (not delivered)."""
        return len(self._ahead)

    # -------------------------------------------------------------- checkpoint
    def checkpoint(self) -> dict[str, Any]:
        """The loader state as of the last batch this iterator returned.

        Batches prefetched onto the devices but not returned are not part of it. With
        aggregation configured on the pipeline every process must call it at the same step:
        process 0 gets the merged state, every other process its share of it, as with
        :meth:`Pipeline.checkpoint`.
        """
        if self._state is None:
            # Nothing returned, so nothing pulled (or only a restore): the pipeline's own
            # state is exact.
            return self.pipeline.checkpoint()
        return self.pipeline.aggregate(self._state)

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`checkpoint` or a merged pipeline
        checkpoint) on this iterator, before its first ``next()``.

        Raises:
            CheckpointError: iteration already began, or the pipeline rejects ``state``
                (see :meth:`Pipeline.restore`).
        """
        if self._ahead or self._state is not None or self._exhausted:
            raise CheckpointError(
                "restore() after iteration began; build a fresh pipeline and iterator and "
                "restore into them"
            )
        self.pipeline.restore(state)

    # ------------------------------------------------------------------- close
    def close(self) -> None:
        """Drop the prefetched batches and close the pipeline. Idempotent."""
        self._ahead.clear()
        self.pipeline.close()

    def __enter__(self) -> GlobalBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GlobalBatches(prefetch={self.prefetch}, returned={self._steps}, "
            f"on_device={len(self._ahead)}, pipeline={self.pipeline!r})"
        )


def global_batches(pipe: Pipeline, sharding: Any, prefetch: int = 2) -> GlobalBatches:
    """Global ``jax.Array`` batches of ``pipe`` laid out by ``sharding``, ``prefetch``
    batches on device ahead; see :class:`GlobalBatches`.

    Example::

        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        sharding = NamedSharding(mesh, PartitionSpec("data"))
        with zephon.jax.global_batches(pipe, sharding) as it:
            for step, batch in enumerate(it):     # dict of jax.Array, global shapes
                state = train_step(state, batch)
                if step % 1000 == 0:
                    zephon.save(f"loader-{step}.zph", it.checkpoint())
    """
    return GlobalBatches(pipe, sharding, prefetch)


def _check_rows(pipe: Pipeline, sharding: Any, local: Any) -> None:
    """With lockstep output the global batch is lanes in order: the data-parallel group
    that owns lanes [g*n, (g+1)*n) fills rows [g*R, (g+1)*R) (R: rows of a local batch).
    ``make_array_from_process_local_data`` puts a process's rows wherever its devices sit
    in the mesh, so check once, before a badly ordered mesh silently permutes the global
    batch (and breaks "same global batches on any number of hosts")."""
    lanes = pipe.lanes
    dp_size = pipe.canonical_replicas // len(lanes)
    if pipe.output != LOCKSTEP or dp_size == 1:
        return
    dp_rank = lanes[0] // len(lanes)
    leaves = jax.tree.leaves(local)
    shardings = (
        [sharding] * len(leaves)
        if isinstance(sharding, jax.sharding.Sharding)
        else jax.tree.leaves(sharding)
    )
    if not leaves or len(shardings) != len(leaves):
        return  # a structure mismatch: make_array_from_process_local_data reports it
    arr, shd = np.asarray(leaves[0]), shardings[0]
    if arr.ndim == 0:
        return
    rows = arr.shape[0]
    global_rows = rows * dp_size
    index_map = shd.addressable_devices_indices_map((global_rows, *arr.shape[1:]))
    spans = [idx[0].indices(global_rows)[:2] for idx in index_map.values() if idx]
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    want = (dp_rank * rows, (dp_rank + 1) * rows)
    if (lo, hi) == (0, global_rows):
        raise ValueError(
            f"the sharding {shd} does not split the batch axis across processes, but each of "
            f"the pipeline's {dp_size} data-parallel groups feeds only its own {rows} rows; "
            "shard the first axis over the data axis, e.g. NamedSharding(mesh, PartitionSpec('data'))"
        )
    if (lo, hi) != want:
        raise ValueError(
            f"this process feeds lanes {lanes[0]}..{lanes[-1]}, rows {want[0]}..{want[1] - 1} "
            f"of the lockstep global batch, but its devices hold rows {lo}..{hi - 1} under "
            f"{shd}; order the mesh's devices by process (jax.make_mesh, or "
            "np.array(jax.devices()) reshaped) so global rows stay in lane order"
        )
