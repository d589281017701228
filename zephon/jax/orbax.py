"""The loader's state in an Orbax ``CheckpointManager`` step, next to the model's.

::

    manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(train_state),
        loader=zephon.jax.CheckpointSave(it)))          # it: GlobalBatches or Pipeline
    ...
    restored = manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(abstract_train_state),
        loader=zephon.jax.CheckpointRestore(it)))       # a fresh iterator, before next()

This is Orbax's v0 API (``CheckpointHandler``, ``ocp.args``); for its v1 API
(``save_checkpointables``), see :mod:`zephon.jax.orbax_v1`. Both write the same files.

What the ``loader`` item directory holds (the layout of :mod:`zephon.checkpoint.layout`;
bytes of :func:`zephon.checkpoint.io.dumps`: msgpack + zstd with a checksummed header,
never pickle):

* ``loader.zph`` when the state is merged across ranks (the pipeline has
  ``aggregate_dir=``/``aggregate_store=``, or a single rank). The round's leader, rank 0,
  holds the merged state; the other ranks hold their share of it (they confirmed the
  round's commit and read no other rank's lanes), so only Orbax's primary host writes it
  (``MultiprocessingOptions.primary_host``, process 0 by default, which is rank 0). With
  ``primary_host=None`` (every process writes, for host-local storage) rank 0 writes
  ``loader.zph`` and every other rank its share as ``process_{i}-of-{n}.zph``, which
  restores that rank in the same layout. A merged state of more than ``SHARD_LANES`` lanes
  is written as ``loader.zph`` holding an index (the state without its lanes, and per
  shard its lane range and sha256) plus ``loader-lanes-<first>-<last>.zph`` shards, so that
  a restoring rank reads the index and only the shards of the lanes it owns.
* otherwise ``process_{i}-of-{n}.zph``, one per rank, each with that rank's lanes. Restore
  reads all ``n`` and merges them (:func:`zephon.checkpoint.state.merge_states`), so a job with any
  number of processes can restore it — every process must see every file (a shared
  filesystem or object store, as Orbax's own multi-host checkpoints need); a rank that
  sees only some of them restores when those hold all of its lanes.

The files need no atomic write of their own: Orbax writes a step into a temporary
directory and renames it (or marks it committed) once every item of every process is
written, and never restores an unfinished step.

The state is taken when Orbax calls the handler, inside the blocking part of
``manager.save`` (before it returns, also with async checkpointing): the loader as of the
last batch the training loop received.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import multihost
from orbax.checkpoint import options as ocp_options

from zephon.checkpoint.layout import (
    INDEX_FORMAT,
    MERGED_FILE,
    SHARD_LANES,
    DirectoryFiles,
    files_to_write,
    merged_files,
    process_file,
)
from zephon.checkpoint.layout import read_state as _read_state

__all__ = [
    "INDEX_FORMAT",
    "MERGED_FILE",
    "SHARD_LANES",
    "CheckpointRestore",
    "CheckpointSave",
    "LoaderCheckpointHandler",
    "process_file",
    "read_state",
    "write_merged",
]


class LoaderCheckpointHandler(ocp.CheckpointHandler):
    """Saves and restores anything with ``checkpoint()``/``restore(state)``: a
    :class:`~zephon.jax.GlobalBatches` iterator or a :class:`~zephon.Pipeline`.

    Orbax builds it from the registered args (:class:`CheckpointSave`,
    :class:`CheckpointRestore`); construct it yourself only to change
    ``multiprocessing_options`` and pass it through a ``handler_registry``.
    """

    def __init__(
        self, *, multiprocessing_options: ocp_options.MultiprocessingOptions | None = None
    ) -> None:
        options = multiprocessing_options or ocp_options.MultiprocessingOptions()
        self._primary_host = options.primary_host

    def save(self, directory: epath.Path, args: CheckpointSave) -> None:
        files = files_to_write(
            args.item.checkpoint(),
            primary_host=self._primary_host,
            is_primary=multihost.is_primary_host(self._primary_host),
        )
        for name, blob in files.items():
            (directory / name).write_bytes(blob)

    def restore(self, directory: epath.Path, args: CheckpointRestore) -> Any:
        """Restores the loader in place and returns it (the same object), reading only
        the lane shards of the lanes it owns."""
        args.item.restore(read_state(directory, lanes=lanes_of(args.item)))
        return args.item

    def metadata(self, directory: epath.Path) -> dict[str, Any] | None:
        """The loader files in the item directory (``None`` before it exists)."""
        directory = epath.Path(directory)
        if not directory.exists():
            return None
        return {"files": sorted(p.name for p in directory.iterdir() if p.suffix == ".zph")}

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


def write_merged(directory: epath.Path, state: dict[str, Any]) -> None:
    """``loader.zph``: the state itself, or (over ``SHARD_LANES`` lanes) an index and the
    lane shards, each written before the index that names it."""
    for name, blob in merged_files(state).items():
        (directory / name).write_bytes(blob)


def read_state(directory: str | epath.Path, lanes: list[int] | None = None) -> dict[str, Any]:
    """The loader state in an Orbax item directory, merged across ranks (see
    :func:`zephon.checkpoint.layout.read_state`).

    Args:
        directory: the item directory.
        lanes: the lanes the restoring rank owns: of a sharded ``loader.zph`` only the
            shards holding them are read (None: all).

    Raises:
        CheckpointError: no loader state there, files of different world sizes, a missing
            rank, or a corrupt or mismatched file (named).
    """
    return _read_state(DirectoryFiles(epath.Path(directory)), lanes)


def lanes_of(item: Any) -> list[int] | None:
    """The lanes a Pipeline (or the pipeline of a GlobalBatches) owns."""
    pipe = getattr(item, "pipeline", item)
    lanes = getattr(pipe, "lanes", None)
    return None if lanes is None else [int(x) for x in lanes]


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_save=True)
@dataclasses.dataclass
class CheckpointSave(ocp.args.CheckpointArgs):
    """Orbax args that save a Zephon loader (``GlobalBatches`` or ``Pipeline``) in a
    ``Composite`` step."""

    item: Any


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class CheckpointRestore(ocp.args.CheckpointArgs):
    """Orbax args that restore a Zephon loader in place; pass a freshly built one."""

    item: Any
