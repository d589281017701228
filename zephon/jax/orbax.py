"""The loader's state in an Orbax ``CheckpointManager`` step, next to the model's.

::

    manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(train_state),
        loader=zephon.jax.CheckpointSave(it)))          # it: GlobalBatches or Pipeline
    ...
    restored = manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(abstract_train_state),
        loader=zephon.jax.CheckpointRestore(it)))       # a fresh iterator, before next()

What the ``loader`` item directory holds (bytes of :func:`zephon.checkpoint.io.dumps`:
msgpack + zstd with a checksummed header, never pickle):

* ``loader.zph`` when the state is already merged across ranks (the pipeline has
  ``aggregate_dir=``/``aggregate_store=``, or a single rank): every rank holds the same
  state, so only Orbax's primary host writes it (``MultiprocessingOptions.primary_host``,
  process 0 by default; ``None``: every process writes, for host-local storage).
* otherwise ``process_{i}-of-{n}.zph``, one per rank, each with that rank's lanes. Restore
  reads all ``n`` and merges them (:func:`zephon.pipeline.merge_states`), so a job with any
  number of processes can restore it — every process must see every file (a shared
  filesystem or object store, as Orbax's own multi-host checkpoints need).

The state is taken when Orbax calls the handler, inside the blocking part of
``manager.save`` (before it returns, also with async checkpointing): the loader as of the
last batch the training loop received.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import multihost
from orbax.checkpoint import options as ocp_options

from zephon.checkpoint.io import dumps, loads
from zephon.errors import CheckpointError
from zephon.pipeline import merge_states

__all__ = ["CheckpointRestore", "CheckpointSave", "LoaderCheckpointHandler"]

MERGED_FILE = "loader.zph"
_PROCESS_FILE = re.compile(r"^process_(\d+)-of-(\d+)\.zph$")


def process_file(rank: int, world_size: int) -> str:
    return f"process_{rank}-of-{world_size}.zph"


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
        state = args.item.checkpoint()
        topo = state.get("topology", {})
        if topo.get("merged") or int(topo.get("world_size", 1)) == 1:
            if multihost.is_primary_host(self._primary_host):
                (directory / MERGED_FILE).write_bytes(dumps(state))
            return
        name = process_file(int(topo["rank"]), int(topo["world_size"]))
        (directory / name).write_bytes(dumps(state))

    def restore(self, directory: epath.Path, args: CheckpointRestore) -> Any:
        """Restores the loader in place and returns it (the same object)."""
        args.item.restore(read_state(directory))
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


def read_state(directory: str | epath.Path) -> dict[str, Any]:
    """The loader state in an Orbax item directory, merged across ranks.

    Raises:
        CheckpointError: no loader state there, files of different world sizes, a missing
            rank, or a corrupt file (named).
    """
    directory = epath.Path(directory)
    merged = directory / MERGED_FILE
    if merged.exists():
        return _load(merged)
    found: dict[int, set[int]] = {}
    for p in directory.iterdir():
        m = _PROCESS_FILE.match(p.name)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        raise CheckpointError(
            f"{directory}: no Zephon loader state ({MERGED_FILE} or process_<i>-of-<n>.zph); "
            "was this step saved with zephon.jax.CheckpointSave?"
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{directory}: loader files from different world sizes {sorted(found)}; the step "
            "directory mixes two jobs"
        )
    ((n, ranks),) = found.items()
    missing = sorted(set(range(n)) - ranks)
    if missing:
        raise CheckpointError(
            f"{directory}: loader state of ranks {missing} of {n} is missing "
            f"({process_file(missing[0], n)}, ...); every process must see every rank's file "
            "to restore (use shared storage, or aggregate_dir=/aggregate_store= on the pipeline)"
        )
    states = [_load(directory / process_file(r, n)) for r in range(n)]
    return merge_states(states)


def _load(path: epath.Path) -> dict[str, Any]:
    try:
        return loads(path.read_bytes())
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e


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
