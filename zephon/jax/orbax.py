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
  filesystem or object store, as Orbax's own multi-host checkpoints need).

The state is taken when Orbax calls the handler, inside the blocking part of
``manager.save`` (before it returns, also with async checkpointing): the loader as of the
last batch the training loop received.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import multihost
from orbax.checkpoint import options as ocp_options

from zephon.checkpoint.io import dumps, loads
from zephon.checkpoint.state import merge_states
from zephon.errors import CheckpointError

__all__ = ["CheckpointRestore", "CheckpointSave", "LoaderCheckpointHandler"]

MERGED_FILE = "loader.zph"
#: merged states with more lanes than this are written as an index plus lane shards
SHARD_LANES = 256
INDEX_FORMAT = "zephon.loader-index"
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
        share = state.get("share")
        if isinstance(share, dict):  # a follower of the round: rank 0 writes the merged state
            if self._primary_host is None:
                name = process_file(int(share["rank"]), int(share["world_size"]))
                (directory / name).write_bytes(dumps(state))
            elif multihost.is_primary_host(self._primary_host):
                raise CheckpointError(
                    f"Orbax's primary host (process {self._primary_host}) holds only rank "
                    f"{share['rank']}'s share of the merged loader state; rank 0, the "
                    "checkpoint round's leader, holds all of it. Use "
                    "MultiprocessingOptions(primary_host=0) (the default), or None"
                )
            return
        if topo.get("merged") or int(topo.get("world_size", 1)) == 1:
            if multihost.is_primary_host(self._primary_host) or self._primary_host is None:
                write_merged(directory, state)
            return
        name = process_file(int(topo["rank"]), int(topo["world_size"]))
        (directory / name).write_bytes(dumps(state))

    def restore(self, directory: epath.Path, args: CheckpointRestore) -> Any:
        """Restores the loader in place and returns it (the same object), reading only
        the lane shards of the lanes it owns."""
        args.item.restore(read_state(directory, lanes=_lanes_of(args.item)))
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
    lanes = sorted(state.get("lanes") or [], key=lambda ls: int(ls["lane"]))
    if len(lanes) <= SHARD_LANES:
        (directory / MERGED_FILE).write_bytes(dumps(state))
        return
    header = {k: v for k, v in state.items() if k != "lanes"}
    shards = []
    for start in range(0, len(lanes), SHARD_LANES):
        block = lanes[start : start + SHARD_LANES]
        first, last = int(block[0]["lane"]), int(block[-1]["lane"])
        name = f"loader-lanes-{first:06d}-{last:06d}.zph"
        blob = dumps({"format": "zephon.loader-shard", "lanes": block})
        (directory / name).write_bytes(blob)
        shards.append(
            {
                "file": name,
                "first_lane": first,
                "last_lane": last,
                "count": len(block),
                "sha256": hashlib.sha256(blob).hexdigest(),
            }
        )
    index = {"format": INDEX_FORMAT, "version": 1, "header": header, "shards": shards}
    (directory / MERGED_FILE).write_bytes(dumps(index))


def read_state(directory: str | epath.Path, lanes: list[int] | None = None) -> dict[str, Any]:
    """The loader state in an Orbax item directory, merged across ranks.

    Args:
        directory: the item directory.
        lanes: the lanes the restoring rank owns: of a sharded ``loader.zph`` only the
            shards holding them are read (None: all).

    Raises:
        CheckpointError: no loader state there, files of different world sizes, a missing
            rank, or a corrupt or mismatched file (named).
    """
    directory = epath.Path(directory)
    merged = directory / MERGED_FILE
    if merged.exists():
        state = _load(merged)
        if state.get("format") == INDEX_FORMAT:
            return _read_shards(directory, state, lanes)
        return state
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
    if lanes is not None and missing:
        # Shares written by every host (primary_host=None): enough if they hold our lanes.
        shares = [_load(directory / process_file(r, n)) for r in sorted(ranks)]
        if all(isinstance(st.get("share"), dict) for st in shares):
            held = {int(ls["lane"]): ls for st in shares for ls in st["lanes"]}
            if all(lane in held for lane in lanes):
                return {**shares[0], "lanes": [held[lane] for lane in sorted(lanes)]}
    if missing:
        raise CheckpointError(
            f"{directory}: loader state of ranks {missing} of {n} is missing "
            f"({process_file(missing[0], n)}, ...); every process must see every rank's file "
            "to restore (use shared storage, or aggregate_dir=/aggregate_store= on the pipeline)"
        )
    states = [_load(directory / process_file(r, n)) for r in range(n)]
    return merge_states(states)


def _read_shards(
    directory: epath.Path, index: dict[str, Any], lanes: list[int] | None
) -> dict[str, Any]:
    wanted = None if lanes is None else {int(x) for x in lanes}
    out: list[Any] = []
    for shard in index["shards"]:
        first, last = int(shard["first_lane"]), int(shard["last_lane"])
        if wanted is not None and not any(first <= lane <= last for lane in wanted):
            continue
        path = directory / shard["file"]
        try:
            blob = path.read_bytes()
        except FileNotFoundError as e:
            raise CheckpointError(
                f"{path}: lane shard named by {MERGED_FILE} is missing; the step directory is "
                "incomplete"
            ) from e
        if hashlib.sha256(blob).hexdigest() != shard["sha256"]:
            raise CheckpointError(
                f"{path}: sha256 differs from the one {MERGED_FILE} records for it; the shard "
                "belongs to another save or is corrupt"
            )
        try:
            block = loads(blob)["lanes"]
        except (CheckpointError, KeyError) as e:
            raise CheckpointError(f"{path}: {e}") from e
        out.extend(ls for ls in block if wanted is None or int(ls["lane"]) in wanted)
    return {**index["header"], "lanes": out}


def _lanes_of(item: Any) -> list[int] | None:
    """The lanes a Pipeline (or the pipeline of a GlobalBatches) owns."""
    pipe = getattr(item, "pipeline", item)
    lanes = getattr(pipe, "lanes", None)
    return None if lanes is None else [int(x) for x in lanes]


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
