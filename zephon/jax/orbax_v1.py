"""The loader in an Orbax v1 checkpoint, next to the model: Orbax's checkpointable protocol
(``StatefulCheckpointable``), the way Grain's iterators are saved.

::

    import orbax.checkpoint.experimental.v1 as ocp   # orbax.checkpoint.v1 in later releases
    import zephon.jax as zj

    it = zj.global_batches(build(), sharding)        # or a Pipeline
    ...
    ocp.save_checkpointables(path, {"params": params, "loader": zj.Checkpointable(it)})

    it = zj.global_batches(build(), sharding)        # fresh, before next()
    restored = ocp.load_checkpointables(
        path, {"params": abstract_params, "loader": zj.Checkpointable(it)})
    params = restored["params"]                      # it is restored in place

It works wherever Orbax v1 takes checkpointables: ``ocp.training.Checkpointer``'s
``save_checkpointables(step, {...})`` / ``load_checkpointables(step, {...})``, and the
``_async`` forms. Leave the ``loader`` entry out of ``load_checkpointables`` (an
evaluation job, say) and only the model is read.

The loader item directory holds the files of Orbax's v0 handler (:mod:`zephon.jax.orbax`,
laid out by :mod:`zephon.checkpoint.layout`: msgpack + zstd, never pickle), so with
several JAX processes the same holds: ``loader.zph`` for a state merged across ranks
(written by Orbax's primary host, ``MultiprocessingOptions.primary_host`` of the active
``ocp.Context``), else one ``process_<i>-of-<n>.zph`` per rank, merged on restore.
Every process must call ``save_checkpointables`` at the same step, as Orbax requires;
with ``aggregate_dir``/``aggregate_store`` on the pipeline that step's checkpoint round
runs inside it.

The state is taken in the blocking part of the save (the loader as of the last batch the
training loop received) and encoded there; the files are written in Orbax's background
part, into the step's temporary directory, which Orbax renames (or marks committed) once
every checkpointable of every process is written. A restore reads the files and restores
the loader inside ``load_checkpointables``, reading only the lane shards of the lanes this
rank owns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from zephon.checkpoint.layout import DirectoryFiles, files_to_write, read_state
from zephon.jax.orbax import lanes_of

try:  # orbax-checkpoint >= 0.12 names it orbax.checkpoint.v1 in later releases
    from orbax.checkpoint.v1 import multihost  # type: ignore[import-not-found]
except ImportError:
    from orbax.checkpoint.experimental.v1 import multihost

__all__ = ["Checkpointable"]


class Checkpointable:
    """A Zephon loader (a :class:`~zephon.jax.GlobalBatches` or a :class:`~zephon.Pipeline`,
    anything with ``checkpoint()``/``restore(state)``) as an Orbax v1 checkpointable.

    It implements ``orbax.checkpoint.v1.handlers.StatefulCheckpointable``: pass it as one
    of the checkpointables of ``save_checkpointables`` to save the loader's state, and a
    new one around a freshly built loader to ``load_checkpointables`` to restore that
    loader in place (``restored[name].item`` is the loader).

    Args:
        item: the loader.
    """

    def __init__(self, item: Any) -> None:
        self.item = item

    async def save(self, directory: Any) -> Awaitable[None]:
        """Takes and encodes the loader state now; the returned awaitable writes it into
        ``directory`` (a path awaiting creation) once Orbax has created it."""
        primary_host = _primary_host()
        files = files_to_write(
            self.item.checkpoint(),
            primary_host=primary_host,
            is_primary=multihost.is_primary_host(primary_host),
        )
        return _write(directory, files)

    async def load(self, directory: Any) -> Awaitable[None]:
        """The returned awaitable reads the loader state in ``directory`` and restores the
        loader (before its first ``next()``)."""
        return self._restore(directory)

    async def _restore(self, directory: Any) -> None:
        state = await asyncio.to_thread(read_state, DirectoryFiles(directory), lanes_of(self.item))
        self.item.restore(state)

    def __repr__(self) -> str:
        return f"Checkpointable({self.item!r})"


async def _write(directory: Any, files: dict[str, bytes]) -> None:
    path = await directory.await_creation()
    for name, blob in files.items():
        await asyncio.to_thread((path / name).write_bytes, blob)


def _primary_host() -> int | None:
    """``primary_host`` of the active ``ocp.Context`` (0, Orbax's default, without one).

    Orbax's own handlers read it the same way; its public API has no accessor for the
    active context yet."""
    try:
        from orbax.checkpoint.experimental.v1._src.context import context as context_lib
    except ImportError:  # pragma: no cover - a later Orbax moved it: its default
        return 0
    return context_lib.get_context().multiprocessing_options.primary_host
